"""Learning-rate schedules and the recipe a run resolves to before its first step.

Two recipes:
- from scratch, the paper's (section 5.3): Adam (0.9, 0.98, 1e-9), warmup then inverse square root;
- fine-tuning a pretrained encoder (`init_from`), what BERT fine-tuners use: AdamW with weight
  decay 0.01, linear warmup over 10% of the steps, then linear decay to 0, peak 3e-5.

`warmup=0` (the default) means the paper's 4,000 steps, but a run too short to profit from them
(fewer than 40,000 planned steps) warms up over `warmup_fraction` (10%) of its planned steps,
while the peak stays where the paper's schedule puts it (d_model^-0.5 x 4000^-0.5 x `lr_scale`):
a 300-step run would otherwise train at a tiny rate throughout. An explicit `warmup` is taken
as given, and noam is then exactly equation 3 (`aiayn.training.loop.get_lr`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

SCHEDULES = ("auto", "noam", "linear", "constant")
OPTIMIZERS = ("auto", "adam", "adamw")
PAPER_WARMUP = 4000
FINETUNE_LR = 3e-5
CONSTANT_LR = 1e-3


@dataclass(frozen=True)
class Recipe:
    """The optimizer and learning-rate schedule a run uses, every "auto" resolved (the rate of each step:
    `aiayn.training.loop.get_lr`).

    Attributes:
        optimizer: "adam" (L2 weight decay, the paper's) or "adamw" (decoupled weight decay).
        schedule: "noam" (warmup, then inverse square root), "linear" (warmup, then linear decay
            to 0 at `total_steps`) or "constant" (warmup, then flat).
        peak_lr: the rate at the end of the warmup.
        warmup: warmup steps.
        total_steps: the planned optimizer steps.
        betas, eps, weight_decay: the optimizer's settings.
    """

    optimizer: str
    schedule: str
    peak_lr: float
    warmup: int
    total_steps: int
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    # Where a re-plan took over (`replanned`): from (anchor_step, anchor_lr) the rate runs on to the new plan, so
    # that a re-planned run's rate never jumps; (0, 0) for a run planned once.
    anchor_step: int = 0
    anchor_lr: float = 0.0

    def replanned(self, new: Recipe, *, step: int, lr: float) -> Recipe:
        """This recipe taken over after `step`, at the rate `lr` it had then, by `new` (the recipe resolved for a new
        plan of the run's steps): the rate never jumps.

        A warmup not yet over takes the new plan's and is reached from where the rate stands; a warmup that is over
        stays as it was (the inverse square root then goes on unchanged); a linear decay runs from where the rate
        stands to 0 at the new end.
        """
        warmup = max(new.warmup, step + 1) if step < self.warmup else self.warmup
        total = max(new.total_steps, step + 1)
        if step == 0:
            return replace(self, warmup=warmup, total_steps=total)
        return replace(self, warmup=warmup, total_steps=total, anchor_step=step, anchor_lr=lr)

    def describe(self) -> str:
        """One line for the run's report."""
        after = {"noam": "inverse square root", "linear": f"linear decay to 0 at step {self.total_steps}",
                 "constant": "constant"}[self.schedule]
        decay = f", weight decay {self.weight_decay:g}" if self.weight_decay else ""
        return (f"{'AdamW' if self.optimizer == 'adamw' else 'Adam'} betas ({self.betas[0]:g}, {self.betas[1]:g}), "
                f"eps {self.eps:g}{decay}; peak lr {self.peak_lr:.3g} after {self.warmup} warmup steps, then {after}")


def resolve_recipe(cfg: Any, *, total_steps: int, d_model: int) -> tuple[Recipe, list[str]]:
    """The run's recipe from its `TrainConfig` and planned steps, plus notes on what was adapted.

    `auto` fields follow `init_from`: fine-tuning gets AdamW / linear / 3e-5 / weight decay 0.01 /
    beta2 0.999 / eps 1e-8 (BERT's), training from scratch the paper's Adam / noam.
    """
    finetune = bool(cfg.init_from)
    schedule = cfg.schedule if cfg.schedule != "auto" else ("linear" if finetune else "noam")
    optimizer = cfg.optimizer if cfg.optimizer != "auto" else ("adamw" if finetune else "adam")
    notes: list[str] = []
    total_steps = max(total_steps, 1)
    fitted = max(1, math.ceil(cfg.warmup_fraction * total_steps))
    if cfg.warmup:
        warmup = cfg.warmup
        if warmup >= total_steps:
            notes.append(f"warmup {warmup} is not shorter than the {total_steps} planned steps: the rate never "
                         f"reaches its peak (warmup=0 fits the warmup to the run)")
    elif schedule == "noam" and fitted < PAPER_WARMUP:
        warmup = fitted
        notes.append(f"warmup: {warmup} steps ({cfg.warmup_fraction:.0%} of the {total_steps} planned) instead of "
                     f"the paper's {PAPER_WARMUP}, which this run would not outlast")
    else:
        warmup = PAPER_WARMUP if schedule == "noam" else fitted
    if cfg.lr:
        peak = cfg.lr
    elif schedule == "noam":  # where equation 3 peaks: at the end of the given warmup, or of the paper's
        peak = cfg.lr_scale * d_model**-0.5 * (cfg.warmup or PAPER_WARMUP) ** -0.5
    elif finetune:
        peak = FINETUNE_LR
    else:
        peak = CONSTANT_LR
    recipe = Recipe(
        optimizer=optimizer, schedule=schedule, peak_lr=peak, warmup=warmup, total_steps=total_steps,
        betas=(cfg.adam_beta1, cfg.adam_beta2 if cfg.adam_beta2 is not None else (0.999 if finetune else 0.98)),
        eps=cfg.adam_eps if cfg.adam_eps is not None else (1e-8 if finetune else 1e-9),
        weight_decay=cfg.weight_decay if cfg.weight_decay is not None else (0.01 if finetune else 0.0),
    )
    return recipe, notes
