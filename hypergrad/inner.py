r"""Differentiable inner optimizers as pure functions over pytrees.

Each optimizer is a frozen dataclass with ``init(w) -> state`` and
``update(w, grad, state) -> (w, state)``. Updates use only out-of-place tensor operations, so the
same code runs under ``torch.no_grad`` (the driver's inner loop), with ``create_graph=True``
(reverse-mode unrolling) and through two backward passes (forward-mode unrolling).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import KW_ONLY, dataclass, field
from typing import Protocol, runtime_checkable

import torch

from hypergrad.line_search import strong_wolfe
from hypergrad.newton import Newton
from hypergrad.objective import InnerObjective
from hypergrad.tree import Tree, supports_foreach, tree_flatten_view, tree_numel, tree_split_views

__all__ = ["LBFGS", "SGD", "Adam", "InnerObjective", "InnerOptimizer", "Momentum", "Newton"]

_LINE_SEARCHES = ("strong_wolfe", "armijo")


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


def _step_sizes(keys: list[str], lr: float, leaf_lr: Mapping[str, float]) -> list[float]:
    return [leaf_lr.get(k, lr) for k in keys]


def _flat_step_sizes(keys: list[str], leaves: list[torch.Tensor], lr: float,
                     leaf_lr: Mapping[str, float]) -> float | torch.Tensor:
    """The step sizes of the leaves laid out like their flat vector: ``lr`` itself when they all share it,
    else a vector holding each leaf's rate over its entries (in the leaves' dtype, as a number is taken)."""
    rates = _step_sizes(keys, lr, leaf_lr)
    if len(set(rates)) == 1:
        return _constants((rates[0],), leaves[0])[0]
    runs: list[tuple[float, int]] = []  # (rate, entries) of consecutive leaves sharing a rate
    for rate, leaf in zip(rates, leaves, strict=True):
        if runs and runs[-1][0] == rate:
            runs[-1] = (rate, runs[-1][1] + leaf.numel())
        else:
            runs.append((rate, leaf.numel()))
    ref = leaves[0]
    if _cacheable():
        return _rate_vector(tuple(runs), ref.dtype, ref.device)
    return _rate_vector.__wrapped__(tuple(runs), ref.dtype, ref.device)


def _cacheable() -> bool:
    """Whether tensors made now can be kept for later calls (not traced, not inference tensors)."""
    return not torch.compiler.is_compiling() and not torch.is_inference_mode_enabled()


@functools.lru_cache(maxsize=64)
def _rate_vector(runs: tuple[tuple[float, int], ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # made in float64 and cast, as a number is taken by an operator: a rate beyond the dtype's range becomes
    # inf (and the update non-finite, which the caller reports), where torch.full in the dtype would raise
    return torch.cat([torch.full((n,), rate, dtype=torch.float64, device=device) for rate, n in runs]).to(dtype)


@functools.lru_cache(maxsize=256)
def _constant_tensors(values: tuple[float, ...], dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, ...]:
    return tuple(torch.tensor(v, dtype=dtype, device=device) for v in values)


def _constants(values: tuple[float, ...], like: torch.Tensor) -> tuple[torch.Tensor | float, ...]:
    """``values`` as 0-dim tensors of ``like``'s dtype and device, made once (numbers where they cannot be kept)."""
    if not _cacheable():
        return values
    return _constant_tensors(values, like.dtype, like.device)


