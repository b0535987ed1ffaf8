"""Hostile CLI cases about what the user typed: configs from the command line, TOML and JSON alike, options
argparse refuses, and values that must be finite, in range and of the right type, checked before any work starts.
Each gets one line `aiayn CMD: error: ...`, its exit code, and loses nothing (the scene and `refused`:
tests/hardening/conftest.py)."""

import pytest

from tests.hardening.conftest import TINY_RUN, Case, edit_json, write


def one_label(scene):
    (scene / "one.csv").write_text("text,label\n" + "".join(f"w{i} x,pos\n" for i in range(12)), encoding="utf-8")


# configs, from the command line, TOML and JSON alike
CONFIGS = [
    Case("dataset=numbers with train=good.tsv", ["train", "dataset=numbers", "train=good.tsv", "--run", "new"], 2,
         r"dataset=numbers makes its own data but train=good.tsv names files too"),
    Case("JSON config: a string where a bool belongs", ["train", "c.json", "--run", "new"], 2,
         r"c.json: training key shared_vocab must be true or false, got 'false'",
         prepare=write("c.json", '{"dataset": "copy", "shared_vocab": "false"}')),
    Case("JSON config: a list, not an object", ["train", "c.json", "--run", "new"], 2,
         r"c.json: expected an object of training keys", prepare=write("c.json", "[1, 2]")),
    Case("JSON config: model is not a table", ["train", "c.json", "--run", "new"], 2,
         r"c.json: 'model' must be a table", prepare=write("c.json", '{"dataset": "copy", "model": 5}')),
    Case("JSON config: a model value of the wrong type", ["train", "c.json", "--run", "new"], 2,
         r"c.json: model key d_model|c.json: d_model must be a positive integer, got '16'",
         prepare=write("c.json", '{"dataset": "copy", "model": {"d_model": "16"}}')),
    Case("JSON config: invalid JSON", ["train", "c.json", "--run", "new"], 2, r"c.json:1: invalid JSON",
         prepare=write("c.json", '{"dataset": ')),
    Case("TOML config: a string where an integer belongs", ["train", "c.toml", "--run", "new"], 2,
         r"c.toml: training key epochs must be an integer, got '3'",
         prepare=write("c.toml", 'dataset = "copy"\nepochs = "3"\n')),
    Case("CLI override of the wrong type", ["train", "dataset=copy", "lowercase=perhaps", "--run", "new"], 2,
         r"lowercase expects true or false, got 'perhaps'"),
    Case("unknown config key", ["train", "dataset=copy", "epochz=3", "--run", "new"], 2,
         r"unknown config key 'epochz'"),
    Case("train_config.json damaged", ["eval", "--run", "run"], 2, r"run/train_config.json:1: invalid JSON",
         prepare=write("run/train_config.json", "{")),
    Case("a config file that is a directory", ["train", "data", "--run", "new"], 2,
         r"config file data is a directory; give a .toml or .json file"),
    Case("resume: train_config.json with a wrong type", ["train", "--run", "run", "--resume"], 2,
         r"run/train_config.json: training key bf16 must be true or false, got 'no'",
         prepare=edit_json("run/train_config.json", lambda c: c.update(bf16="no"))),
]

# arguments
ARGUMENTS = [
    Case("--min-len above --max-new-tokens", ["translate", "--run", "run", "hi", "--min-len", "5",
                                               "--max-new-tokens", "3"], 2, r"min_len 5 is above max_new_tokens 3"),
    Case("--min-len above --max-len", ["translate", "--run", "run", "hi", "--min-len", "5", "--max-len", "3"], 2,
         r"min_len 5 is above max_len 3"),  # the old spelling, named as the user spelled it
    Case("search --index a file aiayn did not write", ["search", "--model", "enc", "--corpus", "good.tsv",
                                                       "--index", "notes.txt", "q"], 2,
         r"notes.txt: not an aiayn search index .*left as it is"),
    Case("an unknown option", ["trace", "--run", "run", "--bogus"], 2,
         r"unrecognized arguments: --bogus \(see aiayn trace --help\)"),
    Case("a missing required option", ["train", "dataset=copy"], 2, r"the following arguments are required: --run"),
    Case("a value argparse cannot read", ["trace", "--seed", "x"], 2, r"argument --seed: invalid int value: 'x'"),
    Case("a choice argparse does not know", ["eval", "--run", "run", "--split", "dev"], 2,
         r"argument --split: invalid choice: 'dev'"),
]

