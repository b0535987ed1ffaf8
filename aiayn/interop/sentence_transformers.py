"""Encoders as sentence-transformers models: the BERT files plus the settings that make a sentence vector.

`SentenceTransformer(directory)` reads `modules.json` (Transformer -> Pooling [-> Normalize]),
`1_Pooling/config.json` (mean or [CLS] pooling) and `sentence_bert_config.json` (the most tokens per
text); without them it pools its own way, does not normalise and cuts texts at 512 tokens, so its
vectors drift from aiayn's. `aiayn.inference.embeddings.SentenceSettings.read` reads the same files.
"""

from __future__ import annotations

import json
from pathlib import Path

from aiayn.interop.bert import export_hf
from aiayn.nn.model import EncoderModel
from aiayn.rundir import atomic_write_text
from aiayn.tokenization import Tokenizer

_MODULE = "sentence_transformers.models."


def write_sentence_settings(directory: str | Path, *, dim: int, pooling: str, normalize: bool,
                            max_length: int) -> Path:
    """Write `modules.json`, `1_Pooling/config.json` and `sentence_bert_config.json` into `directory`.

    Args:
        dim: the vectors' width (d_model).
        pooling: "mean" over real tokens, or "first" (the [CLS] token's state).
        normalize: L2-normalise the pooled vector.
        max_length: most tokens per text, special tokens included; longer texts are truncated.
    """
    directory = Path(directory)
    modules = [{"idx": 0, "name": "0", "path": "", "type": _MODULE + "Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": _MODULE + "Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": _MODULE + "Normalize"})
    pooling_config = {"word_embedding_dimension": dim, "pooling_mode_cls_token": pooling == "first",
                      "pooling_mode_mean_tokens": pooling == "mean", "pooling_mode_max_tokens": False,
                      "pooling_mode_mean_sqrt_len_tokens": False}
    atomic_write_text(directory / "modules.json", json.dumps(modules, indent=2) + "\n")
    atomic_write_text(directory / "1_Pooling" / "config.json", json.dumps(pooling_config, indent=2) + "\n")
    atomic_write_text(directory / "sentence_bert_config.json",
                      json.dumps({"max_seq_length": max_length, "do_lower_case": False}, indent=2) + "\n")
    return directory


def export_sentence_transformer(model: EncoderModel, tokenizer: Tokenizer, directory: str | Path, *,
                                pooling: str, normalize: bool, max_length: int) -> Path:
    """Write `model` as a sentence-transformers model (BERT files + settings); `SentenceTransformer` loads it."""
    export_hf(model, tokenizer, directory)
    return write_sentence_settings(directory, dim=model.config.d_model, pooling=pooling, normalize=normalize,
                                   max_length=max_length)