def _descend(keys: list[str], w: Tree, steps: list[torch.Tensor], lrs: list[float]) -> Tree:
    """``w[k] - lr_k * steps[i]`` for every leaf, one fused ``torch.add(..., alpha=-lr)`` per leaf (the
    ``torch.optim.SGD`` form), or one ``_foreach_add`` per distinct step size."""
    ws = [w[k] for k in keys]
    if not supports_foreach(ws):
        return {k: torch.add(w_k, s, alpha=-lr) for k, w_k, s, lr in zip(keys, ws, steps, lrs, strict=True)}
    out: dict[str, torch.Tensor] = {}
    for lr in dict.fromkeys(lrs):  # distinct step sizes, in order
        group = [i for i, lr_i in enumerate(lrs) if lr_i == lr]
        new = torch._foreach_add([ws[i] for i in group], [steps[i] for i in group], alpha=-lr)
        out.update((keys[i], t) for i, t in zip(group, new, strict=True))
    return {k: out[k] for k in keys}


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
        keys = list(w)
        return _descend(keys, w, [grad[k] for k in keys], _step_sizes(keys, self.lr, self.leaf_lr)), state


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
        keys = list(w)
        grads, moments = [grad[k] for k in keys], [state[f"m.{k}"] for k in keys]
        if supports_foreach(grads + moments):
            moments = torch._foreach_add(grads, moments, alpha=self.beta)
            steps = torch._foreach_add(grads, moments, alpha=self.beta) if self.nesterov else moments
        else:
            moments = [torch.add(g, m, alpha=self.beta) for g, m in zip(grads, moments, strict=True)]
            steps = ([torch.add(g, m, alpha=self.beta) for g, m in zip(grads, moments, strict=True)]
                     if self.nesterov else moments)
        new_state = {f"m.{k}": m for k, m in zip(keys, moments, strict=True)}
        return _descend(keys, w, list(steps), _step_sizes(keys, self.lr, self.leaf_lr)), new_state


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
        leaves = list(w.values())
        # one buffer each (see update); not while torch.compile traces (views by storage offset)
        if supports_foreach(leaves) and len({x.dtype for x in leaves}) == 1 and not torch.compiler.is_compiling():
            n = tree_numel(w)
            for name in ("m", "v"):
                buffer = torch.zeros(n, dtype=ref.dtype, device=ref.device)
                state.update((f"{name}.{k}", x) for k, x in tree_split_views(buffer, w).items())
            return state
        for k, v in w.items():
            state[f"m.{k}"] = torch.zeros_like(v)
            state[f"v.{k}"] = torch.zeros_like(v)
        return state

    def update(self, w: Tree, grad: Tree, state: Tree) -> tuple[Tree, Tree]:
        """Return the parameters and state after one bias-corrected Adam step."""
        b1, b2 = self.betas
        t = state["t"] + 1
        new_state = {"t": t}
        keys = list(w)
        ws, grads = [w[k] for k in keys], [grad[k] for k in keys]
        ms, vs = [state[f"m.{k}"] for k in keys], [state[f"v.{k}"] for k in keys]
        tensors = ws + grads + ms + vs
        differentiated = torch.is_grad_enabled() and any(x.requires_grad for x in tensors)
        if (not differentiated and supports_foreach(tensors) and t.device == ws[0].device
                and len({x.dtype for x in tensors}) == 1 and not torch.compiler.is_compiling()):
            # (not while torch.compile traces: the flat views are read from storage offsets, and inductor
            # fuses the per-leaf arithmetic below anyway)
            # the same arithmetic on the leaves as one flat vector each: about fifteen operators for the
            # whole update, where per-leaf ones (also _foreach on a CPU) run that many per leaf. θ and the
            # moments come back as views of their new buffers, so the next update reads them without a copy.
            flat = {name: tree_flatten_view(dict(zip(keys, leaves, strict=True)))
                    for name, leaves in (("w", ws), ("g", grads), ("m", ms), ("v", vs))}
            # the numbers as 0-dim tensors of the leaves' dtype (a number is taken in that dtype too: the
            # same results), made once: an operator with a Python number converts it first
            one, b1_, c1, b2_, c2, eps_root, eps = _constants((1.0, b1, 1 - b1, b2, 1 - b2, self.eps_root, self.eps),
                                                              ws[0])
            t = state["t"] + one
            new_state["t"] = t
            m = flat["m"] * b1_ + flat["g"] * c1
            v = flat["v"] * b2_ + (flat["g"] * c2) * flat["g"]
            m_hat = m / (one - b1_**t)
            v_hat = v / (one - b2_**t)
            denom = torch.sqrt(v_hat + eps_root) + eps
            new_w = flat["w"] - (m_hat * _flat_step_sizes(keys, ws, self.lr, self.leaf_lr)) / denom
            like = dict(zip(keys, ws, strict=True))
            new_state.update((f"m.{k}", x) for k, x in tree_split_views(m, like).items())
            new_state.update((f"v.{k}", x) for k, x in tree_split_views(v, like).items())
            return tree_split_views(new_w, like), new_state
        if not differentiated and supports_foreach(tensors) and t.device == ws[0].device:
            # the per-leaf arithmetic below, operation by operation, over all leaves at once (not
            # where the update is differentiated: the double backward of these _foreach
            # operators fails in torch 2.13, "inconsistent range for TensorList output")
            ms = torch._foreach_add(torch._foreach_mul(ms, b1), torch._foreach_mul(grads, 1 - b1))
            vs = torch._foreach_add(torch._foreach_mul(vs, b2),
                                    torch._foreach_mul(torch._foreach_mul(grads, 1 - b2), grads))
            m_hat = torch._foreach_div(ms, 1 - b1**t)
            v_hat = torch._foreach_div(vs, 1 - b2**t)
            denom = torch._foreach_add(torch._foreach_sqrt(torch._foreach_add(v_hat, self.eps_root)), self.eps)
            steps = torch._foreach_div(torch._foreach_mul(m_hat, _step_sizes(keys, self.lr, self.leaf_lr)), denom)
            new_state.update((f"m.{k}", m) for k, m in zip(keys, ms, strict=True))
            new_state.update((f"v.{k}", v) for k, v in zip(keys, vs, strict=True))
            return dict(zip(keys, torch._foreach_sub(ws, steps), strict=True)), new_state
        new_w = {}
        for k in w:
            m = b1 * state[f"m.{k}"] + (1 - b1) * grad[k]
            v = b2 * state[f"v.{k}"] + (1 - b2) * grad[k] * grad[k]
            new_state[f"m.{k}"], new_state[f"v.{k}"] = m, v
            m_hat = m / (1 - b1**t)
            v_hat = v / (1 - b2**t)
            new_w[k] = w[k] - self.leaf_lr.get(k, self.lr) * m_hat / (torch.sqrt(v_hat + self.eps_root) + self.eps)
        return new_w, new_state