# numbers and values: finite, in range, the right type, checked before any work starts
VALUES = [
    Case("corpus --valid -1", ["corpus", "--valid", "-1", "--out", "c"], 2, r"--valid must be at least 0, got -1"),
    Case("translate --alpha nan", ["translate", "--run", "run", "--alpha", "nan", "a"], 2,
         r"--alpha must be a finite number, got nan"),
    Case("translate --alpha inf", ["translate", "--run", "run", "--alpha", "inf", "a"], 2,
         r"--alpha must be a finite number, got inf"),
    Case("translate --top-p 0", ["translate", "--run", "run", "--sample", "--top-p", "0", "a"], 2,
         r"--top-p must be above 0, got 0"),
    Case("translate --num-beams 1000000", ["translate", "--run", "run", "--num-beams", "1000000", "a"], 2,
         r"num_beams 1000000 is more than the target vocabulary \(\d+ tokens\), so the beams could not differ"),
    Case("translate --attention-layer 99, before translating", ["translate", "--run", "run", "a", "--show-attention",
                                                                 "map.png", "--attention-layer", "99"], 2,
         r"--attention-layer 99 is outside 1..1 \(the model has 1 decoder layer\)"),
    Case("eval --examples -5", ["eval", "--run", "run", "--examples", "-5"], 2,
         r"--examples must be at least 0, got -5"),
    Case("search an empty query", ["search", "--model", "enc", "--corpus", "good.tsv", ""], 2,
         r"query 1 is empty: give the text to search for"),
    Case("embed --max-length 0", ["embed", "--model", "enc", "--max-length", "0", "x"], 2,
         r"--max-length must be at least 3, got 0"),
    Case("train lr=nan", ["train", *TINY_RUN, "lr=nan", "--run", "new"], 2,
         r"training key lr must be a finite number, got nan"),
    Case("train lr=inf", ["train", *TINY_RUN, "lr=inf", "--run", "new"], 2,
         r"training key lr must be a finite number, got inf"),
    Case("train max_steps=10**23", ["train", *TINY_RUN, f"max_steps={10**23}", "--run", "new"], 2,
         r"training key max_steps must be between -9,223,372,036,854,775,807 and 9,223,372,036,854,775,807, got "),
    Case("generate --seed 10**23, named as the option", ["generate", "--run", "lm", "--sample", "--seed", str(10**23),
                                                         "x"], 2,
         r"--seed must be at most 9,223,372,036,854,775,807, got 100,000,000,000,000,000,000,000"),
    Case("translate --seed 10**23, named as the option", ["translate", "--run", "run", "--sample", "--seed",
                                                          str(10**23), "x"], 2,
         r"--seed must be at most 9,223,372,036,854,775,807, got 100,000,000,000,000,000,000,000"),
    Case("train model.layer_norm_eps=nan", ["train", *TINY_RUN, "model.layer_norm_eps=nan", "--run", "new"], 2,
         r"layer_norm_eps must be a finite number, got nan"),
    Case("train model.d_model=1048576 (out of memory)", ["train", *TINY_RUN, "model.d_model=1048576", "--run", "new",
                                                         "--no-progress"], 4,
         r"training with batches of max_tokens=100 needs about [\d,.]+ GiB of memory, more than the [\d,.]+ GiB "
         r"available \(.*d_model 1,048,576.*\): make max_tokens or the layers \(n_encoder_layers, n_decoder_layers, "
         r"d_model, d_ff\) smaller"),
    Case("train model.max_len=10**11 (out of memory)", ["train", *TINY_RUN, f"model.max_len={10**11}", "--run",
                                                        "new", "--no-progress"], 4,
         r"training with batches of max_tokens=100 needs about [\d,.]+ GiB of memory.*: make max_tokens or max_len "
         r"smaller"),
    Case("train model.max_len=1, checked against the data", ["train", *TINY_RUN, "model.max_len=1", "--run", "new",
                                                              "--no-progress"], 2,
         r"model.max_len=1 is shorter than the longest example \(\d+ tokens with its special tokens\)"),
    Case("train vocab_size=1", ["train", *TINY_RUN, "vocab_size=1", "--run", "new", "--no-progress"], 2,
         r"vocab_size 1 is too small for this text: its 4 special tokens and \d+ distinct characters need at least"),
    Case("a classifier on one label", ["train", "train=one.csv", "objective=sequence_classification", "threads=1",
                                       "--run", "new", "--no-progress"], 2,
         r"the training data has one label \('pos'\): there is nothing to tell apart", prepare=one_label),
]

CASES = [*CONFIGS, *ARGUMENTS, *VALUES]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_gets_one_line_and_an_exit_code_and_loses_nothing(case, refused):
    refused(case)
