"""The outer loop: inner steps, hypergradient, outer optimizer step, for any method."""

from __future__ import annotations

import copy
import functools
import math
import os
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

try:  # the progress bar is optional: hypergrad itself needs only torch and numpy
    from tqdm.auto import tqdm
except ImportError:

    @functools.cache  # once per process
    def _notice_no_tqdm() -> None:
        warnings.warn("progress=True shows a progress bar only with tqdm installed (pip install tqdm); "
                      "pass progress=False to silence this notice", UserWarning, stacklevel=4)

    class tqdm:  # noqa: N801  (stands in for tqdm.auto.tqdm without a bar: iterates, drops the postfix)
        def __init__(self, iterable: Iterable[Any], **options: Any) -> None:
            self.iterable = iterable
            if not options.get("disable", False):
                _notice_no_tqdm()

        def __iter__(self) -> Iterator[Any]:
            return iter(self.iterable)

        def set_postfix(self, **_values: Any) -> None:
            pass


from hypergrad.autodiff import inner_grads
from hypergrad.batches import StepBatches
from hypergrad.checkpoint import SolveState, save_checkpoint
from hypergrad.compiled import check_compilable
from hypergrad.errors import (
    NonFiniteError,
    WarningLog,
    check_inner_optimizer,
    check_not_class,
    collect_warnings,
)
from hypergrad.inner import SGD, InnerOptimizer
from hypergrad.objective import InnerObjective
from hypergrad.problem import BilevelProblem, HypergradMethod
from hypergrad.tree import Tree, check_finite, check_like, tree_detach, tree_norm

__all__ = ["InnerSolveResult", "SolveResult", "inner_solve", "solve"]

OptimizerFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]

# A batch object itself (not an iterable of batches): reused for every step.
_SINGLE_BATCH = (torch.Tensor, dict, tuple)


@dataclass
class SolveResult:
    """Outcome of :func:`solve`.

    Attributes:
        w: final inner parameters.
        lam: final outer parameters.
        history: per outer step: ``outer_loss`` (f at the current ``w``; NaN at the steps where it
            was not evaluated, see ``outer_loss_every``), ``grad_norm`` (of the hypergradient
            estimate), ``inner_residual`` (‖∇_w g‖ before the estimate), ``converged`` (the
            method's ``info.converged`` as 1.0 / 0.0; NaN for a method without a stopping test,
            see :class:`~hypergrad.problem.HypergradInfo`) and ``lr`` (the learning rate of the outer optimizer's first
            parameter group for that step; NaN for an optimizer without one).
        state: a :class:`~hypergrad.checkpoint.SolveState` after the last step: the method's
            state (``state.method``), the outer optimizer's and the scheduler's, the inner
            optimizer's, the batch streams' positions and the random-number state. Pass it to a
            later call (``state=``) to continue exactly, or write it with
            :func:`~hypergrad.checkpoint.save_checkpoint`.
        steps_run: outer steps taken (``steps`` unless the callback stopped the loop).
        stopped_early: whether the callback stopped the loop before ``steps``.
        unconverged_steps: outer steps whose linear solve stopped short of its tolerance
            (``info.converged`` False with ``info.stopping_test`` ``"linear solve"``: ``Implicit``,
            ``FiniteDifference``, ``AlternatingImplicit``; also a method of your own that reports
            False without naming its test). 0 for the other methods: ``BOME``'s value-function
            gap and ``Penalty``'s inner residuals stay above their tolerances during most of a
            run by design (``history["converged"]`` records them).
        warnings: the warnings of the solve, one line per kind, as warned at its end (a kind
            that occurred at several outer steps: at how many, and the worst occurrence).

    Example:
        >>> import torch, hypergrad as hg
        >>> g = lambda w, lam, b: 0.5 * ((w["x"] - lam["c"]) ** 2).sum()
        >>> res = hg.solve(hg.BilevelProblem(g, g), {"x": torch.zeros(1)}, {"c": torch.ones(1)},
        ...                hg.Implicit(), steps=3, inner_steps=5, progress=False)
        >>> sorted(res.history), len(res.history["outer_loss"]), res.steps_run, res.stopped_early
        (['converged', 'grad_norm', 'inner_residual', 'lr', 'outer_loss'], 3, 3, False)
        >>> res.unconverged_steps
        0
    """

    w: Tree
    lam: Tree
    history: dict[str, list[float]] = field(default_factory=dict)
    state: SolveState | None = None
    steps_run: int = 0
    stopped_early: bool = False
    unconverged_steps: int = 0
    warnings: list[str] = field(default_factory=list)


