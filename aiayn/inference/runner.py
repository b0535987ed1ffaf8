"""What every object `aiayn.load` returns holds: the model, the backend that runs it, and its prepared copy."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

from aiayn.backends import inference_shape, select, weights_version
from aiayn.inference import threads
from aiayn.nn.sizes import available_memory, check_memory, forward_bytes


def text_list(texts: object) -> list[str]:
    """`texts` (one string, or an iterable of strings) as a list. Not a sequence at all (None, a number), one
    without an order (a set, a dict) or a text that is not a string raises TypeError, bytes ValueError, each naming
    what to pass (`translate(None)` would otherwise end in "'NoneType' object is not iterable")."""
    if isinstance(texts, str):
        return [texts]
    if isinstance(texts, (bytes, bytearray)):
        raise ValueError(f"texts must be a string or a list of strings, got {type(texts).__name__}: decode it first "
                         "(.decode('utf-8'))")
    if isinstance(texts, (set, frozenset, dict)) or type(texts).__name__ in ("dict_keys", "dict_values"):
        raise TypeError(f"texts must be a string or a list of strings, got {type(texts).__name__}: it has no order "
                        "for the outputs to come back in; pass a list")
    try:
        texts = list(texts)  # type: ignore[call-overload]
    except TypeError:
        raise TypeError(f"texts must be a string or a list of strings, got {type(texts).__name__}") from None
    for number, text in enumerate(texts, start=1):
        if not isinstance(text, str):
            raise TypeError(f"text {number} is a {type(text).__name__}, not a string"
                            + (": decode it first (.decode('utf-8'))" if isinstance(text, bytes) else ""))
    return texts


def check_batch_limits(max_tokens: object, max_sentences: object) -> None:
    """Refuse batch limits that are not whole numbers in range (`max_tokens` >= 1, `max_sentences` >= 0)."""
    for name, value, least in (("max_tokens", max_tokens, 1), ("max_sentences", max_sentences, 0)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
        if value < least:
            bound = f"be at least {least}" if least else "not be negative"
            raise ValueError(f"{name} must {bound}, got {value}")


def check_vocabulary(tokenizer: object, size: int, what: str, *, exact: bool = False) -> None:
    """Refuse a tokenizer whose ids do not fit the model's vocabulary of `size` (`what` names the config key): a
    larger one gives ids the model has no embedding for; with `exact`, a smaller one cannot decode every id the
    model outputs. Both mean the directory's files come from different models."""
    tokens = tokenizer.vocab_size  # type: ignore[attr-defined]
    if tokens > size or (exact and tokens != size):
        raise ValueError(f"the tokenizer has {tokens:,} tokens but the model's {what} is {size:,}: the tokenizer and "
                         "the model come from different runs; save them together again (or use the run's own "
                         "tokenizer.json)")


def too_long(number: int, length: int, limit: int) -> ValueError:
    """The error for text `number` (from 1) of `length` ids where the model has `limit` positions."""
    return ValueError(f"text {number} has {length} tokens, more than the model's max_len ({limit}); shorten it or "
                      "pass truncate=True (--truncate)")


class ModelRunner:
    """A model in eval mode on its device, run through the device's fast path (`aiayn.backends`).

    Args:
        model: the model; moved to the backend's device.
        device: "cpu", "cuda", "mps" or None for the best available.
        precision: "fp32" (the model up to float32 rounding), "bf16" or "int8" (faster, approximate);
            None: the device's default (bf16 on a GPU that has it, else fp32).
        plain: run the modules as written, without the device's fast path.
    """

    def __init__(self, model: nn.Module, *, device: str | torch.device | None = None, precision: str | None = "fp32",
                 plain: bool = False):
        self.backend = select(device, "inference", precision, plain=plain, inference_shape=inference_shape(model))
        self.model = model.to(self.backend.device).eval()
        self._prepared: tuple[tuple | None, nn.Module] | None = None  # (weights' version, prepared model)

    @classmethod
    def to_serve(cls, path: str | Path, *, device: str | torch.device | None = None) -> ModelRunner:
        """The object `aiayn serve` answers with for `path`: `from_pretrained`'s, as `aiayn.load` gives it."""
        return cls.from_pretrained(path, device=device)  # type: ignore[attr-defined]

    @property
    def device(self) -> torch.device:
        """Where the model runs."""
        return self.backend.device

    def check_batch_fits(self, batch: int, length: int, fix: str) -> None:
        """Refuse, before running it, a forward pass over (batch, length) ids whose activations and attention scores
        would not fit in this machine's memory (CPU; `fix` says which option makes batches smaller)."""
        if self.device.type == "cpu":
            check_memory(forward_bytes(self.model.config, batch, length),
                         f"a batch of {batch} text{'s' if batch != 1 else ''} of {length:,} tokens", fix)

    def run_batches(self, run: Callable[[list[int]], None], batches: list[list[int]], lengths: Sequence[int],
                    fix: str) -> None:
        """`run(batch)` for each of an encoder pass's `batches` (indices into `lengths`, each batch's longest first):
        every batch checked to fit in memory before any runs (`fix`: the option that makes batches smaller), the model
        prepared once, then on a CPU of more than one thread the batches side by side, each on its share of the
        threads (`threads.side_by_side`), where `_workers` says they gain."""
        for batch in batches:
            self.check_batch_fits(len(batch), lengths[batch[0]], fix)
        self.prepared_model()  # prepared here, once, not by the first batches at the same time
        threads.side_by_side(run, batches, self._workers(batches, lengths))

    def _workers(self, batches: list[list[int]], lengths: Sequence[int]) -> int:
        """How many of `batches` run at once (`threads.side_by_side_workers`): one where a batch's padded tokens x
        d_model^2 average under `threads.PASS_WORK`, or where the largest batches would not fit in memory together
        (CPU)."""
        if not batches:
            return 1
        width = self.model.config.d_model
        padded = [len(batch) * lengths[batch[0]] for batch in batches]
        workers = threads.side_by_side_workers(self.device, len(batches), sum(padded) / len(padded) * width**2,
                                               threads.PASS_WORK)
        if workers > 1:
            largest = sorted(forward_bytes(self.model.config, len(batch), lengths[batch[0]]) for batch in batches)
            available = available_memory()
            if available is not None and sum(largest[-workers:]) > available:
                return 1
        return workers

    def prepared_model(self) -> nn.Module:
        """The model as the backend prepared it (once, and again whenever a weight changed since)."""
        version = weights_version(self.model)
        if self._prepared is None or self._prepared[0] != version:  # None: inference tensors, no versions to tell
            self._prepared = (version, self.backend.prepare(self.model))
        return self._prepared[1]


def encoding_threads(prepared: nn.Module, ids: torch.Tensor) -> int | None:
    """Fewer threads than the process's for a prepared encoder-only model's pass over `ids` (B, L) where that was
    measured faster (`aiayn.inference.threads`: a request of one short sentence is a few dozen rows), else None."""
    return threads.fewer(prepared, "encoding", ids.numel(), threads.ENCODING_ROWS, _timed_encoding)


def _timed_encoding(model: nn.Module, tokens: int, process: int) -> dict[str, list[float]]:
    """`threads.timed` of an encoder-only model's encoder over random sentences of `tokens` tokens in all
    (`threads.random_sentences`)."""
    ids = threads.random_sentences(model, tokens)
    return threads.timed(lambda n: model.encode(ids), process)
