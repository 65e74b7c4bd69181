"""The state of a :func:`hypergrad.solve` run, and checkpoint files that resume it exactly.

:func:`hypergrad.solve` returns a :class:`SolveState` in ``SolveResult.state``; passing it back
as ``solve(..., state=...)`` continues the run as if it had never stopped: ``10 + 10`` steps give
the numbers of ``20`` steps bit for bit, with any outer optimizer and scheduler.
:func:`save_checkpoint` writes one to a file atomically and :func:`load_checkpoint` reads it back
(``solve(..., checkpoint_every=k, checkpoint_path=...)`` does the writing during a solve).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from hypergrad.tree import Tree

__all__ = ["SolveState", "load_checkpoint", "save_checkpoint"]

_FORMAT = "hypergrad.SolveState"
_VERSION = 1


@dataclass
class SolveState:
    """Everything a resumed :func:`hypergrad.solve` needs to continue exactly.

    Pass it back as ``solve(problem, state.w, state.lam, method, ..., state=state)`` with the
    same problem, method, factories and batch streams; ``steps`` then counts the steps still to
    run. A state holds only tensors, numbers, strings and containers of them, so
    :func:`save_checkpoint` can write it and ``torch.load(weights_only=True)`` read it.

    Attributes:
        step: outer steps taken so far, over all the calls that led to this state.
        w: inner parameters after the last step.
        lam: outer parameters after the last step.
        method: the method's own state (``HypergradResult.state`` of the last step).
        outer_optimizer: the outer optimizer's ``state_dict()`` (Adam's moments and step count,
            the learning rate of each group).
        scheduler: the scheduler's ``state_dict()``, or None without a scheduler.
        inner_optimizer: the state of the plain inner steps' optimizer (``inner_optimizer.init``
            and ``update``), or None before the first plain inner step.
        streams: where each batch stream stood (``"inner_batches"``, ``"hypergrad_batches"``,
            ``"outer_batches"``): batches drawn, and for a re-iterable (a list, a
            ``DataLoader``) the position in the current epoch and the random-number state
            its epoch started from. Empty: every stream starts afresh.
        rng: the global torch random-number state(s) after the last step (``"torch"``, and
            ``"cuda"`` where CUDA was in use).

    Example:
        >>> import torch, hypergrad as hg
        >>> g = lambda w, lam, b: 0.5 * ((w["x"] - lam["c"]) ** 2).sum()
        >>> f = lambda w, lam, b: 0.5 * ((w["x"] - 3.0) ** 2).sum()
        >>> p = hg.BilevelProblem(g, f)
        >>> adam = lambda params: torch.optim.Adam(params, lr=0.1)
        >>> run = lambda w, lam, steps, state=None: hg.solve(
        ...     p, w, lam, hg.Implicit(), adam, steps=steps, inner_steps=5, progress=False, state=state)
        >>> w0, lam0 = {"x": torch.zeros(1)}, {"c": torch.zeros(1)}
        >>> first = run(w0, lam0, 10)
        >>> first.state.step, sorted(first.state.outer_optimizer)
        (10, ['param_groups', 'state'])
        >>> resumed = run(first.w, first.lam, 10, first.state)
        >>> torch.equal(resumed.lam["c"], run(w0, lam0, 20).lam["c"])   # 10 + 10 == 20, bit for bit
        True
    """

    step: int
    w: Tree
    lam: Tree
    method: Any = None
    outer_optimizer: dict[str, Any] | None = None
    scheduler: dict[str, Any] | None = None
    inner_optimizer: Tree | None = None
    streams: dict[str, dict[str, Any]] = field(default_factory=dict)
    rng: dict[str, Any] = field(default_factory=dict)


def save_checkpoint(path: str | os.PathLike[str], state: SolveState) -> None:
    """Write ``state`` to ``path`` atomically (a temporary file, fsync, then rename).

    A reader never sees a half-written file: either the previous checkpoint or the new one.

    Args:
        path: the file to write (its folder must exist).
        state: a :class:`SolveState` (``SolveResult.state``).

    Raises:
        TypeError: ``state`` is not a :class:`SolveState`.

    Example:
        >>> import os, tempfile, torch, hypergrad as hg
        >>> state = hg.SolveState(step=3, w={"x": torch.ones(2)}, lam={"c": torch.zeros(1)})
        >>> path = os.path.join(tempfile.mkdtemp(), "run.pt")
        >>> hg.save_checkpoint(path, state)
        >>> loaded = hg.load_checkpoint(path)
        >>> loaded.step, loaded.w["x"].tolist()
        (3, [1.0, 1.0])
    """
    if not isinstance(state, SolveState):
        raise TypeError(f"state must be a hypergrad.SolveState (SolveResult.state), got {type(state).__name__}")
    target = Path(path)
    payload = {"format": _FORMAT, "version": _VERSION}
    payload.update({f.name: getattr(state, f.name) for f in fields(state)})
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            torch.save(payload, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable (not possible everywhere)
        dir_fd = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def load_checkpoint(path: str | os.PathLike[str]) -> SolveState:
    """Read a :class:`SolveState` written by :func:`save_checkpoint`.

    The file is read with ``torch.load(weights_only=True)``: it can hold tensors and plain data
    only, never code. Tensors are loaded on the CPU when they were saved there, else on the
    device they were saved from.

    Args:
        path: a file written by :func:`save_checkpoint`.

    Returns:
        The saved state.

    Raises:
        FileNotFoundError: there is no such file.
        ValueError: the file is truncated, corrupt, or not a hypergrad checkpoint (the message
            names the file).

    Example:
        >>> import os, tempfile, hypergrad as hg
        >>> path = os.path.join(tempfile.mkdtemp(), "broken.pt")
        >>> with open(path, "wb") as handle:
        ...     _ = handle.write(b"not a checkpoint")
        >>> hg.load_checkpoint(path)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: .../broken.pt is not a readable hypergrad checkpoint (truncated or corrupt?): ...
    """
    source = Path(path)
    if not source.is_file():
        raise FileNotFoundError(f"no checkpoint file {str(source)!r}")
    try:
        payload = torch.load(source, weights_only=True)
    except Exception as exc:  # torch reports a damaged zip archive with several exception types
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(
            f"{source} is not a readable hypergrad checkpoint (truncated or corrupt?): {message}"
        ) from exc
    if not isinstance(payload, dict) or payload.get("format") != _FORMAT:
        raise ValueError(f"{source} is not a hypergrad checkpoint (written by hypergrad.save_checkpoint)")
    if payload.get("version") != _VERSION:
        raise ValueError(
            f"{source} is a hypergrad checkpoint of version {payload.get('version')!r}; this hypergrad "
            f"reads version {_VERSION}"
        )
    names = {f.name for f in fields(SolveState)}
    return SolveState(**{k: v for k, v in payload.items() if k in names})
