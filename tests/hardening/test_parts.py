"""The parts of one model directory must agree with each other (config and weights, tokenizer and vocabulary,
labels and num_labels), and a sentence-transformers folder must ask only for what aiayn implements: otherwise one
line names the part, before anything runs."""

import json
import os
import shutil
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from safetensors.torch import load_file, save_file

import aiayn
from aiayn.cli.main import main
from aiayn.config import ModelConfig
from aiayn.inference import Embedder
from aiayn.interop.bert import export_hf
from aiayn.interop.sentence_transformers import write_sentence_settings
from aiayn.io import save_model
from aiayn.nn.model import build_model
from aiayn.tokenization import train_tokenizer

WORDS = ["the cat sat on the mat", "a dog ran in the park", "birds fly over the sea"] * 5
SMALL = dict(d_model=16, n_heads=2, d_ff=32, n_encoder_layers=1, max_len=16, dropout=0.0)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("parts")
    tokenizer = train_tokenizer(WORDS, vocab_size=60, kind="bpe")
    big = train_tokenizer(WORDS * 3 + ["zebras quietly jumped over lazy foxes"], vocab_size=90, kind="bpe")
    assert big.vocab_size > tokenizer.vocab_size
    torch.manual_seed(0)
    common = dict(vocab_size=tokenizer.vocab_size, pad_id=tokenizer.pad_id, **SMALL)
    save_model(build_model(ModelConfig(n_decoder_layers=1, **common)), root / "translator", tokenizer=tokenizer)
    save_model(build_model(ModelConfig(n_decoder_layers=0, head="sequence_classification", num_labels=2, **common)),
               root / "classifier", tokenizer=tokenizer)
    (root / "classifier" / "labels.json").write_text('["neg", "pos"]')
    big.save(root / "big")
    wordpiece = train_tokenizer(WORDS, vocab_size=60, kind="wordpiece", extra_special=("[MASK]",))
    bert_cfg = ModelConfig(vocab_size=wordpiece.vocab_size, n_decoder_layers=0, positional="learned",
                           embedding_norm=True, scale_embeddings=False, activation="gelu", type_vocab_size=2,
                           layer_norm_eps=1e-12, **{**SMALL, "max_len": 32})
    export_hf(build_model(bert_cfg), wordpiece, root / "st")
    write_sentence_settings(root / "st", dim=16, pooling="mean", normalize=True, max_length=32)
    return root


@pytest.fixture
def copy(built, tmp_path):
    def make(name):
        shutil.copytree(built / name, tmp_path / name)
        return tmp_path / name
    return make


def one_line(capsys):
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    return err


def test_config_and_weights_that_disagree_are_named(copy, capsys):
    model = copy("translator")
    data = json.loads((model / "config.json").read_text())
    data["d_ff"] = 64
    (model / "config.json").write_text(json.dumps(data))
    assert main(["translate", "--run", str(model), "the cat"]) == 2
    err = one_line(capsys)
    assert "does not fit the model of its config" in err and "linear1.weight is (32, 16) in the file but (64, 16)" \
        in err


def test_a_config_asking_for_more_layers_than_its_weights_hold_is_refused_before_building_them(copy, capsys):
    model = copy("translator")
    data = json.loads((model / "config.json").read_text())
    data["n_encoder_layers"] = 10_000  # fits in memory (tiny layers), but would take a minute to build
    (model / "config.json").write_text(json.dumps(data))
    start = time.perf_counter()
    assert main(["translate", "--run", str(model), "the cat"]) == 2
    assert time.perf_counter() - start < 5
    assert (f"{model / 'model.safetensors'} holds 1 encoder and 1 decoder layers, but its config asks for 10,000 "
            "and 1: the config and the weights are not one model's files") in one_line(capsys)


@pytest.mark.parametrize("name, command", [("translator", ["translate", "the cat"]),
                                           ("classifier", ["predict", "the cat"])])
def test_a_tokenizer_larger_than_the_vocabulary_is_refused(built, copy, capsys, name, command):
    model = copy(name)
    for file in ("tokenizer.json", "tokenizer_meta.json"):
        shutil.copy(built / "big" / file, model / file)
    assert main([command[0], "--run", str(model), *command[1:]]) == 2
    assert "is not the tokenizer" in one_line(capsys)  # the weights record their tokenizer's digest
    weights = model / "model.safetensors"  # saved before digests were recorded: the sizes still tell
    save_file(load_file(weights), weights, metadata={"format": "pt"})
    assert main([command[0], "--run", str(model), *command[1:]]) == 2
    err = one_line(capsys)
    assert "the tokenizer has " in err and "tokens but the model's vocab_size is" in err
    assert "come from different runs" in err


def test_a_labels_file_that_disagrees_with_num_labels_is_refused(copy, capsys):
    model = copy("classifier")
    (model / "labels.json").write_text('["neg", "neutral", "pos"]')
    assert main(["predict", "--run", str(model), "the cat"]) == 2
    assert "3 label names (labels.json) for a model with num_labels 2 (config.json)" in one_line(capsys)


def test_a_sentence_transformers_folder_aiayn_can_run_loads(built):
    embedder = Embedder.from_pretrained(built / "st")
    assert (embedder.pooling, embedder.normalize, embedder.max_length) == ("mean", True, 32)


def edit(path, change):
    data = json.loads(path.read_text())
    data = change(data) or data
    path.write_text(json.dumps(data))


POOLING = "1_Pooling/config.json"
MODULE = "sentence_transformers.models."
CASES = [
    ("max pooling", POOLING, lambda d: d.update(pooling_mode_mean_tokens=False, pooling_mode_max_tokens=True),
     r"pooling pooling_mode_max_tokens is not one aiayn implements"),
    ("mean sqrt len pooling", POOLING, lambda d: d.update(pooling_mode_mean_sqrt_len_tokens=True),
     r"pooling pooling_mode_mean_sqrt_len_tokens, pooling_mode_mean_tokens is not one aiayn implements"),
    ("a weighted-mean mode named as a word", POOLING, lambda d: d.update(pooling_mode="weightedmean"),
     r"pooling_mode_weightedmean"),
    ("a Dense module", "modules.json",
     lambda d: d.insert(2, {"idx": 2, "name": "2", "path": "2_Dense", "type": MODULE + "Dense"}),
     r"module 'sentence_transformers.models.Dense' is not one aiayn implements"),
    ("another architecture", "modules.json", lambda d: d[0].update(type=MODULE + "CLIPModel"),
     r"module 'sentence_transformers.models.CLIPModel' is not one aiayn implements"),
    ("a Transformer in a subfolder", "modules.json", lambda d: d[0].update(path="0_Transformer"),
     r"the Transformer module lives in 0_Transformer/"),
    ("no Pooling", "modules.json", lambda d: [d[0], d[2]], r"modules Transformer -> Normalize; aiayn runs"),
    ("a RoBERTa transformer", "config.json", lambda d: d.update(model_type="roberta"),
     r"model_type 'roberta' is not supported"),
]


@pytest.mark.parametrize("case, file, change, message", CASES, ids=[c[0] for c in CASES])
def test_a_sentence_transformers_folder_asking_for_more_is_refused(copy, capsys, case, file, change, message):
    folder = copy("st")
    edit(folder / file, change)
    with pytest.raises(ValueError, match=message):
        Embedder.from_pretrained(folder)
    assert main(["embed", "--model", str(folder), "the cat"]) == 2
    assert "use sentence-transformers" in one_line(capsys) or "roberta" in case.lower()
    with pytest.raises(ValueError):
        aiayn.load(folder).embed("the cat")
