"""What a path is: an input to read (a file, a pipe, a device, a link loop) or an output a command may write.

An explicit output file (`--output`, `--show-attention`, `--index`) may be replaced; never an input of the same
command, never a file inside a run, model, export or checkpoint directory (`aiayn.rundir.owning_directory`), never
a directory (`check_output_file`, `OutputRefused`). What a path to read is, `check_input_file` tells.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from aiayn.rundir import MISSING, OutputRefused, owning_directory


def path_kind(path: str | Path) -> str:
    """What `path` names, in words: "missing", "a file", "a directory", "a FIFO (a pipe)", "a character
    device", "a block device", "a socket", "a symbolic link loop" or "a link to a missing file"."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "a link to a missing file" if os.path.islink(path) else MISSING
    except OSError as err:
        if err.errno == errno.ELOOP:
            return "a symbolic link loop"
        if err.errno == errno.ENOTDIR:
            return MISSING
        raise
    for test, words in ((stat.S_ISREG, "a file"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (a pipe)"),
                        (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                        (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return words
    return "not a regular file"


def check_input_file(path: str | Path, what: str, *, stream: bool = False) -> Path:
    """`path` when it names a file to read (with `stream`, a pipe too: `<(cmd)`, a FIFO); else one line that
    says what it is: FileNotFoundError (nothing there), IsADirectoryError, or ValueError (a device, a link loop)."""
    kind = path_kind(path)
    if kind == "a file" or (stream and kind == "a FIFO (a pipe)"):
        return Path(path)
    if kind == MISSING:
        raise FileNotFoundError(f"{what} {path} does not exist")
    if kind == "a directory":
        raise IsADirectoryError(f"{what} {path} is a directory; give a file")
    raise ValueError(f"{what} {path} is {kind}, not a regular file; give a regular file")


def read_regular_file(path: str | Path, *, limit: int) -> bytes:
    """The bytes of `path` when it is a regular file of at most `limit` bytes; else ValueError saying what it is.

    Never blocks: the file is opened non-blocking, so a FIFO without a writer (or a link to one) opens at once and
    is refused, as a device (`/dev/zero`, which never ends) or a larger file is, before a byte is read. OSError as
    `open` raises it (nothing there, permission denied).
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{path} is {path_kind(path)}, not a regular file")
        if info.st_size > limit:
            raise ValueError(f"{path} holds {info.st_size:,} bytes, more than {limit:,}")
        chunks, size = [], 0
        while chunk := os.read(fd, min(1 << 20, limit + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:  # it grew since fstat
                raise ValueError(f"{path} holds more than {limit:,} bytes")
        return b"".join(chunks)
    finally:
        os.close(fd)


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve() or (a.exists() and b.exists() and os.path.samefile(a, b))
    except OSError:
        return False




def check_output_file(path: str | Path, option: str, *, inputs: Iterable[tuple[str, str | Path | None]] = (),
                      suffixes: Iterable[str] = ()) -> Path:
    """Check before any work that `path` may be written (replaced, when it exists) by a command's output option.

    The rule: an explicit output file may be replaced; never an input of the same command (`inputs`: (option,
    path) pairs; a directory input counts with everything in it), never a file inside a run, model, export or
    checkpoint directory, never a directory or a special file. `suffixes`, when given, are the endings allowed.
    """
    if not str(path).strip():
        raise OutputRefused(f"{option} is empty; name a file")
    path = Path(path)
    kind = path_kind(path)
    if kind == "a directory":
        raise IsADirectoryError(f"{option} {path} is a directory; give a file name")
    if kind not in (MISSING, "a file", "a link to a missing file"):
        raise OutputRefused(f"{option} {path} is {kind}, not a regular file; give a file name (or leave out "
                            f"{option} and redirect stdout)")
    allowed = tuple(suffixes)
    if allowed and path.suffix.lower() not in allowed:
        endings = " or ".join([", ".join(allowed[:-1]), allowed[-1]] if len(allowed) > 1 else allowed)
        raise OutputRefused(f"{option} must end in {endings}, got {path.name!r}")
    for name, source in inputs:
        if source is None or str(source) in ("", "-"):
            continue
        source = Path(source)
        if _same_file(path, source):
            raise OutputRefused(f"{option} {path} is the input {name} {source}: the output would replace it; "
                                f"choose another {option} file")
        if source.is_dir() and source.resolve() in path.resolve().parents:
            raise OutputRefused(f"{option} {path} is inside the input {name} {source}: choose an {option} file "
                                "outside it")
    owner = owning_directory(path)
    if owner is not None:
        raise OutputRefused(f"{option} {path} is inside {owner.path}, which holds {owner.description}; a command "
                            f"never replaces files there: choose an {option} file outside it")
    _check_folder_writable(path, option)
    return path


def _check_folder_writable(path: Path, option: str) -> None:
    """Refuse, before the work, an output whose folder could not take it: a part of its path that is a file, or a
    folder (the nearest that exists: the write makes the others) where no file can be made. Probed by making and
    removing a temporary file there, which also finds what permissions do not say (a read-only file system, an
    immutable folder, /proc)."""
    folder = path.parent
    while not folder.exists() and folder.parent != folder:  # folders the write will make
        folder = folder.parent
    if not folder.is_dir():
        raise OutputRefused(f"{option} {path}: {folder} is not a folder; choose an {option} file in a folder")
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        raise OutputRefused(f"{option} {path}: no file can be written in {folder} ({err.strerror or err}); choose an "
                            f"{option} file in a folder you can write") from None


@contextlib.contextmanager
def locked(path: str | Path, *, seconds: float = 10.0) -> Iterator[bool]:
    """Hold an OS lock (`flock`) on the file `path` (made if missing) while the body runs; yields whether it was taken.

    Waits up to `seconds` for another process to release it, then runs the body without it (a process stopped while
    holding the lock must not stop every other); where `fcntl` does not exist (Windows) it locks nothing. The lock
    file is opened without following a link and without blocking, so a FIFO, a link or a folder planted there, or a
    lock file of another user's, costs only the lock (other OSError from opening it is the caller's: a folder that
    cannot be written).
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not on POSIX
        yield False
        return
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as err:
        if err.errno not in (errno.ELOOP, errno.EISDIR, errno.ENXIO, errno.EACCES, errno.EPERM):
            raise
        yield False  # a link, a folder, a socket or a file not ours at the lock's path: no lock
        return
    try:
        deadline, held = time.monotonic() + seconds, False
        while not held:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held = True
            except OSError as err:
                if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES) or time.monotonic() > deadline:
                    break
                time.sleep(0.02)
        yield held
    finally:
        os.close(fd)  # (closing releases the lock)
