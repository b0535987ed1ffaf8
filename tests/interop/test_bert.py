"""BERT checkpoints in and out: token ids, hidden states and heads equal Hugging Face's; honest key checks."""

import json
import os
import shutil

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

transformers = pytest.importorskip("transformers")

from aiayn.config import ModelConfig  # noqa: E402
from aiayn.inference.embeddings import encode_texts  # noqa: E402
from aiayn.interop.bert import (  # noqa: E402
    bert_problems,
    export_hf,
    load_bert_tokenizer,
    load_pretrained,
    package_model_dir,
    resolve_checkpoint,
)
from aiayn.nn.model import build_model  # noqa: E402

VARIED = [
    "Hello, world!",
    "Café naïve résumé — Zürich's Straße, déjà vu.",
    "Pneumonoultramicroscopicsilicovolcanoconiosis and antidisestablishmentarianism",
    "a" * 120 + " word longer than a hundred characters",
    "Punctuation?! (brackets) [square] {curly} \"quotes\" 'single' ... --- ;:@#$%^&*",
    "中文字符 and 日本語 mixed with English",
    "Emoji 🙂 and tabs\tand\nnewlines   and   spaces",
    "",
    "UPPER lower MiXeD 12345 3.14159 1,000,000",
    " ".join(f"token{i}" for i in range(400)),  # far past every limit
]


@pytest.fixture(scope="module")
def minilm():
    return load_pretrained()


@pytest.fixture(scope="module")
def hf_minilm():
    model = transformers.BertModel.from_pretrained(package_model_dir(), attn_implementation="sdpa").eval()
    return model, transformers.AutoTokenizer.from_pretrained(package_model_dir())


def _tiny_bert_config(**extra):
    return transformers.BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=37, max_position_embeddings=40, **extra)


@pytest.mark.parametrize("max_length", [8, 128, 256, 512])
def test_token_ids_equal_hf_tokenizer(minilm, hf_minilm, max_length):
    _, tokenizer = minilm
    ours = encode_texts(tokenizer, VARIED, max_length)
    theirs = hf_minilm[1](VARIED, truncation=True, max_length=max_length)["input_ids"]
    assert ours == theirs
    assert max(len(ids) for ids in ours) == max_length  # the long input really was truncated


def test_vocab_txt_only_tokenizer_gives_the_same_ids(minilm, tmp_path):
    for name in ("vocab.txt", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(package_model_dir() / name, tmp_path / name)
    from_vocab = load_bert_tokenizer(tmp_path)
    assert encode_texts(from_vocab, VARIED, 512) == encode_texts(minilm[1], VARIED, 512)


def test_every_hidden_state_equals_bert_model_in_a_padded_batch(minilm, hf_minilm, run_on):
    model = run_on(minilm[0])
    hf, hf_tok = hf_minilm
    batch = hf_tok(VARIED[:7], padding=True, truncation=True, max_length=64, return_tensors="pt")
    with torch.inference_mode():
        theirs = hf(**batch, output_hidden_states=True).hidden_states
        inputs = dict(attention_mask=batch["attention_mask"], token_type_ids=batch["token_type_ids"])
        ours = model.hidden_states(batch["input_ids"], **inputs)
        last = model.encode(batch["input_ids"], **inputs)
    assert len(ours) == len(theirs) == 7
    real = batch["attention_mask"].bool()
    for mine, ref in zip(ours, theirs):
        torch.testing.assert_close(mine[real], ref[real], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(last, theirs[-1], atol=1e-4, rtol=1e-4)


def test_pytorch_bin_checkpoint_and_masked_lm_head_equal_hf(tmp_path):
    torch.manual_seed(0)
    hf = transformers.BertForMaskedLM(_tiny_bert_config()).eval()
    torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")
    hf.config.to_json_file(tmp_path / "config.json")
    shutil.copy(package_model_dir() / "tokenizer.json", tmp_path / "tokenizer.json")
    with pytest.raises(ValueError, match="tokenizer has 30522 ids"):
        load_pretrained(tmp_path, head="masked_lm")  # tiny vocabulary, MiniLM's tokenizer: refused
    (tmp_path / "tokenizer.json").unlink()
    (tmp_path / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
                                                  + [f"w{i}" for i in range(94)]) + "\n")
    model, tokenizer = load_pretrained(tmp_path, head="masked_lm")
    assert tokenizer.bos_id == 2 and tokenizer.eos_id == 3
    ids = torch.randint(5, 99, (3, 11))
    with torch.inference_mode():
        torch.testing.assert_close(model(ids), hf(ids).logits, atol=1e-5, rtol=1e-5)


def test_shape_mismatches_are_listed(tmp_path):
    torch.manual_seed(0)
    hf = transformers.BertForTokenClassification(_tiny_bert_config(num_labels=5)).eval()
    hf.save_pretrained(tmp_path)
    shutil.copy(package_model_dir() / "vocab.txt", tmp_path / "vocab.txt")
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["vocab_size"] = 30522  # fit MiniLM's vocabulary: the embeddings no longer match
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"shape mismatches.*word_embeddings"):
        load_pretrained(tmp_path, head="token_classification", num_labels=5)


