"""`aiayn verify`: the oracle comparisons on this machine and device, every path it can use, as a table."""

from __future__ import annotations

import argparse
import sys

from aiayn.cli.options import add_device_argument


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `aiayn verify`."""
    p = subparsers.add_parser(
        "verify", help="check the model's fast paths against torch.nn, the NumPy reference and Hugging Face here",
        description="Run each layer and the whole model against torch.nn, the NumPy reference and (where "
                    "installed) Hugging Face, on the plain path and every backend path this machine can use; "
                    "print the largest differences against their tolerances. Exit code 1 if any check fails.")
    add_device_argument(p)
    p.add_argument("--recalibrate", action="store_true",
                   help="measure again which CPU products are fastest here (cached per machine otherwise)")
    p.set_defaults(func=cmd_verify)


def cmd_verify(args: argparse.Namespace) -> int:
    """Print the table; 0 when every check passes, 1 otherwise."""
    import torch

    from aiayn.backends import calibrate, describe_device, resolve_device
    from aiayn.verify import format_checks, verify

    device = resolve_device(args.device)
    print(f"aiayn verify on {describe_device(device)}; torch {torch.__version__}")
    if device.type == "cpu":
        measured = calibrate.choices(refresh=args.recalibrate)
        print(f"measured here ({'just now' if args.recalibrate else calibrate.cache_path(measured.machine)}): "
              f"{measured.describe()}")
    checks = verify(device, progress=lambda backend: print(f"checking {backend.describe()} ...", file=sys.stderr))
    print(format_checks(checks))
    return 0 if all(check.ok for check in checks) else 1
