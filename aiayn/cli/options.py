"""Options several commands share."""

from __future__ import annotations

import argparse

PROGRESS_FROM = 256  # show a progress bar from this many texts on (fewer finish before a bar tells anything)


def show_progress(count: int, *, quiet: bool = False) -> bool:
    """Whether a command working through `count` texts shows a progress bar on stderr."""
    return not quiet and count >= PROGRESS_FROM


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    """`--device cpu|cuda|mps` (or cuda:N); the default is the best this machine has."""
    parser.add_argument("--device", metavar="DEVICE",
                        help="cpu, cuda (cuda:N for one GPU of several) or mps; default: the best available")