def test_token_classification_head_loads_classifier(tmp_path):
    torch.manual_seed(0)
    hf = transformers.BertForTokenClassification(_tiny_bert_config(num_labels=5)).eval()
    hf.save_pretrained(tmp_path)
    (tmp_path / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
                                                  + [f"w{i}" for i in range(94)]) + "\n")
    model, _ = load_pretrained(tmp_path, head="token_classification", num_labels=5)
    ids = torch.randint(5, 99, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    with torch.inference_mode():
        ours = model(ids, attention_mask=mask)
        theirs = hf(ids, attention_mask=mask).logits
    torch.testing.assert_close(ours[mask.bool()], theirs[mask.bool()], atol=1e-5, rtol=1e-5)


def test_new_classification_head_on_pretrained_encoder(minilm):
    clf, _ = load_pretrained(head="sequence_classification", num_labels=3, pooling="mean", dropout=0.2)
    assert clf.config.dropout == 0.2 and clf.head.classifier.out_features == 3
    torch.testing.assert_close(clf.encoder.layers[3].feed_forward.linear1.weight,
                               minilm[0].encoder.layers[3].feed_forward.linear1.weight)
    ids = torch.tensor([[101, 7592, 2088, 102], [101, 7592, 102, 0]])
    assert clf(ids).shape == (2, 3)


def test_mismatched_keys_are_listed(tmp_path):
    from safetensors.torch import load_file, save_file

    hf = transformers.BertModel(_tiny_bert_config())
    hf.save_pretrained(tmp_path)
    (tmp_path / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]) + "\n")
    state = load_file(tmp_path / "model.safetensors")
    state["encoder.layer.0.attention.self.rotary.weight"] = torch.zeros(3)
    del state["encoder.layer.1.output.dense.bias"]
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ValueError) as err:
        load_pretrained(tmp_path)
    assert "unexpected keys ['encoder.layer.0.attention.self.rotary.weight']" in str(err.value)
    assert "missing keys ['encoder.layers.1.feed_forward.linear2.bias']" in str(err.value)


def test_unsupported_checkpoints_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such checkpoint directory"):
        resolve_checkpoint(tmp_path / "nothing-here")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "roberta", "vocab_size": 10}))
    with pytest.raises(ValueError, match="model_type 'roberta' is not supported"):
        load_pretrained(tmp_path)


def test_hf_export_round_trip(minilm, tmp_path):
    model, tokenizer = minilm
    export_hf(model, tokenizer, tmp_path)
    loaded = transformers.AutoModel.from_pretrained(tmp_path).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert encode_texts(tokenizer, VARIED, 512) == hf_tok(VARIED, truncation=True, max_length=512)["input_ids"]
    batch = hf_tok(VARIED[:5], padding=True, return_tensors="pt")
    with torch.inference_mode():
        theirs = loaded(**batch, output_hidden_states=True).hidden_states
        ours = model.hidden_states(batch["input_ids"], attention_mask=batch["attention_mask"])
    real = batch["attention_mask"].bool()
    for mine, ref in zip(ours, theirs):
        torch.testing.assert_close(mine[real], ref[real], atol=1e-5, rtol=1e-5)


def test_hf_export_of_an_aiayn_encoder_with_paper_options(tmp_path):
    # Sinusoidal positions and sqrt(d_model) scaling are baked into BERT's tables.
    cfg = ModelConfig(vocab_size=50, d_model=16, n_heads=2, d_ff=24, n_encoder_layers=2, n_decoder_layers=0,
                      max_len=32, embedding_norm=True, activation="gelu_tanh", dropout=0.0)
    model = build_model(cfg).eval()
    export_hf(model, None, tmp_path)
    loaded = transformers.AutoModel.from_pretrained(tmp_path).eval()
    ids = torch.randint(1, 50, (2, 7))
    with torch.inference_mode():
        torch.testing.assert_close(loaded(ids).last_hidden_state, model.encode(ids), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="embedding_norm must be true"):
        export_hf(build_model(cfg.replace(embedding_norm=False)), None, tmp_path / "no")


@pytest.mark.parametrize("shape, settings", [("encoder-decoder", dict(n_decoder_layers=1)),
                                             ("decoder-only", dict(n_decoder_layers=0, causal=True))])
def test_only_an_encoder_exports_to_bert_and_the_refusal_names_the_shape(tmp_path, shape, settings):
    cfg = ModelConfig(vocab_size=40, d_model=16, n_heads=2, d_ff=32, n_encoder_layers=1, embedding_norm=True,
                      **settings)
    assert f"the model must be encoder-only (n_decoder_layers=0, causal=false), not {shape}" in bert_problems(cfg)
    with pytest.raises(ValueError, match=f"only encoder-only models export to BERT format \\(this one is {shape}\\)"):
        export_hf(build_model(cfg), None, tmp_path / "bert")


def test_the_training_benchmark_times_fine_tuning_minilm_beside_hugging_face_bert(capsys):
    from aiayn.cli.main import main

    code = main(["bench", "train", "--model", "encoder", "--max-tokens", "64", "--seq-len", "16", "--steps", "1",
                 "--threads", "1", "--precision", "fp32"])
    out = capsys.readouterr().out
    assert code == 0 and "fine-tuning all-MiniLM-L6-v2 (6 layers, d_model 384" in out, out
    assert "attention dropout 0.1" in out and "batches of 4 sequences of <= 16 tokens" in out
    assert "aiayn / Hugging Face BERT" in out and "tokens/s (real tokens)" in out
    assert "bf16 autocast" not in out
    code = main(["bench", "train", "--model", "encoder", "--max-tokens", "32", "--seq-len", "8", "--steps", "1",
                 "--threads", "1", "--precision", "bf16"])
    out = capsys.readouterr().out
    assert code == 0 and "aiayn / Hugging Face BERT, bf16 autocast" in out, out  # the peer in aiayn's precision too
