"""aiayn encoder-decoders as CTranslate2 models (the optional `ctranslate2` extra: `pip install ctranslate2`).

The model goes through its Hugging Face form (`aiayn.interop.translators.to_hf`: Marian for post-LN,
Pegasus for pre-LN, the interleaved sinusoid layout moved to their split one) and CTranslate2's
loader of that layer family (BART's), `pre_norm` set from `norm_first` (a pre-LN spec also takes the
final LayerNorm of each stack), with aiayn's conventions where Marian's differ: the decoder starts
from the `<s>` embedding (Marian starts from a zero vector), and every id is kept (Marian's loader
drops the last one, Marian's pad; aiayn's `<pad>` is id 0).
The vocabularies are the tokenizers' pieces in id order, so CTranslate2 takes the pieces aiayn's
tokenizer makes (`source_tokens`) and returns pieces that map back to the same ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from aiayn.config import ModelConfig, fold_old_spelling
from aiayn.interop.hf_tokenizer import save_hf_tokenizer
from aiayn.interop.translators import to_hf
from aiayn.nn.model import EncoderDecoderModel
from aiayn.rundir import atomic_files
from aiayn.tokenization import Tokenizer

QUANTIZATIONS = ("int8", "int8_float32", "int8_float16", "int8_bfloat16", "int16", "float16", "bfloat16",
                 "float32")


def _require_ctranslate2():
    try:
        import ctranslate2
        from ctranslate2.converters import transformers as converters
    except ImportError:
        raise ModuleNotFoundError("the CTranslate2 export needs the ctranslate2 package: pip install ctranslate2 "
                                  "(or pip install 'aiayn[ctranslate2]')") from None
    return ctranslate2, converters


def vocabulary(tokenizer: Tokenizer, size: int) -> list[str]:
    """The tokenizer's pieces in id order, padded with `<extra_N>` up to the model's vocabulary `size`."""
    pieces = [tokenizer.id_to_token(i) for i in range(min(tokenizer.vocab_size, size))]
    return pieces + [f"<extra_{i}>" for i in range(len(pieces), size)]


def _converter(hf_model, cfg: ModelConfig, source: Tokenizer, target: Tokenizer):
    """A CTranslate2 `Converter` of an in-memory Marian or Pegasus model with aiayn's vocabularies and start token."""
    ctranslate2, converters = _require_ctranslate2()

    class AiaynLoader(converters.BartLoader):  # keeps every id; the decoder starts from <s>'s embedding
        def get_model_spec(self, model):
            model.config.normalize_before = cfg.norm_first
            model.config.normalize_embedding = False
            return converters.BartLoader.get_model_spec(self, model)

        def set_config(self, config, model, tokenizer):
            special = target.special
            config.bos_token, config.eos_token, config.unk_token = special["bos"], special["eos"], special["unk"]
            config.decoder_start_token = special["bos"]

        def get_vocabulary(self, model, tokenizer):
            return None

        def set_vocabulary(self, spec, tokens):
            spec.register_source_vocabulary(vocabulary(source, cfg.vocab_size))
            spec.register_target_vocabulary(vocabulary(target, cfg.target_vocab_size))

    class AiaynConverter(ctranslate2.converters.Converter):
        def _load(self):
            return AiaynLoader()(hf_model, None)

    return AiaynConverter()


def to_ctranslate2(model: EncoderDecoderModel, tokenizer: Tokenizer, out_dir: str | Path, *,
                   target_tokenizer: Tokenizer | None = None, quantization: str | None = None) -> Path:
    """Write `model` as a CTranslate2 model directory (plus the Hugging Face tokenizer files) and return it.

    Args:
        model: an aiayn encoder-decoder that maps to Marian (post-LN) or Pegasus (pre-LN, one vocabulary):
            sinusoidal positions, biases.
        tokenizer: the source tokenizer (and the target's, unless `target_tokenizer` is given).
        out_dir: where `model.bin`, `config.json` and the vocabularies go (created; files replaced).
        target_tokenizer: the target tokenizer of a model with separate vocabularies.
        quantization: CTranslate2's weight type ("int8", "float16", ...); None keeps float32.

    Load it with `ctranslate2.Translator(out_dir)`; `translate_tokens` feeds it aiayn's pieces.
    """
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    target = target_tokenizer or tokenizer
    hf_model = to_hf(model, decoder_start_token_id=target.bos_id, eos_token_id=target.eos_id)
    converter = _converter(hf_model, model.config, tokenizer, target)
    out_dir = Path(out_dir)
    with atomic_files(out_dir) as staging:
        converter.convert(str(staging), quantization=quantization, force=True)  # force: staging exists (empty)
        save_hf_tokenizer(tokenizer, staging, template="marian", max_len=model.config.max_len)
        if target is not tokenizer:
            save_hf_tokenizer(target, staging / "target", template="marian", max_len=model.config.max_len)
    return out_dir


def source_tokens(tokenizer: Tokenizer, text: str) -> list[str]:
    """The pieces CTranslate2 takes for `text`: aiayn's source encoding, `</s>` at the end."""
    return [tokenizer.id_to_token(i) for i in tokenizer.encode(text, add_eos=True)]


def translate_tokens(translator, tokenizer: Tokenizer, texts: Sequence[str], *,
                     target_tokenizer: Tokenizer | None = None, num_beams: int = 1, max_new_tokens: int | None = None,
                     length_penalty: float = 1.0, max_len: int | None = None) -> list[list[int]]:
    """Output ids (no `</s>`) of a `ctranslate2.Translator` for `texts`; an empty text gives an empty output.

    `max_new_tokens` (default 256) counts output tokens, `</s>` included, as
    `aiayn.inference.GenerationConfig.max_new_tokens`; `max_len` is its old spelling, still accepted.
    """
    limit = fold_old_spelling("max_new_tokens", max_new_tokens, "max_len", max_len)
    limit = 256 if limit is None else limit
    target = target_tokenizer or tokenizer
    rows = [i for i, text in enumerate(texts) if text.strip()]
    out: list[list[int]] = [[] for _ in texts]
    if not rows:
        return out
    results = translator.translate_batch([source_tokens(tokenizer, texts[i]) for i in rows], beam_size=num_beams,
                                         max_decoding_length=limit, length_penalty=length_penalty)
    for i, result in zip(rows, results):
        out[i] = [target.hf.token_to_id(piece) for piece in result.hypotheses[0]]
    return out
