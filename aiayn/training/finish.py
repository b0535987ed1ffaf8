"""The end of a run: the processes come together, the final model is chosen and saved, the test split is
evaluated, and the metrics CSV and the plot are written."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from aiayn.data.prepare import save_data_artifacts
from aiayn.io import atomic_write_bytes, save_model
from aiayn.rundir import CURVES, EVAL, METRICS_CSV
from aiayn.training import pacing, saves
from aiayn.training.budget import BEAM_OVERRUN, FINISH_S
from aiayn.training.checkpoint import latest_checkpoint
from aiayn.training.evaluate import EvalOptions, evaluate
from aiayn.training.logbook import plot_curves


@dataclass
class TrainResult:
    """How a run ended."""

    run_dir: Path
    step: int
    interrupted: bool = False
    checkpoint: Path | None = None
    test: dict[str, Any] = field(default_factory=dict)
    budget: dict[str, Any] = field(default_factory=dict)  # how a `time_budget` was spent (Budget.summary)


def finish(t: Any, finished: bool) -> TrainResult:
    """After the loop of the trainer `t` (`finished`: it was not interrupted): rank 0 alone saves an interrupted
    run's checkpoint, or validates, saves and evaluates the full model."""
    t.parallel.gather()  # rank 0 finishes alone: validates, saves and evaluates the full model
    t.parallel.close()
    if finished:
        pacing.check_trained(t)  # a budget that ended before the first step
    if t.rank != 0:
        return TrainResult(t.run_dir, t.step)
    if not finished:
        checkpoint = t.save()
        t.report(f"interrupted at step {t.step}: saved {checkpoint}; continue with --resume")
        return TrainResult(t.run_dir, t.step, interrupted=True, checkpoint=checkpoint)
    if t.last_saved_step != t.step:
        if t.last_validated_step != t.step:
            t.validate()
        t.save()
    checkpoint = latest_checkpoint(t.ckpt_dir)
    began = time.perf_counter()
    saves.choose_final_model(t)
    save_model(t.model, t.run_dir)
    save_data_artifacts(t.run_dir, t.data)
    if t.budget is not None:
        t.budget.record("finish", time.perf_counter() - began)
    test = t.evaluate_test(num_beams=pacing.test_beam(t))
    began = time.perf_counter()
    if t.budget is not None:
        t.log.append({"split": "budget", "step": t.step, "epoch": t.epoch, **t.budget.summary()})
    t.log.write_csv(t.run_dir / METRICS_CSV)
    plot_curves(t.log.rows(), t.run_dir / CURVES)
    summary = {}
    if t.budget is not None:
        t.budget.record("finish", time.perf_counter() - began)
        summary = t.budget.summary()
        t.report(t.budget.describe())
    return TrainResult(t.run_dir, t.step, checkpoint=checkpoint, test=test, budget=summary)


def evaluate_test(t: Any, num_beams: int | None = None) -> dict[str, Any]:
    """Evaluate the final model on the test split (a progress bar with `progress`); writes `eval.json` and a
    `test` log row. `num_beams` replaces the run's (a budget short of time searches greedily)."""
    from tqdm.auto import tqdm

    began = time.perf_counter()
    with tqdm(total=len(t.data.test.items), disable=not t.progress, unit="example", desc="test",
              dynamic_ncols=True) as bar:
        options = EvalOptions.from_train_config(t.cfg)
        if num_beams is not None:
            options = replace(options, num_beams=num_beams)
        result = evaluate(t.model, t.data, t.data.test, options, progress=bar.update)
    seconds = time.perf_counter() - began
    if t.budget is not None:
        t.budget.record("test", seconds)
    if result:
        if num_beams is not None:
            result["num_beams"] = num_beams
        bf16 = bf16_test(t, options, result, seconds)
        if bf16 is not None:
            result["bf16"] = bf16
        row = {k: v for k, v in result.items() if k not in ("examples", "bf16")}
        # bf16's scores as columns of their own in the metrics CSV (eval.json keeps them together)
        row.update({f"bf16_{k}": v for k, v in result.get("bf16", {}).items() if isinstance(v, (int, float))})
        t.log.append({"split": "test", "step": t.step, "epoch": t.epoch, **row, "time_s": t.elapsed()})
        atomic_write_bytes(t.run_dir / EVAL, (json.dumps({"split": "test", "step": t.step, **result},
                                                         indent=2) + "\n").encode())
    return result


def bf16_test(t: Any, options: EvalOptions, result: dict[str, Any], seconds: float) -> dict[str, Any] | None:
    """The test split's scores with the model decoding in bf16, beside float32's `result`, where the end of the run
    decodes it again (`pacing.bf16_test_due`: a generating task on a CPU that computes bf16 natively, its test
    in float32), for a task scored by BLEU: what `aiayn translate` reads to decode in bf16 by default where that is
    as good (`aiayn.inference.translator.measured_precision`). None elsewhere, or where a time budget would end later
    than a beam test may (`budget.BEAM_OVERRUN`) were it to take as long as the float32 test took (`seconds`; the
    plan keeps time for both: `pacing.end_reserve`). On the way it times a step's products in both precisions at the
    model's widths (`calibrate.bf16_faster`), which the translator's choice reads from the machine's cache."""
    from aiayn.backends import calibrate, inference_shape

    if "bleu" not in result or not pacing.bf16_test_due(t):
        return None
    # It may end the run as late as a beam test may (`pacing.test_beam`): the plan keeps room for it, to a few seconds
    if t.budget is not None and not t.budget.fits(seconds, FINISH_S - BEAM_OVERRUN * t.budget.seconds):
        t.report(f"time budget: the test is not decoded again in bf16 ({max(t.budget.left(), 0.0):.0f} s left, the "
                 f"float32 test took {seconds:.0f} s); aiayn translate decodes this model in float32 by default")
        return None
    began = time.perf_counter()
    scores = evaluate(t.model, t.data, t.data.test, replace(options, precision="bf16", examples=0))
    bf16 = {k: v for k, v in scores.items() if k != "examples"}
    # The other half of translate's choice, timed once here (about 0.2 s at the recipe's widths) and cached, so that
    # the first `aiayn translate` on this machine does not wait for it
    faster = calibrate.bf16_faster(*inference_shape(t.model))
    if t.budget is not None:
        t.budget.record("test", time.perf_counter() - began)
    rows = ", ".join(f"{'faster' if fast else 'no faster'} at {name}" for name, fast in faster.items())
    t.report(f"test in bf16: BLEU {bf16['bleu']:.2f} (float32 {result['bleu']:.2f}); a step's products in bf16 "
             f"here: {rows}")
    return bf16