class _BatchStream:
    """One stream of batches, drawn one at a time and never buffered.

    ``None`` or a single batch (a tensor, dict or tuple) is reused for every draw. A re-iterable
    (a list, a ``DataLoader``) is read epoch after epoch, each epoch from a fresh ``iter(...)``
    (so a shuffling loader reshuffles). A one-shot iterator (a generator, ``iter(loader)``, an
    infinite sampler) is read once; running out is an error naming the stream.
    """

    def __init__(self, batches: Any, name: str) -> None:
        self.name = name
        self.drawn = 0
        self.constant = batches is None or isinstance(batches, _SINGLE_BATCH)
        self._batches = batches
        self._iterator: Iterator[Any] | None = None
        self._one_shot = False
        self._epoch_drawn = 0
        self._epoch_rng: dict[str, Any] | None = None  # random state before this epoch's iter(...)
        self._first_rng: dict[str, Any] | None = None  # ... and before its first draw
        if self.constant:
            return
        if isinstance(batches, StepBatches):
            raise TypeError(
                f"{name} must be batches, not a StepBatches: solve draws a fresh batch per step "
                f"for methods that take several (pass {name}=<the batches> directly)"
            )
        self._epoch_rng = _rng_snapshot(batches)
        try:
            self._iterator = iter(batches)
        except TypeError:
            raise TypeError(
                f"{name} must be None, a single batch (a Tensor, dict or tuple), or an iterable of "
                f"batches (a list, a DataLoader, an iterator), got {type(batches).__name__}"
            ) from None
        self._one_shot = self._iterator is batches

    def next(self) -> Any:
        """The next batch: the same object for a constant stream, a fresh draw otherwise."""
        if self.constant:
            return self._batches
        assert self._iterator is not None
        if self._epoch_drawn == 0 and not self._one_shot:
            self._first_rng = _rng_snapshot(self._batches)  # a shuffling sampler draws its seed here
        try:
            batch = next(self._iterator)
        except StopIteration:
            batch = self._next_epoch()
        self.drawn += 1
        self._epoch_drawn += 1
        return batch

    def _next_epoch(self) -> Any:
        if self._one_shot:
            raise ValueError(
                f"{self.name} ran out after {self.drawn} batch(es): it is a one-shot iterator, which "
                "solve cannot restart; pass the re-iterable itself (a list or a DataLoader, "
                "re-read each epoch) or an infinite iterator"
            )
        if self._epoch_drawn == 0 and self.drawn == 0:
            raise ValueError(f"{self.name} is empty: it yielded no batch")
        self._epoch_rng = _rng_snapshot(self._batches)
        self._iterator = iter(self._batches)
        self._epoch_drawn = 0
        self._first_rng = _rng_snapshot(self._batches)
        try:
            return next(self._iterator)
        except StopIteration:
            raise ValueError(
                f"{self.name} yielded no batch in a new epoch (after {self.drawn} batch(es) in "
                "earlier epochs)"
            ) from None

    def position(self) -> dict[str, Any]:
        """Where the stream stands, for :class:`SolveState` (tensors and plain data only)."""
        kind = "constant" if self.constant else "one-shot" if self._one_shot else "re-iterable"
        record: dict[str, Any] = {"kind": kind, "drawn": self.drawn, "epoch_drawn": self._epoch_drawn}
        if kind == "re-iterable":
            record.update(epoch_rng=self._epoch_rng, first_rng=self._first_rng, rng=_rng_snapshot(self._batches))
        return record

    def resume(self, record: dict[str, Any]) -> None:
        """Continue from ``record`` (a :meth:`position`): replay the current epoch up to its position.

        A re-iterable is iterated afresh from the random state its epoch started from, and the
        batches already drawn in that epoch are drawn again and dropped, so a shuffling
        ``DataLoader`` continues with the permutation it was in. A one-shot iterator cannot be
        rewound: it continues from wherever it is.
        """
        self.drawn = int(record["drawn"])
        if self.constant or self._one_shot or record.get("kind") != "re-iterable":
            return
        _set_rng(self._batches, record["epoch_rng"])
        self._iterator = iter(self._batches)
        epoch_drawn = int(record["epoch_drawn"])
        if epoch_drawn:
            _set_rng(self._batches, record["first_rng"])
        for position in range(epoch_drawn):
            try:
                next(self._iterator)
            except StopIteration:
                raise ValueError(
                    f"cannot resume {self.name}: the state stood at batch {epoch_drawn} of an epoch, but "
                    f"the batches given now yield only {position} (pass the same batches as the run that "
                    "made the state)"
                ) from None
        self._epoch_drawn = epoch_drawn
        self._epoch_rng, self._first_rng = record["epoch_rng"], record["first_rng"]
        _set_rng(self._batches, record["rng"])

    def for_call(self, per_step: bool) -> Any:
        """The batch argument of one ``method.hypergrad`` call.

        ``per_step``: the method reads its batches through :func:`hypergrad.batches.per_step`,
        so it gets a :class:`StepBatches` drawing one fresh batch per step from this stream (a
        constant stream hands over its one batch). A stream that itself yields ``StepBatches``
        (the older idiom ``[StepBatches(iterator)]``) hands each one over as it is.
        """
        if self.constant or not per_step:
            return self.next()
        first = self.next()
        if isinstance(first, StepBatches):
            return first
        return StepBatches(self._draws(first))

    def _draws(self, first: Any) -> Iterator[Any]:
        batch = first
        while True:
            if isinstance(batch, StepBatches):
                raise TypeError(
                    f"{self.name} mixes StepBatches with plain batches: pass the batches "
                    f"themselves ({self.name}=<a list, a DataLoader, an iterator>); solve hands "
                    "methods that take several steps a fresh batch per step"
                )
            yield batch
            batch = self.next()


