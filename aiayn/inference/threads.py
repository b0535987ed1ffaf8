"""The threads a decoding step and a short encoding run on, measured on the model itself, by their rows.

Each product, attention, softmax and norm opens a parallel region, and each region wakes the process's other
threads; where OpenMP's threads sleep while they wait (the CLI lets them), a wake costs tens of microseconds. A
narrow model's decoding step at a few dozen rows, or its encoding of one short sentence, then takes two to three
times as long on two threads as on one, while at hundreds of rows, or at a base model's widths, the second thread
pays (docs/notes.md, "Decoding"). Timing a layer's products alone did not show it: the whole pass is timed here, on
the prepared model, at all threads and at one, interleaved (`timing.timed`), once per machine, model shape,
precision, thread count and OpenMP wait policy (`calibrate.measured_once`), and one thread is kept only where it won
by more than its own spread (`timing.pick`).

A pass of `rows` rows (a step's sentences times beams; an encoding's tokens) takes the choice measured at the
nearest of its counts on a log scale (`STEP_ROWS`, `ENCODING_ROWS`); past twice the largest it keeps the process's
threads. Only the counts a search meets are measured, the first time it meets them (a tenth of a second or so at a
small model's widths, half a second to three at a base model's).
"""

from __future__ import annotations

import contextvars
import math
import os
import threading
import weakref
from collections.abc import Callable, Sequence

import torch

from aiayn.backends import calibrate, timing
from aiayn.backends.timing import running_on

STEP_ROWS = (1, 4, 16, 64)  # the rows a decoding step's threads are timed at
ENCODING_ROWS = (8, 32, 128)  # the tokens an encoding's threads are timed at
TIMED_LENGTH = 16  # the sentences (sources, prompts) a pass is timed on have this many tokens, or the model's fewer
WAITS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")  # how OpenMP's threads wait: what a wake costs

# model -> {(pass, counted rows, the process's threads): threads or None}
_chosen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_MEASURING = threading.Lock()  # one measurement at a time: passes in threads of a server would time each other
_worker = threading.local()  # `active` in a worker of `side_by_side`
_STOP: contextvars.ContextVar[threading.Event | None] = contextvars.ContextVar("aiayn_side_by_side_stop", default=None)


class Stopped(Exception):
    """Raised by `check_stopped` in a worker of `side_by_side` whose items were told to stop."""


def check_stopped() -> None:
    """Raise `Stopped` where this runs in a worker of `side_by_side` that was told to stop (an error in the other
    worker, or an interrupt of the calling thread); a search calls it at every step, so that a batch running beside
    one that failed, or under a Ctrl-C, ends within a step. Elsewhere nothing (a context lookup)."""
    stop = _STOP.get()
    if stop is not None and stop.is_set():
        raise Stopped


def counted(rows: int, counts: tuple[int, ...]) -> int | None:
    """The count of `counts` whose choice a pass of `rows` rows takes: the nearest on a log scale (a tie the larger),
    or None past twice the largest (and for no rows at all)."""
    if rows < 1 or rows > 2 * counts[-1]:
        return None
    return min(reversed(counts), key=lambda n: abs(math.log(rows / n)))


def key(model: torch.nn.Module, precision: str) -> str:
    """What a model's threads are kept under: the precision and the shape of the model, and how OpenMP's threads wait
    (`WAITS`: the CLI lets them sleep, a library process lets them spin by default, and the choices differ)."""
    cfg = model.config
    waits = " ".join(f"{name}={os.environ[name]}" for name in WAITS if name in os.environ) or "default waits"
    return (f"{precision} {cfg.architecture} d_model {cfg.d_model} d_ff {cfg.d_ff} heads {cfg.n_heads} "
            f"layers {cfg.n_encoder_layers}+{cfg.n_decoder_layers} vocabulary {cfg.target_vocab_size}, {waits}")


def fewer(model: torch.nn.Module, what: str, rows: int, counts: tuple[int, ...],
          time: Callable[[torch.nn.Module, int, int], dict[str, list[float]]]) -> int | None:
    """The threads a pass `what` ("step", "encoding") of `model` over `rows` rows runs on where fewer than this
    process's were measured faster, else None (the process's own). `model.measured_threads`, set by `Backend.prepare` on
    CPU inference, names its precision; a model without it, a process on one thread, more rows than `counts` reach,
    and a worker of `side_by_side` (its share is its count, and the other worker computes meanwhile) keep every
    thread.

    `time(model, rows, threads)`: the timings of `timing.timed` of the pass at "all" threads against "one"."""
    precision = getattr(model, "measured_threads", None)
    threads = torch.get_num_threads()
    if precision is None or threads == 1 or getattr(_worker, "active", False):
        return None
    measured = counted(rows, counts)
    if measured is None:
        return None
    chosen = _chosen.setdefault(model, {})
    if (what, measured, threads) not in chosen:
        name = f"{key(model, precision)}: {what} at {measured} rows"

        def measure(seconds: dict[str, float], ratios: dict[str, list[float]]) -> int:
            timed = time(model, measured, threads)
            timing.record(seconds, f"threads {name}", timed, plain="all", ratios=ratios)
            return 1 if timing.pick(timed, "all") == "one" else threads
        with _MEASURING:
            kept = calibrate.measured_once("threads", name, measure)
        chosen[what, measured, threads] = kept if kept < threads else None
    return chosen[what, measured, threads]


