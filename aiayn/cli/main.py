"""`aiayn` entry point: one sub-command per job; each `aiayn.cli.<module>` registers its own.

Errors the user can fix (bad input, missing files) become one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from aiayn import __version__

# Each module defines `register(subparsers)`; a sub-command's function receives the parsed args.
COMMAND_MODULES = ("core", "train", "generate", "encoders", "verify", "bench")
# The `nargs="*"` positional of each command that has one (config items, overrides, texts).
POSITIONAL_LISTS = ("items", "overrides", "texts", "text")


class UserError(Exception):
    """A problem in the user's input; reported as one line without a traceback."""


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser."""
    parser = argparse.ArgumentParser(
        prog="aiayn", description="The Transformer of 'Attention Is All You Need', on PyTorch."
    )
    parser.add_argument("--version", action="version", version=f"aiayn {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log details to stderr")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(f"aiayn.cli.{name}").register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit code."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        # Positional words after an option (`aiayn train --run DIR epochs=3`) belong to the
        # command's free list; argparse alone only takes them before the first option.
        target = next((name for name in POSITIONAL_LISTS if isinstance(getattr(args, name, None), list)), None)
        if target is None or any(item.startswith("-") for item in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        getattr(args, target).extend(extra)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        result = args.func(args)
    except (UserError, ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError,
            PermissionError, KeyError) as err:
        message = err.args[0] if isinstance(err, KeyError) and err.args else err
        print(f"aiayn {args.command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"aiayn {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    return int(result or 0)
