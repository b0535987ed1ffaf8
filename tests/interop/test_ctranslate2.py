"""CTranslate2 export: the converted model decodes the same tokens as aiayn, greedily, on a trained run."""

import pytest
import torch

from aiayn.config import ModelConfig
from aiayn.inference.generation import GenerationConfig, generate
from aiayn.io import load_model, load_tokenizers
from aiayn.nn.model import build_model
from aiayn.tokenization import train_tokenizer
from tests.conftest import SAMPLE_LINES

ctranslate2 = pytest.importorskip("ctranslate2")
pytest.importorskip("transformers")
from aiayn.interop.ctranslate2 import to_ctranslate2, translate_tokens  # noqa: E402


def aiayn_greedy(model, source, target, lines, max_new_tokens):
    """aiayn's greedy output ids per line, one sentence at a time (an empty line gives nothing)."""
    out = []
    for line in lines:
        ids = source.encode(line, add_eos=True) if line.strip() else []
        if not ids:
            out.append([])
            continue
        result = generate(model, torch.tensor([ids]), bos_id=target.bos_id, eos_id=target.eos_id,
                          config=GenerationConfig(max_new_tokens=max_new_tokens))
        out.append(result.tokens[0])
    return out


def test_greedy_output_equals_aiayn_on_a_trained_run(translation_run, tmp_path):
    model = load_model(translation_run)
    assert model.config.pe_layout == "interleaved"  # what aiayn train uses: the export permutes it to split
    source, target = load_tokenizers(translation_run)
    out = to_ctranslate2(model, source, tmp_path / "ct2")
    assert (out / "model.bin").is_file() and (out / "tokenizer.json").is_file()
    translator = ctranslate2.Translator(str(out), device="cpu")
    ours = aiayn_greedy(model, source, target, SAMPLE_LINES, max_new_tokens=20)
    theirs = translate_tokens(translator, source, SAMPLE_LINES, max_new_tokens=20)
    assert theirs == ours
    lengths = {len(t) for t in ours if t}
    assert min(lengths) < 20 and max(lengths) == 20  # some end with </s>, some run to the limit


def test_separate_vocabularies_and_int8(tmp_path):
    lines = ["the cat sat on the mat", "a dog ran in the park"] * 4
    source = train_tokenizer(lines, vocab_size=40)
    target = train_tokenizer([line.upper() for line in lines], vocab_size=50, kind="char")
    cfg = ModelConfig(vocab_size=source.vocab_size, tgt_vocab_size=target.vocab_size, share_embeddings=False,
                      d_model=16, n_heads=2, d_ff=32, n_encoder_layers=1, n_decoder_layers=1, dropout=0.0, max_len=32)
    model = build_model(cfg).eval()
    out = to_ctranslate2(model, source, tmp_path / "ct2", target_tokenizer=target)
    translator = ctranslate2.Translator(str(out), device="cpu")
    ours = aiayn_greedy(model, source, target, lines[:2], max_new_tokens=8)
    assert translate_tokens(translator, source, lines[:2], target_tokenizer=target, max_new_tokens=8) == ours
    assert translate_tokens(translator, source, lines[:2], target_tokenizer=target, max_len=8) == ours  # old spelling
    assert (out / "target" / "tokenizer.json").is_file()
    quantized = ctranslate2.Translator(str(to_ctranslate2(model, source, tmp_path / "int8", target_tokenizer=target,
                                                         quantization="int8")), device="cpu")
    ids = translate_tokens(quantized, source, lines[:2], target_tokenizer=target, max_new_tokens=8)
    assert len(ids) == 2 and all(0 <= i < target.vocab_size for row in ids for i in row)


def test_bad_quantization_is_refused_before_writing(tmp_path):
    model = build_model(ModelConfig(vocab_size=300, d_model=16, n_heads=2, d_ff=32, n_encoder_layers=1,
                                    n_decoder_layers=1))
    tokenizer = train_tokenizer(["a b c"], vocab_size=40)
    with pytest.raises(ValueError, match="quantization must be one of"):
        to_ctranslate2(model, tokenizer, tmp_path / "x", quantization="int3")
    assert not (tmp_path / "x").exists()


def test_pre_ln_greedy_output_equals_aiayn(tmp_path):
    """A pre-LN model goes through Pegasus to CTranslate2's pre-norm spec, final LayerNorms included."""
    from tests.interop.test_pegasus import pre_ln

    lines = ["the cat sat on the mat", "a dog ran in the park", "the park is green", "a mat"] * 3
    tokenizer = train_tokenizer(lines, vocab_size=40)
    model = pre_ln(0, vocab=tokenizer.vocab_size)
    translator = ctranslate2.Translator(str(to_ctranslate2(model, tokenizer, tmp_path / "ct2")), device="cpu")
    ours = aiayn_greedy(model, tokenizer, tokenizer, lines[:4], max_new_tokens=12)
    assert translate_tokens(translator, tokenizer, lines[:4], max_new_tokens=12) == ours
    assert len({tuple(t) for t in ours}) > 1
