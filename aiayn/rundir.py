"""The one owner of the files aiayn writes: their names, what a directory holds, atomic writes, the run lock.

A run directory (`aiayn train --run RUN`):

    train_config.json            the training config the run started with (what makes RUN a run)
    config.json, model.safetensors   the final model; every checkpoint holds the same two files
    tokenizer.json, tokenizer_meta.json   one shared tokenizer, or the same names under source/ and target/
    labels.json                  class or tag names (classification and tagging runs)
    metrics.jsonl, metrics.csv, curves.png, eval.json   logs, plots and the test evaluation
    tensorboard/                 TensorBoard event files of the same metrics (`log_to=tensorboard`)
    checkpoints/                 step-NNNNNNNN/ (model files + trainer_state.pt + meta.json), `latest`, `best`
    .aiayn.lock                  held (an OS lock) by the process that trains in RUN

A model directory holds config.json + model.safetensors (+ tokenizer); an export directory also holds
`aiayn_export.json`, which `aiayn export` writes first, so that a later export may replace it.
A command writes only into a new or empty directory or one of its own kind; anything else is refused
with one line naming what is there (`DirectoryRefused`), unless the user forces it.

An explicit output file may be replaced, never one inside a directory aiayn owns (`aiayn.paths`).

Every file is written atomically: to a temporary file beside it, flushed to disk, then renamed, so a
crash or a full disk leaves the previous version whole. An `OSError` raised while writing names the file.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import secrets
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

logger = logging.getLogger(__name__)

TRAIN_CONFIG = "train_config.json"
MODEL_CONFIG = "config.json"
WEIGHTS = "model.safetensors"
TOKENIZER = "tokenizer.json"
TOKENIZER_META = "tokenizer_meta.json"
SOURCE_TOKENIZER, TARGET_TOKENIZER = "source", "target"  # the two folders of a run with two vocabularies
LABELS = "labels.json"
METRICS_LOG = "metrics.jsonl"
METRICS_CSV = "metrics.csv"
CURVES = "curves.png"
EVAL = "eval.json"
TENSORBOARD = "tensorboard"
CHECKPOINTS = "checkpoints"
CHECKPOINT_STATE = "trainer_state.pt"
CHECKPOINT_META = "meta.json"
LOCK = ".aiayn.lock"
EXPORT_MARK = "aiayn_export.json"

# What a directory can be, as `inspect_dir` tells them apart.
MISSING, EMPTY, FILE, RUN, MODEL, EXPORT, HF_CHECKPOINT, CHECKPOINT_DIR, FOREIGN = (
    "missing", "empty", "file", "run", "model", "export", "hf_checkpoint", "checkpoints", "foreign")
# Directories whose files only aiayn (or the checkpoint's maker) writes: an output file never goes inside one.
OWNED_KINDS = (RUN, MODEL, EXPORT, HF_CHECKPOINT, CHECKPOINT_DIR)


class DirectoryRefused(ValueError):
    """A command will not write into a path: it holds something the command did not write."""


class OutputRefused(ValueError):
    """An output file the command will not write: an input, a file inside a run or model directory."""


class RunBusy(RuntimeError):
    """Another process holds the run directory's lock (it is training there)."""


@dataclass(frozen=True)
class DirInfo:
    """What a path holds: `kind` (one of the constants above) and a phrase a message can use."""

    path: Path
    kind: str
    description: str


def load_json(text: str | bytes) -> object:
    """`json.loads`, with input nested too deeply for Python's parser (100,000 `[`) raised as the
    `json.JSONDecodeError` every caller already turns into one line, instead of a RecursionError."""
    try:
        return json.loads(text)
    except RecursionError:
        raise json.JSONDecodeError("nested too deeply (more levels of [ and { than a parser can follow)",
                                   text if isinstance(text, str) else "", 0) from None


