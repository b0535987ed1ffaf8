"""Options several commands share."""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

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


@dataclass(frozen=True)
class Bounded:
    """An argparse `type=` for a number option that also carries its range: argparse converts the text (and
    refuses `--num-beams x`), then `check_numbers` checks every such option of the command, before any work starts:
    finite, in range (`--num-beams 0`, `--alpha nan`, `--valid -1` are refused with the option's name)."""

    kind: type
    minimum: float | None = None
    maximum: float | None = None
    above: float | None = None

    @property
    def __name__(self) -> str:  # argparse's "invalid int value: 'x'"
        return self.kind.__name__

    def __call__(self, text: str) -> int | float:
        return self.kind(text)

    def check(self, option: str, value: float) -> None:
        """Raise ValueError naming `option` when `value` is not finite or out of range."""
        if not math.isfinite(value):
            raise ValueError(f"{option} must be a finite number, got {value}")
        def shown(number: float) -> str:  # a large whole number written out (2**63 - 1, not 9.22337e+18)
            return f"{number:,}" if isinstance(number, int) and abs(number) >= 10**6 else f"{number:g}"

        if self.above is not None and not value > self.above:
            raise ValueError(f"{option} must be above {shown(self.above)}, got {shown(value)}")
        if self.minimum is not None and value < self.minimum:
            raise ValueError(f"{option} must be at least {shown(self.minimum)}, got {shown(value)}")
        if self.maximum is not None and value > self.maximum:
            raise ValueError(f"{option} must be at most {shown(self.maximum)}, got {shown(value)}")


def integer(minimum: int | None = None, maximum: int | None = None) -> Bounded:
    """`type=` of a whole-number option in [minimum, maximum]."""
    return Bounded(int, minimum, maximum)


def number(minimum: float | None = None, maximum: float | None = None, *, above: float | None = None) -> Bounded:
    """`type=` of a finite number option in [minimum, maximum] (and greater than `above`)."""
    return Bounded(float, minimum, maximum, above)


def check_numbers(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Check every `Bounded` option the command was given (the one validator of numeric options)."""
    for action in parser._actions:
        value = getattr(args, action.dest, None)
        if isinstance(action.type, Bounded) and isinstance(value, (int, float)):
            action.type.check("/".join(action.option_strings) or action.dest, value)


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


def add_precision_argument(parser: argparse.ArgumentParser, *, default: str | None = None,
                           measured: bool = False) -> None:
    """`--precision fp32|bf16|int8`: how the model's numbers run at inference (see `aiayn.backends`); `measured`: the
    default is the one measured best for the model (`aiayn.inference.translator.measured_precision`)."""
    usual = "bf16 on a GPU that has it, else fp32"
    if measured:
        usual = ("bf16 on a GPU that has it, and on a CPU with native bf16 where the model's run measured its test "
                 "BLEU in bf16 within 0.3 of fp32's and its products ran faster in bf16 here; else fp32")
    parser.add_argument("--precision", choices=["fp32", "bf16", "int8"], default=default,
                        help="fp32 (exact); bf16; int8 on CPU: int8 weights and activations in the layers where "
                             "the error measured on calibration inputs allows (faster, approximate); default: "
                             f"{default or usual}")
