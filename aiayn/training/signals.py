"""Signals during training: Ctrl-C and its kin finish the step, save a checkpoint and end the run "interrupted"."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

# What interrupts a run as Ctrl-C does (finish the step, save a checkpoint, exit "interrupted"): a supervisor's SIGTERM,
# the terminal's hang-up (SIGHUP: an ssh session that dropped) and Ctrl-\ (SIGQUIT), whose default would dump core
# and lose the steps since the last checkpoint. SIGPIPE stays ignored, as Python sets it: a reader that went away
# fails a write, which the CLI's reporting survives.
INTERRUPT_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")
                          if hasattr(signal, name))


@contextmanager
def interrupts_caught(t: Any) -> Iterator[None]:
    """While training, in the main thread: an interrupt sets `t.interrupt_requested` (the loop ends after its step; with
    several processes, after the step in which rank 0 got it); a second one, or one before the first step, raises
    KeyboardInterrupt at once. A signal ignored when training starts stays ignored (`nohup` ignores SIGHUP so that a run
    outlives the logout). The handlers are put back after."""
    def on_signal(signum: int, frame: Any) -> None:
        if t.interrupt_requested or not t.looping:  # a second signal, or one before any step: abort now
            t.interrupt_requested = True
            raise KeyboardInterrupt
        t.interrupt_requested = True
        name = "interrupt" if signum == signal.SIGINT else signal.Signals(signum).name
        t.report(f"{name}: finishing this step, saving a checkpoint and exiting (Ctrl-C again to abort)")

    previous = {}
    if threading.current_thread() is threading.main_thread():  # a signal ignored at start (nohup's SIGHUP) stays so
        previous = {sig: signal.signal(sig, on_signal) for sig in INTERRUPT_SIGNALS
                    if signal.getsignal(sig) is not signal.SIG_IGN}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
