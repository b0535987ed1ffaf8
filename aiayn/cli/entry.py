"""The `aiayn` command as its console script and `python -m aiayn` start it.

A stopping signal (Ctrl-C, SIGTERM, SIGHUP, SIGQUIT) is taken from this module's first line, while the CLI's modules
still load, and ends the command with one line and exit 130 (`aiayn.cli.main` takes over once it runs); before this
module only Python's own start runs. A signal ignored at start stays ignored.
"""

import signal
import sys

INTERRUPTED = 130  # aiayn.cli.errors.INTERRUPTED: this module imports nothing before its handler is in place
_early: list[int] = []  # signals received while the CLI loads


def _record(signum: int, frame: object) -> None:
    _early.append(signum)


def pending() -> list[int]:
    """The signals received while the CLI loaded, now handed over (`aiayn.cli.main` calls it once its own handler is
    in place, and stops as for a signal of its own)."""
    signals = list(_early)
    _early.clear()
    return signals


def main() -> int:
    previous = {}
    for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT"):
        sig = getattr(signal, name, None)
        if sig is not None and signal.getsignal(sig) is not signal.SIG_IGN:
            previous[sig] = signal.signal(sig, _record)  # (the CLI puts its own over it, then this one back)
    try:
        from aiayn.cli.main import main as run

        if _early:
            print("aiayn: interrupted", file=sys.stderr, flush=True)
            return INTERRUPTED
        return run()
    finally:
        for sig, handler in previous.items():  # what Python had, for the interpreter's exit
            signal.signal(sig, handler)
