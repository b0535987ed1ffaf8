"""`Generator`: a prompt in, its continuation out, with a trained decoder-only language model (`aiayn generate`).

Each prompt is `<s>` + its tokens, as the training lines began; the prompts are sorted by length and continued
in batches of one length (the search takes no padding) of at most `max_tokens` prompt tokens, as `Translator` cuts
its sources (`aiayn.inference.generation.continue_prompts`: greedy, sampling or beam search on the key/value cache),
and the new tokens come back, in the order given, as text that continues the prompt exactly (the tokenizer is
lossless). Keywords follow Hugging Face `generate()`: `max_new_tokens`, `do_sample`, `temperature`, `top_k`,
`top_p`, `num_beams`, `repetition_penalty`, `no_repeat_ngram_size` (`beam_size`, the old spelling of `num_beams`,
is still accepted).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from aiayn.data.batching import token_batches
from aiayn.inference.buffers import reusing_buffers
from aiayn.inference.generation import GenerationConfig, continue_prompts, new_token_limit, prompt_limits
from aiayn.inference.runner import ModelRunner, check_batch_limits, check_vocabulary, text_list
from aiayn.inference.running import Batch
from aiayn.inference.translator import search_settings
from aiayn.tokenization import Tokenizer

# Hugging Face's defaults for a language model: greedy, up to 50 new tokens (`extra_len`, the paper's + 50).
DEFAULT_SEARCH = GenerationConfig()


def stop_strings(stop: str | Sequence[str] | None) -> list[str]:
    """`generate`'s `stop` as a list of strings; ValueError for an empty one or another type."""
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops):
        raise ValueError(f"stop must be a non-empty string or a list of them, got {stop!r}")
    return list(stops)


