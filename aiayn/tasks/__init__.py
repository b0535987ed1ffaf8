"""One object per training objective, and the registry that finds it by the objective's name.

| objective | task object | its file |
| --- | --- | --- |
| translation (encoder-decoder) | `Seq2Seq` | `seq2seq.py` |
| sequence classification | `SequenceClassification` | `sequence_classification.py` |
| token classification (tagging) | `TokenClassification` | `token_classification.py` |
| masked language modelling (BERT) | `MaskedLM` | `masked_lm.py` |
| causal language modelling (GPT) | `CausalLM` | `causal_lm.py` |

A task object owns what differs between objectives: how a data file is read and encoded (asked by
`aiayn.data.prepare` through `TrainConfig.objective_task`), how a batch is collated, the forward that
gives the loss its inputs, how predictions are collected from a batch and scored, its metrics, and the
model head it trains (`head`, a `ModelConfig.head` name the model builder knows), which models are its
(`trains`, asked by `task_of`), and what they become outside training: the object `aiayn.load` returns,
and its exporter (`loaded`, `exporter`: named, and imported by `resolved` when asked; the server finds how to
answer with the loaded object by its class, `aiayn.serve.models.SERVED`). Adding an objective is a new file here
(with the files of what it names, where it needs new ones), its name in `names.py`, and its line in `_MODULES`.

The task modules are imported on first use: `names.py` is imported by the config and the model builder,
which the task modules themselves import.
"""

from __future__ import annotations

import importlib
from functools import cache
from typing import Any

from aiayn.tasks.base import Task
from aiayn.tasks.names import (
    CAUSAL_LM,
    ENCODER_OBJECTIVES,
    LABELLED,
    MASKED_LM,
    OBJECTIVES,
    SEQ2SEQ,
    SEQUENCE_CLASSIFICATION,
    TOKEN_CLASSIFICATION,
)

__all__ = ["ENCODER_OBJECTIVES", "LABELLED", "MASKED_LM", "OBJECTIVES", "SEQ2SEQ", "SEQUENCE_CLASSIFICATION",
           "TOKEN_CLASSIFICATION", "Task", "get_task", "resolved", "task_of"]

_MODULES = {
    SEQ2SEQ: "aiayn.tasks.seq2seq",
    SEQUENCE_CLASSIFICATION: "aiayn.tasks.sequence_classification",
    TOKEN_CLASSIFICATION: "aiayn.tasks.token_classification",
    MASKED_LM: "aiayn.tasks.masked_lm",
    CAUSAL_LM: "aiayn.tasks.causal_lm",
}


def get_task(objective: str) -> Task:
    """The task object of `objective` (one of `OBJECTIVES`); ValueError names the choices."""
    if objective not in _MODULES:
        raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
    return importlib.import_module(_MODULES[objective]).TASK


def task_of(cfg: Any) -> Task:
    """The task object of the objective that trains models of `ModelConfig` `cfg` (`Task.trains`).

    A plain encoder (no head: BERT-family checkpoints, sentence-transformers models) is masked language
    modelling's, as BERT's pre-training makes it. ValueError when no objective trains `cfg`'s shape.
    """
    for objective in OBJECTIVES:
        task = get_task(objective)
        if task.trains(cfg):
            return task
    raise ValueError(f"no objective trains this model ({cfg.architecture}, head {cfg.head!r}); "
                     f"the objectives are {', '.join(OBJECTIVES)}")


@cache
def resolved(reference: str) -> Any:
    """What a task's "module:attribute" reference (`Task.loaded`, `exporter`) names, imported now."""
    module, _, name = reference.partition(":")
    return getattr(importlib.import_module(module), name)
