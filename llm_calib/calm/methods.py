"""Factories of a run's θ optimiser (``init``/``update``) and logit adjustment
(:class:`~llm_calib.adjustment.LogitAdjustment`) from its :class:`CalibrationConfig`. CALM's solvers
are built in :mod:`llm_calib.objectives.calm`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import hypergrad as hg
from llm_calib.adjustment import LogitAdjustment
from llm_calib.calm.lora import OUTPUT_LOG_SCALE

if TYPE_CHECKING:
    from llm_calib.calm.config import CalibrationConfig

__all__ = ["make_adjustment", "resolve_adjustment", "theta_optimizer"]

AUTO_ADJUSTMENT = {"options": "option_temperature", "letter": "answer_tokens", "open": "vector"}
"""What ``adjustment="auto"`` means per layout: λ acts where the prediction is made."""


def theta_optimizer(config: CalibrationConfig, lr: float | None = None) -> hg.inner.Adam:
    """The Adam optimiser of θ (LoRA weights; the output log-scale at ``config.lora.output_scale_lr``).

    Adam moves every coordinate by about ``lr`` per step, so the log-scale gets its own rate to travel
    a useful distance (log 2 for T = 2) in a few dozen steps. ``lr`` defaults to ``config.training.lr``.

    Example:
        >>> from llm_calib.calm.config import CalibrationConfig, TrainingSettings
        >>> theta_optimizer(CalibrationConfig(training=TrainingSettings(lr=1e-3))).lr
        0.001
    """
    leaf_lr = {OUTPUT_LOG_SCALE: config.lora.output_scale_lr} if config.lora.output_scale else {}
    return hg.inner.Adam(lr=config.training.lr if lr is None else lr, leaf_lr=leaf_lr)


def resolve_adjustment(adjustment: str, layout: str) -> str:
    """The λ kind a run uses: ``adjustment``, or for ``"auto"`` :data:`AUTO_ADJUSTMENT` of the records' layout.

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
    """The logit adjustment λ of ``config.objective`` for ``layout`` (``token_ids``: the tokens ``"answer_tokens"``
    adjusts).

    Example:
        >>> from llm_calib.calm.config import CalibrationConfig
        >>> from llm_calib.objectives.calm import Calm
        >>> make_adjustment(CalibrationConfig(objective=Calm(adjustment="answer_tokens")), 10, [3, 1, 3]).token_ids
        (1, 3)
    """
    objective = config.objective
    bounds = {"max_log_scale": objective.max_log_scale, "max_bias": objective.max_bias}
    kind = resolve_adjustment(objective.adjustment, layout)
    if kind == "answer_tokens":
        return LogitAdjustment.for_tokens(token_ids, vocab_size, **bounds)
    return LogitAdjustment(kind, vocab_size, **bounds)