def _read_json(path: Path) -> object:
    try:
        return load_json(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def inspect_dir(path: str | Path) -> DirInfo:
    """Tell what `path` holds: nothing, a file, an aiayn run / model / export, a Hugging Face checkpoint, or else."""
    path = Path(path)
    if not path.exists():
        return DirInfo(path, MISSING, "nothing")
    if not path.is_dir():
        return DirInfo(path, FILE, "a file")
    # Hidden entries (.gitkeep, the lock) do not count: no file aiayn writes is hidden but the lock.
    entries = sorted(p.name for p in path.iterdir() if not p.name.startswith("."))
    if not entries:
        return DirInfo(path, EMPTY, "nothing")
    if (path / TRAIN_CONFIG).is_file() or (path / CHECKPOINTS / "latest").is_file():
        return DirInfo(path, RUN, f"an aiayn training run ({TRAIN_CONFIG})")
    if path.name == CHECKPOINTS and (path / "latest").is_file():
        return DirInfo(path, CHECKPOINT_DIR, f"the checkpoints of the run {path.parent}")
    if (path / EXPORT_MARK).is_file():
        return DirInfo(path, EXPORT, f"an aiayn export ({EXPORT_MARK})")
    config = _read_json(path / MODEL_CONFIG)
    if isinstance(config, dict) and "model_type" in config:
        return DirInfo(path, HF_CHECKPOINT, f"a Hugging Face checkpoint ({MODEL_CONFIG} names model_type "
                                            f"{config['model_type']!r})")
    if isinstance(config, dict) and "d_model" in config:
        return DirInfo(path, MODEL, f"an aiayn model ({MODEL_CONFIG}, {WEIGHTS})")
    shown = ", ".join(entries[:3]) + (f" and {len(entries) - 3} more" if len(entries) > 3 else "")
    return DirInfo(path, FOREIGN, f"files aiayn did not write ({shown})")


def check_path_given(value: str | Path, option: str) -> Path:
    """`value` as a Path; an empty string (which would mean the current directory) is refused."""
    if not str(value).strip():
        raise DirectoryRefused(f"{option} is empty; name a directory, for example {option} runs/exp1")
    return Path(value)


def checkpoint_run(path: str | Path) -> Path | None:
    """The run directory whose checkpoint `path` is (RUN/checkpoints/step-N), or None."""
    path = Path(path)
    if path.parent.name == CHECKPOINTS and (path / CHECKPOINT_META).is_file():
        return path.parent.parent
    return None


def no_model_hint(path: str | Path) -> str | None:
    """Why a directory aiayn wrote holds no final model, and what to give instead (None: not one of those)."""
    info = inspect_dir(path)
    pointer = Path(path)
    if info.kind == FILE and pointer.name in ("best", "latest") and inspect_dir(pointer.parent).kind == CHECKPOINT_DIR:
        try:  # a checkpoint pointer: it names the step it points to
            step = pointer.read_text(encoding="utf-8", errors="replace")[:200].strip()
        except OSError:
            step = "a step"
        run = pointer.parent.parent
        return (f"{pointer} is the run {run}'s pointer to its {pointer.name} checkpoint ({step}), not a model: give "
                f"{pointer.parent / step} (or aiayn eval --run {run} --checkpoint {step}), or the run {run} for its "
                "final model")
    if info.kind == CHECKPOINT_DIR:
        run = info.path.parent
        return (f"{info.path} holds the checkpoints of the run {run}, not a model: give the run directory {run}, "
                f"or one checkpoint ({info.path}/step-N, or aiayn eval --run {run} --checkpoint step-N)")
    if info.kind == RUN and not (info.path / MODEL_CONFIG).is_file():
        return (f"{info.path}: training did not finish (no final {MODEL_CONFIG} yet): continue it with aiayn train "
                f"--run {info.path} --resume, or use a checkpoint ({info.path}/{CHECKPOINTS}/step-N, or aiayn eval "
                f"--run {info.path} --checkpoint step-N)")
    return None


def _refuse_for_training(info: DirInfo, *, resume: bool, force: bool) -> None:
    if info.kind == CHECKPOINT_DIR:
        raise DirectoryRefused(f"{info.path} holds the checkpoints of the run {info.path.parent}: give --run "
                               f"{info.path.parent} (with --resume to continue it), or a new --run directory")
    if info.kind == FILE:
        raise DirectoryRefused(f"{info.path} is a file, not a directory: give --run a directory")
    if resume:
        if info.kind != RUN:
            raise FileNotFoundError(f"{info.path} holds no run to resume ({TRAIN_CONFIG} is missing)")
    elif info.kind == RUN:
        raise DirectoryRefused(f"{info.path} already holds a run; pass --resume to continue it or choose a new "
                               "--run directory")
    elif info.kind in OWNED_KINDS:  # a model, an export, a checkpoint: other writers' files, --force or not
        raise DirectoryRefused(f"{info.path} holds {info.description}; training never writes into it: choose a new "
                               "--run directory")
    elif info.kind not in (MISSING, EMPTY) and not force:
        raise DirectoryRefused(f"{info.path} holds {info.description}; training would write {MODEL_CONFIG}, "
                               f"{WEIGHTS} and logs into it: choose a new --run directory, or pass --force to "
                               "write there anyway")


def check_run_dir(run_dir: str | Path, *, resume: bool, force: bool = False) -> DirInfo:
    """Everything `open_run_dir` refuses, without keeping the lock: for a caller with work to do before the run
    opens its directory (a run in use gives `RunBusy`, as `open_run_dir` would). Returns what the directory holds."""
    info = _before_lock(run_dir, resume=resume, force=force)
    if info.kind == RUN:
        RunLock(info.path).acquire().release()
        _refuse_for_training(info, resume=resume, force=force)
    return info


def _before_lock(run_dir: str | Path, *, resume: bool, force: bool) -> DirInfo:
    info = inspect_dir(check_path_given(run_dir, "--run"))
    if info.kind != RUN and (resume or info.kind not in (MISSING, EMPTY)):
        _refuse_for_training(info, resume=resume, force=force)
    owner = owning_directory(info.path) if info.kind in (MISSING, EMPTY) else None
    if owner is not None:  # a run inside another run (or a model) would mix their files, --force or not
        raise DirectoryRefused(f"{info.path} is inside {owner.path}, which holds {owner.description}: choose a "
                               "--run directory outside it")
    return info


def open_run_dir(run_dir: str | Path, *, resume: bool, force: bool = False) -> RunLock:
    """Check that training may write into `run_dir`, create it and take its lock (returned, held).

    A new or empty directory starts a run; a run continues only with `resume`; a Hugging Face checkpoint, an export,
    a model, a run's checkpoints, or a folder inside any of those is refused, `force` or not; a folder of other
    files only with `force`; all before anything is written. A run that another process is training in gives
    `RunBusy` at once.
    """
    info = _before_lock(run_dir, resume=resume, force=force)
    lock = RunLock(info.path).acquire()
    try:
        _refuse_for_training(inspect_dir(info.path), resume=resume, force=force)  # again, now that we hold it
    except BaseException:
        lock.release()
        raise
    return lock


def check_export_dir(out: str | Path, *, force: bool = False, option: str = "--out",
                     force_hint: str = "pass --force", writer: str = "the export") -> Path:
    """Refuse an export into `out` unless it is new, empty, an earlier aiayn export, or holds only files aiayn did
    not write and `force` is given. A run, model, Hugging Face checkpoint or checkpoints directory, and any folder
    inside one of those or inside an export (their files have one writer), is refused even with `force`: forcing
    replaces what an export wrote, never what the command merely found.

    `option`, `force_hint` and `writer` name the argument, the override and what writes (the CLI's by default).
    """
    info = inspect_dir(check_path_given(out, option))
    if info.kind == FILE:
        raise DirectoryRefused(f"{info.path} is a file, not a directory: give {option} a directory")
    if info.kind in OWNED_KINDS and info.kind != EXPORT:
        raise DirectoryRefused(f"{info.path} holds {info.description}; {writer} never replaces it: choose a new "
                               f"{option} directory")
    if info.kind == FOREIGN and not force:
        raise DirectoryRefused(f"{info.path} holds {info.description}; {writer} would replace files there: "
                               f"choose a new {option} directory, or {force_hint} to write there anyway")
    owner = owning_directory(info.path)
    if owner is not None:  # RUN/export, RUN/checkpoints/x: files the run's owner never wrote
        raise DirectoryRefused(f"{info.path} is inside {owner.path}, which holds {owner.description}; {writer} "
                               f"never writes there: choose an {option} directory outside it")
    return info.path


def claim_for_export(out: str | Path, *, force: bool = False, fmt: str = "hf", option: str = "--out",
                     force_hint: str = "pass --force", writer: str = "the export") -> Path:
    """`check_export_dir`, then create `out` and mark it as an aiayn export before any other file is written. An
    earlier export of another format is refused (its files would stay beside the new ones); one of the same format is
    replaced, file by file."""
    path = check_export_dir(out, force=force, option=option, force_hint=force_hint, writer=writer)
    earlier = export_format(path)
    if earlier is not None and earlier != fmt:
        raise DirectoryRefused(f"{path} holds an aiayn export in the {earlier} format; {writer} in the {fmt} format "
                               f"would leave its files beside the new ones: choose a new {option} directory, or "
                               "delete that one first")
    atomic_write_bytes(path / EXPORT_MARK, (json.dumps({"format": fmt}) + "\n").encode())
    return path


def export_format(path: Path) -> str | None:
    """The format an aiayn export's mark names (`claim_for_export`'s `fmt`), "unknown" where the mark cannot be read;
    None where `path` holds no export mark."""
    mark = path / EXPORT_MARK
    if not mark.is_file():  # a regular file (a FIFO or a device is not one)
        return None
    try:
        if mark.stat().st_size > 1 << 16:
            return "unknown"
        content = load_json(mark.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return "unknown"
    return str(content.get("format", "unknown")) if isinstance(content, dict) else "unknown"


def owning_directory(path: Path) -> DirInfo | None:
    """The nearest directory above `path` that a run, model, export or checkpoint owns, if any."""
    given = list(path.parents)  # as the user wrote them (the message names those), then the rest of the way up
    seen = {p.resolve() for p in given}
    for parent in given + [p for p in path.resolve().parents if p not in seen]:
        info = inspect_dir(parent)
        if info.kind in OWNED_KINDS:
            return info
    return None


# -- atomic writes -----------------------------------------------------------------------------

def _temporary_beside(path: Path) -> Path:
    # The suffix stays last, for writers that pick a format from it (matplotlib) or append one (numpy).
    return path.with_name(f".{path.stem}.{secrets.token_hex(4)}.tmp{path.suffix}")


def _with_filename(err: OSError, path: Path, tmp: Path) -> OSError:
    """The same error with `path` as its file name (not the temporary file's), so that the message names it."""
    if err.errno is None or (err.filename is not None and str(err.filename) != str(tmp)):
        return err
    return OSError(err.errno, err.strerror or os.strerror(err.errno), str(path))


def _umask() -> int:
    """This process's umask, read without changing it where Linux tells it (`os.umask` sets it to read it)."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _give_normal_mode(tmp: Path, path: Path) -> None:
    """Give `tmp` the mode `open(path, "w")` would have left: the mode of the file it replaces, else 0666 less the
    umask. Writers that make their file private (safetensors writes 0600) would otherwise leave one file of a run
    unreadable to the group that reads the rest."""
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except OSError:
        mode = 0o666 & ~_umask()
    with contextlib.suppress(OSError):  # a file system without modes: the rename still stands
        os.chmod(tmp, mode)


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):  # some file systems cannot sync a directory; the rename is still atomic
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_output(path: str | Path) -> Iterator[Path]:
    """A temporary path beside `path` to write to; renamed onto `path` when the block ends without an error.

    For writers that want a file name (matplotlib, safetensors, tokenizers). The file is synced to
    disk before the rename; on any error (or Ctrl-C) it is removed and `path` is left as it was.
    """
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(errno.EISDIR, "is a directory, where a file belongs", str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temporary_beside(path)
    try:
        yield tmp
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        _give_normal_mode(tmp, path)
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise _with_filename(err, path, tmp) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


@contextlib.contextmanager
def atomic_open(path: str | Path, mode: str = "wb", *, encoding: str | None = None,
                newline: str | None = None) -> Iterator[IO]:
    """`open(path, mode)` for writing, atomically: the file appears under its name whole or not at all."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open writes a new file: mode 'w' or 'wb', not {mode!r}")
    with atomic_output(path) as tmp:
        text = mode == "w"
        with open(tmp, mode, encoding=(encoding or "utf-8") if text else None, newline=newline) as handle:
            yield handle
            handle.flush()


@contextlib.contextmanager
def atomic_files(directory: str | Path) -> Iterator[Path]:
    """A hidden staging directory inside `directory` for writers that fill a folder (`save_pretrained`,
    converters); when the block ends without an error each file is moved onto its place in `directory`
    (one rename each, so every file is whole), and the staging directory goes either way."""
    import shutil

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    staging = directory / f".staging-{secrets.token_hex(4)}"
    staging.mkdir()
    try:
        yield staging
        for path in sorted(p for p in staging.rglob("*") if p.is_file()):
            target = directory / path.relative_to(staging)
            if target.is_dir():
                raise IsADirectoryError(errno.EISDIR, "is a directory, where a file belongs", str(target))
            target.parent.mkdir(parents=True, exist_ok=True)
            _give_normal_mode(path, target)
            os.replace(path, target)
        _fsync_dir(directory)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write `data` to `path` atomically (a temporary file beside it, synced, then renamed)."""
    with atomic_open(path, "wb") as handle:
        handle.write(data)


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write UTF-8 `text` to `path` atomically."""
    atomic_write_bytes(path, text.encode("utf-8"))


# -- the run lock ------------------------------------------------------------------------------

class RunLock:
    """An OS lock (`flock`) on RUN/.aiayn.lock, held while a process trains in RUN.

    The operating system releases it when the process ends, however it ends (SIGKILL included), so
    a stale lock never blocks a resume. Where `fcntl` does not exist (Windows) it locks nothing.
    A directory the lock created and nothing else filled (a run that failed at its start) goes on release.
    """

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / LOCK
        self._handle: IO | None = None
        self._created = False

    def acquire(self) -> RunLock:
        """Take the lock or raise `RunBusy` at once (never waits)."""
        try:
            import fcntl
        except ImportError:  # pragma: no cover - not on POSIX
            logger.warning("no file locking on this system: do not train twice in %s", self.path.parent)
            return self
        self._created = not self.path.parent.exists()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(self.path, "a+", encoding="utf-8")
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                handle.close()
                raise
            handle.seek(0)
            owner = handle.read().strip()
            handle.close()
            who = f"process {owner}" if owner.isdigit() else "another process"
            raise RunBusy(f"{self.path.parent} is in use: {who} is training in it; wait for it to finish or "
                          "choose another --run directory") from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        self._handle = handle
        return self

    def release(self) -> None:
        """Let go of the lock (closing the file releases it)."""
        if self._handle is None:
            return
        self._handle.close()
        self._handle = None
        if self._created and [p.name for p in self.path.parent.iterdir()] == [LOCK]:
            with contextlib.suppress(OSError):
                self.path.unlink()
                self.path.parent.rmdir()

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
