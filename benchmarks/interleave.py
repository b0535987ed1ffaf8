"""Timing shared by the benchmark scripts: contenders run in turn, in a rotating order."""

from __future__ import annotations

import time
from collections.abc import Callable


def interleaved(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """Seconds of each call per repeat, the order rotating each repeat so that a busy moment on a
    shared machine hits every contender alike; ratios are then taken within a repeat."""
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:
            start = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - start)
    return times
