"""Threads or processes: a CPU run under a time budget takes the layout measured faster; any other run keeps its own."""

import json
import os

import pytest
import torch

from aiayn.backends import timing
from aiayn.backends.backend import Backend
from aiayn.config import ModelConfig
from aiayn.training import layout, load_run_config
from aiayn.training.layout import Layout, choose, measured_rates, resolved, step_rates

TINY = ModelConfig(vocab_size=40, d_model=16, n_heads=2, d_ff=32, n_encoder_layers=1, n_decoder_layers=1, max_len=64)


@pytest.fixture
def two_quiet_cores(monkeypatch, other_work):
    """A quiet 2-core CPU machine whose measured rates the test sets: {"one": tokens/s, "many": tokens/s}."""
    rates = {"one": 100.0, "many": 150.0}
    monkeypatch.setattr(layout, "usable_cores", lambda: 2)
    monkeypatch.setattr(timing, "usable_cores", lambda: 2)
    monkeypatch.setattr(layout.torch, "get_num_threads", lambda: 2)
    other_work(0.1)
    monkeypatch.setattr(layout, "measured_rates",
                        lambda model, rows, threads, precision="fp32": (rates["one"], rates["many"]))
    return rates


def _run(*items: str):
    return load_run_config(None, ["dataset=copy", *items])


def test_processes_where_measured_faster_threads_where_not(two_quiet_cores):
    chosen = choose(_run("time_budget=10m"), device="cpu")
    assert chosen.processes == 2 and "1.25x" in chosen.why  # 2 x 100 x 0.94 = 188 against 150
    two_quiet_cores["many"] = 190.0  # threads scale well: 2 x 100 x 0.94 = 188 is no win
    chosen = choose(_run("time_budget=10m"), device="cpu")
    assert chosen.processes == 1 and "2 threads" in chosen.why


def test_no_budget_a_short_one_one_core_or_a_pretrained_start_keep_one_process(two_quiet_cores, monkeypatch):
    assert choose(_run("max_steps=100"), device="cpu").processes == 1
    assert choose(_run("time_budget=2m"), device="cpu").processes == 1
    assert choose(_run("time_budget=10m", "threads=1"), device="cpu").processes == 1
    monkeypatch.setattr(layout.torch, "get_num_threads", lambda: 1)  # OMP_NUM_THREADS=1, say
    assert choose(_run("time_budget=10m"), device="cpu").processes == 1
    monkeypatch.setattr(layout.torch, "get_num_threads", lambda: 2)
    fine_tuning = load_run_config(None, ["dataset=compare", "objective=sequence_classification", "init_from=minilm",
                                         "time_budget=10m"])
    assert choose(fine_tuning, device="cpu").processes == 1
    # an objective whose data shapes its model (a head over the data's labels): one process
    classifier = load_run_config(None, ["dataset=compare", "objective=sequence_classification", "time_budget=10m"])
    chosen = choose(classifier, device="cpu")
    assert chosen.processes == 1 and "sequence_classification" in chosen.why
    monkeypatch.setattr(layout, "usable_cores", lambda: 8)  # beyond what was measured: not chosen by itself
    monkeypatch.setattr(layout.torch, "get_num_threads", lambda: 8)
    assert choose(_run("time_budget=10m"), device="cpu").processes == 1


