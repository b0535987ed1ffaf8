"""A translation model's precision where its caller leaves it open (`aiayn translate` without --precision): bf16 on a
CPU only where the model's quality in bf16 and its speed here were both measured, float32 elsewhere."""

import json

import pytest
import torch

import aiayn.backends.backend
from aiayn.backends import calibrate
from aiayn.backends.backend import native_bf16_cpu
from aiayn.inference.translator import BF16_BLEU_TOLERANCE, Translator, measured_precision
from aiayn.io import load_model

NATIVE = native_bf16_cpu(torch.device("cpu"))
ALL_FASTER = {"one": True, "few": True, "many": True}


def _scored(directory, bleu, bf16=None):
    """`directory` with an eval.json of test BLEU `bleu`, and `bf16` as the trainer writes its bf16 test beside it."""
    directory.mkdir(exist_ok=True)
    record = {"split": "test", "step": 60, "bleu": bleu}
    if bf16 is not None:
        record["bf16"] = {"bleu": bf16}
    (directory / "eval.json").write_text(json.dumps(record))
    return directory


def test_the_trainer_scores_its_test_split_in_bf16_too_on_a_cpu_that_computes_bf16(translation_run):
    result = json.loads((translation_run / "eval.json").read_text())
    [test] = [json.loads(line) for line in (translation_run / "metrics.jsonl").read_text().splitlines()
              if '"split": "test"' in line]
    if NATIVE:
        assert {"bleu", "chrf", "exact_match"} <= set(result["bf16"]) and "examples" not in result["bf16"]
        # the log and the metrics CSV keep them as columns of numbers of their own
        assert test["bf16_bleu"] == result["bf16"]["bleu"] and "bf16" not in test and "bf16_bleu_tokenize" not in test
    else:  # emulated bf16 is slow, and never chosen by itself: not measured
        assert "bf16" not in result and not any(name.startswith("bf16") for name in test)


@pytest.mark.parametrize("native, bleu, bf16, faster, chosen, why", [
    (False, 30.0, 30.0, ALL_FASTER, None, "emulation"),
    (True, 30.0, None, ALL_FASTER, None, "no bf16 test score"),
    (True, 30.0, 30.0 - BF16_BLEU_TOLERANCE - 0.01, ALL_FASTER, None, "more than 0.3 below"),
    (True, 30.0, 30.0, {"one": True, "few": False, "many": True}, None, "no faster in bf16 on this CPU at few rows"),
    (True, 30.0, 30.0 - BF16_BLEU_TOLERANCE + 0.01, ALL_FASTER, "bf16", "test BLEU 29.71 in bf16 against 30.00"),
    (True, 30.0, 30.5, ALL_FASTER, "bf16", "faster products here"),
    (True, 30.0, float("nan"), ALL_FASTER, None, "no bf16 test score"),  # a score that is no number proves nothing
    (True, float("nan"), 30.0, ALL_FASTER, None, "no bf16 test score"),
])
def test_bf16_is_chosen_only_where_its_test_bleu_and_its_speed_here_were_measured(
        translation_run, tmp_path, monkeypatch, native, bleu, bf16, faster, chosen, why):
    measured = []
    monkeypatch.setattr(aiayn.backends.backend, "native_bf16_cpu", lambda device: native)
    monkeypatch.setattr(calibrate, "bf16_faster", lambda *shape: measured.append(shape) or faster)
    model = load_model(translation_run)
    precision, reason = measured_precision(_scored(tmp_path / "run", bleu, bf16), model, "cpu")
    assert precision == chosen and why in reason
    # the products are timed (once a machine, cached) only for a model whose bf16 quality was measured as good
    assert bool(measured) == (native and bf16 is not None and bf16 >= bleu - BF16_BLEU_TOLERANCE)


def test_a_directory_without_its_run_scores_decodes_in_float32(translation_run, tmp_path, monkeypatch):
    monkeypatch.setattr(calibrate, "bf16_faster", lambda *shape: ALL_FASTER)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "eval.json").write_text("{not json")
    assert measured_precision(tmp_path / "run", load_model(translation_run), "cpu")[0] is None
    assert measured_precision(tmp_path / "elsewhere", load_model(translation_run), "cpu")[0] is None


@pytest.mark.skipif(not NATIVE, reason="bf16 is chosen only on a CPU that computes it natively")
def test_a_translator_left_to_choose_decodes_in_bf16_where_measured_better_and_in_float32_when_asked(
        translation_run, tmp_path, monkeypatch):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(translation_run, run)
    bleu = json.loads((run / "eval.json").read_text())["bleu"]
    _scored(run, bleu, bleu)
    monkeypatch.setattr(calibrate, "bf16_faster", lambda *shape: ALL_FASTER)
    chosen = Translator.from_pretrained(run, precision=None)
    assert chosen.backend.precision == "bf16"
    assert len(chosen.translate(["a b c", "d d d"])) == 2
    assert Translator.from_pretrained(run).backend.precision == "fp32"  # the Python default: float32, exact
    monkeypatch.setattr(calibrate, "bf16_faster", lambda *shape: {**ALL_FASTER, "one": False})
    assert Translator.from_pretrained(run, precision=None).backend.precision == "fp32"


def test_a_server_loads_a_translator_to_decode_as_aiayn_translate_does(translation_run, monkeypatch):
    from aiayn.inference.loading import load_to_serve

    asked = []
    original = Translator.from_pretrained.__func__
    monkeypatch.setattr(Translator, "from_pretrained", classmethod(
        lambda cls, path, **options: asked.append(options) or original(cls, path, **options)))
    served = load_to_serve(translation_run)
    assert isinstance(served, Translator) and asked == [{"device": None, "precision": None}]
