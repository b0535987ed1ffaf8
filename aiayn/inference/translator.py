"""`Translator`: text in, text out, with a trained encoder-decoder (what `aiayn translate` runs).

It tokenizes (each source ends with `</s>`, as in training), sorts the sentences by length and cuts
them into batches of at most `max_tokens` padded source tokens (little padding, and outputs come
back in the order given), generates on the key/value cache (`aiayn.inference.generation`) and
detokenizes. Decoding keywords follow Hugging Face `generate()` where it has a name for them:
`num_beams`, `max_new_tokens`, `min_new_tokens`, `length_penalty`, `repetition_penalty`,
`no_repeat_ngram_size`, `do_sample`, `temperature`, `top_k`, `top_p`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from aiayn.data.batching import token_batches
from aiayn.data.collate import pad
from aiayn.inference import threads
from aiayn.inference.buffers import reusing_buffers, searches_at_once
from aiayn.inference.generation import GenerationConfig, decoded_part, generate, new_tokens, search_bytes
from aiayn.inference.runner import ModelRunner, check_batch_limits, check_vocabulary, text_list, too_long
from aiayn.inference.running import Batch
from aiayn.nn.model import architecture_of
from aiayn.nn.sizes import available_memory
from aiayn.tokenization import Tokenizer

logger = logging.getLogger(__name__)

# The paper's search (section 6.1): beam 4, length penalty 0.6, at most source length + 50 tokens.
DEFAULT_SEARCH = GenerationConfig(num_beams=4, length_penalty=0.6)
# Other names for `GenerationConfig` fields: Hugging Face's `min_new_tokens`, and the old spellings `beam_size` (of
# `num_beams`) and `max_len` (of `max_new_tokens`).
_FIELD_NAMES = {"min_new_tokens": "min_len", "beam_size": "num_beams", "max_len": "max_new_tokens"}
# How far below float32's a model's bf16 test BLEU may be for it to decode in bf16 when its precision is left open
# (`measured_precision`).
BF16_BLEU_TOLERANCE = 0.3


def measured_precision(directory: Path, model: nn.Module,
                       device: str | torch.device | None = None) -> tuple[str | None, str]:
    """The precision a translation model decodes in where its caller leaves it open, and why.

    bf16 on a CPU that computes it natively, where both were measured: the model's run decoded its test split in
    bf16 too, to a BLEU at most `BF16_BLEU_TOLERANCE` below float32's (`eval.json`, written by the trainer:
    `aiayn.training.finish.bf16_test`), and a decoding step's products of the model's widths ran faster in bf16
    here at every row class (`calibrate.bf16_faster`, measured once and cached). Else None: the device's default
    (`aiayn.backends.select`: bf16 on a GPU that has it, float32 elsewhere).
    """
    from aiayn.backends import calibrate, inference_shape, resolve_device
    from aiayn.backends.backend import native_bf16_cpu
    from aiayn.rundir import EVAL, load_json

    where = resolve_device(device)
    if where.type != "cpu":
        return None, f"the default on {where.type}"
    if not native_bf16_cpu(where):
        return None, "this CPU computes bf16 only by emulation (or runs no oneDNN products)"
    try:
        record = load_json((directory / EVAL).read_text(encoding="utf-8"))
        bleu, bf16 = float(record["bleu"]), float(record["bf16"]["bleu"])
        if not (math.isfinite(bleu) and math.isfinite(bf16)):
            raise ValueError("a score that is not a number")
    except (OSError, ValueError, KeyError, TypeError):
        return None, f"no bf16 test score in {directory / EVAL} (the trainer writes one on a CPU with native bf16)"
    if bf16 < bleu - BF16_BLEU_TOLERANCE:
        return None, f"its test BLEU in bf16, {bf16:.2f}, is more than {BF16_BLEU_TOLERANCE} below float32's {bleu:.2f}"
    slower = [rows for rows, faster in calibrate.bf16_faster(*inference_shape(model)).items() if not faster]
    if slower:
        return None, f"its products ran no faster in bf16 on this CPU at {', '.join(slower)} rows"
    return "bf16", f"test BLEU {bf16:.2f} in bf16 against {bleu:.2f} in float32, and faster products here"


@dataclass
class Translation:
    """One output: its text, its ids (no `<s>` / `</s>`), its score and, on request, its cross-attention
    (n_layers, n_heads, output length, source length)."""

    text: str
    tokens: list[int]
    score: float
    attention: torch.Tensor | None = None


def search_settings(config: GenerationConfig | None = None, **changes: object) -> GenerationConfig:
    """`config` (default: the paper's beam 4) with `changes` (Hugging Face's names and old spellings too; None:
    unchanged)."""
    config = config or DEFAULT_SEARCH
    fields = {f.name for f in dataclasses.fields(GenerationConfig)}
    updates, spelled = {}, {}
    for name, value in changes.items():
        if value is None:
            continue
        field = _FIELD_NAMES.get(name, name)
        if field not in fields:
            raise TypeError(f"unknown decoding setting {name!r}")
        if field in updates and updates[field] != value:
            raise ValueError(f"{name}={value!r} contradicts another setting of {field} ({updates[field]!r})")
        updates[field], spelled[field] = value, name
    try:
        return dataclasses.replace(config, **updates)
    except ValueError as err:  # name the setting as the caller spelled it (min_new_tokens, not min_len)
        message = str(err)
        for field, name in spelled.items():
            message = re.sub(rf"\b{field}\b", name, message)
        raise ValueError(message) from None


class Translator(ModelRunner):
    """Translate text with an encoder-decoder model.

    Args:
        model: an `EncoderDecoderModel`.
        source_tokenizer: the tokenizer of the source side.
        target_tokenizer: the target side's (default: the same, one shared vocabulary).
        device, precision, plain: where and how the model runs (`ModelRunner`).
    """

    def __init__(self, model: nn.Module, source_tokenizer: Tokenizer, target_tokenizer: Tokenizer | None = None, *,
                 device: str | torch.device | None = None, precision: str | None = "fp32", plain: bool = False):
        if architecture_of(model) != "encoder-decoder":
            raise ValueError(f"a Translator needs an encoder-decoder model; this one is {architecture_of(model)}")
        cfg = model.config
        check_vocabulary(source_tokenizer, cfg.vocab_size, "vocab_size")
        check_vocabulary(target_tokenizer or source_tokenizer, cfg.target_vocab_size,
                         "tgt_vocab_size" if cfg.tgt_vocab_size is not None else "vocab_size", exact=True)
        super().__init__(model, device=device, precision=precision, plain=plain)
        self.source_tokenizer = source_tokenizer
        self.target_tokenizer = target_tokenizer or source_tokenizer

    @classmethod
    def from_pretrained(cls, directory: str | Path, *, device: str | torch.device | None = None,
                        precision: str | None = "fp32") -> Translator:
        """The translator of a run or model directory (config.json, model.safetensors, tokenizer(s)). `precision`
        None: the one measured best for this model here (`measured_precision`), as `aiayn translate` decodes."""
        from aiayn.io import load_model, load_tokenizers

        model = load_model(directory)
        if not model.config.has_cross_attention:
            hint = " (continue text with aiayn generate)" if model.config.causal else ""
            raise ValueError(f"{directory}'s model is {model.config.architecture}; translate "
                             f"needs an encoder-decoder{hint} (aiayn.load picks the right object for any directory)")
        if precision is None:
            precision, why = measured_precision(Path(directory), model, device)
            logger.info("%s decodes in %s: %s", directory, precision or "the device's default precision", why)
        return cls(model, *load_tokenizers(directory), device=device, precision=precision)

    @classmethod
    def to_serve(cls, path: str | Path, *, device: str | torch.device | None = None) -> Translator:
        """A server's translator decodes as `aiayn translate` does: in the precision measured best for it here."""
        return cls.from_pretrained(path, device=device, precision=None)

    def save_pretrained(self, directory: str | Path, *, force: bool = False) -> Path:
        """Write the model and tokenizer(s) as a model directory `from_pretrained` loads (a new or empty
        directory, or one aiayn saved before, unless `force`)."""
        from aiayn.io import save_model
        from aiayn.rundir import SOURCE_TOKENIZER, TARGET_TOKENIZER, claim_for_export

        directory = claim_for_export(directory, force=force, fmt="aiayn", option="directory",
                                     force_hint="pass force=True")
        if self.source_tokenizer is self.target_tokenizer:
            return save_model(self.model, directory, tokenizer=self.source_tokenizer)
        self.source_tokenizer.save(directory / SOURCE_TOKENIZER)  # first: the weights record their digest
        self.target_tokenizer.save(directory / TARGET_TOKENIZER)
        return save_model(self.model, directory)

    def translate(self, texts: str | Sequence[str], config: GenerationConfig | None = None, *,
                  num_beams: int | None = None, beam_size: int | None = None, max_new_tokens: int | None = None,
                  min_new_tokens: int | None = None, length_penalty: float | None = None,
                  length_ratio: float | None = None, extra_len: int | None = None,
                  repetition_penalty: float | None = None, no_repeat_ngram_size: int | None = None,
                  early_stopping: bool | None = None, do_sample: bool | None = None, temperature: float | None = None,
                  top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                  max_tokens: int = 4096, max_sentences: int = 0, truncate: bool = False,
                  progress: Callable[[int], None] | None = None) -> str | list[str]:
        """Translations of `texts` (one string gives one string); an empty text gives an empty translation.

        Args:
            texts: the sentences, or one sentence.
            config: the search; default beam 4, length penalty 0.6, at most source length + 50 tokens.
            num_beams, max_new_tokens, ...: change one setting of `config` (see `GenerationConfig`;
                `length_ratio` and `extra_len` bound the output by the source's length).
            beam_size: the old spelling of `num_beams`, still accepted.
            max_tokens: padded source tokens per batch (sentences are sorted by length first);
                max_sentences caps the sentences per batch (0: no cap).
            truncate: cut sources longer than the model's `max_len` instead of raising ValueError.
            progress: called with the number of sentences done after each batch (a progress bar).
        """
        settings = search_settings(config, num_beams=num_beams, beam_size=beam_size, max_new_tokens=max_new_tokens,
                                   min_new_tokens=min_new_tokens, length_penalty=length_penalty,
                                   length_ratio=length_ratio, extra_len=extra_len,
                                   repetition_penalty=repetition_penalty, no_repeat_ngram_size=no_repeat_ngram_size,
                                   early_stopping=early_stopping, do_sample=do_sample, temperature=temperature,
                                   top_k=top_k, top_p=top_p, seed=seed)
        single = isinstance(texts, str)
        settings = dataclasses.replace(settings, return_scores=False)  # texts only: no scores (`translations` has them)
        results = self.translations(text_list(texts), settings, max_tokens=max_tokens,
                                    max_sentences=max_sentences, truncate=truncate, progress=progress)
        return results[0].text if single else [r.text for r in results]

    def search_batches(self, texts: Sequence[str], config: GenerationConfig | None = None, *,
                       max_tokens: int = 4096, max_sentences: int = 0) -> list[Batch]:
        """The batches `translations` decodes `texts` in (an empty text in none: its translation is empty), as a
        running batch takes them (`aiayn.inference.running`): each one's texts, sources, `<s>` and limits, checked
        (ValueError names a text too long, or a search too large)."""
        config = config or DEFAULT_SEARCH
        check_batch_limits(max_tokens, max_sentences)
        ids = self.encode(text_list(texts))
        out = []
        for batch in token_batches([len(row) for row in ids], max_tokens, shuffle=False, max_sentences=max_sentences):
            real = [i for i in batch if ids[i]]
            if real:
                src = pad([ids[i] for i in real], self.model.config.pad_id).to(self.device)  # (B, S)
                sub, limits = decoded_part(self.model, src, torch.arange(len(real)), config)
                start = torch.full((len(real), 1), self.target_tokenizer.bos_id, device=self.device)
                out.append(Batch(real, sub, start, limits))
        return out

    def _fit_together(self, batches: list[list[int]], ids: list[list[int]], config: GenerationConfig,
                      workers: int) -> bool:
        """Whether the `workers` largest of these batches' searches fit in this machine's memory at once."""
        available = available_memory()
        if available is None:
            return True
        cfg = self.model.config
        needs = []
        for batch in batches:
            lengths = [len(ids[i]) for i in batch if ids[i]]
            if lengths:
                steps = int(new_tokens(config, torch.tensor([max(lengths)]), cfg.max_len)[0])
                needs.append(search_bytes(cfg, len(lengths), max(lengths), steps, config))
        return sum(sorted(needs)[-workers:]) <= available

    def encode(self, texts: Sequence[str], *, truncate: bool = False) -> list[list[int]]:
        """Source ids of each text, ending with `</s>`; an empty (or all-space) text gives no ids."""
        limit = self.model.config.max_len
        eos = self.source_tokenizer.eos_id
        rows = []
        for number, text in enumerate(text_list(texts), start=1):
            ids = self.source_tokenizer.encode(text, add_eos=True) if text.strip() else []
            if len(ids) > limit:
                if not truncate:
                    raise too_long(number, len(ids), limit)
                logger.warning("text %d truncated from %d to %d tokens", number, len(ids), limit)
                ids = ids[: limit - 1] + [eos]
            rows.append(ids)
        return rows

    @reusing_buffers()  # a file's batches write their caches into the memory of the batches before
    def translations(self, texts: Sequence[str], config: GenerationConfig | None = None, *, max_tokens: int = 4096,
                     max_sentences: int = 0, truncate: bool = False, progress: Callable[[int], None] | None = None,
                     on_result: Callable[[int, Translation], None] | None = None) -> list[Translation]:
        """`Translation`s (text, ids, score, attention) of `texts` in the order given; see `translate`.

        `on_result(i, translation)` hears of each text's translation as soon as it is known: a sentence leaves
        its batch when its search ends (with attention asked for, when its batch ends), so a server can answer
        it before the longer sentences decoded beside it."""
        config = config or DEFAULT_SEARCH
        check_batch_limits(max_tokens, max_sentences)
        ids = self.encode(text_list(texts), truncate=truncate)
        out: list[Translation] = [Translation("", [], 0.0) for _ in ids]
        prepared = self.prepared_model()
        target = self.target_tokenizer
        early = on_result is not None and not config.return_attention
        told = threading.Lock()  # the callbacks hear of one batch at a time when batches run side by side

        def run(batch: list[int]) -> None:
            real = [i for i in batch if ids[i]]
            if on_result is not None:  # an empty text's translation is known before its batch runs
                with told:
                    for i in batch:
                        if not ids[i]:
                            on_result(i, out[i])
            if real:
                src = pad([ids[i] for i in real], self.model.config.pad_id).to(self.device)  # (B, S)

                def finished(j: int, tokens: list[int], score: float, real=real) -> None:
                    out[real[j]] = Translation(target.decode_batch([tokens])[0], tokens, score)
                    with told:
                        on_result(real[j], out[real[j]])

                result = generate(prepared, src, bos_id=target.bos_id, eos_id=target.eos_id, config=config,
                                  on_finished=finished if early else None)
                if not early:
                    texts_out = target.decode_batch(result.tokens)
                    for j, i in enumerate(real):
                        attention = None if result.attention is None else result.attention[j]
                        out[i] = Translation(texts_out[j], result.tokens[j], float(result.scores[j]), attention)
                        if on_result is not None:
                            with told:
                                on_result(i, out[i])
            if progress is not None:
                with told:
                    progress(len(batch))

        batches = list(token_batches([len(row) for row in ids], max_tokens, shuffle=False, max_sentences=max_sentences))
        # On a CPU of more than one thread, batches side by side, each on one thread: faster than one at a time on all
        # (`threads.side_by_side_workers`); each batch's arithmetic is the same as on one thread alone (but where a bf16
        # layer's "aten" kernel runs its packed form beside the other thread: `cpu._without_onednn`). Not where a
        # batch records attention (its hooks on the shared modules would hear the other batch's calls) or samples
        # from torch's own generator (two batches would take its draws in either order).
        alone = config.return_attention or (config.do_sample and config.seed is None)
        rows = config.num_beams * len(ids) / max(len(batches), 1)  # a step's rows, on average
        workers = 1 if alone else threads.side_by_side_workers(self.device, len(batches),
                                                               rows * self.model.config.d_model**2, threads.SEARCH_WORK)
        if workers > 1 and not self._fit_together(batches, ids, config, workers):
            workers = 1  # each batch's search is checked alone when it starts (`generate`), as one at a time
        searches_at_once(workers)
        threads.side_by_side(run, batches, workers)
        return out