def _dot(a: Tree, b: Tree) -> torch.Tensor:
    return sum((a[k] * b[k]).sum() for k in a)  # type: ignore[return-value]


@dataclass(frozen=True)
class LBFGS:
    r"""Limited-memory BFGS with ``torch.optim.LBFGS``'s update rule, as a pure function.

    Each step keeps the last ``history_size`` pairs :math:`s = w_{t} - w_{t-1}`,
    :math:`y = \nabla g(w_t) - \nabla g(w_{t-1})` (a pair with :math:`s^\top y \le 10^{-10}` is
    skipped, as in PyTorch), turns the gradient into a quasi-Newton direction :math:`d` with the
    two-loop recursion scaled by :math:`s^\top y / y^\top y` of the newest pair, and moves
    :math:`w \leftarrow w + \eta d`; the first step is :math:`-\eta \min(1, 1/\lVert\nabla g\rVert_1)
    \nabla g`. :meth:`update` is exactly one ``torch.optim.LBFGS(lr, history_size=...,
    max_iter=1, line_search_fn=None)`` step (with its tolerance tests off), written with
    out-of-place operations on a fixed-size state, so it can be unrolled and differentiated.

    :func:`hypergrad.inner_solve` and the plain inner steps of :func:`hypergrad.solve` call
    :meth:`update_with_objective` instead, which searches along :math:`d` from step :math:`\eta`
    on the batch of that step: by default for the strong Wolfe conditions
    (:func:`hypergrad.line_search.strong_wolfe`, with its slope-based test where the loss's
    changes are at rounding level), as SciPy's L-BFGS-B and ``torch.optim.LBFGS(line_search_fn=
    "strong_wolfe")`` do; ``line_search="armijo"`` backtracks for sufficient decrease only
    (:meth:`update_with_loss`). This is the deterministic, full-batch solver of a smooth inner
    problem (ridge or logistic regression to machine precision, with ``inner_solve(..., tol=)``):
    on the wine problem of ``tests/test_newton.py`` it reaches a gradient norm of 1e-10 in
    36 steps (39 loss-and-gradient evaluations) where SciPy's L-BFGS-B stops after 32 at 1.6e-9,
    ``torch.optim.LBFGS`` with its strong Wolfe search after 81 at 8.5e-10, and backtracking
    needs 104 (``benchmarks/results/inner_solvers.md``).

    Where it does not fit: a stochastic inner loss (a fresh batch per step) mixes gradients of
    different batches into the curvature pairs, so L-BFGS is no better than SGD there; as the
    ``inner_optimizer`` of :class:`~hypergrad.unrolled.Unrolled` (differentiated through, no line
    search) it works but each step costs ``4 * history_size`` tree dot products in the graph; BOME
    and Penalty restart the optimizer's state at every call (their few inner steps build no
    useful history), and BOME's ``w_optimizer`` steps along a direction that is not the gradient of
    one function, which breaks the curvature pairs: use SGD, Momentum or Adam there.

    Args:
        lr: step size :math:`\eta` (finite, > 0); 1 is the natural quasi-Newton step (the line
            search starts from ``lr``: a larger ``lr`` is kept from diverging, but steps longer than
            1 overshoot and converge slowly near the minimum).
        history_size: curvature pairs kept (int >= 1).
        line_search: ``"strong_wolfe"`` (default), ``"armijo"`` (backtracking) or None (the fixed
            step of :meth:`update`); ``True`` and ``False`` mean the default and None.
        c1: the sufficient-decrease constant of the line search, in (0, 1).
        c2: the curvature constant of the strong Wolfe search, in (c1, 1).
        max_backtracks: halvings of the step before the Armijo search gives up and takes the
            smallest step tried (int >= 1).
        max_evaluations: loss-and-gradient evaluations of one strong Wolfe search (int >= 1).

    Raises:
        ValueError: an argument out of range.

    Example:
        >>> import torch, hypergrad as hg
        >>> A = torch.tensor([[3.0, 1.0], [1.0, 2.0]], dtype=torch.float64)
        >>> g = lambda w, lam, b: 0.5 * w["x"] @ A @ w["x"] - lam["b"] @ w["x"]
        >>> lam = {"b": torch.tensor([1.0, 1.0], dtype=torch.float64)}
        >>> out = hg.inner_solve(hg.BilevelProblem(g, g), {"x": torch.zeros(2, dtype=torch.float64)}, lam,
        ...                      100, hg.inner.LBFGS(), tol=1e-12)
        >>> torch.allclose(out.w["x"], torch.linalg.solve(A, lam["b"]), atol=1e-12), out.converged, out.steps
        (True, True, 3)
    """

    lr: float = 1.0
    _: KW_ONLY  # the options below are keyword-only
    history_size: int = 10
    line_search: str | bool | None = "strong_wolfe"
    c1: float = 1e-4
    c2: float = 0.9
    max_backtracks: int = 30
    max_evaluations: int = 25

    def __post_init__(self) -> None:
        _check_lr(self.lr)
        for name in ("history_size", "max_backtracks", "max_evaluations"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if isinstance(self.line_search, bool):  # True: the default search; False: none
            object.__setattr__(self, "line_search", "strong_wolfe" if self.line_search else None)
        if self.line_search is not None and self.line_search not in _LINE_SEARCHES:
            raise ValueError(f"line_search must be 'strong_wolfe', 'armijo' or None, got {self.line_search!r}")
        if not _is_real(self.c1) or not 0.0 < self.c1 < 1.0:
            raise ValueError(f"c1 must be in (0, 1), got {self.c1!r}")
        if not _is_real(self.c2) or not self.c1 < self.c2 < 1.0:
            raise ValueError(f"c2 must be in (c1, 1) = ({self.c1}, 1), got {self.c2!r}")

    def init(self, w: Tree) -> Tree:
        r"""Return the empty history: ``"t"`` (steps taken), ``"h_diag"`` (the scaling), ``"rho"``
        (:math:`1/s^\top y` per pair, 0 for an empty slot), and per leaf the pairs ``"s.<name>"``,
        ``"y.<name>"`` (newest first, shape ``(history_size, *leaf.shape)``) and the previous
        point and gradient ``"w_prev.<name>"``, ``"g_prev.<name>"``."""
        ref = next(iter(w.values()))
        state = {
            "t": torch.zeros((), dtype=ref.dtype, device=ref.device),
            "h_diag": torch.ones((), dtype=ref.dtype, device=ref.device),
            "rho": torch.zeros(self.history_size, dtype=ref.dtype, device=ref.device),
        }
        for k, v in w.items():
            state[f"s.{k}"] = v.new_zeros((self.history_size, *v.shape))
            state[f"y.{k}"] = v.new_zeros((self.history_size, *v.shape))
            state[f"w_prev.{k}"] = torch.zeros_like(v)
            state[f"g_prev.{k}"] = torch.zeros_like(v)
        return state

    def direction(self, w: Tree, grad: Tree, state: Tree, relative: bool = False) -> tuple[Tree, Tree, torch.Tensor]:
        r"""The quasi-Newton direction at ``w``, the state with the newest pair stored, and the
        step scale of this step (:math:`\min(1, 1/\lVert\nabla g\rVert_1)` on the first step, else 1).

        A pair is stored when :math:`s^\top y > 10^{-10}` (PyTorch's rule), or with ``relative``
        when :math:`s^\top y > \epsilon\, y^\top y` (SciPy's L-BFGS-B's): near a minimum the pairs
        are small, and the absolute rule drops every one of them there, so that the steps decay
        to scaled gradient steps (measured on the wine problem: 78 steps to a gradient norm of
        1e-10 with the absolute rule, 36 with the relative one)."""
        first = state["t"] == 0
        s = {k: w[k] - state[f"w_prev.{k}"] for k in w}
        y = {k: grad[k] - state[f"g_prev.{k}"] for k in w}
        ys = _dot(y, s)
        floor = torch.finfo(ys.dtype).eps * _dot(y, y) if relative else 1e-10
        accept = (~first) & (ys > floor)
        safe_ys = torch.where(accept, ys, torch.ones_like(ys))
        new_state: Tree = {"t": state["t"] + 1}
        new_state["rho"] = torch.where(accept, torch.cat([(1.0 / safe_ys).reshape(1), state["rho"][:-1]]), state["rho"])
        h_diag = torch.where(accept, ys / torch.where(accept, _dot(y, y), torch.ones_like(ys)), state["h_diag"])
        new_state["h_diag"] = torch.where(first, torch.ones_like(h_diag), h_diag)
        for k in w:
            for name, pair in (("s", s), ("y", y)):
                old = state[f"{name}.{k}"]
                new_state[f"{name}.{k}"] = torch.where(accept, torch.cat([pair[k].unsqueeze(0), old[:-1]]), old)
            new_state[f"w_prev.{k}"], new_state[f"g_prev.{k}"] = w[k], grad[k]
        rho = new_state["rho"]
        q = {k: -grad[k] for k in w}
        alphas = []
        for i in range(self.history_size):  # newest pair first
            alpha = rho[i] * _dot({k: new_state[f"s.{k}"][i] for k in w}, q)
            q = {k: q[k] - alpha * new_state[f"y.{k}"][i] for k in w}
            alphas.append(alpha)
        r = {k: q[k] * new_state["h_diag"] for k in w}
        for i in reversed(range(self.history_size)):
            beta = rho[i] * _dot({k: new_state[f"y.{k}"][i] for k in w}, r)
            r = {k: r[k] + (alphas[i] - beta) * new_state[f"s.{k}"][i] for k in w}
        grad_l1 = sum(grad[k].abs().sum() for k in w)
        scale = torch.where(first, torch.clamp(1.0 / grad_l1, max=1.0), torch.ones_like(ys))
        return r, new_state, scale

    def update(self, w: Tree, grad: Tree, state: Tree) -> tuple[Tree, Tree]:
        """Return the parameters and state after one fixed-step L-BFGS step (no line search)."""
        d, new_state, scale = self.direction(w, grad, state)
        return {k: w[k] + self.lr * scale * d[k] for k in w}, new_state

    def update_with_loss(
        self, w: Tree, grad: Tree, state: Tree, loss: float, loss_at: Callable[[Tree], float]
    ) -> tuple[Tree, Tree]:
        r"""One step with a backtracking (Armijo) line search unless ``line_search`` is None
        (then :meth:`update`): a search on values only, for callers that cannot give gradients at
        other points (:meth:`update_with_objective` takes the strong Wolfe search).

        Args:
            w: the current parameters; ``grad`` and ``loss`` are the gradient and the loss there.
            grad: the gradient at ``w``.
            state: the optimizer state.
            loss: the loss at ``w``.
            loss_at: the loss at other parameters (same batch), as a number.

        Returns:
            The new parameters and state. A direction that does not descend (:math:`\nabla g^\top d
            \ge 0`) is replaced by the steepest descent, and the history is cleared.
        """
        if not self.line_search:
            return self.update(w, grad, state)
        d, new_state, scale = self.direction(w, grad, state)
        slope = float(_dot(grad, d))
        if not slope < 0:
            d, slope, new_state = self._restart(w, grad, new_state)
        step = self.lr * float(scale)
        candidate = {k: w[k] + step * d[k] for k in w}
        # near the minimum the decrease falls below the loss's rounding error: a test that cannot
        # see it would halve good steps to nothing, so changes within rounding count as decrease
        rounding = 16 * torch.finfo(next(iter(w.values())).dtype).eps * abs(loss)
        for _ in range(self.max_backtracks):
            if loss_at(candidate) <= loss + self.c1 * step * slope + rounding:
                break
            step *= 0.5
            candidate = {k: w[k] + step * d[k] for k in w}
        return candidate, new_state

    def update_with_objective(self, w: Tree, grad: Tree, state: Tree, objective: InnerObjective) -> tuple[Tree, Tree]:
        r"""One step with the configured line search on ``objective`` (the step's inner loss).

        With ``"strong_wolfe"``: the quasi-Newton direction :math:`d`, then
        :func:`~hypergrad.line_search.strong_wolfe` from step ``lr`` (scaled on the first step as
        in :meth:`update`). A direction that does not descend, or a search that finds no
        decrease, clears the history (the next step starts again from the scaled gradient).

        Args:
            w: the current parameters.
            grad: the gradient at ``w``.
            state: the optimizer state.
            objective: the step's inner loss (:class:`~hypergrad.objective.InnerObjective`).

        Returns:
            The new parameters and state.

        Example:
            >>> import torch, hypergrad as hg
            >>> g = lambda w, lam, b: ((w["x"] - 2.0) ** 4).sum()
            >>> w = {"x": torch.zeros(1, dtype=torch.float64)}
            >>> objective = hg.inner.InnerObjective(hg.BilevelProblem(g, g), {}, None, w, 16.0, {"x": torch.tensor([-32.0], dtype=torch.float64)})
            >>> opt = hg.inner.LBFGS()
            >>> w1, state = opt.update_with_objective(w, objective.grad, opt.init(w), objective)
            >>> 0.0 < float(w1["x"]) < 4.0, objective.evaluations > 0
            (True, True)
        """
        if self.line_search != "strong_wolfe":
            if self.line_search is None:
                return self.update(w, grad, state)
            return self.update_with_loss(w, grad, state, objective.value, objective.value_at)
        d, new_state, scale = self.direction(w, grad, state, relative=True)
        slope = float(_dot(grad, d))
        if not slope < 0:
            d, slope, new_state = self._restart(w, grad, new_state)
        ref = next(iter(w.values()))
        rounding = 16 * torch.finfo(ref.dtype).eps * abs(objective.value)

        def phi(t: float) -> tuple[float, float, tuple[Tree, Tree]]:
            point = {k: w[k] + t * d[k] for k in w}
            value, g = objective.value_and_grad(point)
            return value, float(_dot(g, d)), (point, g)

        if slope == 0.0:  # a zero gradient: nothing to search
            return w, new_state
        # without curvature pairs d is the gradient: a first step of unit length (as SciPy's L-BFGS-B takes),
        # then the quasi-Newton step lr
        no_history = float(new_state["rho"].abs().sum()) == 0.0 and float(new_state["h_diag"]) == 1.0
        step = self.lr / math.sqrt(-slope) if no_history else self.lr * float(scale)
        result = strong_wolfe(phi, objective.value, slope, step, c1=self.c1, c2=self.c2,
                              max_evaluations=self.max_evaluations, rounding=rounding)
        if result.step == 0.0:  # no decrease along d: start again from the gradient next time
            return w, self._restart(w, grad, new_state)[2]
        return result.aux[0], new_state

    def _restart(self, w: Tree, grad: Tree, new_state: Tree) -> tuple[Tree, float, Tree]:
        """Steepest descent, with the history cleared (its previous point and gradient kept)."""
        fresh = self.init(w)
        kept = {f"{n}_prev.{k}": new_state[f"{n}_prev.{k}"] for n in ("w", "g") for k in w}
        return {k: -grad[k] for k in w}, -float(_dot(grad, grad)), {**fresh, "t": new_state["t"], **kept}
