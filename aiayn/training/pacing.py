"""A `time_budget` as training runs: before each step whether it fits, the plan after the probe steps and after
each validation, the beam's cost, and the test's beam at the end (the accounts and the rules: `budget.py`)."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from aiayn.data.batching import token_batches
from aiayn.nn.model import set_dropout
from aiayn.training.budget import BEAM_OVERRUN, BEAM_SAMPLE, END_MARGIN, FINISH_S, PROBE_STEPS, REFIT_STEPS
from aiayn.training.evaluate import EvalOptions, evaluate
from aiayn.training.recipe import compute_keys
from aiayn.training.schedule import resolve_recipe
from aiayn.training.setup import save_run_config

# The share of a time budget the test may be estimated to take for the end to decode it a second time, in bf16
# (`bf16_test_due`): at the English -> French recipe's 10 minutes it took 9 s of 600.
BF16_TEST_SHARE = 0.05


class BudgetTooShort(ValueError):
    """A `time_budget` that left no time for one optimizer step: there is no trained model to save."""


def end_reserve(t: Any) -> float:
    """Seconds the end of the run needs: a last validation and checkpoint, the test evaluation, the files."""
    budget = t.budget
    valid = budget.valid_estimate() if t.data.valid.items else 0.0
    checkpoint = budget.spent["checkpoint"] / max(t.saves, 1) if t.saves else 1.0
    test = _test_estimate(t)
    if bf16_test_due(t):
        test *= 2  # float32's test, then bf16's (no slower where bf16 is native)
    return END_MARGIN * (valid + test) + checkpoint + FINISH_S


def _test_estimate(t: Any) -> float:
    """Seconds the end's test decoding is estimated to take (`Budget.end_test_estimate`)."""
    generated = t.data.task.generates
    return t.budget.end_test_estimate(len(t.data.test.items), t.cfg.num_beams if generated else 1, generated)


def bf16_test_due(t: Any) -> bool:
    """Whether the end of the run decodes the test split again in bf16 (`finish.bf16_test`): a task whose outputs are
    generated, on a CPU that computes bf16 natively (`native_bf16_cpu`), where the test itself decodes in float32,
    and, under a time budget, where the test is estimated to take at most `BF16_TEST_SHARE` of it: a short budget
    keeps its minutes for training (a 2-minute run's two test decodings took 34 of its 120 s)."""
    from aiayn.backends.backend import default_precision, native_bf16_cpu

    device = t.backend.device
    return bool(t.data.task.generates and native_bf16_cpu(device)
                and (t.cfg.precision or default_precision(device, "inference")) == "fp32"
                and (t.budget is None or _test_estimate(t) <= BF16_TEST_SHARE * t.budget.seconds))


def allows(t: Any, seconds: float) -> bool:
    """Whether `seconds` more of training (or validation) leave the end of the run its time; rank 0 decides."""
    budget = t.budget
    if t.rank == 0:
        budget.end_reserve_s = end_reserve(t)
        allowed = budget.fits(seconds, budget.end_reserve_s)
        if budget.planned_steps and t.recipe.schedule == "linear" and t.step >= budget.planned_steps:
            allowed = False  # the rate has decayed to 0
    else:
        allowed = False
    return t.parallel.from_rank0(allowed)


def step_fits(t: Any) -> bool:
    """Before each step (every process at once): False when, under a budget, one more step would leave the end of
    the run too little time."""
    return t.budget is None or allows(t, t.budget.step_s or 0.0)


def step_taken(t: Any, seconds: float, data_s: float = 0.0) -> None:
    """A step took `seconds` (`data_s` of them making its batches); after the `PROBE_STEPS` first, the run is
    planned; after `REFIT_STEPS`, a fitted recipe is fitted to the compute the plan buys (`refit`)."""
    budget = t.budget
    if budget is not None:
        budget.record_step(seconds, data_s)
        if budget.timed_steps == PROBE_STEPS and not budget.planned_steps:
            plan(t)
        elif budget.timed_steps == REFIT_STEPS and not budget.refitted:
            budget.refitted = True
            if t.run.train.recipe == "fit":
                plan(t)  # the first steps of each batch shape are slow: the pace is known only now
                refit(t)


def planned_passes(t: Any) -> float:
    """Passes over the training split the planned steps make (steps x batches a step / batches in the split)."""
    cfg = t.cfg
    batches = token_batches(t.data.train.lengths, cfg.max_tokens, seed=cfg.seed, epoch=0,
                            max_sentences=cfg.max_sentences, ties=t.data.train.ties)
    return t.budget.planned_steps * cfg.global_batches / max(len(batches), 1)