def _at_step(log: WarningLog, step: int, where: str, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``call(*args, **kwargs)`` as part of outer step ``step``: its warnings go to ``log`` (warned
    once per kind when the solve ends, or now if it raises), and a :class:`NonFiniteError` names
    the step."""
    log.step = step
    try:
        with collect_warnings(log):
            return call(*args, **kwargs)
    except NonFiniteError as error:
        log.emit(step + 1, stacklevel=3)
        raise NonFiniteError(f"outer step {step}, {where}{_function_of(str(error))}: {error}") from error
    except BaseException:
        log.emit(step + 1, stacklevel=3)
        raise


def _check_components(method: Any, inner_optimizer: Any, outer_optimizer: Any) -> None:
    """One-line errors for a class where an instance is expected, and for an optimizer of the
    wrong kind (torch.optim where hypergrad's inner optimizers go, and the other way round)."""
    check_not_class(method, "method")
    if inner_optimizer is not None:
        check_inner_optimizer(inner_optimizer, "inner_optimizer", objective=True)
    if isinstance(outer_optimizer, type) and not issubclass(outer_optimizer, torch.optim.Optimizer):
        # a torch.optim class is a factory (torch.optim.Adam(params)); any other class is not
        hint = (" (hypergrad.inner optimizers are for inner_optimizer)"
                if callable(getattr(outer_optimizer, "update", None)) else "")
        raise TypeError(
            "outer_optimizer must be a factory params -> torch.optim.Optimizer, e.g. lambda p: "
            f"torch.optim.Adam(p, lr=1e-2), not the class {outer_optimizer.__module__}.{outer_optimizer.__qualname__}"
            f"{hint}")
    if isinstance(outer_optimizer, torch.optim.Optimizer) or (
            outer_optimizer is not None and not callable(outer_optimizer)):
        kind = type(outer_optimizer)
        given = f"torch.optim.{kind.__name__}" if isinstance(outer_optimizer, torch.optim.Optimizer) else kind.__name__
        hint = (" (hypergrad.inner optimizers are for inner_optimizer)"
                if callable(getattr(outer_optimizer, "update", None)) else "")
        raise TypeError(
            "outer_optimizer must be a factory params -> torch.optim.Optimizer, e.g. lambda p: "
            f"torch.optim.Adam(p, lr=1e-2), not a {given} instance: solve builds the optimizer over its own "
            f"copy of lam{hint}")


def _compiled_combination(method: Any) -> str | None:
    """How ``method`` asks for compiled stages (``"SOBA(compile=True)"``), or None when it does not."""
    if getattr(method, "compile", False) is True:
        return f"{type(method).__name__}(compile=True)"
    nested = getattr(method, "implicit", None)  # AlternatingImplicit's Implicit
    if nested is not None and _compiled_combination(nested) is not None:
        return f"{type(method).__name__}(implicit={_compiled_combination(nested)})"
    return None


def _function_of(message: str) -> str:
    """Which of the problem's functions a non-finite message is about (the methods name the
    inner and outer losses in their messages)."""
    if "penalised loss" in message:
        return " (g + sigma f)"
    if "inner loss" in message or "inner iterate" in message or "inner gradient" in message:
        return " (g, the inner loss)"
    if "outer loss" in message or "outer gradient" in message:
        return " (f, the outer loss)"
    return ""


def _loader_generators(batches: Any) -> list[torch.Generator]:
    """The random generators a ``DataLoader`` (or its sampler) was given, if any."""
    found: list[torch.Generator] = []
    holders = (batches, getattr(batches, "sampler", None), getattr(getattr(batches, "batch_sampler", None), "sampler", None))
    for holder in holders:
        generator = getattr(holder, "generator", None)
        if isinstance(generator, torch.Generator) and all(generator is not g for g in found):
            found.append(generator)
    return found


def _rng_snapshot(batches: Any) -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "generators": [g.get_state() for g in _loader_generators(batches)]}


def _set_rng(batches: Any, snapshot: dict[str, Any]) -> None:
    torch.set_rng_state(snapshot["torch"])
    for generator, saved in zip(_loader_generators(batches), snapshot["generators"], strict=False):
        generator.set_state(saved)


def _global_rng() -> dict[str, Any]:
    rng: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return rng


def _set_global_rng(rng: dict[str, Any]) -> None:
    if "torch" in rng:
        torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


def _check_resume_point(resume: SolveState, w: Tree, lam: Tree) -> None:
    for name, given, saved in (("w", w, resume.w), ("lam", lam, resume.lam)):
        same = set(given) == set(saved) and all(
            given[k].shape == saved[k].shape and torch.equal(given[k], saved[k].to(given[k].device, given[k].dtype))
            for k in given)
        if not same:
            raise ValueError(
                f"{name} is not state.{name} (where the state's run stopped, after step {resume.step}): resume "
                f"with {name}=state.{name}, or pass state=state.method to start a new run with the "
                "method's state only"
            )


def _restore_outer(resume: SolveState, optimizer: torch.optim.Optimizer,
                   scheduler: torch.optim.lr_scheduler.LRScheduler | None) -> None:
    if resume.scheduler is not None and scheduler is None:
        raise ValueError("state holds a scheduler's state but scheduler=None: pass the run's scheduler factory")
    if resume.outer_optimizer is not None:
        try:  # a copy: the optimizer steps its state in place, and the same state may be resumed twice
            optimizer.load_state_dict(copy.deepcopy(resume.outer_optimizer))
        except (ValueError, KeyError, RuntimeError) as exc:
            raise ValueError(f"state.outer_optimizer does not fit the outer_optimizer given: {exc}") from exc
    if scheduler is not None and resume.scheduler is not None:
        scheduler.load_state_dict(copy.deepcopy(resume.scheduler))


def _check_steps(steps: Any, name: str) -> None:
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
        raise ValueError(f"{name} must be an int >= 0, got {steps!r}")


class InnerSolveResult(tuple):
    """What :func:`inner_solve` returns: unpacks as ``(w, state, grad_norm)``, and says how it stopped.

    Attributes:
        w: the inner parameters reached.
        state: the optimizer's state there (pass it back as ``opt_state`` to continue).
        grad_norm: the norm of the last gradient taken (NaN when no gradient was taken).
        steps: optimizer steps taken.
        converged: with a ``tol``, whether the gradient norm reached it (then ``grad_norm`` is
            the norm at ``w`` and ``<= tol``); None without a ``tol`` (nothing was checked).
        evaluations: evaluations of the inner loss with its gradient: at the start of each step
            (and at the final ``w`` with a ``tol``), plus those of a line search (``LBFGS``,
            ``Newton``); a step that starts where the previous step's search already evaluated
            the loss on the same batch (a full-batch solve) reuses that evaluation.

    Example:
        >>> import torch, hypergrad as hg
        >>> out = hg.InnerSolveResult({"x": torch.ones(1)}, {}, 0.0, steps=4, converged=None)
        >>> w, state, norm = out
        >>> out.steps, out.converged, out.grad_norm
        (4, None, 0.0)
    """

    steps: int
    converged: bool | None
    evaluations: int

    def __new__(cls, w: Tree, state: Tree, grad_norm: float, *, steps: int,
                converged: bool | None, evaluations: int = 0) -> InnerSolveResult:
        self = super().__new__(cls, (w, state, grad_norm))
        self.steps, self.converged, self.evaluations = steps, converged, evaluations
        return self

    @property
    def w(self) -> Tree:
        """The inner parameters reached."""
        return self[0]

    @property
    def state(self) -> Tree:
        """The optimizer's state."""
        return self[1]

    @property
    def grad_norm(self) -> float:
        """The norm of the last gradient taken."""
        return self[2]

    def __repr__(self) -> str:
        return (f"InnerSolveResult(steps={self.steps}, converged={self.converged}, "
                f"grad_norm={self.grad_norm:.3g})")


def _inner_steps(
    problem: BilevelProblem,
    w: Tree,
    lam: Tree,
    steps: int,
    optimizer: InnerOptimizer,
    stream: _BatchStream,
    opt_state: Tree | None,
    tol: float | None = None,
) -> InnerSolveResult:
    state = optimizer.init(w) if opt_state is None else opt_state
    residual = float("nan")
    taken, converged, evaluations = 0, None if tol is None else False, 0
    # an optimizer with a line search or second-order steps: it gets the step's loss itself
    update_with_objective = getattr(optimizer, "update_with_objective", None)
    update_with_loss = getattr(optimizer, "update_with_loss", None)  # the earlier form: values only
    known: tuple[Any, float, Tree] | None = None  # (batch, loss, gradient) at w from the last step's search
    for _ in range(steps + (tol is not None)):  # with a tol: one more gradient, at the final w
        batch = stream.next()
        if known is not None and known[0] is batch:  # the same batch: the search already evaluated w
            loss, gw = known[1], known[2]
        else:
            loss, gw, _ = inner_grads(problem, batch, w, lam)
            evaluations += 1
        known = None
        assert gw is not None
        residual = float(tree_norm(gw))
        if tol is not None and residual <= tol:
            converged = True
            break
        if taken == steps:
            break
        with torch.no_grad():
            if update_with_objective is not None:
                objective = InnerObjective(problem, lam, batch, w, float(loss), gw)
                w, state = update_with_objective(w, gw, state, objective)
                evaluations += objective.evaluations
                if objective.last is not None and objective.last[0] is w:  # a full-batch search ended at w
                    known = (batch, objective.last[1], objective.last[2])
            elif update_with_loss is not None:
                w, state = update_with_loss(w, gw, state, float(loss),
                                            lambda v, batch=batch: float(problem.inner_loss(v, lam, batch)))
            else:
                w, state = optimizer.update(w, gw, state)
        w = tree_detach(w)
        taken += 1
    return InnerSolveResult(w, state, residual, steps=taken, converged=converged, evaluations=evaluations)


def inner_solve(
    problem: BilevelProblem,
    w: Tree,
    lam: Tree,
    steps: int,
    optimizer: InnerOptimizer,
    batches: Iterable[Any] | None = None,
    *,
    opt_state: Tree | None = None,
    tol: float | None = None,
) -> InnerSolveResult:
    """Run up to ``steps`` plain (non-differentiable) optimizer steps on ``g(·, lam)``.

    With ``tol``, stop as soon as :math:`\\lVert \\nabla_w g \\rVert \\le` ``tol`` (checked
    before each step and once more after the last, on that step's batch); the result says how
    many steps were taken and whether the tolerance was met. An optimizer with a line search
    (:class:`~hypergrad.inner.LBFGS`) searches on the batch of its step.

    Args:
        problem: the bilevel problem (only its inner loss is used).
        w: starting inner parameters.
        lam: outer parameters, held fixed.
        steps: number of steps (>= 0).
        optimizer: an inner optimizer from :mod:`hypergrad.inner`.
        batches: the inner batches, one per step, drawn as :func:`solve` draws them: an iterable
            of batches (a list or a ``DataLoader`` is re-read from a fresh ``iter(...)`` each
            epoch, an iterator is consumed and must not run out), a single batch (a tensor, dict
            or tuple, reused), or None.
        opt_state: optimizer state to continue from (default ``optimizer.init(w)``).
        tol: stop when the gradient norm is at most this (a number >= 0); default None: run all
            ``steps``.

    Returns:
        An :class:`InnerSolveResult`, which unpacks as ``(w, optimizer_state,
        final_gradient_norm)``; the norm is that of the last gradient taken (NaN when
        ``steps == 0`` without ``tol``); ``.steps`` and ``.converged`` say how it stopped
        (``converged`` is None without ``tol``).

    Raises:
        ValueError: ``steps`` is not an int >= 0; ``tol`` is not a number >= 0; an iterator
            ``batches`` ran out, or an iterable is empty.
        TypeError: ``batches`` is not one of the forms above.
        hypergrad.errors.NonFiniteError: the inner loss or its gradient became NaN or inf (a
            step size too large for the problem).

    Example:
        >>> import torch, hypergrad as hg
        >>> g = lambda w, lam, b: 0.5 * ((w["x"] - lam["c"]) ** 2).sum()
        >>> p = hg.BilevelProblem(g, g)
        >>> w, _, res = hg.inner_solve(p, {"x": torch.zeros(2)}, {"c": torch.ones(2)}, 50, hg.inner.SGD(0.5))
        >>> w["x"].tolist(), res < 1e-6
        ([1.0, 1.0], True)

        Stop at a gradient-norm tolerance instead (here after 20 of at most 100 steps):

        >>> out = hg.inner_solve(p, {"x": torch.zeros(2)}, {"c": torch.ones(2)}, 100, hg.inner.SGD(0.5), tol=1e-5)
        >>> out.steps, out.converged, out.grad_norm <= 1e-5
        (18, True, True)
    """
    _check_steps(steps, "inner_steps")
    check_inner_optimizer(optimizer, "optimizer", objective=True)
    if tol is not None and (not isinstance(tol, (int, float)) or isinstance(tol, bool) or not 0 <= tol < math.inf):
        raise ValueError(f"tol must be None or a finite number >= 0, got {tol!r}")
    return _inner_steps(problem, w, lam, steps, optimizer, _BatchStream(batches, "batches"), opt_state, tol)


def _make_scheduler(factory: SchedulerFactory | None, optimizer: torch.optim.Optimizer,
                    outer_loss_every: int) -> torch.optim.lr_scheduler.LRScheduler | None:
    if factory is None:
        return None
    scheduler = factory(optimizer)
    if not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
        raise TypeError(
            "scheduler must be a factory optimizer -> torch.optim.lr_scheduler.LRScheduler (e.g. "
            f"lambda opt: torch.optim.lr_scheduler.StepLR(opt, 10)), got {type(scheduler).__name__}"
        )
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau) and outer_loss_every != 1:
        raise ValueError(
            "scheduler=ReduceLROnPlateau is stepped with the outer loss of every step, so it needs "
            f"outer_loss_every=1, got {outer_loss_every!r}"
        )
    return scheduler


