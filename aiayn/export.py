"""`aiayn export`: what aiayn trained (or loaded) in the ecosystem's formats, each export checked against aiayn.

| the source | format | written by |
| --- | --- | --- |
| a post-LN translator (encoder-decoder) | Hugging Face Marian model + tokenizer | `interop.marian.export_marian` |
| a pre-LN translator (`norm_first`) | Hugging Face Pegasus model + tokenizer | `interop.pegasus.export_pegasus` |
| a translator, `ctranslate2` | CTranslate2 model (+ tokenizer files) | `interop.ctranslate2.to_ctranslate2` |
| an encoder of BERT's layout | sentence-transformers / BERT model + tokenizer | `interop.sentence_transformers` |
| any encoder, `onnx` | `model.onnx` + tokenizer | `interop.onnx.export_onnx` |
| a pre-LN decoder-only language model | Hugging Face GPT-2 model + tokenizer | `interop.gpt2.export_gpt2` |
| a post-LN one (the paper's decoder alone) | Hugging Face `MarianForCausalLM` + tokenizer | `interop.marian_lm` |

The model's objective names its exporter (`Task.exporter`: `export_translator`, `export_generator` or
`export_encoder` here). Every export then runs a fixed set of texts through the exported model (loaded
back from disk with its own library) and through aiayn with the same settings, and reports the
agreement: tokens for translators (greedy and beam search), cosine similarity for encoders. Converted
models that decode differently without a word are what users of converters meet most; here they are told.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from aiayn.inference.embeddings import Embedder
from aiayn.inference.generation import GenerationConfig
from aiayn.inference.generator import Generator
from aiayn.inference.loading import loaded_class, objective_of
from aiayn.inference.translator import Translator
from aiayn.rundir import TARGET_TOKENIZER, check_export_dir, claim_for_export
from aiayn.tasks import resolved

logger = logging.getLogger(__name__)

FORMATS = ("hf", "onnx", "ctranslate2")
# The fixed inputs every export is checked on: prose, numbers, accents, other scripts, a literal special token.
CHECK_TEXTS = ("The cat sat on the mat.", "Attention is all you need.", "a b c d e", "twenty-one",
               "three hundred and five", "naïve café, déjà vu", "Zürich 2017: 12.5% mehr!",
               "literal <s> and </s> here", "日本語のテキスト", "one two three four five six seven eight nine ten")
CHECK_MAX_NEW_TOKENS = 48
# Teacher-forced logits of a float32 export and of aiayn differ by rounding alone: the same products summed in
# another order (attention scaled before or after Q K^T, fused or separate projections), a few float32 ulps at
# each sum, carried through the layers to the logits.
CHECK_LOGITS_ATOL = 1e-4


@dataclass
class Agreement:
    """How many of the check inputs the export and aiayn agree on, and how close they are."""

    what: str
    agreed: int
    total: int
    detail: str = ""
    required: bool = True  # False where a difference is expected (quantized weights) or nothing was compared

    @property
    def complete(self) -> bool:
        """True when every input agreed."""
        return self.agreed == self.total

    @property
    def failed(self) -> bool:
        """True when the export computes something else than aiayn on an input where it must not."""
        return self.required and not self.complete

    def __str__(self) -> str:
        return f"{self.what}: {self.agreed}/{self.total} agree" + (f" ({self.detail})" if self.detail else "")


@dataclass
class ExportResult:
    """Where the export went, in which format, and its agreement with aiayn."""

    path: Path
    format: str
    checks: list[Agreement]


@contextlib.contextmanager
def _transformers_quiet():
    """transformers' own progress bars and notes off while exporting and checking (restored afterwards)."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        yield
        return
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def export(source: str | Path | None, out: str | Path, *, fmt: str = "hf", quantization: str | None = None,
           force: bool = False, check: bool = True) -> ExportResult:
    """Export the model of `source` (a run, model directory, BERT checkpoint, or None / "minilm") into `out`.

    Args:
        fmt: "hf" (Marian for post-LN translators, Pegasus for pre-LN ones, sentence-transformers / BERT
            for encoders), "onnx" (encoders) or "ctranslate2" (translators).
        quantization: CTranslate2's weight type ("int8", "float16", ...); None keeps float32.
        force: write into a directory of files aiayn did not write (refused otherwise); a run, model or
            checkpoint directory, or a folder inside one or inside an export, is refused even so.
        check: run the fixed check texts through both models and report the agreement.
    """
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if quantization is not None and fmt != "ctranslate2":
        raise ValueError("quantization applies to the CTranslate2 export only")
    from aiayn.interop.ctranslate2 import QUANTIZATIONS

    if quantization is not None and quantization not in QUANTIZATIONS:  # before the directory is claimed
        raise ValueError(f"--quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    check_export_dir(out, force=force)  # before the model loads: refuse at once
    source = "minilm" if source is None else source
    exporter = resolved(objective_of(source).exporter)  # the one the model's objective names
    with _transformers_quiet():
        return exporter(source, out, fmt=fmt, quantization=quantization, force=force, check=check)


def _encoder_of(source: str | Path) -> Embedder:
    """An Embedder over the encoder of any encoder-only source (a task head is not exported)."""
    if loaded_class(source) is Embedder:
        return Embedder.from_pretrained(source, device="cpu")
    from aiayn.io import load_model, load_tokenizers

    model = load_model(source)
    logger.warning("the %s head is not exported: the export is the encoder (sentence vectors, hidden states)",
                   model.config.head)
    return Embedder(model, load_tokenizers(source)[0], pooling=model.config.pooling, device="cpu")


# -- translators -----------------------------------------------------------------------------------

def export_translator(source: str | Path, out: str | Path, *, fmt: str, quantization: str | None, force: bool,
                      check: bool) -> ExportResult:
    """A translator's export: Hugging Face Marian (post-LN) or Pegasus (pre-LN), or CTranslate2."""
    from aiayn.interop.translators import check_mappable, hf_family

    translator = Translator.from_pretrained(source, device="cpu")
    if fmt == "onnx":
        raise ValueError("the ONNX export takes encoders; a translator exports to Hugging Face Marian or Pegasus "
                         "(the default) or to CTranslate2 (--ctranslate2)")
    check_mappable(translator.model.config)  # refused before anything is written
    family = hf_family(translator.model.config)
    out = claim_for_export(out, force=force, fmt=family if fmt == "hf" else fmt)
    source, target = translator.source_tokenizer, translator.target_tokenizer
    if fmt == "hf":
        from aiayn.interop.translators import export_hf

        export_hf(translator.model, source, target, out)
        checks = check_hf_translator(translator, out) if check else []
    else:
        from aiayn.interop.ctranslate2 import to_ctranslate2

        to_ctranslate2(translator.model, source, out, target_tokenizer=target, quantization=quantization)
        checks = check_ctranslate2(translator, out, quantized=quantization is not None) if check else []
    return ExportResult(out, fmt if fmt != "hf" else family, checks)


def _check_limit(translator: Translator) -> int:
    return min(CHECK_MAX_NEW_TOKENS, translator.model.config.max_len - 1)


def _aiayn_tokens(translator: Translator, texts: list[str], num_beams: int) -> list[list[int]]:
    config = GenerationConfig(num_beams=num_beams, max_new_tokens=_check_limit(translator), length_penalty=0.6)
    return [t.tokens for t in translator.translations(texts, config)]


def check_hf_translator(translator: Translator, directory: str | Path) -> list[Agreement]:
    """Load the Marian or Pegasus export back with `transformers` and compare its tokenizer and `generate()`
    with aiayn's."""
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    directory = Path(directory)
    hf_model = AutoModelForSeq2SeqLM.from_pretrained(directory).eval()
    hf_source = AutoTokenizer.from_pretrained(directory)
    target_dir = directory / TARGET_TOKENIZER
    hf_target = AutoTokenizer.from_pretrained(target_dir) if target_dir.is_dir() else hf_source
    source, target = translator.source_tokenizer, translator.target_tokenizer
    texts = list(CHECK_TEXTS)
    same_ids = sum(hf_source(text).input_ids == source.encode(text, add_eos=True) for text in texts)
    round_trips = sum(hf_target.decode(target.encode(text), skip_special_tokens=True) == target.decode(
        target.encode(text)) for text in texts)
    checks = [Agreement("tokenizer ids (AutoTokenizer vs aiayn)", same_ids, len(texts)),
              Agreement("tokenizer decoding", round_trips, len(texts))]
    batch = hf_source(texts, padding=True, return_tensors="pt")
    for beam in (1, 4):
        with torch.no_grad():
            out = hf_model.generate(**batch, num_beams=beam, max_new_tokens=_check_limit(translator),
                                    length_penalty=0.6, early_stopping=False, do_sample=False)
        theirs = [_until(row[1:].tolist(), target.eos_id) for row in out]
        ours = _aiayn_tokens(translator, texts, beam)
        search = "greedy" if beam == 1 else f"beam {beam}"
        checks.append(Agreement(f"{type(hf_model).__name__}.generate(), {search}, tokens",
                                sum(a == b for a, b in zip(ours, theirs)), len(texts)))
        if beam == 1:
            checks.append(_logits_agreement(translator, hf_model, batch, ours))
    return checks


def _logits_agreement(translator: Translator, hf_model, batch, outputs: list[list[int]]) -> Agreement:
    """The export's and aiayn's logits, teacher-forced on aiayn's `outputs` (one row per text), within
    `CHECK_LOGITS_ATOL` at every real position."""
    from aiayn.data.collate import pad

    rows = [[translator.target_tokenizer.bos_id, *tokens] for tokens in outputs]
    tgt = pad(rows, translator.model.config.pad_id)  # (B, T)
    with torch.no_grad():
        theirs = hf_model(**batch, decoder_input_ids=tgt).logits  # (B, T, V)
        ours = translator.model(batch["input_ids"], tgt)  # (B, T, V)
    errors = [float((theirs[i, : len(row)] - ours[i, : len(row)]).abs().max()) for i, row in enumerate(rows)]
    return Agreement(f"{type(hf_model).__name__} logits on aiayn's greedy outputs, within {CHECK_LOGITS_ATOL:g}",
                     sum(e <= CHECK_LOGITS_ATOL for e in errors), len(rows), f"largest difference {max(errors):.1e}")


def check_ctranslate2(translator: Translator, directory: str | Path, *, quantized: bool = False) -> list[Agreement]:
    """Load the CTranslate2 export back and compare its greedy outputs with aiayn's."""
    import ctranslate2

    from aiayn.interop.ctranslate2 import translate_tokens

    texts = list(CHECK_TEXTS)
    model = ctranslate2.Translator(str(directory), device="cpu")
    theirs = translate_tokens(model, translator.source_tokenizer, texts, target_tokenizer=translator.target_tokenizer,
                              num_beams=1, max_new_tokens=_check_limit(translator))
    ours = _aiayn_tokens(translator, texts, 1)
    note = "quantized weights: some difference is expected" if quantized else ""
    return [Agreement("ctranslate2.Translator, greedy, tokens", sum(a == b for a, b in zip(ours, theirs)),
                      len(texts), note, required=not quantized)]


def _until(row: list[int], eos: int) -> list[int]:
    return row[: row.index(eos)] if eos in row else row


# -- decoder-only language models ---------------------------------------------------------------------

def export_generator(source: str | Path, out: str | Path, *, fmt: str, quantization: str | None, force: bool,
                     check: bool) -> ExportResult:
    """A decoder-only language model's export (`quantization` is CTranslate2's: always None): Hugging Face GPT-2
    where it holds the model (pre-LN: what the defaults train), else `MarianForCausalLM` (the paper's post-LN
    decoder with sinusoids and a scaled embedding: `recipe=paper`)."""
    from aiayn.interop.gpt2 import export_gpt2, gpt2_problems
    from aiayn.interop.marian_lm import export_marian_lm, marian_lm_problems

    if fmt != "hf":
        raise ValueError(f"a decoder-only language model exports to Hugging Face (the default), not {fmt}")
    generator = Generator.from_pretrained(source, device="cpu")
    cfg = generator.model.config
    gpt2, marian = gpt2_problems(cfg), marian_lm_problems(cfg)
    if gpt2 and marian:  # refused before anything is written
        raise ValueError(f"model cannot be mapped to GPT-2 ({'; '.join(gpt2)}) nor to MarianForCausalLM "
                         f"({'; '.join(marian)})")
    name, write = ("gpt2", export_gpt2) if not gpt2 else ("marian-causal-lm", export_marian_lm)
    out = claim_for_export(out, force=force, fmt=name)
    write(generator.model, generator.tokenizer, out)
    return ExportResult(out, name, check_causal_lm(generator, out) if check else [])


@torch.no_grad()
def check_causal_lm(generator: Generator, directory: str | Path) -> list[Agreement]:
    """Load a language model's export back with `transformers` (`AutoModelForCausalLM`: GPT-2 or Marian); compare
    its tokenizer, logits and greedy `generate()` with aiayn's on the check texts, each a prompt (`<s>` + its tokens,
    as `Generator` prompts)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from aiayn.interop.gpt2 import logits_tolerance

    hf_model = AutoModelForCausalLM.from_pretrained(directory).eval()
    hf_name = type(hf_model).__name__
    hf_tokenizer = AutoTokenizer.from_pretrained(directory)
    model, cfg = generator.model, generator.model.config
    encoded = {text: generator.tokenizer.encode(text, add_bos=True) for text in CHECK_TEXTS}
    texts = [text for text, row in encoded.items() if len(row) < cfg.max_len]  # a prompt leaves room for a token
    rows = [encoded[text] for text in texts]
    same_ids = sum(hf_tokenizer(text).input_ids == row for text, row in zip(texts, rows))
    steps = min(CHECK_MAX_NEW_TOKENS, cfg.max_len - max(len(row) for row in rows))
    ours = [c.tokens for c in generator.generate(texts, max_new_tokens=steps, do_sample=False, num_beams=1)]
    close, same_tokens, worst = 0, 0, 0.0
    for row, tokens in zip(rows, ours):
        prompt = torch.tensor([row])  # (1, P)
        logits = model(prompt)  # (1, P, V)
        difference = float((hf_model(input_ids=prompt).logits - logits).abs().max())
        close, worst = close + (difference <= logits_tolerance(cfg, logits)), max(worst, difference)
        out = hf_model.generate(prompt, attention_mask=torch.ones_like(prompt), max_length=len(row) + steps,
                                do_sample=False, num_beams=1)
        same_tokens += _until(out[0, len(row):].tolist(), generator.tokenizer.eos_id) == tokens
    return [Agreement("tokenizer ids (AutoTokenizer vs aiayn, <s> first)", same_ids, len(texts)),
            Agreement(f"{hf_name} logits", close, len(texts), f"max |difference| {worst:.1e}"),
            Agreement(f"{hf_name}.generate(), greedy, tokens", same_tokens, len(texts))]


# -- encoders --------------------------------------------------------------------------------------

def _encoder_check_texts(embedder: Embedder) -> list[str]:
    """The check texts plus one longer than the embedder's length limit (truncation is part of what must agree)."""
    long = " ".join(CHECK_TEXTS) * max(1, min(embedder.max_length, embedder.model.config.max_len) // 40 + 1)
    return [*CHECK_TEXTS, long]


def export_encoder(source: str | Path, out: str | Path, *, fmt: str, quantization: str | None, force: bool,
                   check: bool) -> ExportResult:
    """An encoder's export (a task head is left out): sentence-transformers / BERT, or ONNX (`quantization` is
    CTranslate2's: always None)."""
    from aiayn.interop.bert import bert_problems

    if fmt == "ctranslate2":
        raise ValueError("the CTranslate2 export takes translators (encoder-decoders); export an encoder to "
                         "Hugging Face format (the default) or --onnx")
    embedder = _encoder_of(source)
    cfg = embedder.model.config
    if fmt == "hf" and bert_problems(cfg):  # refused before anything is written
        raise ValueError(f"cannot export to BERT format: {'; '.join(bert_problems(cfg))} (--onnx exports any encoder)")
    out = claim_for_export(out, force=force, fmt=fmt)
    max_length = min(embedder.max_length, cfg.max_len)
    if fmt == "hf":
        from aiayn.interop.sentence_transformers import export_sentence_transformer

        export_sentence_transformer(embedder.model, embedder.tokenizer, out, pooling=embedder.pooling,
                                    normalize=embedder.normalize, max_length=max_length)
        checks = check_sentence_transformer(embedder, out) if check else []
        return ExportResult(out, "sentence-transformers", checks)
    from aiayn.interop.bert import encoder_input_names
    from aiayn.interop.hf_tokenizer import save_hf_tokenizer
    from aiayn.interop.onnx import export_onnx

    export_onnx(embedder.model, out / "model.onnx")
    save_hf_tokenizer(embedder.tokenizer, out, template="encoder", max_len=max_length,
                      model_input_names=encoder_input_names(cfg))
    return ExportResult(out, "onnx", check_onnx(embedder, out) if check else [])


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.maximum(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-12)


def _cosine_agreement(what: str, theirs: np.ndarray, ours: np.ndarray, threshold: float = 0.99999) -> Agreement:
    cos = _cosines(theirs, ours)
    return Agreement(what, int((cos >= threshold).sum()), len(cos), f"min cosine {cos.min():.7f}")


def check_sentence_transformer(embedder: Embedder, directory: str | Path) -> list[Agreement]:
    """`SentenceTransformer(directory).encode` against `Embedder.embed` (when sentence-transformers is installed)."""
    texts = _encoder_check_texts(embedder)
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:
        return [Agreement("SentenceTransformer.encode: not checked (pip install sentence-transformers)", 0,
                          len(texts), required=False)]
    model = SentenceTransformer(str(directory), device="cpu")
    return [_cosine_agreement("SentenceTransformer.encode, cosine >= 0.99999", model.encode(texts),
                              embedder.embed(texts))]


def check_onnx(embedder: Embedder, directory: str | Path) -> list[Agreement]:
    """ONNX Runtime fed exactly what the exported tokenizer returns, pooled as aiayn pools, against `Embedder.embed`."""
    texts = _encoder_check_texts(embedder)
    try:
        import onnxruntime
        from transformers import AutoTokenizer
    except ImportError:
        return [Agreement("ONNX Runtime: not checked (pip install onnxruntime transformers)", 0, len(texts),
                          required=False)]
    from aiayn.nn.heads import pool

    directory = Path(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    batch = dict(tokenizer(texts, padding=True, truncation=True, return_tensors="np"))
    session = onnxruntime.InferenceSession(str(directory / "model.onnx"), providers=["CPUExecutionProvider"])
    (hidden,) = session.run(None, batch)  # (B, L, d_model)
    mask = torch.from_numpy(batch["attention_mask"]).bool()
    vectors = pool(torch.from_numpy(hidden), mask, embedder.pooling)
    if embedder.normalize:
        vectors = torch.nn.functional.normalize(vectors, dim=1)
    inputs = ", ".join(batch)
    return [_cosine_agreement(f"ONNX Runtime on the tokenizer's own outputs ({inputs}), cosine >= 0.99999",
                              vectors.numpy(), embedder.embed(texts))]
