"""`aiayn` entry point: one sub-command per job; each `aiayn.cli.<module>` registers its own.

Every failure the user can meet becomes one line on stderr, `aiayn CMD: error: ...`, and an exit
code documented in `aiayn.cli.errors` (2 bad input, 3 non-finite numbers, 4 disk / permissions,
5 run directory in use, 130 interrupted, 1 a bug). `--debug` prints the traceback as well.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import sys
import traceback

from aiayn import __version__
from aiayn.cli.errors import BAD_INPUT, INTERRUPTED, NON_FINITE, UserError, describe, one_line
from aiayn.cli.options import check_numbers
from aiayn.cli.streams import Stdout, silence_stdout
from aiayn.interrupts import INTERRUPT_SIGNALS, handling, pending
from aiayn.memory import keep_freed_memory

# Each module defines `register(subparsers)`; a sub-command's function receives the parsed args.
COMMAND_MODULES = ("core", "data", "train", "translate", "generate", "predict", "encoders", "export", "serve", "verify",
                   "bench")
# The `nargs="*"` positional of each command that has one (config items, overrides, texts).
POSITIONAL_LISTS = ("items", "overrides", "texts", "text")

__all__ = ["UserError", "build_parser", "main"]


class Parser(argparse.ArgumentParser):
    """argparse with its errors on one line (no usage block): `aiayn train: error: ... (see aiayn train --help)`."""

    def error(self, message: str) -> None:
        """Print one line and exit with code 2."""
        self.exit(BAD_INPUT, f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser."""
    parser = Parser(prog="aiayn", description="The Transformer of 'Attention Is All You Need', on PyTorch.")
    parser.add_argument("--version", action="version", version=f"aiayn {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log details to stderr")
    parser.add_argument("--debug", action="store_true", help="on an error, print the traceback too")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(f"aiayn.cli.{name}").register(subparsers)
    for sub in subparsers.choices.values():  # `aiayn train ... --debug` works as well as `aiayn --debug train`
        sub.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    parser.set_defaults(commands=subparsers.choices)
    return parser


_signalled: list[int] = []  # signals received while the command runs
_started: list[bool] = []  # set once the parser is built: from then on a signal raises KeyboardInterrupt


def _on_signal(signum: int, frame: object) -> None:
    """Ctrl-C, SIGTERM, SIGHUP or SIGQUIT: end with `interrupted`; a second one ends the process at once.

    While the CLI starts (importing torch and the commands) the signal is only recorded and the command
    stops right after: a KeyboardInterrupt raised inside an extension's import can be swallowed by a
    library's bare `except`, or mark the interpreter to die by SIGINT at exit whatever `main` returns
    (CPython does so when one escapes code that C runs through `PyRun_String`).
    """
    if _signalled:
        os._exit(INTERRUPTED)
    _signalled.append(signum)
    if _started:
        raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit code.

    SIGTERM, SIGHUP and SIGQUIT are handled like Ctrl-C for the whole command (files being written are left as they
    were; `aiayn train` saves a checkpoint), and so is a Ctrl-C that comes while the command is still starting.
    """
    code = _run(argv)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and "torch" in sys.modules:
        _exit_rank(code)
    return code


def _exit_rank(code: int) -> None:
    """End a torchrun process now, with `code`, skipping the interpreter's teardown.

    Everything the command writes is written and closed by now (files atomically, the run's lock released, the
    process group left). What teardown would still do is destroy the distributed library's C++ objects, and a
    rank that exits while its peer is still leaving can find one of their threads still running: C++ then calls
    `std::terminate`, and the rank dies of SIGABRT ("terminate called without an active exception") instead of
    exiting with its code. So the streams are flushed and the process ends here.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _run(argv: list[str] | None) -> int:
    _openmp_waits_passively()
    _no_progress_monitor()
    keep_freed_memory()  # the process's allocator keeps what a step frees for the next (aiayn.memory)
    _signalled.clear()
    _started.clear()
    handlers = contextlib.ExitStack()  # put back when the command ends
    handlers.enter_context(handling(INTERRUPT_SIGNALS, _on_signal))
    _signalled.extend(pending())  # a signal that came while the CLI loaded stops it as one that comes now
    command, debug = "", "--debug" in (argv if argv is not None else sys.argv[1:])
    stdout, sys.stdout = sys.stdout, Stdout(sys.stdout)  # a failure to write names stdout
    try:
        parser = build_parser()
        args, extra = parser.parse_known_args(argv)
        command, debug = args.command or "", args.debug
        if extra:
            # Positional words after an option (`aiayn train --run DIR epochs=3`) belong to the
            # command's free list; argparse alone only takes them before the first option.
            target = next((name for name in POSITIONAL_LISTS if isinstance(getattr(args, name, None), list)), None)
            if target is None or any(item.startswith("-") for item in extra):
                args.commands.get(command, parser).error(f"unrecognized arguments: {' '.join(extra)}")
            getattr(args, target).extend(extra)
        logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                            format="%(levelname)s %(name)s: %(message)s")
        if not getattr(args, "func", None):
            parser.print_help()
            return BAD_INPUT
        _started.append(True)
        if _signalled:  # an interrupt while starting up
            raise KeyboardInterrupt
        check_numbers(args.commands[command], args)  # every numeric option in range, before any work
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # a full disk behind stdout is told now, not ignored at exit
        return code
    except BrokenPipeError:  # the reader went away (`aiayn params | head -1`): done
        silence_stdout()
        return 0
    except Exception as err:
        # an error after an interrupt is its consequence (a half-finished import): report the interrupt
        return _interrupted(command) if _signalled and not debug else _report(err, command, debug)
    except KeyboardInterrupt as err:
        return _report(err, command, debug) if debug else _interrupted(command)
    finally:
        sys.stdout = stdout
        handlers.close()


def _no_progress_monitor() -> None:
    """Progress bars (tqdm's) start no monitor thread, which by default the first bar starts and keeps: a command with
    no other Python thread lets bf16's "aten" kernel run (`aiayn.backends.cpu._without_onednn`), and every bar here is
    updated after each batch or step anyway."""
    from tqdm import tqdm

    tqdm.monitor_interval = 0


def _openmp_waits_passively() -> None:
    """OpenMP threads sleep while they wait for their siblings, unless the user set `OMP_WAIT_POLICY`.

    By default they spin, holding their core: where another program keeps a core busy, every parallel
    region then waits for a thread the kernel has descheduled, and two threads ran several times slower than
    one (docs/training.md, "On a shared machine"). libgomp reads the policy once, when torch loads it, so it is
    set before the CLI's first import of torch, and never in a process that has imported torch already.
    """
    if "torch" not in sys.modules:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _echoed_by_rank0(code: int) -> bool:
    """Under torchrun every process stops together on a non-finite loss or an interrupt; rank 0 says it once."""
    return code in (NON_FINITE, INTERRUPTED) and os.environ.get("RANK", "0") != "0"


def _interrupted(command: str) -> int:
    if _echoed_by_rank0(INTERRUPTED):
        return INTERRUPTED
    print(f"aiayn{' ' + command if command else ''}: interrupted", file=sys.stderr)
    return INTERRUPTED


def _report(err: BaseException, command: str, debug: bool) -> int:
    code, line = describe(err)
    if _echoed_by_rank0(code) and not debug:
        return code
    if debug:
        traceback.print_exception(err)
    print(f"aiayn{' ' + command if command else ''}: error: {one_line(line)}", file=sys.stderr)
    return code
