"""The recipe on one page: the settings, `get_lr` (equation 3), the train step and the loop.

The settings (`TrainConfig` in config.py; the defaults are the paper's, section 5): batches of `max_tokens`
tokens, `global_batches` of them a step; Adam with betas (0.9, 0.98) and eps 1e-9; `get_lr` with `warmup` steps
(fitted to a short run) and `lr_scale`; label smoothing `label_smoothing` = 0.1; residual dropout in the model
config; `clip_norm` 0 (no clipping); `epochs`, `max_steps` or `time_budget`; `seed`.

`Trainer(run, run_dir).fit()` trains and returns a `TrainResult`; everything a run writes lives in `run_dir`
(docs/training.md). The pieces hang off the step, each in its own file: setting up the data, model and
optimizer (`setup.py`), checkpoints and resume (`saves.py`), validation and patience (`validation.py`), the time
budget (`pacing.py`), signals (`signals.py`), processes (`distributed.py`), the log (`logbook.py`) and the end
(`finish.py`); the state and hooks (`state.py`). What differs by objective, its task object answers (`aiayn.tasks`).
"""

from __future__ import annotations

import math
import time

import torch

from aiayn.data.batching import shard_steps, token_batches
from aiayn.training import finish, pacing, saves, setup, validation
from aiayn.training.finish import TrainResult
from aiayn.training.logbook import TrainRows
from aiayn.training.loss import label_smoothed_loss
from aiayn.training.objectives import batch_seed, loss_units, make_batch, masking_generator, to_device
from aiayn.training.schedule import Recipe
from aiayn.training.signals import interrupts_caught
from aiayn.training.state import RunState


class TrainingError(RuntimeError):
    """Training had to stop (for example a non-finite loss); the message names the step and the last checkpoint."""


def get_lr(step: int, recipe: Recipe, d_model: int) -> float:
    """The rate of optimizer step `step` (1-based): a linear warmup over `recipe.warmup` steps to `recipe.peak_lr`.

    From scratch ("noam"), equation 3 of section 5.3, lrate = d_model^-0.5 * min(step^-0.5, step * warmup^-1.5),
    with the warmup fitted to the run and scaled so that its peak is the recipe's (`schedule.resolve_recipe`).
    "linear" then decays linearly to 0 at `total_steps`, "constant" stays at the peak. A recipe re-planned during
    the run (`Recipe.replanned`) goes on from the rate it had at its anchor step.
    """
    step, warmup, peak = max(step, 1), recipe.warmup, recipe.peak_lr
    start, start_lr = recipe.anchor_step, recipe.anchor_lr  # (0, 0.0) for a recipe never re-planned
    if step <= warmup and start:  # a warmup re-planned on its way: on from where the rate stood
        return start_lr + (peak - start_lr) * (step - start) / max(warmup - start, 1)
    if recipe.schedule == "noam":
        scale = peak / (d_model**-0.5 * warmup**-0.5)  # equation 3 peaks at d_model^-0.5 * warmup^-0.5
        return scale * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)
    if step <= warmup:
        return peak * step / warmup
    if recipe.schedule == "linear":
        start, start_lr = (start, start_lr) if start > warmup else (warmup, peak)
        return start_lr * max(0.0, (recipe.total_steps - step) / max(recipe.total_steps - start, 1))
    return peak


