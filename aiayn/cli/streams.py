"""The command's standard output as the CLI writes to it: a failure to write names `stdout`.

A full disk behind `> file`, `/dev/full`, or a closed stdout (`aiayn params >&-`, where Python leaves
`sys.stdout` None and `print` would drop every line) becomes one line, `stdout: No space left on device`,
with the exit code of a system error; a reader that went away (`aiayn params | head -1`) ends the command
quietly, as Unix tools end.
"""

from __future__ import annotations

import errno
import os
import sys
from typing import Any, TextIO

NAME = "stdout"


def _named(err: OSError) -> OSError:
    if err.filename is None and err.strerror is not None:
        return type(err)(err.errno, err.strerror, NAME)
    return err


class Stdout:
    """A proxy of `sys.stdout` whose OSErrors name it; writing to a closed one is an error, not a no-op."""

    def __init__(self, stream: TextIO | None):
        self.stream = stream

    def write(self, text: str) -> int:
        """Write `text`, or raise OSError naming stdout."""
        if self.stream is None:
            raise OSError(errno.EBADF, "the output is closed", NAME)
        try:
            return self.stream.write(text)
        except BrokenPipeError:
            raise
        except OSError as err:
            raise _named(err) from None

    def flush(self) -> None:
        """Flush, or raise OSError naming stdout."""
        if self.stream is None:
            return
        try:
            self.stream.flush()
        except BrokenPipeError:
            raise
        except OSError as err:
            raise _named(err) from None

    def __getattr__(self, name: str) -> Any:
        if self.stream is None:
            raise OSError(errno.EBADF, "the output is closed", NAME)
        return getattr(self.stream, name)


def silence_stdout() -> None:
    """After a reader went away: what is still buffered, and whatever comes, goes nowhere (Python would
    otherwise report the pipe again while it flushes at exit)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.__stdout__.fileno() if sys.__stdout__ is not None else 1)
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass
