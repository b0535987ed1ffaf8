"""Threads or processes: how a CPU training run under a time budget uses the cores it is given, chosen by measuring.

N threads share the products of one batch; N processes (`processes=N`, DDP over gloo) each train a batch of
their own and average their gradients. Which trains more tokens a second depends on the model's widths and on
the CPU: the small products of a narrow model gain little from a second thread. On a 2-core AVX2 EPYC, 2
processes trained 1.21x the tokens a second of 2 threads at the fitted recipe's widths; on an Intel Xeon
1.03-1.07x (docs/training.md, "Speed").

`processes=0`, the default, lets `choose` decide for a run that

- trains on the CPU, on N >= 2 cores (`threads`, else torch's default: `OMP_NUM_THREADS` or the cores),
- under a `time_budget` of at least `MIN_BUDGET_S`: the budget, not a step count, bounds such a run, so what
  counts is tokens a second (a step of N processes holds N batches), and the processes' start (a few seconds)
  is a small part of it,
- from scratch (a run from a pretrained encoder, `init_from`, trains a model its config does not describe),
  for an objective whose model's shape is known before its data is read and was measured so
  (`Task.shape_before_data`: translation and the causal language model; a classifier's head takes its
  labels from the data, and masked-LM runs were not measured),
- on at most `MAX_PROCESSES` cores (measured with 2).

Such a run times a training step of its own model at N threads, and N one-thread steps of N copies at once, one
a core, as N processes would run them (`step_rates`, a few seconds to half a minute, interleaved; cached per
machine, shape and precision in `calibrate.cache_dir()` unless the machine was busy), the model prepared as the
trainer prepares it in the precision the run will train in (`precision`, else the machine's choice:
`backend.default_precision`), and trains as N processes of one thread where the N steps' tokens a second x
`DDP_EFFICIENCY` beat the N-thread rate by more than `timing.MARGIN`. Any other run, and a run given
`processes=N`, keeps what it was given. A busy machine does not change the answer: with another program holding
one of 2 cores, 2 processes still trained ~1.3x the tokens a second of 2 threads (each ~0.6x its quiet rate;
docs/notes.md).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch

from aiayn.backends import timing
from aiayn.backends.backend import default_precision, select
from aiayn.backends.calibrate import CACHE_LIMIT, cache_dir, dropout_setting, machine
from aiayn.backends.devices import resolve_device, usable_cores
from aiayn.config import ModelConfig
from aiayn.data.prepare import read_examples
from aiayn.nn.model import build_model
from aiayn.paths import read_regular_file
from aiayn.rundir import atomic_write_text
from aiayn.training.budget import parse_duration
from aiayn.training.config import RunConfig
from aiayn.training.recipe import fit_run, uses_fit

logger = logging.getLogger(__name__)

MIN_BUDGET_S = 300.0
# The share of N one-thread steps' tokens that N processes keep (their gradients averaged every step): 14,954
# tokens/s from 2 processes against 2 x 7,978 from one thread, at the recipe's widths on a 2-core AVX2 EPYC
# (docs/notes.md, "training on the recipe's shapes"). Applied to N steps timed at once, on a Zen 4 EPYC it
# predicted 1.60x for the recipe's widths in bf16 where 2 DDP processes trained 1.56x 2 threads' tokens a second
# (docs/notes.md, "the layout timed with every core busy").
DDP_EFFICIENCY = 0.94
MAX_PROCESSES = 4  # measured with 2: beyond a few, N copies of the data and model and N-batch steps are untried
FORMAT = 3  # of the cached rates: bump when `step_rates` times something else
# Tokens a batch when timing: the run's own batch up to this. Threads that wait passively (as the CLI's do) scale
# with the batch: on a Zen 4 EPYC the small preset in bf16 measured 1.42-1.51x for processes at 1,024 tokens and
# 1.18-1.20x at its own 4,096 (docs/notes.md, "the layout in the run's precision, at the run's batch").
MEASURE_ROWS = 4096
MEASURE_LENGTH = 32
REPEATS = 3  # best of each: 2-18 s in all (the recipe's widths to the small preset's in fp32, Zen 4)


@dataclass(frozen=True)
class Layout:
    """How a run spreads over the CPU: `processes` (1: threads only) and why, for the run's log."""

    processes: int
    why: str


