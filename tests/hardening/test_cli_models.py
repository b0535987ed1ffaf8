"""Hostile CLI cases about the models a command loads: damaged or foreign weights, configs, tokenizers and
checkpoints, a pickle with code in it, a model of the wrong kind for the command, and a local-looking path that must
never go to the network. Each gets one line `aiayn CMD: error: ...`, its exit code, and loses nothing (the scene and
`refused`: tests/hardening/conftest.py)."""

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.hardening.conftest import Case, edit_json, truncate, write


def poison(path, value=float("nan")):
    def prepare(scene):
        state = load_file(Path(scene, path))
        name = sorted(k for k in state if state[k].dim() == 2)[0]
        state[name][0, 0] = value
        save_file(state, Path(scene, path))
    return prepare


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > pwned.txt",))


def swap_pieces(scene):
    """The run's tokenizer with two learned pieces' ids swapped: as loadable, and as large, as its own."""
    path = Path(scene, "run", "tokenizer.json")
    data = json.loads(path.read_text(encoding="utf-8"))
    vocab = data["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[-2:]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    path.write_text(json.dumps(data), encoding="utf-8")


def pickle_payload(path):
    def prepare(scene):
        torch.save({"weight": Evil()}, Path(scene, path))
    return prepare


def bin_only_bert(scene):
    (scene / "bert" / "model.safetensors").unlink()
    torch.save({"x": Evil()}, scene / "bert" / "pytorch_model.bin")


def no_network(monkeypatch):
    import huggingface_hub

    def refuse(*args, **kwargs):
        raise AssertionError("a local-looking path went to the network")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)


# models, checkpoints, tokenizers
MODELS = [
    Case("truncated model.safetensors", ["translate", "--run", "run", "hello"], 2,
         r"run/model.safetensors is not a complete safetensors file", prepare=truncate("run/model.safetensors")),
    Case("empty model.safetensors", ["translate", "--run", "run", "hello"], 2,
         r"run/model.safetensors is empty \(0 bytes\)", prepare=truncate("run/model.safetensors", 0)),
    Case("a NaN weight", ["translate", "--run", "run", "hello"], 2,
         r"run/model.safetensors: non-finite weights \(.* has 1 NaN and 0 Inf values\)",
         prepare=poison("run/model.safetensors")),
    Case("an Inf weight, eval", ["eval", "--run", "run"], 2, r"has 0 NaN and 1 Inf values",
         prepare=poison("run/model.safetensors", float("inf"))),
    Case("config.json missing a key", ["translate", "--run", "run", "hello"], 2,
         r"run/config.json lacks pe_layout; a saved model names every setting",
         prepare=edit_json("run/config.json", lambda c: c.pop("pe_layout"))),
    Case("config.json: a string where a bool belongs", ["translate", "--run", "run", "hello"], 2,
         r"run/config.json: norm_first must be true or false, got 'false'",
         prepare=edit_json("run/config.json", lambda c: c.update(norm_first="false"))),
    Case("config.json of another size than the weights", ["translate", "--run", "run", "hello"], 2,
         r"model.safetensors does not fit the model of its config: .* is \(\d+, 16\) in the file but \(\d+, 32\)",
         prepare=edit_json("run/config.json", lambda c: c.update(d_model=32))),
    Case("corrupt tokenizer.json", ["translate", "--run", "run", "hello"], 2,
         r"run/tokenizer.json: not a readable tokenizer file", prepare=truncate("run/tokenizer.json")),
    Case("another tokenizer of the same size (two pieces swapped)", ["translate", "--run", "run", "hello"], 2,
         r"run/tokenizer.json is not the tokenizer run's weights were saved with \(they record sha256 [0-9a-f]{16}"
         r"\.\.\., the file has [0-9a-f]{16}\.\.\.\): put the model's own tokenizer back", prepare=swap_pieces),
    Case("another tokenizer, loading a checkpoint", ["translate", "--run", "run/checkpoints/step-00000002", "hello"],
         2, r"run/tokenizer.json is not the tokenizer run/checkpoints/step-00000002's weights were saved with",
         prepare=swap_pieces),
    Case("corrupt tokenizer_meta.json", ["translate", "--run", "run", "hello"], 2,
         r"run/tokenizer_meta.json: not valid JSON", prepare=write("run/tokenizer_meta.json", "{")),
    Case("trace --run at a BERT checkpoint", ["trace", "--run", "bert"], 2,
         r"bert holds a Hugging Face checkpoint \(model_type 'bert'\), not an aiayn model"),
    Case("BERT: truncated model.safetensors", ["embed", "--model", "bert", "hello"], 2,
         r"bert/model.safetensors is not a complete safetensors file", prepare=truncate("bert/model.safetensors")),
    Case("BERT: corrupt tokenizer.json", ["embed", "--model", "bert", "hello"], 2,
         r"bert/tokenizer.json: not a readable tokenizer file", prepare=write("bert/tokenizer.json", "{nope")),
    Case("BERT: config.json missing sizes", ["embed", "--model", "bert", "hello"], 2,
         r"bert/config.json: the BERT config lacks hidden_size",
         prepare=edit_json("bert/config.json", lambda c: c.pop("hidden_size"))),
    Case("BERT: a pickle .bin with code in it", ["embed", "--model", "bert", "hello"], 2,
         r"pytorch_model.bin: refused: this pickle holds Python objects besides tensors", prepare=bin_only_bert),
    Case("resume: every checkpoint damaged", ["train", "--run", "run", "--resume"], 2,
         r"no intact checkpoint in run/checkpoints: step-00000002: .*; step-00000001: .*refused",
         prepare=lambda s: (truncate("run/checkpoints/step-00000002/model.safetensors")(s),
                            pickle_payload("run/checkpoints/step-00000001/trainer_state.pt")(s))),
    Case("eval --checkpoint that does not exist", ["eval", "--run", "run", "--checkpoint", "step-9"], 2,
         r"checkpoint step-9 not found"),
    Case("a local-looking --model path that does not exist", ["embed", "--model", "./typo/minilm", "x"], 2,
         r"./typo/minilm: no such checkpoint directory", patch=no_network),
    Case("a --model path whose folder exists", ["embed", "--model", "data/minilm", "x"], 2,
         r"data/minilm: no such checkpoint directory", patch=no_network),
    Case("eval --checkpoint damaged", ["eval", "--run", "run", "--checkpoint", "step-00000001"], 2,
         r"step-00000001/model.safetensors is not a complete safetensors file",
         prepare=truncate("run/checkpoints/step-00000001/model.safetensors", 0.9)),
    Case("ONNX export of an encoder-decoder", ["export", "--run", "run", "--onnx", "--out", "new"], 2,
         r"the ONNX export takes encoders; a translator exports to Hugging Face Marian"),
    Case("CTranslate2 export of an encoder", ["export", "--model", "enc", "--ctranslate2", "--out", "new"], 2,
         r"the CTranslate2 export takes translators"),
    Case("translate with an encoder-only model", ["translate", "--run", "enc", "hi"], 2,
         r"enc's model is encoder-only; translate needs an encoder-decoder"),
    Case("--init-from a file", ["train", "dataset=compare", "objective=sequence_classification", "--init-from",
                                "notes.txt", "--run", "new"], 2, r"notes.txt is not a checkpoint directory"),
]

CASES = MODELS


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_gets_one_line_and_an_exit_code_and_loses_nothing(case, refused):
    refused(case)
