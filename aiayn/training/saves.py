"""Checkpoints as training takes them: when to save, what a checkpoint holds to resume exactly, the resume, and
the weights the final model takes (the files themselves: `checkpoint.py`)."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from aiayn.training.checkpoint import (
    average_checkpoints,
    best_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    load_newest_intact,
    mark_best,
    prune_checkpoints,
    save_checkpoint,
)
from aiayn.training.schedule import resolve_recipe

# A time budget's schedule as its re-plans left it (`Recipe.replanned`), kept with a checkpoint.
RESUMED_SCHEDULE = ("warmup", "total_steps", "anchor_step", "anchor_lr")


def state(t: Any) -> dict[str, Any]:
    """What the trainer `t` resumes from besides the weights: where the next step starts, the optimizer, the best
    score and patience, and a time budget's plan."""
    budget = t.budget
    return {"step": t.step, "epoch": t.epoch, "batch_index": t.batch_index,
            "optimizer": t.parallel.optimizer_state(), "best_score": t.best_score,
            "stale_validations": t.stale_validations,
            "budget": None if budget is None else {
                "used": budget.elapsed(), "planned_steps": budget.planned_steps,
                "next_valid": budget.next_valid, "step_s": budget.step_s,
                "schedule": {key: getattr(t.recipe, key) for key in RESUMED_SCHEDULE}}}


def save(t: Any, *, best: bool = False) -> Path:
    """Write a checkpoint of the current step (once per step); `best` marks it the best validated one."""
    began = time.perf_counter()
    cfg = t.cfg
    if t.last_saved_step == t.step:
        path = latest_checkpoint(t.ckpt_dir)
    else:
        path = save_checkpoint(t.ckpt_dir, t.model, state(t), step=t.step,
                               meta={"epoch": t.epoch, "batch_index": t.batch_index,
                                     f"valid_{cfg.metric}": t.last_valid.get(cfg.metric)})
        t.last_saved_step = t.step
        t.saves += 1
    if best:
        mark_best(t.ckpt_dir, path)
    prune_checkpoints(t.ckpt_dir, max(cfg.keep_last, cfg.average_last, 1))
    if t.budget is not None:
        t.budget.record("checkpoint", time.perf_counter() - began)
    return path


def save_on_rank0(t: Any) -> None:
    """Every process: the model comes together (FSDP), and rank 0 writes a checkpoint."""
    t.parallel.gather()
    if t.rank == 0:
        t.save()


def after_step(t: Any) -> None:
    """A checkpoint every `save_every` steps."""
    if t.cfg.save_every and t.step % t.cfg.save_every == 0:
        save_on_rank0(t)


def after_epoch(t: Any) -> None:
    """A checkpoint at each epoch's end, unless `save_every` or a time budget (which saves at validations and at
    the end) chooses when."""
    if t.budget is None and not t.cfg.save_every:
        save_on_rank0(t)


def failure_message(t: Any, what: str) -> str:
    """`what` went wrong at the step being taken: the message names it and the last good checkpoint."""
    last = latest_checkpoint(t.ckpt_dir)
    kept = f"the last good checkpoint is {last}" if last else "no checkpoint was written yet"
    return t.parallel.from_rank0(f"{what} at step {t.step + 1}: training stopped; {kept}")


def restore(t: Any) -> None:
    """Resume the trainer `t` from the newest intact checkpoint: weights, optimizer, position, best score,
    patience and a budget's plan; the log loses the rows after it."""
    checkpoint, saved, damaged = load_newest_intact(t.ckpt_dir, t.model)
    for note in damaged:
        t.report(f"skipped a damaged checkpoint: {note}")
    if checkpoint is None:
        t.report(f"no checkpoint in {t.ckpt_dir} yet: starting from step 0")
        if t.rank == 0:
            t.log.truncate_after(0)
        return
    step, cfg = int(saved["step"]), t.cfg
    if cfg.max_steps and step > cfg.max_steps:  # resumed, it would only save the same model again
        raise ValueError(f"{checkpoint} is at step {step}, past max_steps={cfg.max_steps}: nothing is left to "
                         f"train; give a larger max_steps (or a new --run)")
    t.optimizer.load_state_dict(saved["optimizer"])
    t.step, t.epoch, t.batch_index = int(saved["step"]), int(saved["epoch"]), int(saved["batch_index"])
    t.best_score = tuple(float(v) for v in saved["best_score"])
    t.stale_validations = int(saved["stale_validations"])
    t.last_saved_step = t.step
    if t.budget is not None and saved.get("budget"):  # the plan and what the earlier processes spent
        plan = saved["budget"]
        t.budget.used = float(plan["used"])
        t.budget.planned_steps, t.budget.next_valid = int(plan["planned_steps"]), int(plan["next_valid"])
        t.budget.step_s = plan.get("step_s")
        t.budget.refitted = True  # its config holds what the fit chose
        t.recipe, _ = resolve_recipe(cfg, total_steps=t.budget.planned_steps, d_model=t.model.config.d_model)
        if "schedule" in plan:  # the plan as re-planned (continuous), not as resolved afresh
            t.recipe = replace(t.recipe, **{key: plan["schedule"][key] for key in RESUMED_SCHEDULE})
    if t.rank == 0:
        t.log.truncate_after(t.step)
    t.report(f"resumed from {checkpoint} (step {t.step}, epoch {t.epoch + 1}, batch {t.batch_index})")


def choose_final_model(t: Any) -> None:
    """Put the `final_model` weights into `t.model`: the best validated, the last, or an average."""
    cfg = t.cfg
    best = best_checkpoint(t.ckpt_dir)
    choice = cfg.final_model
    if choice == "auto":
        choice = "average" if cfg.average_last > 1 else "best"
    if choice == "average":
        chosen = list_checkpoints(t.ckpt_dir)[-max(cfg.average_last, 1):]
        average_checkpoints(t.model, chosen)
        t.report(f"final model: the average of {len(chosen)} checkpoints ({chosen[0].name} .. {chosen[-1].name})")
    elif choice == "best" and best is not None and best != latest_checkpoint(t.ckpt_dir):
        load_checkpoint(best, t.model)
        t.report(f"final model: {best.name}, the best {cfg.metric} on the valid split ({abs(t.best_score[0]):.4g})")
