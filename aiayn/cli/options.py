"""Options several commands share."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Iterator

PROGRESS_FROM = 256  # show a progress bar from this many texts on (fewer finish before a bar tells anything)


def show_progress(count: int, *, quiet: bool = False) -> bool:
    """Whether a command working through `count` texts shows a progress bar on stderr."""
    return not quiet and count >= PROGRESS_FROM


@contextlib.contextmanager
def progress_bar(total: int, *, quiet: bool, unit: str, desc: str) -> Iterator[Callable[[int], object] | None]:
    """A tqdm bar on stderr counting `unit`s with their rate, when `show_progress` says so: yields its update
    function, or None (the library's `progress=` arguments take either)."""
    if not show_progress(total, quiet=quiet):
        yield None
        return
    from tqdm import tqdm

    with tqdm(total=total, unit=unit, desc=desc, file=sys.stderr, dynamic_ncols=True) as bar:
        yield bar.update


def input_lines(args: argparse.Namespace, what: str = "texts") -> list[str]:
    """The TEXT arguments of a command, or else the lines of --input FILE (stdin for '-' or no --input)."""
    if args.text and args.input:
        raise ValueError(f"give {what} either as arguments or with --input, not both")
    if args.text:
        return list(args.text)
    from aiayn.data.readers import read_lines

    return read_lines(args.input or "-")


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    """`--device cpu|cuda|mps` (or cuda:N); the default is the best this machine has."""
    parser.add_argument("--device", metavar="DEVICE",
                        help="cpu, cuda (cuda:N for one GPU of several) or mps; default: the best available")


def add_precision_argument(parser: argparse.ArgumentParser, *, default: str | None = None) -> None:
    """`--precision fp32|bf16|int8`: how the model's numbers run at inference (see `aiayn.backends`)."""
    parser.add_argument("--precision", choices=["fp32", "bf16", "int8"], default=default,
                        help="fp32 (exact); bf16; int8 on CPU: int8 weights and activations in the layers where "
                             "the error measured on calibration inputs allows (faster, approximate); default: "
                             f"{default or 'bf16 on a GPU that has it, else fp32'}")
