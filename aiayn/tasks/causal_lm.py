"""Causal language modelling (GPT): each token of a line predicted from the tokens before it; scored on loss.

The model is the decoder-only shape (`ModelConfig.causal`: the paper's decoder without cross-attention). A line
is `<s>` + its tokens + `</s>`; the model reads all but the last id and learns the next one at every position
(teacher forcing, as the translation decoder does), so one line trains as many predictions as it has tokens.
What a trained model gives at inference is `aiayn.inference.generator.Generator` (`aiayn generate`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from aiayn.data.collate import IGNORE, pad
from aiayn.data.prepare import PreparedData
from aiayn.data.readers import ReadStats, read_documents, read_text
from aiayn.tasks.base import Encoded, Task
from aiayn.tasks.names import CAUSAL_LM
from aiayn.tokenization import Tokenizer

DECODER_ONLY = {"n_decoder_layers": 0, "causal": True, "head": "none", "num_labels": 0}  # the model's shape
# GPT-2's shape, the default a key the config sets overrides: pre-LN (with a final LayerNorm), learned positions, its
# tanh GELU, an embedding not scaled by sqrt(d_model) that the head shares; what the defaults train thus exports to
# Hugging Face. `recipe=paper` keeps the paper's post-LN decoder with sinusoids.
GPT_SHAPE = {"norm_first": True, "positional": "learned", "activation": "gelu_tanh", "scale_embeddings": False}


class CausalLM(Task):
    """ids (B, L) = a window of the text's tokens; labels (B, L) = the tokens one position ahead.

    Args:
        window: tokens a window holds (the run's `max_source_len`); 0 trains on one example a line instead, `<s>`
            line `</s>` (`lm_examples="lines"`), as the built-in data sets' sentences are.
    """

    name = CAUSAL_LM
    starts_from_encoder = False
    fits_recipe = True
    loaded = "aiayn.inference.generator:Generator"
    exporter = "aiayn.export:export_generator"

    def __init__(self, window: int = 0, gpt_shape: bool = False):
        self.window, self.gpt_shape = window, gpt_shape

    def configured(self, cfg: Any) -> CausalLM:
        """The task reading the run's files as windows of `max_source_len` tokens (`lm_examples`), or lines; its model
        GPT-2's shape unless the run takes the paper's recipe (`recipe=paper`)."""
        windows = cfg.lm_examples == "windows" or (cfg.lm_examples == "auto" and not cfg.dataset)
        window, gpt_shape = cfg.max_source_len if windows else 0, cfg.recipe != "paper"
        return self if (window, gpt_shape) == (self.window, self.gpt_shape) else CausalLM(window, gpt_shape)

    def trains(self, cfg: Any) -> bool:
        return bool(cfg.causal)

    def model_settings(self, data: PreparedData, given: dict[str, Any]) -> dict[str, Any]:
        """The decoder-only shape: the preset's layers as one causal stack, the vocabulary projection its head.
        `model.n_decoder_layers` names the second stack an encoder-decoder has: given here, it is refused, not
        dropped."""
        shape = {key: value for key, value in GPT_SHAPE.items() if key not in given} if self.gpt_shape else {}
        if given.get("n_decoder_layers"):
            raise ValueError(f"model.n_decoder_layers={given['n_decoder_layers']} names the decoder of an "
                             "encoder-decoder model; a decoder-only language model has one stack of causal layers, "
                             f"whose depth is model.n_layers: set model.n_layers="
                             f"{given['n_decoder_layers']} instead")
        return {**shape, **DECODER_ONLY}

    def shape_before_data(self, train: Any) -> dict[str, Any]:
        """The decoder-only shape, whatever the text."""
        return dict(DECODER_ONLY)

    def read(self, cfg: Any, path: str) -> tuple[list, ReadStats]:
        """Plain text: documents (`read_documents`) for windows, else one example a line."""
        return read_documents(path) if self.window else read_text(path)

    def encode(self, raw: list, source: Tokenizer, target: Tokenizer, labels: list[str], name: str) -> Encoded:
        """`<s>` ids `</s>` of each example; in windows, those of every document one after another as one stream,
        cut into windows of `window` + 1 ids that overlap by one, so that each id but the first is a label once (as
        nanoGPT's and Hugging Face's `group_texts` read text). An item's length is what the model reads (one less)."""
        ids = source.encode_batch(list(raw), add_bos=True, add_eos=True)
        if self.window:
            stream = [token for document in ids for token in document]
            ids = [stream[i:i + self.window + 1] for i in range(0, max(len(stream) - 1, 0), self.window)]
        return ids, [(len(i) - 1, 0) for i in ids]

    def characters(self, raw: list) -> int:
        """The characters of the documents (or lines), each with one for its end, which its `</s>` label stands
        for (the line break or blank line after it)."""
        return sum(len(text) + 1 for text in raw)

    def encoding_note(self, splits: dict[str, tuple[int, Any]]) -> str | None:
        """How many documents, tokens and windows each split holds, where the text is read as one stream."""
        if not self.window:
            return None
        counts = "; ".join(f"{name} {documents} documents, {sum(split.lengths)} tokens in {len(split.items)} windows"
                           for name, (documents, split) in splits.items())
        return f"text as one stream, windows of {self.window} tokens (max_source_len), every token trained on: {counts}"

    def collate(self, data: PreparedData, items: list, *, generator: torch.Generator | None) -> dict[str, torch.Tensor]:
        """ids (B, L): each line but its last id, right-padded; labels (B, L): each line but its first, -100 on
        padding (which the look-ahead mask keeps every real position from seeing)."""
        return {"ids": pad([row[:-1] for row in items], data.source_tokenizer.pad_id),
                "labels": pad([row[1:] for row in items], IGNORE)}

    def forward(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Only the N real positions reach the vocabulary projection: logits (N, V), labels (N,)."""
        labels = batch["labels"]
        hidden = model.decode(batch["ids"])  # (B, L, d_model)
        keep = labels != IGNORE
        return model.head(hidden[keep]), labels[keep]  # (N, V), (N,)


TASK = CausalLM()