def first_stop(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """(where, which) of the first of `stops` to occur in `text` (the earlier-listed one where two start there), or
    None: where a continuation ends, here and in the server's answers and streams."""
    found = [(text.find(stop), stop) for stop in stops if stop in text]
    return min(found, key=lambda place: place[0]) if found else None


@dataclass
class Completion:
    """One continuation: its text (what follows the prompt), its ids (no `</s>`), its score (sum of log p of the
    ids the search made), whether the model ended it with `</s>` (False: it reached max_new_tokens or the model's
    max_len positions), and the stop string that cut it (`generate(stop=...)`: the text ends before it, the ids are
    the fewest that hold the text kept; None: none)."""

    text: str
    tokens: list[int]
    score: float
    ended: bool = False
    stop: str | None = None


class Generator(ModelRunner):
    """Continue text with a decoder-only language model.

    Args:
        model: a `DecoderOnlyModel` (`ModelConfig.causal`).
        tokenizer: its tokenizer.
        device, precision, plain: where and how the model runs (`ModelRunner`).
    """

    def __init__(self, model: nn.Module, tokenizer: Tokenizer, *, device: str | torch.device | None = None,
                 precision: str | None = "fp32", plain: bool = False):
        if not getattr(model.config, "causal", False):
            raise ValueError("a Generator needs a decoder-only language model (causal=true); aiayn.load picks "
                             "the right object for any directory")
        check_vocabulary(tokenizer, model.config.vocab_size, "vocab_size", exact=True)
        super().__init__(model, device=device, precision=precision, plain=plain)
        self.tokenizer = tokenizer

    @classmethod
    def from_pretrained(cls, directory: str | Path, *, device: str | torch.device | None = None,
                        precision: str | None = "fp32") -> Generator:
        """The generator of a run or model directory (config.json, model.safetensors, tokenizer)."""
        from aiayn.io import load_model, load_tokenizers

        model = load_model(directory)
        if not model.config.causal:
            what = "a translation model (encoder-decoder): use aiayn translate" if model.config.has_cross_attention \
                else "an encoder-only model: use aiayn embed or aiayn predict"
            raise ValueError(f"{directory} holds {what}; generate needs a decoder-only language model "
                             "(objective=causal_lm)")
        return cls(model, load_tokenizers(directory)[0], device=device, precision=precision)

    @reusing_buffers()  # each batch's search writes its cache into the memory of the one before
    def generate(self, prompts: str | Sequence[str], config: GenerationConfig | None = None, *,
                 max_new_tokens: int | None = None, do_sample: bool | None = None, temperature: float | None = None,
                 top_k: int | None = None, top_p: float | None = None, num_beams: int | None = None,
                 beam_size: int | None = None, length_penalty: float | None = None,
                 repetition_penalty: float | None = None, no_repeat_ngram_size: int | None = None,
                 seed: int | None = None, stop: str | Sequence[str] | None = None, max_tokens: int = 4096,
                 max_sentences: int = 0) -> list[Completion]:
        """Continue each prompt (one string or a list); the completions come back in the prompts' order.

        `stop`: a string or strings a continuation ends before, as OpenAI's and Hugging Face's `stop` (the first
        that occurs cuts the text; `Completion.stop` names it).

        `max_tokens`: prompt tokens per batch (the prompts are sorted by length, and a batch holds prompts of one
        length: the search takes no padding); `max_sentences` caps the prompts per batch (0: no cap). The other
        keywords change one setting of `config` (see `GenerationConfig`).
        """
        check_batch_limits(max_tokens, max_sentences)
        texts, stops = text_list(prompts), stop_strings(stop)
        config = search_settings(config or DEFAULT_SEARCH, max_new_tokens=max_new_tokens, do_sample=do_sample,
                                 temperature=temperature, top_k=top_k, top_p=top_p, num_beams=num_beams,
                                 beam_size=beam_size, length_penalty=length_penalty,
                                 repetition_penalty=repetition_penalty, no_repeat_ngram_size=no_repeat_ngram_size,
                                 seed=seed)
        rows = self.encode(texts)
        model = self.prepared_model()
        out: list[Completion | None] = [None] * len(texts)
        for batch in self.search_batches(rows, config, max_tokens=max_tokens, max_sentences=max_sentences):
            result = continue_prompts(model, batch.ids, eos_id=self.tokenizer.eos_id, config=config)
            for i, tokens, score in zip(batch.indices, result.tokens, result.scores.tolist()):
                out[i] = self.cut_at_stop(rows[i], self.completion(rows[i], tokens, score, config), stops)
        return out  # type: ignore[return-value]

    def search_batches(self, rows: list[list[int]], config: GenerationConfig, *, max_tokens: int = 4096,
                       max_sentences: int = 0) -> list[Batch]:
        """The batches `generate` continues the prompts' ids `rows` (`encode`) in, as a running batch takes them
        (`aiayn.inference.running`): prompts of one length each, their limits checked (ValueError)."""
        check_batch_limits(max_tokens, max_sentences)
        by_length: dict[int, list[int]] = {}
        for i, row in enumerate(rows):
            by_length.setdefault(len(row), []).append(i)
        out = []
        for length in sorted(by_length):
            same = by_length[length]
            for batch in token_batches([length] * len(same), max_tokens, shuffle=False, max_sentences=max_sentences):
                indices = [same[j] for j in batch]
                ids = torch.tensor([rows[i] for i in indices], device=self.device)  # (B, P): one length, no padding
                out.append(Batch(indices, ids, ids, prompt_limits(self.model, ids, self.tokenizer.eos_id, config)))
        return out

    def completion(self, prompt: list[int], tokens: list[int], score: float, config: GenerationConfig) -> Completion:
        """The `Completion` of the new ids `tokens` after `prompt`'s (ended: stopped by `</s>`, not by its limit)."""
        limit = new_token_limit(config, self.model.config.max_len, len(prompt))
        return Completion(self._continuation(prompt, tokens), tokens, score, len(tokens) < limit)

    def cut_at_stop(self, prompt: list[int], completion: Completion, stops: list[str]) -> Completion:
        """`completion` ending before the first of `stops` in its text, its ids the fewest that hold the text kept."""
        found = first_stop(completion.text, stops)
        if found is None:
            return completion
        cut, stop = found
        low, high = 0, len(completion.tokens)  # the fewest ids whose text holds the kept text (it grows with them)
        while low < high:
            middle = (low + high) // 2
            if len(self._continuation(prompt, completion.tokens[:middle])) >= cut:
                high = middle
            else:
                low = middle + 1
        return dataclasses.replace(completion, text=completion.text[:cut], tokens=completion.tokens[:low], stop=stop)

    def encode(self, prompts: str | Sequence[str]) -> list[list[int]]:
        """Each prompt's ids, `<s>` first, as generation reads them; ValueError names a prompt (counted from 1)
        that leaves the model no position to continue it, before any work."""
        rows = self.tokenizer.encode_batch(text_list(prompts), add_bos=True)
        max_len = self.model.config.max_len
        for number, row in enumerate(rows, start=1):
            if len(row) >= max_len:
                raise ValueError(f"prompt {number} has {len(row)} tokens with <s>, and the model reads at most "
                                 f"{max_len} positions with its continuation: shorten it")
        return rows

    def _continuation(self, prompt: list[int], new: list[int]) -> str:
        """The text the new ids add to the prompt's (decoded together, so a word split across them reads whole)."""
        before = self.tokenizer.decode(prompt)
        after = self.tokenizer.decode(prompt + new)
        return after[len(before):] if after.startswith(before) else self.tokenizer.decode(new)
