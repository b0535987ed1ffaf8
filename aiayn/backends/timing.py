"""How the backend times its candidates: interleaved repeats, ratios within a repeat, a win only beyond its spread.

A shared machine's speed drifts between repeats (up to 2x on the VMs this runs on), so candidates run in turn,
the order rotating each repeat, and each is compared with the plain one within the same repeat; a candidate
replaces the plain one only where it is faster by more than `MARGIN` in at least three repeats of four (its lower
quartile of per-repeat speed-ups), so that a busy moment cannot make a slower kernel look faster.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from aiayn.backends.devices import usable_cores

MARGIN = 0.05  # another kernel replaces the plain one only when at least this much faster
REPEATS = 7
SAMPLE_SECONDS = 0.2  # how long `other_work` watches the cores (where no measurement is running to watch)


@dataclass
class Competition:
    """What `competing` read: how many of this process's cores other programs kept busy, on average."""

    cores: float = 0.0


@contextmanager
def competing() -> Iterator[Competition]:
    """Around a measurement: other programs' CPU time on the cores this process may run on while the block runs, this
    process's own (all its threads) taken out, in cores (`Competition.cores`, set when the block ends). What the
    measurement competed with. The load average is not: it counts for a minute the commands that ran just before,
    so a measurement right after another command would read as busy, and be repeated once the machine was quiet.
    Where the system has no /proc/stat: the 1-minute load average."""
    reading, cores = Competition(), _affinity()
    before, own, start = _busy_seconds(cores), time.process_time(), time.perf_counter()
    try:
        yield reading
    finally:
        after = _busy_seconds(cores)
        own, wall = time.process_time() - own, time.perf_counter() - start
        if before is None or after is None or wall <= 0:
            reading.cores = load_average()
        else:
            reading.cores = round(max(0.0, (after - before - own) / wall), 2)


def other_work(seconds: float = SAMPLE_SECONDS) -> float:
    """How many of this process's cores other programs keep busy now: `competing` over `seconds` of this process
    asleep."""
    with competing() as reading:
        time.sleep(seconds)
    return reading.cores


def _affinity() -> set[int]:
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


def _busy_seconds(cores: set[int]) -> float | None:
    """CPU seconds the `cores` have spent busy since boot (user, system, interrupts and the time a hypervisor took
    from them), from /proc/stat; None where there is none."""
    try:
        busy = 0
        for line in Path("/proc/stat").read_text().splitlines():
            name, *fields = line.split() or [""]
            if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cores:
                user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in (fields + ["0"] * 8)[:8])
                busy += user + nice + system + irq + softirq + steal
        return busy / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, AttributeError):
        return None


def load_average() -> float:
    """The 1-minute load average (0 where the system does not say)."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return 0.0


def busy(load: float, threads: int) -> bool:
    """Whether other work of `load` cores (`other_work`) left fewer than `threads` cores free (half a core to
    spare)."""
    return load > usable_cores() - threads + 0.5


def measured_busy(then: float, now: float, threads: int) -> bool:
    """Whether choices measured with `threads` threads beside `then` cores of other work (`other_work`) should be
    measured again beside `now`:
    other work held some of the cores the measurement needed (a busy measurement chose the wrong kernel for
    training once: docs/notes.md, "Encoder and CPU kernels"), and the
    machine is quieter now by half a core or more. Choices measured on a quiet machine stay until
    `--recalibrate`."""
    return busy(then, threads) and now < then - 0.5


@contextmanager
def running_on(threads: int | None) -> Iterator[None]:
    """Inside the block, `threads` threads (None: the process's), the process's count restored on leaving: a
    candidate timed on another count than the process's, or a pass run on the count measured faster for it."""
    if threads is None:
        yield
        return
    process = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(process)


def interleaved(fns: dict[str, Callable[[], object]], repeats: int, *, warm: bool = False) -> dict[str, list[float]]:
    """Seconds of each call per repeat, the order rotating each repeat so that a busy moment on a
    shared machine hits every contender alike; ratios are then taken within a repeat. (The benchmark
    scripts time their contenders with it too.)

    `warm`: each timed call right after an untimed call of the same candidate, so that it finds the memory it reads
    where its own last pass left it, not where the other candidates' passes pushed it (`timed`)."""
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:
            if warm:
                fns[name]()
            start = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - start)
    return times


def timed(candidates: dict[str, Callable[[], object]], repeats: int = REPEATS, *,
          warm: bool = False) -> dict[str, list[float]]:
    """Each candidate called once untimed (first-call costs), then `interleaved`.

    `warm=True` for a candidate that cycles through copies of a weight holding as many bytes as a model's: each timed
    pass then follows its own, as a decoding step follows the step before over the same weights. A model whose weights
    fit in the processor's cache finds them there at every step; timed right after the other candidates' copies
    pushed them out, such a product was timed on memory it never reads (docs/notes.md, "Decoding")."""
    if not warm:  # warm: the call before each timed one pays them
        for fn in candidates.values():
            fn()
    return interleaved(candidates, repeats, warm=warm)


def speedups(times: dict[str, list[float]], name: str, plain: str) -> list[float]:
    """How many times faster than `plain` the candidate `name` ran, repeat by repeat: [median, lower quartile]."""
    ratios = [p / t for t, p in zip(times[name], times[plain])]
    lower = statistics.quantiles(ratios, n=4, method="inclusive")[0] if len(ratios) > 1 else ratios[0]
    return [statistics.median(ratios), lower]


def pick(times: dict[str, list[float]], plain: str, margin: float = MARGIN) -> str:
    """The candidate with the highest median speed-up over `plain` among those faster by more than `margin` in at
    least three repeats out of four (their lower quartile); else `plain`.

    Ratios taken within a repeat cancel the load that drifts between repeats; requiring the lower quartile to win,
    not the median, keeps a choice only where it wins by more than its own spread, so that a busy moment on a
    shared machine cannot make a slower kernel look faster.
    """
    winners = [name for name in times if name != plain and speedups(times, name, plain)[1] > 1 / (1 - margin)]
    return max(winners, key=lambda name: speedups(times, name, plain)[0]) if winners else plain


def record(seconds: dict[str, float], what: str, times: dict[str, list[float]], *, plain: str | None = None,
            ratios: dict[str, list[float]] | None = None) -> None:
    """The best time of each candidate, for the report, as "what: candidate"; with `plain` and `ratios`, also each
    other candidate's speed-ups over `plain` (`speedups`)."""
    seconds.update({f"{what}: {name}": min(t) for name, t in times.items()})
    if plain is not None and ratios is not None:
        ratios.update({f"{what}: {name}": [round(r, 3) for r in speedups(times, name, plain)]
                       for name in times if name != plain})
