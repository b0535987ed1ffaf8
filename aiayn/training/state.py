"""What a trainer holds between steps (settings, where the next step starts, the best score, the processes),
its hooks, and the pieces a subclass may wrap; the recipe that runs on it is `loop.py`."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from aiayn.backends import resolve_device
from aiayn.rundir import CHECKPOINTS, check_path_given
from aiayn.training import finish, saves, setup, validation
from aiayn.training.config import RunConfig
from aiayn.training.logbook import open_log

logger = logging.getLogger(__name__)


class RunState:
    """The state of one run: `run` (training and model config) trained into `run_dir`.

    Args: resume: continue from the newest intact checkpoint (exactly, on CPU). force: write into a directory
    holding files aiayn did not write. progress: a progress bar on stderr. report: receives human-readable lines
    (default: the logger). device: "cpu", "cuda", "mps" or None for the best (under torchrun, LOCAL_RANK's GPU).
    """

    def __init__(self, run: RunConfig, run_dir: str | Path, *, resume: bool = False, progress: bool = False,
                 report: Callable[[str], None] | None = None, force: bool = False,
                 device: str | torch.device | None = None):
        self.run, self.cfg = run, run.train  # the settings: config.py documents every one
        self.run_dir = check_path_given(run_dir, "--run")
        self.ckpt_dir = self.run_dir / CHECKPOINTS
        self.device = setup.process_device(resolve_device(device))
        self.resume, self.force, self.progress, self.report = resume, force, progress, report or logger.info
        self.log = open_log(self.cfg, self.run_dir)
        self.step = self.epoch = self.batch_index = 0  # where the next step starts: a checkpoint resumes it exactly
        self.rank, self.world, self.parallel, self.budget, self.lock = 0, 1, None, None, None
        self.interrupt_requested, self.looping, self.stopping = False, False, None  # a signal; stepping; why it ends
        # (metric, -loss) of the best validation: higher is better; ties on the metric go to the lower loss
        self.best_score, self.stale_validations, self.last_valid = (-math.inf, -math.inf), 0, {}
        self.last_validated_step = self.last_saved_step = -1
        self.saves = 0  # checkpoints written (their mean time is a budget's estimate of the next)
        self.started = time.perf_counter()  # wall clock of this process's run: every log row's `time_s`

    # Hooks and the pieces a subclass may wrap (a benchmark times them); each piece's file documents it.
    def after_setup(self) -> None:
        """Called once data, model and optimizer are ready."""

    def after_step(self) -> None:
        """Called after every optimizer step, unless patience ended the run at it."""

    def validation_due(self) -> bool:
        """Whether a validation follows this step."""
        return validation.due(self)

    def validate(self) -> dict[str, Any]:
        """Score the valid split, log a `valid` row, checkpoint the model when its score is the best so far."""
        return validation.validate(self)

    def save(self, *, best: bool = False) -> Path:
        """Write a checkpoint of the current step (once per step); `best` marks it the best validated one."""
        return saves.save(self, best=best)

    def evaluate_test(self, num_beams: int | None = None) -> dict[str, Any]:
        """Evaluate the final model on the test split; writes `eval.json` and a `test` log row."""
        return finish.evaluate_test(self, num_beams)

    def elapsed(self) -> float:
        """Seconds of wall clock since this process began the run (data, model and all)."""
        return round(time.perf_counter() - self.started, 3)

    def interrupted(self) -> bool:
        """Whether a signal ends the run after this step: rank 0's decides for every process (a signal reaches each
        process at its own moment, and all must stop after the same step)."""
        return self.parallel.from_rank0(self.interrupt_requested)

    def check_limits(self) -> None:
        """End the run for "max_steps" once that many steps are done, or for "epochs" once that many epochs are, when
        neither `max_steps` nor a time budget sets the length (under a budget the clock decides)."""
        cfg = self.cfg
        if self.stopping is None and cfg.max_steps and self.step >= cfg.max_steps:
            self.stopping = "max_steps"
        elif self.stopping is None and cfg.epochs and not cfg.max_steps and self.budget is None \
                and self.epoch >= cfg.epochs:
            self.stopping = "epochs"
