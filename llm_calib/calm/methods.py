"""Factories of a run's optimisers and logit adjustment, built from its :class:`CalibrationConfig`.

Small objects in the style of ``torchopt``/``optax``: each factory returns an object with
``init``/``update`` (θ's optimiser), a :class:`torch.optim.Optimizer` (λ's) or the
:class:`~llm_calib.adjustment.LogitAdjustment`; the training loop (:mod:`llm_calib.calm.training`)
only calls those. CALM's bilevel solvers are built by their configs in
:mod:`llm_calib.objectives.calm` (a new solver is a class registered with
:func:`~llm_calib.objectives.registry.register_solver`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

import hypergrad as hg
from llm_calib.adjustment import LogitAdjustment
from llm_calib.calm.lora import OUTPUT_LOG_SCALE

if TYPE_CHECKING:
    from llm_calib.calm.config import CalibrationConfig

__all__ = [
    "lam_optimizer",
    "make_adjustment",
    "resolve_adjustment",
    "theta_optimizer",
]

AUTO_ADJUSTMENT = {"options": "option_temperature", "letter": "answer_tokens", "open": "vector"}
"""What ``adjustment="auto"`` means per encoding layout: λ acts where the prediction is made (the
option scores, the answer letters' logits, or the vocabulary logits of an open answer)."""


def theta_optimizer(config: CalibrationConfig, lr: float | None = None) -> hg.inner.Adam:
    """The Adam optimiser of θ (LoRA weights, and the output log-scale at its own rate).

    Adam moves every coordinate by about ``lr`` per step, so the output log-scale gets
    ``config.lora.output_scale_lr`` to travel a useful distance (log 2 for T = 2) within a run's few
    dozen steps.

    Args:
        config: the run's configuration.
        lr: the LoRA step size (default ``config.training.lr``).

    Example:
        >>> from llm_calib.calm.config import CalibrationConfig, TrainingSettings
        >>> theta_optimizer(CalibrationConfig(training=TrainingSettings(lr=1e-3))).lr
        0.001
    """
    leaf_lr = {OUTPUT_LOG_SCALE: config.lora.output_scale_lr} if config.lora.output_scale else {}
    return hg.inner.Adam(lr=config.training.lr if lr is None else lr, leaf_lr=leaf_lr)


def resolve_adjustment(adjustment: str, layout: str) -> str:
    """The λ kind a run uses: ``adjustment`` itself, or for ``"auto"`` the kind of
    :data:`AUTO_ADJUSTMENT` for the records' layout (``"options"``: option-likelihood multiple
    choice, ``"letter"``, ``"open"``).

    Raises:
        ValueError: an unknown layout with ``"auto"``.

    Example:
        >>> resolve_adjustment("auto", "options"), resolve_adjustment("auto", "open"), resolve_adjustment("vector", "options")
        ('option_temperature', 'vector', 'vector')
    """
    if adjustment != "auto":
        return adjustment
    if layout not in AUTO_ADJUSTMENT:
        raise ValueError(f"layout must be one of {tuple(AUTO_ADJUSTMENT)}, got {layout!r}")
    return AUTO_ADJUSTMENT[layout]


def make_adjustment(config: CalibrationConfig, vocab_size: int, token_ids: Iterable[int] = (),
                    layout: str = "options") -> LogitAdjustment:
    """The logit adjustment λ of ``config.objective.adjustment`` (resolved for ``layout`` when ``"auto"``).

    Args:
        config: the run's configuration (``adjustment``, ``max_log_scale``, ``max_bias``).
        vocab_size: the model's vocabulary size.
        token_ids: the adjusted tokens for ``adjustment="answer_tokens"`` (ignored otherwise).
        layout: the layout of the training records (see :func:`resolve_adjustment`).

    Example:
        >>> from llm_calib.calm.config import CalibrationConfig
        >>> from llm_calib.objectives.calm import Calm
        >>> make_adjustment(CalibrationConfig(objective=Calm(adjustment="answer_tokens")), 10, [3, 1, 3]).token_ids
        (1, 3)
        >>> make_adjustment(CalibrationConfig(), 10).kind
        'option_temperature'
    """
    objective = config.objective
    bounds = {"max_log_scale": objective.max_log_scale, "max_bias": objective.max_bias}
    kind = resolve_adjustment(objective.adjustment, layout)
    if kind == "answer_tokens":
        return LogitAdjustment.for_tokens(sorted(set(token_ids)), vocab_size, **bounds)
    return LogitAdjustment(kind, vocab_size, **bounds)


def lam_optimizer(params: Iterable[torch.Tensor], config: CalibrationConfig) -> torch.optim.Optimizer:
    """The optimiser of λ: :class:`torch.optim.Adam` with the objective's ``lam_lr``.

    Example:
        >>> from llm_calib.calm.config import CalibrationConfig
        >>> from llm_calib.objectives.calm import Calm
        >>> lam_optimizer([torch.zeros(2, requires_grad=True)], CalibrationConfig(objective=Calm(lam_lr=0.1))).defaults["lr"]
        0.1
    """
    return torch.optim.Adam(list(params), lr=config.objective.lam_lr)
