"""How the ``llm-calib`` command ends when it is stopped: Ctrl-C (SIGINT) and SIGTERM (``kill``, a
batch scheduler's time limit) both unwind the command as an exception, so every lock and
temporary file is cleaned up on the way out, and end it with one line and the conventional status
(130, 143), from the first import on. Imports nothing heavy: it guards the import of the rest."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

__all__ = ["Terminated", "exit_status", "stopped_message", "terminate_as_interrupt"]


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the program is, as Ctrl-C raises :class:`KeyboardInterrupt` (a subclass
    of it, so whatever cleans up after Ctrl-C cleans up after SIGTERM too)."""


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    raise Terminated(signum)


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM raises :class:`Terminated` instead of ending the process at once
    (without a word, leaving the run's lock behind); the previous handler is restored after. Off
    the main thread (where Python cannot set handlers) the block changes nothing.

    Example:
        >>> import os, signal
        >>> with terminate_as_interrupt():
        ...     try:
        ...         os.kill(os.getpid(), signal.SIGTERM)
        ...     except Terminated:
        ...         print("terminated")
        terminated
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def exit_status(stop: KeyboardInterrupt) -> int:
    """The exit status of a command ended by ``stop``: 143 (128 + SIGTERM) or 130 (128 + SIGINT).

    Example:
        >>> exit_status(KeyboardInterrupt()), exit_status(Terminated())
        (130, 143)
    """
    return 128 + (signal.SIGTERM if isinstance(stop, Terminated) else signal.SIGINT)


def stopped_message(stop: KeyboardInterrupt, hint: str = "") -> str:
    """The one line a command ended by ``stop`` prints: ``llm-calib: interrupted`` (Ctrl-C) or
    ``llm-calib: terminated (SIGTERM)``, then ``hint`` (how to continue).

    Example:
        >>> stopped_message(Terminated(), "; continue with --resume")
        'llm-calib: terminated (SIGTERM); continue with --resume'
    """
    return f"llm-calib: {'terminated (SIGTERM)' if isinstance(stop, Terminated) else 'interrupted'}{hint}"
