"""Factories of a run's optimisers and bilevel solver, built from its :class:`CalibrationConfig`.

Small objects in the style of ``torchopt``/``optax``: each factory returns a
:mod:`hypergrad` object with ``init``/``update`` (optimisers) or ``hypergrad`` (solvers); the
training loop (:mod:`llm_calib.calm.training`) only calls those. A new solver is one more branch
of :func:`make_solver` (any object with ``hypergrad(problem, w, lam, inner_batch, outer_batch,
state)`` that returns a :class:`hypergrad.HypergradResult`), for example ``hg.Implicit``.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch

import hypergrad as hg
from llm_calib.adjustment import LogitAdjustment
from llm_calib.calm.attention import second_order_attention
from llm_calib.calm.config import CalibrationConfig
from llm_calib.calm.lora import OUTPUT_LOG_SCALE

__all__ = [
    "inner_lr",
    "lam_optimizer",
    "make_adjustment",
    "make_solver",
    "resolve_adjustment",
    "theta_optimizer",
]

AUTO_ADJUSTMENT = {"options": "option_temperature", "letter": "answer_tokens", "open": "vector"}
"""What ``adjustment="auto"`` means per encoding layout: λ acts where the prediction is made (the
option scores, the answer letters' logits, or the vocabulary logits of an open answer)."""


def theta_optimizer(config: CalibrationConfig, lr: float | None = None) -> hg.inner.Adam:
    """The Adam optimiser of θ (LoRA weights, and the output log-scale at its own rate).

    Adam moves every coordinate by about ``lr`` per step, so the output log-scale gets
    ``config.output_scale_lr`` to travel a useful distance (log 2 for T = 2) within a run's few
    dozen steps.

    Args:
        config: the run's configuration.
        lr: the LoRA step size (default ``config.lr``).

    Example:
        >>> theta_optimizer(CalibrationConfig(lr=1e-3)).lr
        0.001
    """
    leaf_lr = {OUTPUT_LOG_SCALE: config.output_scale_lr} if config.output_scale else {}
    return hg.inner.Adam(lr=config.lr if lr is None else lr, leaf_lr=leaf_lr)


def inner_lr(config: CalibrationConfig) -> float:
    """The inner step size of the configured solver: ``config.inner_lr`` when set, else the
    solver's default (BOME: ``5e-2``, plain SGD, large enough that the value function's
    ``inner_steps`` steps make the lower level bind; F2SA: ``config.lr``, θ's Adam rate).

    Example:
        >>> inner_lr(CalibrationConfig(solver="f2sa", lr=3e-3)), inner_lr(CalibrationConfig())
        (0.003, 0.05)
    """
    if config.inner_lr is not None:
        return config.inner_lr
    return 5e-2 if config.solver == "bome" else config.lr


@contextlib.contextmanager
def _capped_second_order_solve() -> Iterator[None]:
    """The implicit step of ``solver="implicit"``: attention with second derivatives, and a CG
    solve capped at ``cg_maxiter`` without a warning per step (``info.converged`` reports it)."""
    with second_order_attention(), warnings.catch_warnings():
        warnings.simplefilter("ignore", hg.ConvergenceWarning)
        yield


def make_solver(config: CalibrationConfig) -> Any:
    """The first-order bilevel solver of ``method="calm"`` (``config.solver``).

    * ``"bome"``: :class:`hypergrad.BOME` with ``inner_steps`` plain-SGD steps of
      :func:`inner_lr` defining the value function, θ stepped along BOME's direction by
      :func:`theta_optimizer`.
    * ``"f2sa"``: :class:`hypergrad.Penalty` whose two iterates (θ on g, θ_σ on g + σ f) take
      ``inner_steps`` Adam steps of :func:`inner_lr` (by default θ's rate ``config.lr``).
    * ``"implicit"``: :class:`hypergrad.AlternatingImplicit`: ``inner_steps`` Adam steps of θ on
      g, then the exact hypergradient by damped CG (``cg_maxiter``, ``cg_damping``, ``cg_tol``),
      warm started across steps, in attention's math kernel (second derivatives); a capped CG
      solve is reported per step (``cg_converged``), not warned about. The first-order solvers
      approximate this direction; on CALM's problem they can point away from it
      (``benchmarks/results/calm_hypergradient.md``).

    Raises:
        ValueError: an unknown solver.

    Example:
        >>> type(make_solver(CalibrationConfig(solver="f2sa"))).__name__
        'Penalty'
    """
    if config.solver == "bome":
        return hg.BOME(
            hg.inner.SGD(lr=inner_lr(config)), w_lr=config.lr, inner_steps=config.inner_steps,
            eta=config.bome_eta, barrier=config.bome_barrier, w_optimizer=theta_optimizer(config),
        )
    if config.solver == "f2sa":
        # "advanced": the estimate after the last inner step, as the CALM results in
        # benchmarks/results were measured
        return hg.Penalty(sigma=config.f2sa_sigma, inner_optimizer=theta_optimizer(config, inner_lr(config)),
                          inner_steps=config.inner_steps, evaluate="advanced")
    if config.solver == "implicit":
        cg = hg.linear.CG(tol=config.cg_tol, maxiter=config.cg_maxiter, damping=config.cg_damping)
        return hg.AlternatingImplicit(theta_optimizer(config, inner_lr(config)), config.inner_steps,
                                      hg.Implicit(solver=cg, warm_start=True), solve_context=_capped_second_order_solve)
    raise ValueError(f"solver must be one of 'bome', 'f2sa', 'implicit', got {config.solver!r}")


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
    """The logit adjustment λ of ``config.adjustment`` (resolved for ``layout`` when ``"auto"``).

    Args:
        config: the run's configuration (``adjustment``, ``max_log_scale``, ``max_bias``).
        vocab_size: the model's vocabulary size.
        token_ids: the adjusted tokens for ``adjustment="answer_tokens"`` (ignored otherwise).
        layout: the layout of the training records (see :func:`resolve_adjustment`).

    Example:
        >>> make_adjustment(CalibrationConfig(adjustment="answer_tokens"), 10, [3, 1, 3]).token_ids
        (1, 3)
        >>> make_adjustment(CalibrationConfig(adjustment="auto"), 10).kind
        'option_temperature'
    """
    bounds = {"max_log_scale": config.max_log_scale, "max_bias": config.max_bias}
    kind = resolve_adjustment(config.adjustment, layout)
    if kind == "answer_tokens":
        return LogitAdjustment.for_tokens(sorted(set(token_ids)), vocab_size, **bounds)
    return LogitAdjustment(kind, vocab_size, **bounds)


def lam_optimizer(params: Iterable[torch.Tensor], config: CalibrationConfig) -> torch.optim.Optimizer:
    """The optimiser of λ: :class:`torch.optim.Adam` with ``config.lam_lr``.

    Example:
        >>> lam_optimizer([torch.zeros(2, requires_grad=True)], CalibrationConfig(lam_lr=0.1)).defaults["lr"]
        0.1
    """
    return torch.optim.Adam(list(params), lr=config.lam_lr)