def timed(run: Callable[[int], object], process: int) -> dict[str, list[float]]:
    """`timing.timed` of `run(n)` on n = `process` threads ("all") against n = 1 ("one")."""
    def on(n: int) -> None:
        with running_on(n):
            run(n)
    return timing.timed({"all": lambda: on(process), "one": lambda: on(1)})


def random_sentences(model: torch.nn.Module, tokens: int) -> torch.Tensor:
    """Random ids (B, L) of about `tokens` tokens in all, sentences of `TIMED_LENGTH` tokens or fewer (and no more
    than the model's positions), to time a pass of `model` on."""
    length = max(1, min(TIMED_LENGTH, model.config.max_len, tokens))
    return torch.randint(model.config.vocab_size, (max(1, tokens // length), length),
                         generator=torch.Generator().manual_seed(0))


def own_count(threads: int) -> None:
    """This (new) thread's own count of `threads` threads: read once first, since a thread's first count is copied
    from the process's, which a pass on fewer threads sets for a moment (`running_on`)."""
    torch.get_num_threads()
    torch.set_num_threads(threads)


SIDE_BY_SIDE = 2  # the most batches run at once (measured on two cores only; each holds its own activations)
# The least size of a batch's products (its rows x d_model^2) at which its batches run side by side: smaller, two
# Python threads wait for each other more than they compute. Measured on two threads (docs/notes.md, "Decoding"): a
# search step's rows (sentences x beams) at d_model 128, 1 to 128 rows: 0.63x one at a time at 1 row, 0.83-1.00x at
# 4, 1.03-1.10x at 8, 1.16x at 16, 1.28-1.59x above; an encoder pass's padded tokens at d_model 32-384, which also
# pays a batch's own Python each pass: 0.39-0.85x at 12K-442K, 1.05-1.86x at 786K and above.
SEARCH_WORK = 2**17
PASS_WORK = 2**19


def side_by_side_workers(device: torch.device, items: int, work: float = math.inf, least: float = 0.0) -> int:
    """How many of `items` independent batches run at once, each in a thread of its own on an equal share of this
    process's threads: on a CPU of more than one thread `SIDE_BY_SIDE` (or fewer items), else one. Two batches at
    once on one thread each ran 1.3-1.55x as fast as one at a time on two, at d_model 128 and at a base model's
    widths (docs/notes.md, "Decoding"): each operation of a batch alone waits for the other thread, which sleeps
    while it waits under the CLI. One where `work`, a batch's rows x d_model^2 on average, is under `least`
    (`SEARCH_WORK`, `PASS_WORK`)."""
    if device.type != "cpu" or work < least:
        return 1
    return max(1, min(torch.get_num_threads(), SIDE_BY_SIDE, items))


def side_by_side(run: Callable[[object], None], items: Sequence, workers: int) -> None:
    """`run(item)` for every item, `workers` at a time, each worker a thread on its share of this process's threads,
    in a copy of this thread's context (a search's buffer pool is shared: `buffers.searches_at_once`). An error, or
    an interrupt of this thread, stops the workers: they start no other item, and a search running there ends at
    its next step (`check_stopped`); then the error of the first item that failed is raised (as one at a time would
    raise it), or the interrupt."""
    if workers <= 1:
        for item in items:
            run(item)
        return
    share = max(1, torch.get_num_threads() // workers)
    queue = list(enumerate(items))[::-1]  # popped from the end: first item first
    failed: dict[int, BaseException] = {}
    stop = threading.Event()
    taking = threading.Lock()

    def work(context: contextvars.Context, done: threading.Event) -> None:
        try:
            own_count(share)
            _worker.active = True  # nothing is measured here: the other worker computes meanwhile (`fewer`)
            context.run(_STOP.set, stop)
            while not stop.is_set():
                with taking:
                    if not queue:
                        return
                    index, item = queue.pop()
                try:
                    context.run(run, item)
                except Stopped:
                    return
                except BaseException as error:  # noqa: BLE001 (handed to the calling thread)
                    failed[index] = error
                    stop.set()
        finally:
            done.set()

    process = torch.get_num_threads()
    ended = [threading.Event() for _ in range(workers)]
    pool = [threading.Thread(target=work, args=(contextvars.copy_context(), done), name=f"aiayn-batch-{i}")
            for i, done in enumerate(ended)]
    try:
        for thread in pool:
            thread.start()
        for done in ended:
            done.wait()
    except BaseException:
        stop.set()  # the workers end within a step: the interrupt waits for that, not for their batches
        for done in ended:
            done.wait()
        raise
    finally:
        for thread in pool:
            thread.join()  # each has set its event: it is leaving
        torch.set_num_threads(process)  # also the count new threads start from, which the workers' own set
    if failed:
        raise failed[min(failed)]
