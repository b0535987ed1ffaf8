"""The recipe that fits the data: the sizes and rates a run takes from its corpus and its time budget.

`recipe="auto"` (the default) is `"fit"` for an objective measured with it (`Task.fits_recipe`:
translation and the causal language model) trained from scratch on files, and `"paper"` otherwise
(built-in data sets, other objectives, fine-tuning). Under `"fit"`, every key below that the config does
not set is chosen from the number of training examples (pairs, or lines of text); a key the config sets
is kept.
`"paper"` keeps the dataclass defaults: the paper's post-LN model and its schedule (`schedule.py`).

The rule, and what backs each lever (docs/training.md, "A recipe that fits the data"):

| examples | model | vocabulary | batch tokens |
| --- | --- | --- | --- |
| 10,000 or more | "small" (d_model 256, 3 + 3 layers) | 8,000 | 4,096 |
| 2,000 to 10,000 | "small" | 4,000 | 2,048 |
| fewer | "tiny" (d_model 64, 2 + 2 layers) | 2,000 | 1,024 |

and, with a `time_budget` that buys at most `SHORT_THREAD_S` (4 hours) of one CPU thread (the budget times the
threads the run trains on, its processes together, four at most: 2 hours on 2 cores), or on a GPU a budget under
`SHORT_BUDGET_S` (1 hour), the "small" model narrowed to d_model 128 and d_ff 512, with at most 4,000 pieces and
1,024-token batches (`SHORT`), and for a language model at most 2,000 pieces and AdamW with weight decay 0.1
(`LM_SHORT`): a short run on a CPU is short of steps before it is short of parameters, and the
vocabulary projection is the largest product of a narrow model (docs/training.md: an hour on one thread at the
"small" sizes fell far behind the narrow model at the same minute). At every size: pre-LN (`norm_first`), peak
learning rate 3e-3 reached after 30% of the planned steps (`warmup_fraction`), then a linear decay to 0 at the
planned end (`SCHEDULE`); label smoothing 0.1 (the paper's); under a budget, `PATIENCE`.

The compute decides the rest (`compute_keys`): the passes over the training data the run will make choose
the residual dropout (`DROPOUT_BY_PASSES`: none while each step still sees mostly new data, the paper's 0.1
once a model sees its data ten times and more). Without a budget the passes are `epochs`; under one, the run
knows them once it knows its pace, and `aiayn.training.pacing.refit` applies them then, once.

What backs it: runs on English -> French UI strings in 10 and 30 minutes on one thread, each lever
changed alone, and language models on either side of those strings against the paper's recipe in
the same budget (docs/training.md, "A recipe that fits the data"; the figures, dated, in docs/notes.md,
"Training"). The rows without a short budget keep the sizes of 71-minute runs; the smaller rows follow
Sennrich & Zhang (2019), smaller vocabularies and batches for less data, and are not measured here.
A `time_budget` then sets the steps (`aiayn.training.budget`), and with them the warmup.
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

import torch

from aiayn.backends.devices import resolve_device, usable_cores
from aiayn.tasks.names import CAUSAL_LM, SEQ2SEQ
from aiayn.training.budget import parse_duration
from aiayn.training.config import RunConfig, TrainConfig

PEAK_LR = 3e-3
WARMUP_FRACTION = 0.3
# (least training examples, model preset, vocabulary size, batch tokens), largest first.
SIZES = ((10_000, "small", 8000, 4096), (2_000, "small", 4000, 2048), (0, "tiny", 2000, 1024))
# Warmup, then a linear decay to 0 at the planned end, which a fitted run always knows (a budget's plan, or its
# epochs): the rate anneals to its end instead of stopping high on the inverse square root.
SCHEDULE = "linear"
# Under a budget: validations in a row without a better score that end the run early, with the best model.
PATIENCE = 3
SHORT_THREAD_S = 4 * 3600.0  # on a CPU: the most budget x training threads that narrows the "small" model
SHORT_BUDGET_S = 3600.0  # on a GPU: the budget under which it is narrowed
# A "small" run under a budget shorter than SHORT_BUDGET_S: (model keys, most vocabulary, batch tokens).
SHORT = {"d_model": 128, "d_ff": 512, "dropout": 0.0}, 4000, 1024


# A language model narrowed as above: at most 2,000 pieces, and AdamW's weight decay (docs/language-models.md: on a
# 1.27 MB text in 20 minutes on one thread, 0.7186 nats a character with 4,000 pieces, 0.7048 with 2,000, 0.6981
# with weight decay 0.1 beside them; 1,000 pieces 0.7324, no label smoothing 0.7654, d_model 192 0.708).
LM_SHORT = {"vocab_size": 2000, "optimizer": "adamw", "weight_decay": 0.1}

# The second half of the rule, applied once the run knows its pace (`aiayn.training.pacing.refit`): the passes over
# the training data that the planned steps buy (steps x batches a step / batches in the training split) decide the
# residual dropout. (fewest planned passes, dropout), most first; a language model, which sees its text's every token
# as a label at every pass, more of it from 20 passes (docs/language-models.md: 0.1 turned its curve up there).
DROPOUT_BY_PASSES = ((10.0, 0.1), (0.0, 0.0))
LM_DROPOUT_BY_PASSES = ((20.0, 0.2), *DROPOUT_BY_PASSES)


def compute_keys(passes: float, objective: str = SEQ2SEQ) -> dict[str, Any]:
    """The keys the planned passes over the training data decide for a run of `objective`, model keys as
    "model.KEY"."""
    rule = LM_DROPOUT_BY_PASSES if objective == CAUSAL_LM else DROPOUT_BY_PASSES
    return {"model.dropout": next(dropout for least, dropout in rule if passes >= least)}


def uses_fit(cfg: TrainConfig) -> bool:
    """Whether the run's recipe is "fit" ("auto": an objective that `fits_recipe`, from scratch on files)."""
    if cfg.recipe != "auto":
        return cfg.recipe == "fit"
    return cfg.objective_task.fits_recipe and not cfg.dataset and not cfg.init_from


