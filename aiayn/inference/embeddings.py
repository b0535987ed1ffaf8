"""Sentence embeddings with a pretrained encoder (the search index over them is `aiayn.inference.search`).

`Embedder` tokenises ([CLS] text [SEP], truncated as Hugging Face truncates), batches texts
sorted by length (little padding, and no mask at all for batches of one length), encodes,
pools (mean over real tokens or the [CLS] state) and L2-normalises: the recipe of
sentence-transformers' all-MiniLM-L6-v2 (Transformer -> Pooling(mean) -> Normalize).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from aiayn.backends import PRECISIONS
from aiayn.config import POOLINGS
from aiayn.inference import threads
from aiayn.inference.runner import ModelRunner, check_vocabulary, encoding_threads, text_list, too_long
from aiayn.nn.heads import pool
from aiayn.rundir import load_json
from aiayn.tokenization import Tokenizer


def encode_texts(tokenizer: Tokenizer, texts: Sequence[str], max_length: int, *,
                 truncate: bool = True) -> list[list[int]]:
    """Ids of each text as `[CLS] ... [SEP]`, the text truncated so the whole fits `max_length` ids.

    This is Hugging Face's `truncation=True, max_length=max_length` for single sequences; `truncate=False`
    raises ValueError naming the first text that does not fit instead.
    """
    if max_length < 3:
        raise ValueError(f"max_length must be at least 3 ([CLS] token [SEP]), got {max_length}")
    body = tokenizer.encode_batch(list(texts))
    if not truncate:
        for number, ids in enumerate(body, start=1):
            if len(ids) + 2 > max_length:
                raise too_long(number, len(ids) + 2, max_length)
    return [[tokenizer.bos_id, *ids[: max_length - 2], tokenizer.eos_id] for ids in body]


# What one more forward pass costs, in padded tokens: a call's fixed cost over a token's cost, both measured
# for MiniLM on one CPU thread (docs/notes.md, "Embedding"). Splitting off a long text rather than padding the
# rest to it pays where the padding would cost more than a call.
CALL_COST_TOKENS = 48


def length_sorted_batches(lengths: Sequence[int], batch_size: int,
                          call_cost: int | None = CALL_COST_TOKENS) -> list[list[int]]:
    """Indices grouped into batches of at most `batch_size`, longest first, with the least padding overall.

    The texts are sorted by length and cut where it is cheapest: each batch costs its padded size (its
    count x its longest) plus `call_cost` tokens for the pass itself, and the cuts minimise the total
    (dynamic programming over the sorted lengths). A handful of texts of mixed lengths (what a server
    gathers) then runs as a few tight batches instead of one padded to its longest; many texts of
    similar lengths come out as full batches. `call_cost=None` cuts the sorted texts into full batches
    only (on a GPU, where a pass costs far more than 48 tokens, that is what the cost would choose).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    if call_cost is None:
        return [order[start : start + batch_size] for start in range(0, len(order), batch_size)]
    cost = [0] * (len(order) + 1)  # cost[end]: the cheapest batching of order[:end]
    start_of = [0] * (len(order) + 1)  # where the last batch of that batching starts
    for end in range(1, len(order) + 1):
        cost[end], start_of[end] = min((cost[start] + call_cost + (end - start) * lengths[order[start]], start)
                                       for start in range(max(0, end - batch_size), end))
    batches, end = [], len(order)
    while end:
        batches.append(order[start_of[end] : end])
        end = start_of[end]
    return batches[::-1]


def pass_cost(device: torch.device) -> int | None:
    """The cost of a pass in tokens for `length_sorted_batches` on `device` (None: full batches only)."""
    return CALL_COST_TOKENS if device.type == "cpu" else None