def test_a_language_model_is_timed_as_the_decoder_only_stack_it_trains(two_quiet_cores, monkeypatch):
    timed = []
    monkeypatch.setattr(layout, "measured_rates",
                        lambda model, rows, threads, precision="fp32": timed.append(model) or (100.0, 150.0))
    chosen = choose(load_run_config(None, ["dataset=counting", "objective=causal_lm", "time_budget=10m"]), device="cpu")
    [model] = timed
    assert chosen.processes == 2 and model.causal and model.n_decoder_layers == 0
    # a decoder stack the run names is still the language model's one causal stack
    choose(load_run_config(None, ["dataset=counting", "objective=causal_lm", "time_budget=10m",
                                  "model.n_decoder_layers=4"]), device="cpu")
    assert timed[-1].causal and timed[-1].n_decoder_layers == 0
    # a translation run with two vocabularies is timed with its target vocabulary
    choose(_run("time_budget=10m", "shared_vocab=false", "vocab_size=300", "target_vocab_size=500"), device="cpu")
    assert (timed[-1].vocab_size, timed[-1].tgt_vocab_size, timed[-1].share_embeddings) == (300, 500, False)
    # a shape translation refuses keeps one process (the trainer's own check then says why, once)
    chosen = choose(_run("time_budget=10m", "model.n_decoder_layers=0"), device="cpu")
    assert chosen.processes == 1 and len(timed) == 3


def test_a_run_that_gives_processes_keeps_them_and_a_chosen_layout_runs_one_thread_a_process(two_quiet_cores):
    given = _run("time_budget=10m", "processes=1")
    assert resolved(given) == (given, None)
    run, chosen = resolved(_run("time_budget=10m", "threads=2"), device="cpu")
    # the launcher gives each process one thread; the run saves threads=0, so a resume with processes=1 uses them all
    assert chosen.processes == 2 and run.train.processes == 2 and run.train.threads == 0
    run, chosen = resolved(_run("time_budget=10m"), device="cpu", relaunchable=False)  # a config from a pipe
    assert chosen.processes == 1 and run.train.processes == 1
    run, chosen = resolved(_run("max_steps=10"), device="cpu")
    assert chosen == Layout(1, chosen.why) and run.train.processes == 1 and run.train.threads == 0


def test_the_rates_are_measured_once_per_machine_and_shape(monkeypatch, tmp_path, other_work):
    monkeypatch.setenv("AIAYN_CACHE_DIR", str(tmp_path))
    other_work(0.0)
    one, many = measured_rates(TINY, 64, 2)
    assert one > 0 and many > 0
    [cached] = tmp_path.glob("train-layout-*.json")
    assert json.loads(cached.read_text())["one"] == one
    monkeypatch.setattr(layout, "step_rates", lambda *args, **kwargs: pytest.fail("measured again"))
    assert measured_rates(TINY, 64, 2) == (one, many)
    # measured while other work held the cores: used, not kept
    other_work(5.0)
    monkeypatch.setattr(layout, "step_rates", lambda *args, **kwargs: (1.0, 2.0))
    assert measured_rates(TINY, 32, 2) == (1.0, 2.0) and len(list(tmp_path.glob("train-layout-*.json"))) == 1


def test_the_layout_is_timed_in_the_precision_the_run_will_train_in(two_quiet_cores, monkeypatch):
    asked = []
    monkeypatch.setattr(layout, "measured_rates",
                        lambda model, rows, threads, precision="fp32": asked.append(precision) or (100.0, 150.0))
    monkeypatch.setattr(layout, "default_precision", lambda device, mode, shape: asked.append(shape) or "bf16")
    chosen = choose(_run("time_budget=10m"), device="cpu")  # left to the machine: what it would train in
    shape, precision = asked
    assert precision == "bf16" and " in bf16 " in chosen.why and shape[0] == _run().train.max_tokens
    asked.clear()
    chosen = choose(_run("time_budget=10m", "precision=fp32"), device="cpu")  # given: never asked of the machine
    assert asked == ["fp32"] and " in " not in chosen.why.split(":")[1]


def test_the_rates_of_each_precision_are_kept_apart(monkeypatch, tmp_path, other_work):
    monkeypatch.setenv("AIAYN_CACHE_DIR", str(tmp_path))
    other_work(0.0)
    timed = []
    monkeypatch.setattr(layout, "step_rates", lambda model, rows, threads, precision: timed.append(precision) or (
        1.0, 2.0))
    assert measured_rates(TINY, 64, 2) == measured_rates(TINY, 64, 2, "bf16") == (1.0, 2.0)
    assert measured_rates(TINY, 64, 2, "bf16") == (1.0, 2.0) and timed == ["fp32", "bf16"]
    assert len(list(tmp_path.glob("train-layout-*.json"))) == 2


