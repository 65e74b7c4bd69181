"""Two implementations of CALM's losses compared at one point (values and gradients).

:func:`compare_losses` checks e.g. the trunk-cached trainer against a reference one
(``benchmarks/llm_speed.py``); :func:`relative_difference` is its measure.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

import hypergrad as hg
from llm_calib.calm.training import Trainer

__all__ = ["compare_losses", "relative_difference"]


def relative_difference(a: Mapping[str, Tensor], b: Mapping[str, Tensor]) -> float:
    """``‖a - b‖ / ‖b‖`` over all entries of two parameter trees (float64).

    Example:
        >>> relative_difference({"w": torch.tensor([1.0, 1.0])}, {"w": torch.tensor([1.0, 2.0])})
        0.4472135954999579
    """
    if sorted(a) != sorted(b):
        raise ValueError(f"the trees have different keys: {sorted(a)} and {sorted(b)}")
    x, y = (torch.cat([t[k].detach().double().reshape(-1) for k in sorted(t)]) for t in (a, b))
    return float((x - y).norm() / y.norm().clamp_min(1e-30))


def compare_losses(a: Trainer, a_theta: dict[str, Tensor], b: Trainer, b_theta: dict[str, Tensor],
                   lam: dict[str, Tensor], step: int = 0) -> dict[str, Any]:
    """Two implementations of CALM's losses (e.g. trunk-cached and reference trainers) at one point, on ``step``'s
    batches.

    Returns:
        Per loss ``"g"`` and ``"f"``: values ``a`` and ``b``, ``abs_diff``, ``grad_theta_rel`` (and for
        ``g`` ``grad_lam_rel``), :func:`relative_difference` against ``b``; and ``scores_max_abs_diff``.

    Example:
        >>> from llm_calib.config.calibration import CalibrationConfig, LoraSettings
        >>> from llm_calib.calm.training import build_trainer
        >>> from llm_calib.data import builtin_multiple_choice
        >>> from llm_calib.models import tiny_random_model
        >>> model, tok = tiny_random_model()
        >>> qs = builtin_multiple_choice(n_per_domain=2, domains=["capitals"])
        >>> from llm_calib.calm.run import resolve_run
        >>> cfg = CalibrationConfig(training={"batch_size": 2}, lora=LoraSettings(layers=(1,)))
        >>> tr = build_trainer(model, tok, qs, qs, resolve_run(cfg, qs, qs))
        >>> theta, lam = tr.lm.theta(), {k: v.detach() for k, v in tr.adjustment.init().items()}
        >>> compare_losses(tr, theta, tr, theta, lam)["g"]["abs_diff"]
        0.0
    """
    lam = {k: v.detach() for k, v in lam.items()}
    out: dict[str, Any] = {}
    batches = {"g": (a.train_batch(step), b.train_batch(step)), "f": (a.unlabeled_batch(step), b.unlabeled_batch(step))}
    for name, (ba, bb) in batches.items():
        fa, fb = (a.losses.inner, b.losses.inner) if name == "g" else (a.losses.outer, b.losses.outer)
        va, ga, la = hg.autodiff.loss_and_grads(lambda w, l_, fn=fa, x=ba: fn(w, l_, x), a_theta, lam)
        vb, gb, lb = hg.autodiff.loss_and_grads(lambda w, l_, fn=fb, x=bb: fn(w, l_, x), b_theta, lam)
        out[name] = {"a": float(va), "b": float(vb), "abs_diff": abs(float(va) - float(vb)),
                     "grad_theta_rel": relative_difference(ga, gb)}
        if name == "g":
            out[name]["grad_lam_rel"] = relative_difference(la, lb)
    ba, bb = batches["g"]
    sa, sb = a.losses.scores(a_theta, lam, ba), b.losses.scores(b_theta, lam, bb)
    finite = torch.isfinite(sb)
    out["scores_max_abs_diff"] = float((sa[finite] - sb[finite]).abs().max())
    return out
