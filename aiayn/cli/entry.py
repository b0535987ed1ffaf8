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


def main() -> int:
    for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT"):
        sig = getattr(signal, name, None)
        if sig is not None and signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, _record)  # (the CLI puts its own over it, then this one back)
    from aiayn.cli.main import main as run

    if _early:
        print("aiayn: interrupted", file=sys.stderr, flush=True)
        return INTERRUPTED
    return run()