def test_a_run_that_says_how_to_draw_dropout_reads_rates_timed_so(monkeypatch, tmp_path, other_work):
    """`AIAYN_DROPOUT` decides the masks the step draws: rates timed with one setting are not read with another,
    nor with the machine's own choice."""
    monkeypatch.setenv("AIAYN_CACHE_DIR", str(tmp_path))
    other_work(0.0)
    timed = []
    monkeypatch.setattr(layout, "step_rates", lambda model, rows, threads, precision: timed.append(
        os.environ.get("AIAYN_DROPOUT")) or (1.0, 2.0))
    for setting in ("bits", "bernoulli", None, "bits"):
        if setting is None:
            monkeypatch.delenv("AIAYN_DROPOUT")
        else:
            monkeypatch.setenv("AIAYN_DROPOUT", setting)
        assert measured_rates(TINY, 64, 2) == (1.0, 2.0)
    assert timed == ["bits", "bernoulli", None] and len(list(tmp_path.glob("train-layout-*.json"))) == 3


def test_a_bf16_step_is_timed_on_the_copy_the_trainer_prepares_under_its_autocast(monkeypatch):
    autocast = []  # the autocast dtype each forward of the timed copy ran under (None: autocast off)
    real_prepare = Backend.prepare

    def prepare(self, model):
        copy = real_prepare(self, model)
        copy.register_forward_pre_hook(lambda module, inputs: autocast.append(
            torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None))
        return copy

    monkeypatch.setattr(Backend, "prepare", prepare)
    one, many = step_rates(TINY, 64, 2, repeats=1, precision="bf16")
    assert one > 0 and many > 0 and autocast and set(autocast) == {torch.bfloat16}
    autocast.clear()
    step_rates(TINY, 64, 2, repeats=1)
    assert autocast and set(autocast) == {None}


def test_the_one_thread_rate_is_timed_with_every_core_running_a_copy(monkeypatch):
    """As N processes would run: N copies prepared, their one-thread steps run at once on N Python threads; the
    N-thread step on one copy."""
    import threading

    seen, copies = set(), []
    real_prepare = Backend.prepare

    def prepare(self, model):
        copy = real_prepare(self, model)
        copies.append(copy)
        copy.register_forward_pre_hook(lambda module, inputs: seen.add(
            (copies.index(module), threading.get_ident(), torch.get_num_threads())))
        return copy

    monkeypatch.setattr(Backend, "prepare", prepare)
    one, many = step_rates(TINY, 64, 2, repeats=1)
    assert one > 0 and many > 0 and len(copies) == 2
    at_once = {(copy, ident) for copy, ident, threads in seen if threads == 1}
    assert {copy for copy, _ in at_once} == {0, 1} and len({ident for _, ident in at_once}) == 2
    assert {copy for copy, _, threads in seen if threads == 2} == {0}


def test_step_rates_time_a_training_step_of_each_architecture_and_leave_threads_and_seed_alone():
    threads, state = torch.get_num_threads(), torch.random.get_rng_state()
    for cfg in (TINY, TINY.replace(n_decoder_layers=0), TINY.replace(n_decoder_layers=0, causal=True)):
        one, many = step_rates(cfg, 64, 2, repeats=1)
        assert one > 0 and many > 0
    assert torch.get_num_threads() == threads and torch.equal(torch.random.get_rng_state(), state)


@pytest.mark.parametrize("value", ["-1", "-2"])
def test_processes_must_not_be_negative(value):
    with pytest.raises(ValueError, match=f"processes must not be negative, got {value}"):
        _run(f"processes={value}")