def resolved(run: RunConfig, *, device: str | None = None, resume: bool = False,
             relaunchable: bool = True) -> tuple[RunConfig, Layout | None]:
    """`run` with `processes=0` decided (`choose`), and the layout chosen; `run` itself and None where the config
    gives `processes`. The recipe is fitted for the measurement as the trainer will fit it (a resumed run keeps
    the model it saved). `relaunchable=False` (the config came from a pipe, which the processes could not read
    again) keeps one process."""
    if run.train.processes != 0:
        return run, None

    def fitted() -> RunConfig:
        if resume or not uses_fit(run.train):
            return run
        return fit_run(run, len(read_examples(run.train, run.train.train)[0]), device)[0]

    layout = choose(run, device=device, fitted=fitted) if relaunchable else Layout(1, "a config read from a pipe: "
                                                                                    "one process")
    # Processes chosen: each takes the one thread the launcher gives it (OMP_NUM_THREADS), and the run saves
    # threads=0, so that a resume with processes=1 trains on every core again.
    threads = 0 if layout.processes > 1 else run.train.threads
    return replace(run, train=replace(run.train, processes=layout.processes, threads=threads)), layout


def choose(run: RunConfig, *, device: str | None = None, fitted: Callable[[], RunConfig] | None = None) -> Layout:
    """The layout of a run whose config says `processes=0` (see the module docstring). `fitted()` gives the run as
    it will train (its recipe fitted), asked only once the run qualifies; the step timed is the preset's model at
    the run's widths, layers and vocabulary size."""
    t = run.train
    cores = min(t.threads or torch.get_num_threads(), usable_cores())  # torch's default: OMP_NUM_THREADS or cores
    budget = parse_duration(t.time_budget) if t.time_budget else 0.0
    if resolve_device(device).type != "cpu" or cores < 2:
        return Layout(1, "one process")
    if budget < MIN_BUDGET_S:
        return Layout(1, f"{cores} threads: a run without a time budget of {MIN_BUDGET_S / 60:.0f} minutes or more "
                         "keeps one process")
    if t.init_from:  # the model is the pretrained encoder's, which the config does not describe
        return Layout(1, f"{cores} threads: a run that starts from a pretrained encoder keeps one process")
    if cores > MAX_PROCESSES:
        return Layout(1, f"{cores} threads: more than {MAX_PROCESSES} processes are not chosen by themselves "
                         "(give processes=N)")
    task = t.objective_task
    if task.shape_before_data(t) is None:  # a classifier's head takes its labels from the data
        return Layout(1, f"{cores} threads: a {t.objective} run is not timed before its data is read; one process")
    shaped = fitted() if fitted is not None else run
    # The run's widths and layers, its vocabulary's target size, the objective's shape.
    model = shaped.model_config(vocab_size=shaped.train.vocab_size, **task.shape_before_data(shaped.train))
    if not task.trains(model):  # a shape the objective refuses: it says why once, in one process
        return Layout(1, f"{cores} threads: {t.objective} does not train this model; one process")
    batch_tokens = shaped.train.max_tokens
    # The precision the trainer will take: measured once here, read from the cache there.
    precision = t.precision or default_precision(torch.device("cpu"), "train",
                                                 (batch_tokens, model.d_model, model.d_ff))
    return measured_layout(model, batch_tokens, cores, precision)


def measured_layout(model: ModelConfig, batch_tokens: int, cores: int, precision: str = "fp32") -> Layout:
    """Threads or processes for training `model` in `precision` on batches of `batch_tokens` over `cores` cores, by
    `measured_rates` (what `choose` decides once a run qualifies; `aiayn bench train` prints it too)."""
    one, many = measured_rates(model, batch_tokens, cores, precision)
    gain = cores * one * DDP_EFFICIENCY / many
    what = "" if precision == "fp32" else f" in {precision}"
    if gain > 1 + timing.MARGIN:
        return Layout(cores, f"{cores} processes of one thread: at this model's widths{what} they should train "
                             f"{gain:.2f}x the tokens a second of {cores} threads (measured; processes=1 keeps "
                             "threads)")
    return Layout(1, f"{cores} threads: {cores} processes would train {gain:.2f}x their tokens a second{what} "
                     "(measured)")


