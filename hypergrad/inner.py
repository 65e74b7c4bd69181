r"""Differentiable inner optimizers as pure functions over pytrees.

Each optimizer is a frozen dataclass with ``init(w) -> state`` and
``update(w, grad, state) -> (w, state)``. Updates use only out-of-place tensor operations, so the
same code runs under ``torch.no_grad`` (the driver's inner loop), with ``create_graph=True``
(reverse-mode unrolling) and through two backward passes (forward-mode unrolling).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import KW_ONLY, dataclass, field
from typing import Protocol, runtime_checkable

import torch

from hypergrad.tree import Tree

__all__ = ["SGD", "Adam", "InnerOptimizer", "Momentum"]


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_lr(lr: float) -> None:
    if not _is_real(lr) or not 0 < lr < math.inf:
        raise ValueError(f"lr must be a finite number > 0, got {lr!r}")


def _check_leaf_lr(leaf_lr: Mapping[str, float]) -> None:
    if not isinstance(leaf_lr, Mapping):
        raise TypeError(f"leaf_lr must be a mapping from leaf name to step size, got {type(leaf_lr).__name__}")
    for name, lr in leaf_lr.items():
        if not isinstance(name, str):
            raise TypeError(f"leaf_lr keys must be leaf names (str), got {name!r}")
        if not _is_real(lr) or not 0 < lr < math.inf:
            raise ValueError(f"leaf_lr[{name!r}] must be a finite number > 0, got {lr!r}")


def _check_unit_interval(value: float, name: str) -> None:
    if not _is_real(value) or not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value!r}")


@runtime_checkable
class InnerOptimizer(Protocol):
    """A pure, differentiable optimizer over pytrees.

    Anything with these two methods works where an inner optimizer is expected (``Unrolled``,
    ``Penalty``, ``BOME``, :func:`~hypergrad.driver.inner_solve`); the update must use only
    out-of-place tensor operations so that it can be differentiated.

    Example:
        >>> import torch, hypergrad as hg
        >>> isinstance(hg.inner.SGD(lr=0.1), hg.inner.InnerOptimizer)
        True
    """

    def init(self, w: Tree) -> Tree:
        """Return the initial optimizer state for parameters ``w``."""
        ...

    def update(self, w: Tree, grad: Tree, state: Tree) -> tuple[Tree, Tree]:
        """Return the parameters and state after one step with gradient ``grad``."""
        ...


@dataclass(frozen=True)
class SGD:
    r"""Gradient descent, :math:`w \leftarrow w - \eta \nabla_w g`.

    Args:
        lr: step size :math:`\eta` (finite, > 0).
        leaf_lr: step sizes of named leaves that override ``lr`` (e.g. a scalar that needs larger
            steps than a matrix), as in per-parameter-group learning rates.

    Raises:
        ValueError: ``lr`` or a ``leaf_lr`` value is not a finite number > 0.

    Example:
        >>> import torch, hypergrad as hg
        >>> opt = hg.inner.SGD(lr=0.5)
        >>> w, s = opt.update({"x": torch.tensor([2.0])}, {"x": torch.tensor([2.0])}, opt.init({}))
        >>> w["x"].tolist()
        [1.0]
    """

    lr: float
    _: KW_ONLY  # the options below are keyword-only
    leaf_lr: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_lr(self.lr)
        _check_leaf_lr(self.leaf_lr)

    def init(self, w: Tree) -> Tree:
        """Return the (empty) state: plain gradient descent keeps none."""
        return {}

    def update(self, w: Tree, grad: Tree, state: Tree) -> tuple[Tree, Tree]:
        """Return ``(w - lr * grad, state)``."""
        # One fused op per leaf (as torch.optim.SGD's add_(grad, alpha=-lr)): in reverse-mode
        # unrolling every op here is recorded K times and replayed in the backward pass.
        return {k: torch.add(w[k], grad[k], alpha=-self.leaf_lr.get(k, self.lr)) for k in w}, state


@dataclass(frozen=True)
class Momentum:
    r"""Heavy-ball momentum: :math:`m \leftarrow \beta m + \nabla g`, :math:`w \leftarrow w - \eta m`
    (the ``torch.optim.SGD(momentum=beta)`` convention; ``nesterov`` as in PyTorch).

    Args:
        lr: step size :math:`\eta` (finite, > 0).
        beta: momentum coefficient in ``[0, 1)``.
        nesterov: use Nesterov's variant, :math:`w \leftarrow w - \eta (\nabla g + \beta m)`.
        leaf_lr: step sizes of named leaves that override ``lr``.

    Raises:
        ValueError: ``lr``, a ``leaf_lr`` value or ``beta`` out of range.
        TypeError: ``nesterov`` is not a bool.

    Example:
        >>> import torch, hypergrad as hg
        >>> opt = hg.inner.Momentum(lr=0.1, beta=0.9)
        >>> sorted(opt.init({"x": torch.zeros(3)}))
        ['m.x']
    """

    lr: float
    _: KW_ONLY  # the options below are keyword-only
    beta: float = 0.9
    nesterov: bool = False
    leaf_lr: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_lr(self.lr)
        _check_leaf_lr(self.leaf_lr)
        _check_unit_interval(self.beta, "beta")
        if not isinstance(self.nesterov, bool):
            raise TypeError(f"nesterov must be a bool, got {type(self.nesterov).__name__}")

    def init(self, w: Tree) -> Tree:
        """Return zero momentum buffers, one per leaf of ``w`` (keys ``"m.<name>"``)."""
        return {f"m.{k}": torch.zeros_like(v) for k, v in w.items()}

    def update(self, w: Tree, grad: Tree, state: Tree) -> tuple[Tree, Tree]:
        """Return the parameters and momentum buffers after one step."""
        new_state = {f"m.{k}": torch.add(grad[k], state[f"m.{k}"], alpha=self.beta) for k in w}
        if self.nesterov:
            step = {k: torch.add(grad[k], new_state[f"m.{k}"], alpha=self.beta) for k in w}
        else:
            step = {k: new_state[f"m.{k}"] for k in w}
        return {k: torch.add(w[k], step[k], alpha=-self.leaf_lr.get(k, self.lr)) for k in w}, new_state


@dataclass(frozen=True)
class Adam:
    r"""Adam (Kingma & Ba), bias-corrected, as in ``torch.optim.Adam``.

    ``eps_root`` is added under the square root so that the update stays differentiable where a
    gradient coordinate is exactly zero (the derivative of :math:`\sqrt{v}` is infinite at 0).

    Args:
        lr: step size (finite, > 0).
        betas: decay rates ``(beta1, beta2)`` of the first and second moment estimates, each in
            ``[0, 1)``.
        eps: added to the denominator (>= 0).
        eps_root: added under the square root (>= 0).
        leaf_lr: step sizes of named leaves that override ``lr``. Adam's steps are about ``lr``
            per coordinate whatever the gradient's scale, so a leaf that must travel further in
            the same number of steps (a log-scale next to LoRA matrices) needs its own.

    Raises:
        ValueError: an argument out of range.

    Example:
        >>> import torch, hypergrad as hg
        >>> opt = hg.inner.Adam(lr=0.1)
        >>> w, s = opt.update({"x": torch.tensor([1.0])}, {"x": torch.tensor([3.0])}, opt.init({"x": torch.zeros(1)}))
        >>> round(w["x"].item(), 4)   # first Adam step moves by lr * sign(grad)
        0.9
    """

    lr: float
    _: KW_ONLY  # the options below are keyword-only
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    eps_root: float = 1e-30
    leaf_lr: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_lr(self.lr)
        _check_leaf_lr(self.leaf_lr)
        if not isinstance(self.betas, (tuple, list)) or len(self.betas) != 2:
            raise ValueError(f"betas must be a pair (beta1, beta2), got {self.betas!r}")
        _check_unit_interval(self.betas[0], "betas[0]")
        _check_unit_interval(self.betas[1], "betas[1]")
        if not _is_real(self.eps) or not self.eps >= 0:
            raise ValueError(f"eps must be a number >= 0, got {self.eps!r}")
        if not _is_real(self.eps_root) or not self.eps_root >= 0:
            raise ValueError(f"eps_root must be a number >= 0, got {self.eps_root!r}")

    def init(self, w: Tree) -> Tree:
        """Return the step count ``"t"`` and zero moment estimates ``"m.<name>"``, ``"v.<name>"``."""
        ref = next(iter(w.values()))
        state = {"t": torch.zeros((), dtype=ref.dtype, device=ref.device)}
        for k, v in w.items():
            state[f"m.{k}"] = torch.zeros_like(v)
            state[f"v.{k}"] = torch.zeros_like(v)
        return state

    def update(self, w: Tree, grad: Tree, state: Tree) -> tuple[Tree, Tree]:
        """Return the parameters and state after one bias-corrected Adam step."""
        b1, b2 = self.betas
        t = state["t"] + 1
        new_state = {"t": t}
        new_w = {}
        for k in w:
            m = b1 * state[f"m.{k}"] + (1 - b1) * grad[k]
            v = b2 * state[f"v.{k}"] + (1 - b2) * grad[k] * grad[k]
            new_state[f"m.{k}"], new_state[f"v.{k}"] = m, v
            m_hat = m / (1 - b1**t)
            v_hat = v / (1 - b2**t)
            new_w[k] = w[k] - self.leaf_lr.get(k, self.lr) * m_hat / (torch.sqrt(v_hat + self.eps_root) + self.eps)
        return new_w, new_state
