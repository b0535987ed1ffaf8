"""Signal handlers set for a while, the one rule every command keeps: a signal ignored when the process started stays
ignored (`nohup` ignores SIGHUP so that a command outlives the logout, a shell's background job SIGINT)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

# What interrupts a command as Ctrl-C does: a supervisor's SIGTERM, the terminal's hang-up (SIGHUP: an ssh session
# that dropped) and Ctrl-\ (SIGQUIT), whose default would dump core. SIGPIPE stays ignored, as Python sets it.
INTERRUPT_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")
                          if hasattr(signal, name))


@contextmanager
def handling(signals: Iterable[int], handler: Callable[[int, Any], None]) -> Iterator[None]:
    """`handler` for each of `signals` that is not ignored, while the block runs (in the main thread: elsewhere
    Python sets none); the handlers before are put back after."""
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, handler) for sig in signals if signal.getsignal(sig) is not signal.SIG_IGN}
    try:
        yield
    finally:
        for sig, before in previous.items():
            signal.signal(sig, before)


_early: list[int] = []  # signals received while the CLI loaded (`record_early`), before its own handler was in place


def record_early(signum: int, frame: object) -> None:
    """The handler `aiayn.cli.entry` sets while the CLI's modules load: the signal is kept for the CLI (`pending`)."""
    _early.append(signum)


def pending() -> list[int]:
    """The signals `record_early` kept, now handed over (the CLI calls it once its own handler is in place, and stops
    as for a signal of its own)."""
    signals = list(_early)
    _early.clear()
    return signals
