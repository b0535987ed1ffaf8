"""The threads a decoding step runs on, measured on the model itself, by its number of rows.

Each product, attention, softmax and norm of a step opens a parallel region, and each region wakes the process's
other threads; where OpenMP's threads sleep while they wait (the CLI lets them), a wake costs tens of microseconds.
A narrow model's step at a few dozen rows then takes two to three times as long on two threads as on one, while at
hundreds of rows, or at a base model's widths, the second thread pays (docs/notes.md, "Decoding"). Timing a layer's
products alone did not show it: the whole step is timed here, on the prepared model, at all threads and at one,
interleaved (`timing.timed`), once per machine, model shape, precision and thread count (`calibrate.measured_once`),
and one thread is kept only where it won by more than its own spread (`timing.pick`).

A step of `rows` rows takes the choice measured at the nearest of `MEASURED_ROWS` on a log scale; past
`MANY_ROWS` every step keeps the process's threads. Only the row counts a search meets are measured, the first
time it meets them (a second or less at a small model's widths, a few at a base model's 64 rows).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable

import torch

from aiayn.backends import calibrate, timing

MEASURED_ROWS = (1, 4, 16, 64)  # the rows a step's threads are timed at
MANY_ROWS = 2 * MEASURED_ROWS[-1]  # more rows than this keep every thread (measured faster there on both widths)

_chosen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {measured rows: threads or None}


def measured_rows(rows: int) -> int | None:
    """The row count of `MEASURED_ROWS` whose choice a step of `rows` rows takes, or None past `MANY_ROWS`: one row
    its own (a one-row step runs kernels of its own), more the nearest other on a log scale (a tie the fewer)."""
    if rows > MANY_ROWS:
        return None
    return 1 if rows == 1 else min(MEASURED_ROWS[1:], key=lambda measured: abs(math.log(rows / measured)))


def key(model: torch.nn.Module, precision: str) -> str:
    """What a step's threads are kept under: the precision and the shape of the model's step."""
    cfg = model.config
    return (f"{precision} {cfg.architecture} d_model {cfg.d_model} d_ff {cfg.d_ff} heads {cfg.n_heads} "
            f"layers {len(model.decoder.layers)} vocabulary {cfg.target_vocab_size}")


def step_threads(model: torch.nn.Module, rows: int,
                 time_steps: Callable[[torch.nn.Module, int, int], dict[str, list[float]]]) -> int | None:
    """The threads a step of `model` over `rows` rows runs on where fewer than this process's were measured faster,
    else None (the process's own). `model.step_threads`, set by `Backend.prepare` on CPU inference, names its
    precision; a model without it, a process on one thread, and many rows keep every thread.

    `time_steps(model, rows, threads)`: the timings of `timing.timed` of steps at "all" threads against "one"."""
    precision = getattr(model, "step_threads", None)
    measured = measured_rows(rows)
    threads = torch.get_num_threads()
    if precision is None or measured is None or threads == 1:
        return None
    chosen = _chosen.setdefault(model, {})
    if measured not in chosen:
        kept = calibrate.measured_once("step_threads", f"{key(model, precision)} rows {measured}", lambda seconds,
                                       ratios: _measure(model, measured, threads, time_steps, seconds, ratios))
        chosen[measured] = kept if kept < threads else None
    return chosen[measured]


def _measure(model: torch.nn.Module, rows: int, threads: int, time_steps: Callable, seconds: dict[str, float],
             ratios: dict[str, list[float]]) -> int:
    timed = time_steps(model, rows, threads)
    timing.record(seconds, f"step threads {key(model, model.step_threads)} rows {rows}", timed, plain="all",
                  ratios=ratios)
    return 1 if timing.pick(timed, "all") == "one" else threads