def measured_rates(model: ModelConfig, batch_tokens: int, threads: int,
                   precision: str = "fp32") -> tuple[float, float]:
    """(tokens a second of one thread while each of `threads` cores runs one, of `threads` threads) of a training
    step of `model` in `precision` on batches of `batch_tokens` (timed on at most `MEASURE_ROWS`): from the cache,
    else `step_rates` (cached unless the machine was busy while it measured)."""
    rows = min(batch_tokens, MEASURE_ROWS)
    description = {**machine(), "threads": str(threads), "model": json.dumps(model.to_dict(), sort_keys=True),
                   "rows": str(rows), "precision": precision, "format": str(FORMAT)}
    if forced := dropout_setting():  # masks drawn as given, not as the machine chose: timed apart
        description["dropout"] = forced
    digest = hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()[:16]
    path = cache_dir() / f"train-layout-{digest}.json"
    try:
        found = json.loads(read_regular_file(path, limit=CACHE_LIMIT))  # a FIFO or a device there: measured again
        return float(found["one"]), float(found["many"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    with timing.competing() as competition:
        one, many = step_rates(model, batch_tokens, threads, precision=precision)
    load = competition.cores
    if not timing.busy(load, threads):
        try:
            atomic_write_text(path, json.dumps({"one": one, "many": many, "load": load, **description}, indent=1))
        except OSError as err:  # a read-only home costs measuring again next time
            logger.info("could not cache the training layout's measurement in %s (%s)", path, err)
    return one, many


def step_rates(model: ModelConfig, batch_tokens: int, threads: int, repeats: int = REPEATS,
               precision: str = "fp32") -> tuple[float, float]:
    """Tokens a second of a training step (forward, backward, AdamW) of a model built from `model`, prepared as the
    trainer prepares it in `precision` for batches of `batch_tokens`, on random batches of about
    min(`batch_tokens`, `MEASURE_ROWS`) tokens: (one thread's while `threads` copies step at once, one thread each,
    as `threads` processes would; `threads` threads'), timed interleaved (best repeat each).

    The copies run at once because a core trains slower while its neighbours work (shared caches and memory): on a
    Zen 4 EPYC two one-thread steps at once kept 0.91-1.00 of one alone's rate each (docs/notes.md)."""
    backend = select("cpu", "train", precision, train_shape=(batch_tokens, model.d_model, model.d_ff))
    with torch.random.fork_rng():  # the caller's random state stays as it was (init, dropout)
        nets = []
        for _ in range(threads):
            torch.manual_seed(0)
            net = build_model(model).train()
            nets.append((net, backend.prepare(net)))
        return _step_rates(nets, backend.autocast, min(batch_tokens, MEASURE_ROWS), threads, repeats)


def _step_rates(nets: list[tuple[torch.nn.Module, torch.nn.Module]], autocast: Callable, rows: int, threads: int,
                repeats: int) -> tuple[float, float]:
    """`step_rates` on `threads` (model, prepared copy) pairs: the first also times the `threads`-thread step."""
    previous = torch.get_num_threads()
    config = nets[0][0].config
    length = min(MEASURE_LENGTH, config.max_len)
    batch = max(1, rows // length)
    inputs = nets[0][0].example_inputs(batch, length, torch.Generator().manual_seed(0))

    def stepper(net: torch.nn.Module, prepared: torch.nn.Module) -> Callable[[int], None]:
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4)

        def step(n: int) -> None:
            torch.set_num_threads(n)  # OpenMP's thread count is the calling thread's own
            with autocast():
                out = prepared(*inputs)
            out.float().logsumexp(-1).mean().backward()  # a softmax over the outputs, as the loss takes one
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return step

    steps = [stepper(net, prepared) for net, prepared in nets]
    pool = ThreadPoolExecutor(threads)  # torch releases the GIL inside its operations

    def at_once() -> None:
        for done in [pool.submit(step, 1) for step in steps]:
            done.result()

    try:
        with torch.inference_mode(False):
            times = timing.timed({"at once": at_once, "many": lambda: steps[0](threads)}, repeats)
    finally:
        pool.shutdown()
        torch.set_num_threads(previous)
    tokens = batch * length
    return tokens / min(times["at once"]), tokens / min(times["many"])