def solve(
    problem: BilevelProblem,
    w: Tree,
    lam: Tree,
    method: HypergradMethod,
    outer_optimizer: OptimizerFactory | None = None,
    *,
    steps: int = 100,
    inner_steps: int = 0,
    inner_optimizer: InnerOptimizer | None = None,
    inner_batches: Iterable[Any] | None = None,
    outer_batches: Iterable[Any] | None = None,
    progress: bool = True,
    callback: Callable[[int, Tree, Tree, Any], Any] | None = None,
    state: SolveState | dict[str, Any] | None = None,
    hypergrad_batches: Iterable[Any] | None = None,
    scheduler: SchedulerFactory | None = None,
    outer_loss_every: int = 1,
    checkpoint_every: int = 0,
    checkpoint_path: str | os.PathLike[str] | None = None,
) -> SolveResult:
    r"""Minimise :math:`F(\lambda) = f(w^*(\lambda), \lambda)` with any hypergradient method.

    Each outer step runs ``inner_steps`` plain steps of ``inner_optimizer`` on ``w`` (warm
    started from the previous step), asks ``method`` for the hypergradient, and steps ``lam``
    with a :mod:`torch.optim` optimizer (and its learning-rate ``scheduler``, if any). Methods
    that advance ``w`` themselves (``Unrolled``, ``Penalty``, ``BOME``) usually need
    ``inner_steps=0``; ``Implicit`` and ``FiniteDifference`` assume ``w`` solves the inner
    problem, so give them enough ``inner_steps`` (the residual is recorded in
    ``history["inner_residual"]``).

    **Batch streams.** ``inner_batches``, ``hypergrad_batches`` and ``outer_batches`` each take
    one of: None (the losses get ``batch=None``); a single batch, a tensor, dict or tuple,
    reused for every step; a re-iterable such as a list or a :class:`torch.utils.data.DataLoader`,
    read epoch after epoch, each epoch from a fresh ``iter(...)`` (a shuffling loader reshuffles
    every epoch; epochs run on across outer steps); or a one-shot iterator (a generator,
    ``iter(loader)``, an infinite sampler), read once and never buffered: a finite one running
    out raises :class:`ValueError` naming the stream and how many batches it gave. Batches are
    drawn only as they are used.

    Who draws what, per outer step: the ``inner_steps`` plain steps draw one batch each from
    ``inner_batches``; the method's ``inner_batch`` (the batch of its inner steps, linear solve
    and Hessian products) comes from ``hypergrad_batches``, by default the same stream as
    ``inner_batches`` (the next batches after the plain steps'); its ``outer_batch`` from
    ``outer_batches``. A method that takes several steps per call and says so with the class
    attribute ``takes_step_batches = True`` (``Unrolled``, ``Penalty``, ``BOME``; it reads its
    batches through :func:`hypergrad.batches.per_step`) gets a
    :class:`~hypergrad.batches.StepBatches` over each stream, so every one of its steps draws a
    fresh batch; any other method (``Implicit``, ``FiniteDifference``, your own) gets one batch
    per call. (A stream of :class:`~hypergrad.batches.StepBatches`, the older idiom
    ``inner_batches=[StepBatches(iterator)]``, still works: each is handed over as it is.) Such
    a method draws the first batch of each stream when the call starts. For minibatch
    ``Implicit``, a larger ``hypergrad_batches`` batch keeps the linear
    solve well posed (see :doc:`/methods/implicit`).

    **Loop controls.** ``callback(step, w, lam, result)`` runs after each outer step; returning a
    true value (e.g. ``True``) stops the loop after that step (``SolveResult.steps_run`` and
    ``stopped_early`` record it). ``scheduler`` is a factory ``optimizer -> LRScheduler`` (e.g.
    ``lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=50, gamma=0.5)``), stepped once
    after each outer step; ``ReduceLROnPlateau`` is stepped with that step's outer loss.
    ``outer_loss_every=k`` evaluates the outer loss for ``history`` (and the progress bar) at
    every ``k``-th step (0: never); skipped steps record NaN. Each evaluation is one extra
    forward pass of ``f``, and for a method that takes step batches one more batch drawn from
    ``outer_batches``.

    **Resuming.** ``SolveResult.state`` is a :class:`~hypergrad.checkpoint.SolveState`; pass it
    back, with ``w=state.w`` and ``lam=state.lam`` and the same problem, method, factories and
    batches, and the run continues exactly where it stopped: ``steps`` more steps, numbered on
    from ``state.step`` (in ``callback`` and ``outer_loss_every``), with the method's state, the
    outer optimizer's and the scheduler's state (Adam's moments, the schedule's position), the
    plain inner steps' optimizer state, and each batch stream's position restored, so 10 + 10
    steps give the numbers of 20 bit for bit. A re-iterable stream (a list, a ``DataLoader``)
    is replayed from the random state its current epoch started from up to the batch it stood
    at (its batches are drawn again and dropped), so a shuffling ``DataLoader`` continues its
    permutation; torch's global random state (and the generator a ``DataLoader`` or its sampler
    was given) is set back to where the run left it. Not restored: a one-shot iterator (it
    continues from wherever it is; ``state.streams[name]["drawn"]`` says how many batches it
    gave), and random state outside torch (Python's ``random``, NumPy) that the batches or
    losses use. ``dataclasses.replace(state, streams={})`` continues the optimization with
    fresh streams. ``checkpoint_every=k`` writes the state to ``checkpoint_path`` (atomically,
    with :func:`~hypergrad.checkpoint.save_checkpoint`) after every ``k``-th step and after the
    last; :func:`~hypergrad.checkpoint.load_checkpoint` reads it back to resume a killed run.

    Args:
        problem: the bilevel problem.
        w: initial inner parameters.
        lam: initial outer parameters.
        method: any object with the ``hypergrad`` method (``Implicit``, ``Unrolled``, ...).
        outer_optimizer: factory ``params -> torch.optim.Optimizer``; default
            ``torch.optim.Adam(params, lr=1e-2)``.
        steps: maximum number of outer steps (>= 1).
        inner_steps: plain inner steps before each hypergradient (>= 0).
        inner_optimizer: optimizer for those steps (default ``hg.inner.SGD(lr=0.1)``); one with a
            line search (``hg.inner.LBFGS()``) searches on the batch of each step.
        inner_batches: the batches of the plain inner steps (and, by default, of the method's
            ``inner_batch``); see "Batch streams".
        outer_batches: the batches of the outer loss (the method's ``outer_batch``).
        progress: show a tqdm progress bar with F and ‖grad‖ (when tqdm is installed; without it,
            a warning says so once per process and no bar is shown).
        callback: called as ``callback(step, w, lam, result)`` after each outer step; a true
            return value stops the loop.
        state: the state to resume from: a :class:`~hypergrad.checkpoint.SolveState`
            (``SolveResult.state`` of a previous run, or :func:`~hypergrad.checkpoint.load_checkpoint`),
            see "Resuming"; anything else is the method's own state alone (the outer optimizer,
            scheduler and streams start afresh).
        hypergrad_batches: the batches of the method's ``inner_batch`` (its inner steps, linear
            solve and products); default None: drawn from ``inner_batches``.
        scheduler: factory ``optimizer -> torch.optim.lr_scheduler.LRScheduler`` for the outer
            learning rate, stepped once per outer step; default None (constant).
        outer_loss_every: evaluate the outer loss for ``history`` every this many steps
            (int >= 0; 0: never; default 1: every step).
        checkpoint_every: write the state to ``checkpoint_path`` after every this many steps
            (int >= 0; counted from the first step of the whole run; 0: only after the last).
        checkpoint_path: the checkpoint file (default None: none written); written after the
            last step as well.

    Returns:
        A :class:`SolveResult`.

    Raises:
        TypeError: ``method`` has no ``hypergrad`` method; ``outer_optimizer`` does not return a
            :class:`torch.optim.Optimizer` or ``scheduler`` an ``LRScheduler``; a batch stream is
            not one of the forms above.
        ValueError: ``steps < 1``, ``inner_steps < 0``, ``outer_loss_every < 0``, malformed
            ``w``/``lam``, a hypergradient not shaped like ``lam``; a one-shot batch iterator
            ran out or an iterable of batches is empty; ``ReduceLROnPlateau`` without
            ``outer_loss_every=1``; ``checkpoint_every < 0``, or > 0 without ``checkpoint_path``;
            a :class:`~hypergrad.checkpoint.SolveState` whose ``w``/``lam`` are not the ones
            given, or whose optimizer or scheduler state does not fit.
        hypergrad.errors.NonFiniteError: a loss, gradient or hypergradient became NaN or inf.

    Example:
        >>> import torch, hypergrad as hg
        >>> g = lambda w, lam, b: 0.5 * ((w["x"] - lam["c"]) ** 2).sum()
        >>> f = lambda w, lam, b: 0.5 * ((w["x"] - 3.0) ** 2).sum()
        >>> res = hg.solve(hg.BilevelProblem(g, f), {"x": torch.zeros(1)}, {"c": torch.zeros(1)},
        ...                hg.Implicit(hg.linear.CG()), lambda p: torch.optim.SGD(p, lr=0.5),
        ...                steps=30, inner_steps=20, inner_optimizer=hg.inner.SGD(0.5), progress=False)
        >>> round(res.lam["c"].item(), 4)
        3.0

        Stop early from the callback, with a decaying learning rate and the outer loss
        evaluated every 5th step only:

        >>> res = hg.solve(hg.BilevelProblem(g, f), {"x": torch.zeros(1)}, {"c": torch.zeros(1)},
        ...                hg.Implicit(hg.linear.CG()), lambda p: torch.optim.SGD(p, lr=0.5),
        ...                steps=100, inner_steps=20, inner_optimizer=hg.inner.SGD(0.5), progress=False,
        ...                scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 10, gamma=0.5),
        ...                outer_loss_every=5,
        ...                callback=lambda step, w, lam, r: r.grad["c"].abs().max() < 1e-4)
        >>> res.stopped_early, res.steps_run < 100, round(res.lam["c"].item(), 3)
        (True, True, 3.0)
        >>> import math
        >>> res.history["lr"][:2], res.history["lr"][10], math.isnan(res.history["outer_loss"][1])
        ([0.5, 0.5], 0.25, True)
    """
    w, lam = problem.validate(w, lam)
    _check_components(method, inner_optimizer, outer_optimizer)
    if not hasattr(method, "hypergrad"):
        raise TypeError(f"method must have a hypergrad(...) method, got {type(method).__name__}")
    combination = _compiled_combination(method)
    if combination is not None:
        check_compilable(problem, combination)  # before the first step: no step is taken and then refused
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    _check_steps(inner_steps, "inner_steps")
    _check_steps(outer_loss_every, "outer_loss_every")
    _check_steps(checkpoint_every, "checkpoint_every")
    if checkpoint_every and checkpoint_path is None:
        raise ValueError(f"checkpoint_every={checkpoint_every} needs checkpoint_path (the file to write)")
    resume = state if isinstance(state, SolveState) else None
    if resume is not None:
        _check_resume_point(resume, w, lam)
        state = resume.method
    if callback is not None and not callable(callback):
        raise TypeError(f"callback must be callable or None, got {type(callback).__name__}")
    inner_optimizer = inner_optimizer if inner_optimizer is not None else SGD(lr=0.1)
    lam_params = {k: v.detach().clone().requires_grad_(True) for k, v in lam.items()}
    factory = outer_optimizer if outer_optimizer is not None else (lambda p: torch.optim.Adam(p, lr=1e-2))
    optimizer = factory(list(lam_params.values()))
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError("outer_optimizer must be a factory returning a torch.optim.Optimizer")
    lr_scheduler = _make_scheduler(scheduler, optimizer, outer_loss_every)
    if resume is not None:
        _restore_outer(resume, optimizer, lr_scheduler)
    inner_stream = _BatchStream(inner_batches, "inner_batches")
    hyper_stream = (
        inner_stream if hypergrad_batches is None else _BatchStream(hypergrad_batches, "hypergrad_batches")
    )
    outer_stream = _BatchStream(outer_batches, "outer_batches")
    streams = {"inner_batches": inner_stream, "outer_batches": outer_stream}
    if hyper_stream is not inner_stream:
        streams["hypergrad_batches"] = hyper_stream
    step_batches = bool(getattr(method, "takes_step_batches", False))
    w = tree_detach(w)
    opt_state: Tree | None = None
    start = 0
    if resume is not None:
        for name, stream in streams.items():
            if name in resume.streams:
                stream.resume(resume.streams[name])
        _set_global_rng(resume.rng)
        opt_state, start = resume.inner_optimizer, resume.step

    def solve_state(steps_done: int) -> SolveState:
        return SolveState(
            step=steps_done, w=w, lam={k: v.detach().clone() for k, v in lam_params.items()}, method=state,
            outer_optimizer=copy.deepcopy(optimizer.state_dict()),
            scheduler=None if lr_scheduler is None else copy.deepcopy(lr_scheduler.state_dict()),
            inner_optimizer=opt_state, streams={name: stream.position() for name, stream in streams.items()},
            rng=_global_rng())

    history: dict[str, list[float]] = {
        "outer_loss": [], "grad_norm": [], "inner_residual": [], "converged": [], "lr": []}
    steps_run, stopped_early = 0, False
    unconverged_steps = 0
    log = WarningLog()  # each kind of warning is counted over the steps and warned once, at the end
    last_outer_loss = float("nan")
    bar = tqdm(range(start, start + steps), desc="hypergrad.solve", disable=not progress, leave=False)
    for step in bar:
        lam_now = {k: v.detach() for k, v in lam_params.items()}
        residual = float("nan")
        if inner_steps:
            w, opt_state, residual = _at_step(log, step, "the plain inner steps", _inner_steps,
                problem, w, lam_now, inner_steps, inner_optimizer, inner_stream, opt_state)
        inner_batch = hyper_stream.for_call(step_batches)
        outer_batch = outer_stream.for_call(step_batches)
        result = _at_step(log, step, f"{type(method).__name__}.hypergrad", method.hypergrad,
                          problem, w, lam_now, inner_batch=inner_batch, outer_batch=outer_batch, state=state)
        check_like(result.grad, lam_now, "hypergradient", "lam")
        check_finite(result.grad, f"hypergradient at outer step {step}")
        outer_loss = float("nan")
        if outer_loss_every and step % outer_loss_every == 0:
            batch = outer_stream.next() if isinstance(outer_batch, StepBatches) else outer_batch
            with torch.no_grad():
                outer_loss = last_outer_loss = float(_at_step(
                    log, step, "the outer loss for history", problem.outer_loss, w, lam_now, batch))
        lr = float(optimizer.param_groups[0].get("lr", float("nan")))  # NaN: an optimizer without "lr"
        optimizer.zero_grad(set_to_none=False)
        for k, p in lam_params.items():
            p.grad = result.grad[k].detach().to(p.dtype).clone()
        optimizer.step()
        if isinstance(lr_scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            lr_scheduler.step(outer_loss)
        elif lr_scheduler is not None:
            lr_scheduler.step()
        w, state = tree_detach(result.w), result.state
        grad_norm = float(tree_norm(result.grad))
        history["outer_loss"].append(outer_loss)
        history["grad_norm"].append(grad_norm)
        history["inner_residual"].append(residual)
        converged = result.info.converged
        history["converged"].append(float("nan") if converged is None else float(converged))
        # a linear solve that stopped short (or a test a method of its own does not name); BOME's gap and
        # Penalty's residuals are above their tolerance during most of a run, by design
        unconverged_steps += converged is False and result.info.stopping_test in (None, "linear solve")
        history["lr"].append(lr)
        steps_run = step + 1 - start
        bar.set_postfix(F=f"{last_outer_loss:.4g}", grad=f"{grad_norm:.3g}")
        if callback is not None and callback(step, w, {k: v.detach() for k, v in lam_params.items()}, result):
            stopped_early = steps_run < steps
        if checkpoint_every and (step + 1) % checkpoint_every == 0 and checkpoint_path is not None:
            save_checkpoint(checkpoint_path, solve_state(step + 1))
        if stopped_early:
            break
    final = solve_state(start + steps_run)
    if checkpoint_path is not None and not (checkpoint_every and (start + steps_run) % checkpoint_every == 0):
        save_checkpoint(checkpoint_path, final)
    return SolveResult(w, final.lam, history, final, steps_run, stopped_early, unconverged_steps,
                       log.emit(steps_run, stacklevel=2))
