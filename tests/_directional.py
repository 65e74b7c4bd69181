"""A shared finite-difference check: the analytic gradient along a random direction."""

from __future__ import annotations

from collections.abc import Callable

import torch

Tree = dict[str, torch.Tensor]


def directional_derivatives(loss: Callable[[Tree], torch.Tensor], theta: Tree, grad: Tree, h: float,
                            seed: int = 1) -> tuple[float, float]:
    """``(⟨grad, d⟩, central difference of loss along d)`` for a seeded random direction ``d``."""
    gen = torch.Generator().manual_seed(seed)
    direction = {k: torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in theta.items()}
    plus = loss({k: theta[k] + h * direction[k] for k in theta})
    minus = loss({k: theta[k] - h * direction[k] for k in theta})
    fd = float(plus - minus) / (2 * h)
    analytic = float(sum((grad[k] * direction[k]).sum() for k in theta))
    return analytic, fd
