"""`time_budget`: durations, the plan, and a tiny run that ends within its budget."""

import json
import random
import time

import pytest
import torch

from aiayn.training.budget import FINISH_S, FIRST_VALID, Budget, parse_duration
from aiayn.training.config import TrainConfig, load_run_config
from tests.conftest import TINY_RUN


@pytest.mark.parametrize(("text", "seconds"), [("90s", 90), ("20m", 1200), ("1h", 3600), ("1h30m", 5400),
                                                ("1.5h", 5400), (" 2m 30s ", 150), (".5m", 30)])
def test_parse_duration(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "20", "5x", "0s", "-1m", "m", "1m30"])
def test_parse_duration_refuses_what_is_not_a_duration(text):
    with pytest.raises(ValueError, match="time_budget"):
        parse_duration(text)


def test_config_checks_the_budget_and_needs_no_epochs_with_one():
    with pytest.raises(ValueError, match="time_budget must be a duration"):
        TrainConfig(dataset="copy", time_budget="ten minutes")
    assert TrainConfig(dataset="copy", epochs=0, time_budget="10m").time_budget == "10m"
    with pytest.raises(ValueError, match="set epochs, max_steps or time_budget"):
        TrainConfig(dataset="copy", epochs=0)


def test_plan_spends_what_is_left_on_steps_and_a_tenth_on_validation():
    budget = Budget(100.0, started=time.perf_counter())
    budget.step_s, budget.valid_s = 0.5, 2.0
    total, upcoming = budget.plan(steps_done=10, reserve=10.0, valid_examples=50)
    left = 100.0 - 10.0  # less the reserve (and the instant since `started`)
    validations = 5  # 10% of 100 s at 2 s each, from 40% of the steps on
    assert total == pytest.approx(10 + (left - validations * 2.0) / 0.5, abs=2)
    assert upcoming == round(FIRST_VALID * total)
    assert budget.plan(steps_done=round(0.95 * total), reserve=10.0, valid_examples=50, max_steps=total) == (total, 0)
    # past the last spread validation, the next is the one at the end
    assert budget.plan(steps_done=10, reserve=10.0, valid_examples=50, max_steps=40)[0] == 40


def test_test_estimate_uses_the_measured_beam_ratio():
    budget = Budget(60.0, started=time.perf_counter())
    budget.record_validation(2.0, 100, decoded=True)  # 0.02 s an example, greedy
    assert budget.test_estimate(500, 4, decoded=True) == pytest.approx(0.02 * 500 * 4)  # unmeasured: x beam
    budget.record_beam(0.5, 1.0)
    assert budget.test_estimate(500, 4, decoded=True) == pytest.approx(0.02 * 500 * 2.0)
    assert budget.test_estimate(500, 1, decoded=True) == pytest.approx(0.02 * 500)


def test_a_tiny_run_ends_within_its_budget(tmp_path):
    from aiayn.training import Trainer

    seconds = 20.0
    overrides = [item for item in TINY_RUN if not item.startswith("max_steps")]
    run = load_run_config(None, [*overrides, "dataset_train=400", "dataset_valid=40", "dataset_test=40", "num_beams=2",
                                 f"time_budget={seconds:g}s"])
    began = time.perf_counter()
    result = Trainer(run, tmp_path / "run").fit()
    used = time.perf_counter() - began
    # Over: 5% at most. Under: the stop leaves room for one more step and for the end's estimate, whose two
    # guesses before anything is measured are FINISH_S and the first checkpoint's 1 s; 5% besides.
    assert seconds - (FINISH_S + 1.0 + 0.05 * seconds) <= used <= 1.05 * seconds, result.budget
    assert result.step > 5 and result.budget["planned_steps"] > 5
    # the budget records its times to the millisecond: the wall time is compared at that precision
    assert result.budget["budget_s"] == seconds and result.budget["used_s"] <= round(used, 3)
    phases = ("setup", "train", "data", "valid", "checkpoint", "test", "finish")
    spent = sum(result.budget[f"{phase}_s"] for phase in phases)
    assert spent == pytest.approx(result.budget["used_s"], rel=0.05)  # every second is accounted for
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["split"] for row in rows][-2:] == ["test", "budget"]
    valid_times = [row["time_s"] for row in rows if row["split"] == "valid"]
    assert len(valid_times) >= 2 and valid_times == sorted(valid_times)


def test_a_resumed_run_gets_what_its_first_process_left(tmp_path):
    from aiayn.training import Trainer
    from aiayn.training.setup import read_run_config

    class StopsAtTen(Trainer):
        def after_step(self):
            if self.step == 10:
                self.interrupt_requested = True  # what Ctrl-C does: finish the step, save, return

    seconds = 15.0
    overrides = [item for item in TINY_RUN if not item.startswith("max_steps")]
    first = StopsAtTen(load_run_config(None, [*overrides, f"time_budget={seconds:g}s"]), tmp_path / "run").fit()
    assert first.interrupted and first.step == 10
    began = time.perf_counter()
    resumed = Trainer(read_run_config(tmp_path / "run"), tmp_path / "run", resume=True).fit()
    second = time.perf_counter() - began
    used = resumed.budget["used_s"]  # both processes
    assert resumed.step > 10 and second < used <= 1.05 * seconds, resumed.budget
    assert used >= seconds - (FINISH_S + 1.0 + 0.05 * seconds)


def test_an_undecoded_validation_sizes_an_undecoded_test_only():
    budget = Budget(100.0, started=time.perf_counter())
    budget.record_validation(1.0, 50, decoded=False)  # a classifier's validation: 0.02 s an example
    assert budget.test_estimate(200, 1, decoded=False) == pytest.approx(4.0)
    assert budget.test_estimate(200, 4, decoded=True) <= 0.15 * 100  # a decoded test is still a guess


