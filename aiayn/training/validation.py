"""Validation during training: when it runs, the `valid` log row, the best checkpoint, and `patience`."""

from __future__ import annotations

import time
from typing import Any

from aiayn.training import pacing
from aiayn.training.budget import format_duration
from aiayn.training.evaluate import EvalOptions, evaluate


def validate(t: Any) -> dict[str, Any]:
    """Score the valid split on the run's metric (generating greedily for BLEU / chrF), log a `valid` row, and
    checkpoint the model when the score is the best so far."""
    cfg = t.cfg
    began = time.perf_counter()
    split = t.data.valid.head(cfg.valid_max_examples)  # what validation scores
    options = EvalOptions.from_train_config(cfg, decode=t.data.task.generates and cfg.metric != "loss",
                                            num_beams=1, examples=0)
    result = evaluate(t.model, t.data, split, options)
    result.pop("examples", None)
    if t.budget is not None:
        t.budget.record_validation(time.perf_counter() - began, len(split.items), options.decode)
    if not result:
        return result
    t.last_valid, t.last_validated_step = result, t.step
    t.log.append({"split": "valid", "step": t.step, "epoch": t.epoch, **result, "time_s": t.elapsed()})
    score = (-result["loss"] if cfg.metric == "loss" else result[cfg.metric], -result["loss"])
    if score > t.best_score:
        t.best_score, t.stale_validations = score, 0
        t.save(best=True)
    else:
        t.stale_validations += 1
    return result


def validate_and_check_patience(t: Any) -> None:
    """Validate on rank 0; every rank ends the run for "patience" when `patience` validations in a row brought no
    better score."""
    t.parallel.gather()
    spent = False
    if t.rank == 0:
        t.validate()
        spent = bool(t.cfg.patience) and t.stale_validations >= t.cfg.patience
        if spent:
            unspent = (f"; {format_duration(t.budget.left())} of the time budget left unspent: this data supports no "
                       "more training of this model (more data would)") if t.budget is not None else ""
            t.report(f"early stop at step {t.step}: {t.cfg.metric} has not improved for "
                     f"{t.cfg.patience} validations (best {abs(t.best_score[0]):.4g}){unspent}")
    if t.parallel.from_rank0(spent):
        t.stopping = "patience"


def due(t: Any) -> bool:
    """Every `eval_every` steps; under a budget without one, at the planned steps."""
    if t.cfg.eval_every:
        return t.step % t.cfg.eval_every == 0
    return t.budget is not None and t.budget.next_valid > 0 and t.step >= t.budget.next_valid


def after_step(t: Any) -> None:
    """A scheduled validation, which may end the run for "patience"; skipped when a budget has no room for it
    (each one a budget runs moves its plan)."""
    if not t.validation_due():
        return
    budget = t.budget
    if budget is None:
        validate_and_check_patience(t)
    elif not pacing.allows(t, budget.valid_estimate()):
        budget.skipped_validations += 1
    else:
        validate_and_check_patience(t)
        pacing.after_validation(t)


def after_epoch(t: Any) -> None:
    """At an epoch's end, a validation unless `eval_every` or a time budget chooses when."""
    if t.budget is None and not t.cfg.eval_every:
        validate_and_check_patience(t)