def _read_json(path: Path, expected: type = dict) -> object:
    """A sentence-transformers settings file (`expected()` when absent); one line naming it when it is not JSON."""
    if not path.is_file():
        return expected()
    try:
        data = load_json(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(data, expected):
        raise ValueError(f"{path}: expected a JSON {'object' if expected is dict else 'list'}, got "
                         f"{type(data).__name__}")
    return data


_ST_MODULE = "sentence_transformers.models."
# The sentence-transformers modules aiayn runs, in this order: the encoder, its pooling, an optional L2 norm.
_ST_PIPELINE = ("Transformer", "Pooling", "Normalize")
# 1_Pooling/config.json's modes, and aiayn's name for those it implements.
_POOLING_MODES = {"pooling_mode_cls_token": "first", "pooling_mode_mean_tokens": "mean"}


def _st_modules(path: Path) -> dict[str, str]:
    """{module kind: its folder} from `modules.json`; one line naming a module or order aiayn does not run."""
    modules = _read_json(path, list)
    kinds: dict[str, str] = {}
    for module in modules:
        kind = str(module.get("type", "")) if isinstance(module, dict) else repr(module)
        name = kind.removeprefix(_ST_MODULE)
        if not kind.startswith(_ST_MODULE) or name not in _ST_PIPELINE or name in kinds:
            raise ValueError(f"{path}: module {kind!r} is not one aiayn implements (it runs "
                             f"{' -> '.join(_ST_PIPELINE)}, each once): its vectors would differ from this model's; "
                             "use sentence-transformers for it")
        kinds[name] = str(module.get("path", ""))
    order = [name for name in _ST_PIPELINE if name in kinds]
    if list(kinds) != order or order[:2] != ["Transformer", "Pooling"]:
        raise ValueError(f"{path}: modules {' -> '.join(kinds) or 'none'}; aiayn runs Transformer -> Pooling "
                         "[-> Normalize]: use sentence-transformers for this model")
    if kinds["Transformer"] not in ("", "."):
        raise ValueError(f"{path}: the Transformer module lives in {kinds['Transformer']}/; aiayn reads the encoder "
                         "at the top of the folder: point it at that folder, or use sentence-transformers")
    return kinds


def _st_pooling(path: Path) -> str:
    """aiayn's pooling for a sentence-transformers `Pooling` config: [CLS] or mean; any other mode is refused."""
    config = _read_json(path)
    chosen = []
    for key, value in config.items():
        if key.startswith("pooling_mode") and key != "pooling_mode":
            if not isinstance(value, bool):
                raise ValueError(f"{path}: {key} must be true or false, got {value!r}")
            if value:
                chosen.append(key)
    if "pooling_mode" in config:  # newer files also name the mode as a word
        chosen.append("pooling_mode_" + {"cls": "cls_token", "mean": "mean_tokens"}.get(str(config["pooling_mode"]),
                                                                                       str(config["pooling_mode"])))
    unknown = sorted({key for key in chosen if key not in _POOLING_MODES})
    if unknown or len(set(chosen)) > 1:
        raise ValueError(f"{path}: pooling {', '.join(sorted(set(chosen)))} is not one aiayn implements ([CLS] "
                         "or mean over the tokens, one of them): use sentence-transformers for this model")
    return _POOLING_MODES[chosen[0]] if chosen else "mean"


@dataclass(frozen=True)
class SentenceSettings:
    """How a checkpoint turns hidden states into a sentence vector (sentence-transformers' config files)."""

    pooling: str = "mean"
    normalize: bool = True
    max_length: int = 512

    @classmethod
    def read(cls, directory: Path, *, model_max_len: int) -> SentenceSettings:
        """Read `modules.json`, its pooling config (`1_Pooling/config.json`) and `sentence_bert_config.json` where
        present; a module, pooling mode or order aiayn does not implement is refused by name."""
        modules = directory / "modules.json"
        pooling_dir, normalize = "1_Pooling", True
        if modules.is_file():
            kinds = _st_modules(modules)
            pooling_dir, normalize = kinds["Pooling"], "Normalize" in kinds
        pooling = _st_pooling(directory / pooling_dir / "config.json")
        max_length = _read_json(directory / "sentence_bert_config.json").get("max_seq_length") or model_max_len
        if not isinstance(max_length, int) or isinstance(max_length, bool) or max_length < 1:
            raise ValueError(f"{directory / 'sentence_bert_config.json'}: max_seq_length must be a positive integer, "
                             f"got {max_length!r}")
        return cls(pooling=pooling, normalize=normalize, max_length=min(max_length, model_max_len))


def _check_max_length(max_length: int | None) -> None:
    if max_length is not None and (not isinstance(max_length, int) or isinstance(max_length, bool) or max_length < 3):
        raise ValueError(f"max_length must be at least 3 ([CLS] token [SEP]), got {max_length!r}")


class Embedder(ModelRunner):
    """Texts -> sentence vectors (N, d_model) with an encoder-only model.

    Args:
        model: an `EncoderModel` (its `encode` gives (B, L, d_model) hidden states); moved to `device`.
        tokenizer: its tokenizer; bos/eos are wrapped around each text ([CLS]/[SEP] for BERT).
        pooling: "mean" over real tokens or "first" (the [CLS] token's state).
        normalize: L2-normalise each vector (cosine similarity becomes a dot product).
        max_length: most ids per text, special tokens included; longer texts are truncated.
        name: what the vectors come from (recorded in search indexes).
        device: where to run (default: the best available).
        precision: "fp32" (equal to the model up to float32 rounding), "bf16" or "int8" (faster, approximate).
        plain: run the model's modules as written, without the device's fast path (`aiayn.backends`).
    """

    def __init__(self, model: nn.Module, tokenizer: Tokenizer, *, pooling: str = "mean", normalize: bool = True,
                 max_length: int | None = None, name: str = "model", device: str | torch.device | None = None,
                 precision: str = "fp32", plain: bool = False):
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
        _check_max_length(max_length)
        check_vocabulary(tokenizer, model.config.vocab_size, "vocab_size")
        super().__init__(model, device=device, precision=precision, plain=plain)
        self.tokenizer = tokenizer
        self.pooling = pooling
        self.normalize = normalize
        limit = model.config.max_len  # sinusoidal positions extend, but attention's (L x L) scores grow with L
        self.max_length = min(max_length or limit, limit)
        self.name = name

    @classmethod
    def from_pretrained(cls, path_or_hub_id: str | Path | None = None, *, pooling: str | None = None,
                        normalize: bool | None = None, max_length: int | None = None,
                        device: str | torch.device | None = None) -> Embedder:
        """An embedder for a BERT checkpoint (default all-MiniLM-L6-v2) or an aiayn model directory.

        Pooling, normalisation and the length limit default to the checkpoint's
        sentence-transformers settings where it has them (mean, normalised, 256 for MiniLM).
        """
        from aiayn.interop.bert import is_bert_checkpoint, load_pretrained, resolve_checkpoint

        _check_max_length(max_length)  # before loading: 0 must not mean "the default"
        directory = resolve_checkpoint(path_or_hub_id)
        if is_bert_checkpoint(directory):
            model, tokenizer = load_pretrained(directory)
        else:
            from aiayn.io import check_tokenizer_digest, load_model

            model, tokenizer = load_model(directory), Tokenizer.load(directory)
            check_tokenizer_digest(Path(directory), Path(directory))
            if model.config.architecture != "encoder-only":
                what = "a decoder-only language model (aiayn generate continues text with it)" \
                    if model.config.causal else "an encoder-decoder model"
                raise ValueError(f"{directory} holds {what}; embedding needs an encoder-only one")
        settings = SentenceSettings.read(directory, model_max_len=model.config.max_len)
        return cls(model, tokenizer, pooling=pooling or settings.pooling,
                   normalize=settings.normalize if normalize is None else normalize,
                   max_length=max_length or settings.max_length,
                   name=str(path_or_hub_id or "all-MiniLM-L6-v2"), device=device)

    def save_pretrained(self, directory: str | Path, *, force: bool = False) -> Path:
        """Write the model, tokenizer and these settings (pooling, normalisation, max length) into `directory`.

        `from_pretrained` loads it back; a BERT-layout encoder is written as a sentence-transformers
        model, so `SentenceTransformer(directory)` gives the same vectors. Only a new or empty directory,
        or one aiayn saved or exported before, is written to, unless `force`.
        """
        from aiayn.interop.bert import bert_problems
        from aiayn.interop.sentence_transformers import export_sentence_transformer, write_sentence_settings
        from aiayn.io import save_model
        from aiayn.rundir import claim_for_export

        cfg = self.model.config
        sentence_transformer = not bert_problems(cfg)
        directory = claim_for_export(directory, force=force, option="directory", force_hint="pass force=True",
                                     fmt="sentence-transformers" if sentence_transformer else "aiayn")
        settings = {"pooling": self.pooling, "normalize": self.normalize, "max_length": min(self.max_length,
                                                                                             cfg.max_len)}
        if sentence_transformer:
            return export_sentence_transformer(self.model, self.tokenizer, directory, **settings)
        save_model(self.model, directory, tokenizer=self.tokenizer)
        return write_sentence_settings(directory, dim=cfg.d_model, **settings)

    @property
    def dim(self) -> int:
        """Width of each vector."""
        return self.model.config.d_model

    def with_precision(self, precision: str) -> Embedder:
        """This embedder in "fp32" (itself), "bf16" or "int8" (faster, approximate), on the same model."""
        if precision == self.backend.precision:
            return self
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
        return Embedder(self.model, self.tokenizer, pooling=self.pooling, normalize=self.normalize,
                        max_length=self.max_length, name=f"{self.name} ({precision})" if precision != "fp32"
                        else self.name, device=self.backend.device, precision=precision, plain=self.backend.plain)

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        """Ids of each text, `[CLS] ... [SEP]`, truncated to `max_length`."""
        return encode_texts(self.tokenizer, texts, self.max_length)

    def embed_ids(self, ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Padded ids (B, L) and their (B, L) 0/1 mask -> sentence vectors (B, d_model), on the model's device."""
        device = self.backend.device
        ids = ids.to(device)
        mask = None if attention_mask is None else attention_mask.to(device)
        model = self.prepared_model()
        with torch.inference_mode(), threads.running_on(encoding_threads(model, ids)):
            hidden = model.encode(ids, attention_mask=mask).float()  # (B, L, d_model), fp32 pooling
            vectors = pool(hidden, None if mask is None else mask.bool(), self.pooling)  # (B, d_model)
            return F.normalize(vectors, p=2, dim=1) if self.normalize else vectors

    def embed(self, texts: str | Sequence[str], *, batch_size: int = 16,
              progress: Callable[[int], None] | None = None) -> np.ndarray:
        """Vectors of `texts` as a float32 array (N, d_model), in the order given; one string gives one (d_model,).

        Args:
            texts: the sentences, or one sentence.
            batch_size: most texts per forward pass (they are sorted by length first); small batches
                keep activations in cache and measured fastest on CPU.
            progress: called with the number of texts done after each batch (a progress bar).
        """
        if isinstance(texts, str):
            return self.embed([texts], batch_size=batch_size, progress=progress)[0]
        texts = text_list(texts)
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        if not texts:
            return out
        ids = self.tokenize(texts)
        pad = self.tokenizer.pad_id
        told = threading.Lock()  # `progress` hears of one batch at a time when batches run side by side

        def run(batch: list[int]) -> None:
            longest = len(ids[batch[0]])
            rows = np.full((len(batch), longest), pad, dtype=np.int64)  # (B, L)
            mask = np.zeros((len(batch), longest), dtype=np.int64)  # (B, L), 1 = real token
            for r, index in enumerate(batch):
                rows[r, : len(ids[index])] = ids[index]
                mask[r, : len(ids[index])] = 1
            out[batch] = self.embed_ids(torch.from_numpy(rows), torch.from_numpy(mask)).cpu().numpy()
            if progress is not None:
                with told:
                    progress(len(batch))

        lengths = [len(row) for row in ids]
        # On a CPU of more than one thread, batches side by side, each on one thread: 1,000 sentences in 1.12-1.17 s
        # against 1.49-1.81 one batch at a time on two (docs/notes.md, "Decoding"); the vectors of the same model on
        # one. One at a time where batches are too small to gain, or the largest would not fit in memory together.
        self.run_batches(run, length_sorted_batches(lengths, batch_size, pass_cost(self.device)), lengths,
                         "a smaller batch_size (--batch-size) or max_length")
        return out

    def similarity(self, a: str, b: str) -> float:
        """Cosine similarity of two texts."""
        va, vb = self.embed([a, b])
        return float(np.dot(va, vb) / max(np.linalg.norm(va) * np.linalg.norm(vb), 1e-12))
