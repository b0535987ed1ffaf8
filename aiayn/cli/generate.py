"""Sub-commands of this module are registered here as they are built."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add this module's sub-commands (none yet)."""
