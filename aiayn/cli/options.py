"""Options several commands share."""

from __future__ import annotations

import argparse


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    """`--device cpu|cuda|mps` (or cuda:N); the default is the best this machine has."""
    parser.add_argument("--device", metavar="DEVICE",
                        help="cpu, cuda (cuda:N for one GPU of several) or mps; default: the best available")
