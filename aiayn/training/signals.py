"""Signals during training: Ctrl-C and its kin finish the step, save a checkpoint and end the run "interrupted"."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from aiayn.interrupts import INTERRUPT_SIGNALS, handling


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

    with handling(INTERRUPT_SIGNALS, on_signal):
        yield
