"""The `aiayn` command as its console script and `python -m aiayn` start it.

A stopping signal (Ctrl-C, SIGTERM, SIGHUP, SIGQUIT) is taken from this module's first line, while the CLI's modules
still load, and ends the command with one line and exit 130 (`aiayn.cli.main` takes over once its handler is in
place, and stops for a signal that came before it: `aiayn.interrupts.pending`); before this module only Python's own
start runs. A signal ignored at start stays ignored.
"""

import signal
import sys

from aiayn.interrupts import INTERRUPT_SIGNALS, pending, record_early


def main() -> int:
    previous = {sig: signal.signal(sig, record_early) for sig in INTERRUPT_SIGNALS
                if signal.getsignal(sig) is not signal.SIG_IGN}  # (the CLI puts its own over it, then this one back)
    try:
        from aiayn.cli.errors import INTERRUPTED
        from aiayn.cli.main import main as run

        if pending():
            print("aiayn: interrupted", file=sys.stderr, flush=True)
            return INTERRUPTED
        return run()
    finally:
        for sig, handler in previous.items():  # what Python had, for the interpreter's exit
            signal.signal(sig, handler)
