"""What the CLI prints and returns for each kind of failure: one line, and a documented exit code.

| code | meaning |
| --- | --- |
| 0 | done |
| 1 | an internal error (a bug): the line names the exception; `--debug` shows the traceback |
| 2 | bad input: arguments, config values, data, model / checkpoint / tokenizer files, a directory not its own; |
|   | also an optional package the command needs and does not find (the line says what to install) |
| 3 | training or evaluation produced non-finite numbers (NaN / Inf); checkpoints written before are kept |
| 4 | the system refused: disk full, permission denied, read-only file system, out of memory, other I/O errors |
| 5 | the run directory is in use: another process is training in it |
| 130 | interrupted (Ctrl-C, SIGTERM, SIGHUP, SIGQUIT); `aiayn train` saved a checkpoint, continue with `--resume` |
"""

from __future__ import annotations

import errno
import re
import sys

OK, INTERNAL, BAD_INPUT, NON_FINITE, SYSTEM, BUSY, INTERRUPTED = 0, 1, 2, 3, 4, 5, 130


# What a user can do about an operating-system error, by errno.
_OS_HINTS = {
    errno.ENOSPC: "free some disk space and run it again",
    errno.EDQUOT: "the disk quota is used up: free some space and run it again",
    errno.EACCES: "check the file's permissions",
    errno.EPERM: "check the file's permissions",
    errno.EROFS: "the file system is read-only: choose a writable place",
    errno.EBADF: "redirect it to a file (> FILE) or give the command's output option",
}
# Missing paths, or a directory where a file belongs (or the reverse), are the user's input.
_INPUT_ERRNOS = {errno.ENOENT, errno.EISDIR, errno.ENOTDIR, errno.ENAMETOOLONG}
# Out of memory: the options that make batches smaller (embed / predict / search; translate; train).
_SMALLER_BATCHES = "smaller batches (--batch-size; --max-tokens or --max-sentences; max_tokens in training)"


class UserError(Exception):
    """A problem in the user's input; reported as one line without a traceback (exit code 2)."""


def _os_line(err: OSError) -> str:
    if err.strerror is None:  # raised with a message of our own
        return str(err.args[0]) if err.args else type(err).__name__
    where = f"{err.filename}: " if err.filename is not None else ""
    hint = _OS_HINTS.get(err.errno)
    return f"{where}{err.strerror}" + (f"; {hint}" if hint else "")


def describe(err: BaseException) -> tuple[int, str]:
    """(exit code, one-line message) for an exception that ended a command."""
    from aiayn.rundir import RunBusy

    loop = sys.modules.get("aiayn.training.loop")  # only a command that trained can raise its TrainingError
    if isinstance(err, KeyboardInterrupt):
        return INTERRUPTED, "interrupted"
    if isinstance(err, RunBusy):
        return BUSY, str(err)
    if loop is not None and isinstance(err, loop.TrainingError):
        return NON_FINITE, str(err)
    if isinstance(err, OSError):
        code = BAD_INPUT if err.errno in _INPUT_ERRNOS or err.strerror is None else SYSTEM
        return code, _os_line(err)
    if isinstance(err, MemoryError):
        return SYSTEM, str(err) if str(err) else f"out of memory; try {_SMALLER_BATCHES}"
    if _out_of_memory(err):  # PyTorch's allocators raise RuntimeError subclasses
        asked = re.search(r"allocate (\d+) bytes", str(err))
        size = f" {int(asked.group(1)) / 2**30:,.1f} GiB" if asked else " memory"
        return SYSTEM, f"out of memory: PyTorch could not allocate{size}; try {_SMALLER_BATCHES}, or a smaller model"
    if isinstance(err, ModuleNotFoundError):  # an optional package: the message says what to install
        return BAD_INPUT, str(err)
    if isinstance(err, KeyError):
        return BAD_INPUT, str(err.args[0]) if err.args else "a required key is missing"
    if isinstance(err, (UserError, ValueError, UnicodeError)):
        return BAD_INPUT, str(err)
    return INTERNAL, f"internal error: {type(err).__name__}: {err} (rerun with --debug for the traceback)"


def _out_of_memory(err: BaseException) -> bool:
    return type(err).__name__ == "OutOfMemoryError" or (
        isinstance(err, RuntimeError) and ("can't allocate memory" in str(err) or "out of memory" in str(err)))


def one_line(text: str) -> str:
    """`text` on one line (a message that holds newlines is joined with ' | ')."""
    return " | ".join(part.strip() for part in str(text).strip().splitlines() if part.strip())