def test_the_test_is_decoded_again_in_bf16_only_where_bf16_is_native_and_the_budget_has_the_time(monkeypatch):
    from types import SimpleNamespace

    import torch

    import aiayn.backends.backend
    from aiayn.training import finish
    from aiayn.training.evaluate import EvalOptions

    native = [True]
    monkeypatch.setattr(aiayn.backends.backend, "native_bf16_cpu", lambda device: native[0])
    calls = []
    monkeypatch.setattr(finish, "evaluate", lambda model, data, split, options: calls.append(options) or {
        "bleu": 29.9, "chrf": 55.0, "examples": [("a", "b", "c")]})
    reports, room, estimate = [], [True], [9.0]  # the recipe's 10 minutes: a 9 s test
    budget = SimpleNamespace(fits=lambda seconds, reserve: room[0], left=lambda: 3.0, record=lambda *a: None,
                             seconds=600.0, end_test_estimate=lambda examples, beams, decoded: estimate[0])
    t = SimpleNamespace(backend=SimpleNamespace(device=torch.device("cpu")), budget=budget, report=reports.append,
                        model=None, data=SimpleNamespace(test=SimpleNamespace(items=[0] * 20),
                                                         task=SimpleNamespace(generates=True)),
                        cfg=SimpleNamespace(precision=None, num_beams=4))
    from aiayn.backends import calibrate

    timed = []
    monkeypatch.setattr(calibrate, "bf16_faster", lambda *shape: timed.append(shape) or {"one": True, "many": False})
    monkeypatch.setattr("aiayn.backends.inference_shape", lambda model: (128, 512, 4000, 1 << 22))
    fp32 = {"bleu": 30.0}
    assert finish.bf16_test(t, EvalOptions(), fp32, 12.0) == {"bleu": 29.9, "chrf": 55.0}
    assert calls[-1].precision == "bf16" and "BLEU 29.90 (float32 30.00)" in reports[-1]
    # the step's products timed in both precisions now, for translate's first call on this machine
    assert timed == [(128, 512, 4000, 1 << 22)] and "faster at one, no faster at many" in reports[-1]
    room[0] = False  # less left than the float32 test took
    assert finish.bf16_test(t, EvalOptions(), fp32, 12.0) is None and "not decoded again in bf16" in reports[-1]
    room[0] = True
    estimate[0] = 31.0  # a test of more than 5% of the budget: a short budget keeps its time for training
    assert finish.bf16_test(t, EvalOptions(), fp32, 12.0) is None
    estimate[0] = 9.0
    t.cfg.precision = "bf16"
    assert finish.bf16_test(t, EvalOptions(precision="bf16"), fp32, 12.0) is None  # the test ran in bf16
    t.cfg.precision = None
    assert finish.bf16_test(t, EvalOptions(), {"accuracy": 90.0}, 12.0) is None  # no BLEU to compare
    native[0] = False
    assert finish.bf16_test(t, EvalOptions(), fp32, 12.0) is None
    assert len(calls) == 1


def test_a_fitted_recipe_is_fitted_to_the_compute_once_the_pace_is_known(tmp_path, monkeypatch):
    """`recipe=fit` under a budget: once the first `REFIT_STEPS` steps know the pace, the passes over the data the plan
    buys choose the residual dropout (`recipe.compute_keys`), one line says so, the model trains on with it, and the
    saved config holds it for a resume; a dropout the config sets is kept."""
    from aiayn.training import Trainer, pacing, recipe

    monkeypatch.setattr(pacing, "REFIT_STEPS", 12)
    monkeypatch.setattr(recipe, "DROPOUT_BY_PASSES", ((1e6, 0.9), (0.0, 0.25)))
    rng = random.Random(0)
    words = [" ".join(rng.choice("abcdefgh") for _ in range(rng.randint(1, 6))) for _ in range(240)]
    (tmp_path / "pairs.tsv").write_text("".join(f"{w}\t{w[::-1]}\n" for w in words), encoding="utf-8")
    overrides = [f"train={tmp_path / 'pairs.tsv'}", *(item for item in TINY_RUN if not item.startswith(
        ("dataset", "max_steps", "model.dropout", "lr", "warmup")))]
    lines = []

    class Watched(Trainer):
        def after_step(self):
            if self.step == 13:
                self.seen = sorted({m.p for m in self.prepared.modules() if isinstance(m, torch.nn.Dropout)})

    run = load_run_config(None, [*overrides, "recipe=fit", "num_beams=1", "time_budget=12s"])
    trainer = Watched(run, tmp_path / "run", report=lines.append)
    trainer.fit()
    fitted = [line for line in lines if line.startswith("recipe fitted to the compute")]
    assert len(fitted) == 1 and "model.dropout=0.25" in fitted[0] and "passes over the training data" in fitted[0]
    assert trainer.seen == [0.0, 0.25] and trainer.model.config.dropout == 0.25  # 0: the attention's own, not set
    saved = json.loads((tmp_path / "run" / "train_config.json").read_text(encoding="utf-8"))
    assert saved["model"]["dropout"] == 0.25

    lines.clear()
    run = load_run_config(None, [*overrides, "recipe=fit", "num_beams=1", "time_budget=12s", "model.dropout=0.05"])
    Trainer(run, tmp_path / "given", report=lines.append).fit()
    fitted = [line for line in lines if line.startswith("recipe fitted to the compute")]
    assert fitted and fitted[0].endswith("every key it fits is set by the config")
    saved = json.loads((tmp_path / "given" / "train_config.json").read_text(encoding="utf-8"))
    assert saved["model"]["dropout"] == 0.05