def refit(t: Any) -> None:
    """Fit the recipe's compute keys (`recipe.compute_keys`) to the passes over the data the plan buys, once, early;
    a key the config sets is kept, and so is the model of a preset the config names. One line says what changed."""
    passes = planned_passes(t)
    given = t.run.given | ({"model.dropout"} if "model.preset" in t.run.given else set())
    keys = {key: value for key, value in compute_keys(passes, t.cfg.objective).items()
            if key not in given}  # model keys only
    changed = {key[6:]: value for key, value in keys.items() if getattr(t.model.config, key[6:]) != value}
    if "dropout" in changed:
        for model in (t.model, t.prepared):  # the prepared copy has modules of its own
            set_dropout(model, changed["dropout"])
    t.run = replace(t.run, model_overrides={**t.run.model_overrides, **changed})
    if t.rank == 0:
        save_run_config(t)  # a resume builds the model with what was chosen
        chosen = " ".join(f"{key}={value:g}" for key, value in keys.items())
        t.report(f"recipe fitted to the compute: {t.budget.planned_steps} steps planned, {passes:.1f} passes over the "
                 "training data: " + ((chosen + ("" if changed else " (as set up)")) if keys else
                                      "every key it fits is set by the config"))


def plan(t: Any) -> None:
    """Plan the steps and the validation cadence that fit what is left; the recipe follows the plan."""
    budget, cfg = t.budget, t.cfg
    first = not budget.planned_steps
    valid_examples = len(t.data.valid.head(cfg.valid_max_examples).items)
    total, upcoming = budget.plan(t.step, end_reserve(t), valid_examples, cfg.max_steps)
    budget.planned_steps, budget.next_valid = t.parallel.from_rank0((total, upcoming))
    fresh, notes = resolve_recipe(cfg, total_steps=total, d_model=t.model.config.d_model)
    # the steps taken so far ran on the setup's provisional plan: the rate goes on from where the optimizer's stands
    t.recipe = t.recipe.replanned(fresh, step=t.step, lr=t.optimizer.param_groups[0]["lr"])
    if first and t.rank == 0:
        for note in notes:
            t.report(note)
        when = (f"every {cfg.eval_every} steps" if cfg.eval_every else
                f"first at step {upcoming}" if upcoming else "only at the end")
        t.report(f"time budget {budget.seconds:g} s: {budget.step_s:.3g} s a step measured over "
                 f"{budget.timed_steps} steps, about {total} steps planned, validation {when}, "
                 f"{end_reserve(t):.3g} s kept for the end; recipe: {t.recipe.describe()}")


def after_validation(t: Any) -> None:
    """After a validation in the loop: time the test's beam on a sample (rank 0), then plan again (the
    validation's measured time moves the plan)."""
    if t.rank == 0 and t.data.task.generates and t.cfg.num_beams > 1 and t.data.valid.items:
        time_beam(t)
    plan(t)


def time_beam(t: Any) -> None:
    """Decode a sample of the valid split greedily and with the test's beam: the ratio sizes the test's
    reserve (the sample, an eighth of what validation generates for, 8 to `BEAM_SAMPLE` examples)."""
    split = t.data.valid.head(t.cfg.valid_max_examples)
    sample = split.head(min(BEAM_SAMPLE, max(8, len(split.items) // 8)))
    seconds = []
    for beam in (1, t.cfg.num_beams):
        began = time.perf_counter()
        evaluate(t.model, t.data, sample, EvalOptions.from_train_config(t.cfg, num_beams=beam, examples=0))
        seconds.append(time.perf_counter() - began)
    t.budget.record_beam(*seconds)


def test_beam(t: Any) -> int | None:
    """The test's beam: the run's, or greedy decoding when only that fits what is left of a budget."""
    budget, cfg = t.budget, t.cfg
    if budget is None or not t.data.task.generates or cfg.num_beams == 1:
        return None
    n = len(t.data.test.items)
    if budget.fits(budget.test_estimate(n, cfg.num_beams, True), FINISH_S - BEAM_OVERRUN * budget.seconds):
        return None  # it fits, or ends at most BEAM_OVERRUN of the budget late
    t.report(f"time budget: the test is decoded greedily, beam {cfg.num_beams} would take about "
             f"{budget.test_estimate(n, cfg.num_beams, True):.0f} s of the {budget.left():.0f} s left")
    return 1


def check_trained(t: Any) -> None:
    """Refuse a run whose budget ended before its first step (`BudgetTooShort`): there is no model to save."""
    budget = t.budget
    if t.step == 0 and budget is not None:
        raise BudgetTooShort(
            f"time_budget={t.cfg.time_budget} is too short to train one step: {max(budget.left(), 0.0):.1f} s "
            f"were left after setting up, and the end of the run (validation, test, saving) needs about "
            f"{budget.end_reserve_s:.1f} s; nothing was trained or saved as a model: give a longer time_budget "
            f"(aiayn train --run {t.run_dir} --resume time_budget=...)")