class Trainer(RunState):
    """Trains one run: `Trainer(run, run_dir).fit()` (the arguments, the state and the hooks: `state.py`)."""

    def fit(self) -> TrainResult:
        """Train until `epochs`, `max_steps`, the time budget or patience; save, evaluate on the test split, plot.

        Ctrl-C and the other `INTERRUPT_SIGNALS` finish the step, save a checkpoint and return `interrupted`.
        The run directory stays locked against a second process until this returns.
        """
        try:
            with interrupts_caught(self):
                setup.setup(self)
                self.after_setup()
                try:
                    with self.parallel.peers_watched():
                        finished = self.loop()
                except TrainingError:  # every process fails at this same step: each leaves the group before it exits
                    self.parallel.close()
                    raise
            return finish.finish(self, finished)
        finally:
            self.log.close()
            if self.lock is not None:
                self.lock.release()

    def loop(self) -> bool:
        """Step until `stopping` says why not: "max_steps" or "epochs" (`check_limits`), "budget" (`pacing`),
        "patience" (`validation`) or "interrupted" (a signal, once its step is done; True unless that one)."""
        cfg, self.rows, self.looping, self.stopping = self.cfg, TrainRows(self), True, None
        self.check_limits()  # a resumed run may have nothing left to train
        with self.rows:
            while self.stopping is None:
                batches = token_batches(self.data.train.lengths, cfg.max_tokens, seed=cfg.seed, epoch=self.epoch,
                                        max_sentences=cfg.max_sentences, ties=self.data.train.ties)
                # A step takes `global_batches` batches, process r every world-th of them (None: an empty batch)
                for next_batch, mine in shard_steps(len(batches), cfg.global_batches, rank=self.rank,
                                                    world=self.world, start=self.batch_index):
                    if not pacing.step_fits(self):
                        self.stopping = "budget"
                        break
                    began = time.perf_counter()
                    micro = [make_batch(self.data, self.data.train, batches[i] if i is not None else [],
                                        generator=masking_generator(cfg.seed, self.epoch, i or 0)) for i in mine]
                    made = time.perf_counter()
                    stats = self.train_step(micro, [batch_seed(cfg.seed, self.epoch, i or 0, stream=1) for i in mine])
                    self.batch_index = next_batch
                    pacing.step_taken(self, time.perf_counter() - began, made - began)
                    self.rows.add(stats)  # the `train` log row
                    validation.after_step(self)  # a scheduled validation; "patience" skips the rest
                    if self.stopping is None:
                        saves.after_step(self)  # a `save_every` checkpoint
                        self.after_step()
                        self.stopping = "interrupted" if self.interrupted() else self.stopping
                        self.check_limits()
                    if self.stopping is not None:
                        break
                else:  # an epoch's end: the next starts at its first batch
                    self.epoch, self.batch_index = self.epoch + 1, 0
                    validation.after_epoch(self)  # without a budget or `eval_every`; "patience" skips the rest
                    if self.stopping is None:
                        saves.after_epoch(self)  # without a budget or `save_every`
                    self.check_limits()
        return self.stopping != "interrupted"

    def train_step(self, micro_batches: list[dict[str, torch.Tensor]], dropout_seeds: list[int]) -> dict[str, float]:
        """One optimizer step of the paper's recipe; every process calls it at once, with as many micro-batches.

        The summed loss is divided by the loss positions of the whole step over all processes (the loss per token
        of section 5.4); DDP and FSDP average gradients over the processes, so the factor `world` makes the update
        the one a single process makes on the same global batch.
        """
        pad_id, task = self.data.source_tokenizer.pad_id, self.data.task
        units, tokens = self.parallel.total([sum(loss_units(b) for b in micro_batches),  # section 5.1's batch
                                             sum(task.batch_tokens(b, pad_id) for b in micro_batches)])
        scale = self.world / max(units, 1)  # the mean loss per token of the global batch
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = nll_sum = 0.0
        for number, (host_batch, seed) in enumerate(zip(micro_batches, dropout_seeds)):
            torch.manual_seed(seed)  # dropout keyed by the batch, not the process: equal at any world size
            batch = to_device(host_batch, self.device)
            # gradients are reduced across processes after the step's last micro-batch only
            with self.parallel.micro_step(last=number == len(micro_batches) - 1):
                with self.backend.autocast():  # task.forward(model, batch) through DDP / FSDP; dropout on (5.4)
                    logits, labels = self.parallel.module(batch)
                loss, nll = label_smoothed_loss(logits, labels, smoothing=self.cfg.label_smoothing)  # section 5.4
                (loss * scale).backward()
            loss_sum, nll_sum = loss_sum + float(loss.detach()), nll_sum + float(nll.detach())
        loss_sum, nll_sum = self.parallel.total([loss_sum, nll_sum])  # NaN on any process: NaN on all
        if not math.isfinite(loss_sum):
            raise TrainingError(saves.failure_message(self, f"non-finite loss ({loss_sum})"))
        # clip_norm (not in the paper; 0, the default, only measures the norm)
        norm = self.parallel.clip_grad_norm(self.cfg.clip_norm if self.cfg.clip_norm > 0 else math.inf)
        if not math.isfinite(norm):
            raise TrainingError(saves.failure_message(self, f"non-finite gradient norm ({norm})"))
        lr = get_lr(self.step + 1, self.recipe, self.model.config.d_model)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()  # Adam (section 5.3)
        self.step += 1
        return {"loss": loss_sum / max(units, 1), "nll": nll_sum / max(units, 1), "lr": lr, "grad_norm": norm,
                "tokens": tokens}