# Threads beyond these count as these: a narrow model's steps are not measured to go faster on more (untried).
MOST_THREADS_COUNTED = 4


def training_threads(t: TrainConfig) -> int:
    """The CPU threads a run trains on, its processes together: `processes` x `threads` as given (one a process where
    processes are launched), else the cores torch uses (the layout `processes=0` chooses uses them all either way);
    at most `MOST_THREADS_COUNTED`."""
    if t.processes > 1:
        return min(t.processes * (t.threads or 1), MOST_THREADS_COUNTED)
    return min(t.threads or torch.get_num_threads(), usable_cores(), MOST_THREADS_COUNTED)


def short_budget(budget_s: float, threads: int) -> bool:
    """Whether a time budget of `budget_s` seconds on `threads` CPU threads (0: a GPU) narrows the "small" model."""
    if not budget_s:
        return False
    return budget_s * threads <= SHORT_THREAD_S if threads else budget_s < SHORT_BUDGET_S


def fitted_keys(pairs: int, budget_s: float = 0.0, passes: float = 0.0, threads: int = 1,
                objective: str = SEQ2SEQ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(training keys, model keys) the recipe chooses for `pairs` training examples and a time budget of `budget_s`
    seconds (0: none) on `threads` CPU threads (0: a GPU), or `passes` over the data known before the first step
    (`epochs`; 0: not known); the model keys include "preset". Under a budget, the compute keys are chosen again once
    the pace is known (`compute_keys`)."""
    _, preset, vocab, tokens = next(row for row in SIZES if pairs >= row[0])
    model = {"preset": preset, "norm_first": True, "dropout": 0.1}
    narrow = preset == "small" and short_budget(budget_s, threads)
    if narrow:
        keys, most_vocab, tokens = SHORT
        model.update(keys)
        vocab = min(vocab, most_vocab)
    if passes:
        model.update({key[6:]: value for key, value in compute_keys(passes, objective).items()})
    train = {"vocab_size": vocab, "max_tokens": tokens, "lr": PEAK_LR, "warmup": 0,
             "warmup_fraction": WARMUP_FRACTION, "schedule": SCHEDULE, "label_smoothing": 0.1}
    if narrow and objective == CAUSAL_LM:
        train.update(LM_SHORT, vocab_size=min(vocab, LM_SHORT["vocab_size"]))
    if budget_s:  # the data may support fewer steps than the budget buys: the run stops when it says so
        train["patience"] = PATIENCE
    return train, model


def fit_run(run: RunConfig, pairs: int, device: str | torch.device | None = None) -> tuple[RunConfig, list[str]]:
    """`run` with every fitted key it does not set chosen for `pairs` training examples on `device` (None: the
    machine's best, as `aiayn train` picks it), and a note of the choice.

    A key counts as set when the config file or an override names it (`RunConfig.given`) or when its value
    differs from the default.
    """
    if not uses_fit(run.train):
        return run, []
    defaults = TrainConfig(train="-")
    given = set(run.given) | {f.name for f in fields(TrainConfig)
                              if getattr(run.train, f.name) != getattr(defaults, f.name)}
    budget_s = parse_duration(run.train.time_budget) if run.train.time_budget else 0.0
    passes = run.train.epochs if not budget_s and not run.train.max_steps else 0.0
    threads = training_threads(run.train) if resolve_device(device).type == "cpu" else 0
    train, model = fitted_keys(pairs, budget_s, passes, threads, run.train.objective)
    train = {key: value for key, value in train.items() if key not in given}
    chosen_preset = model.pop("preset")
    preset = run.model_preset if "model.preset" in given or run.model_preset != "tiny" else chosen_preset
    if preset != chosen_preset:  # the config's own preset keeps its sizes and dropout; pre-LN is the recipe's
        model = {"norm_first": model["norm_first"]}
    model = {key: value for key, value in model.items() if key not in run.model_overrides}
    fitted = replace(run, train=replace(run.train, recipe="fit", **train), model_preset=preset,
                     model_overrides={**model, **run.model_overrides})
    chosen = [f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in train.items()]
    chosen += [f"model.{k}={v}" for k, v in model.items()]
    if preset != run.model_preset:
        chosen.insert(0, f"model.preset={preset}")
    note = (f"recipe fitted to {pairs} training examples: {' '.join(chosen)}" if chosen else
            f"recipe: every fitted key is set by the config ({pairs} training examples)")
    return fitted, [note]
