"""The fitted recipe: keys the config leaves out are chosen from the corpus size; keys it sets are kept."""

import pytest

from aiayn.training.config import RunConfig, TrainConfig, load_run_config
from aiayn.training.recipe import (
    LM_SHORT,
    PATIENCE,
    PEAK_LR,
    SHORT,
    SIZES,
    compute_keys,
    fit_run,
    fitted_keys,
    short_budget,
    uses_fit,
)


@pytest.mark.parametrize(("pairs", "preset", "vocab", "tokens"), [(40_000, "small", 8000, 4096),
                                                                 (5_000, "small", 4000, 2048),
                                                                 (500, "tiny", 2000, 1024)])
def test_only_train_given_gets_the_sizes_of_its_corpus(pairs, preset, vocab, tokens):
    fitted, notes = fit_run(load_run_config(None, ["train=data.tsv"]), pairs)
    assert (fitted.model_preset, fitted.train.vocab_size, fitted.train.max_tokens) == (preset, vocab, tokens)
    assert fitted.model_overrides == {"norm_first": True, "dropout": 0.1}
    assert (fitted.train.lr, fitted.train.warmup, fitted.train.recipe) == (PEAK_LR, 0, "fit")
    assert f"recipe fitted to {pairs} training examples" in notes[0]
    assert fitted.model_config(vocab_size=vocab).norm_first


def test_keys_the_config_sets_are_kept_even_when_they_equal_the_defaults():
    run = load_run_config(None, ["train=data.tsv", "vocab_size=8000", "lr=1e-3", "model.preset=tiny",
                                 "model.norm_first=false"])
    fitted, _ = fit_run(run, 500)
    assert (fitted.train.vocab_size, fitted.train.lr, fitted.model_preset) == (8000, 1e-3, "tiny")
    assert fitted.model_overrides["norm_first"] is False
    assert fitted.train.max_tokens == fitted_keys(500)[0]["max_tokens"]  # not set: fitted
    # from Python, without a file: a value other than the default counts as set
    fitted, _ = fit_run(RunConfig(TrainConfig(train="data.tsv", max_tokens=999)), 40_000)
    assert (fitted.train.max_tokens, fitted.train.vocab_size) == (999, 8000)


@pytest.mark.parametrize("items", [["dataset=copy"], ["train=data.tsv", "recipe=paper"],
                                   ["train=data.tsv", "objective=sequence_classification"]])
def test_tasks_classifiers_and_the_paper_recipe_are_not_fitted(items):
    run = load_run_config(None, items)
    assert not uses_fit(run.train)
    assert fit_run(run, 40_000) == (run, [])


@pytest.mark.parametrize("objective", ["seq2seq", "causal_lm"])
def test_translation_and_language_models_from_files_are_fitted(objective):
    run = load_run_config(None, ["train=text.txt", f"objective={objective}", "time_budget=4m"])
    assert uses_fit(run.train)
    fitted, notes = fit_run(run, 40_000)
    vocab = SHORT[1] if objective == "seq2seq" else LM_SHORT["vocab_size"]
    assert (fitted.model_preset, fitted.train.vocab_size, fitted.train.max_tokens) == ("small", vocab, SHORT[2])
    assert notes[0].startswith("recipe fitted to 40000 training examples")


def test_a_short_language_model_takes_fewer_pieces_and_weight_decay():
    """Measured on a 1.27 MB text in 20 minutes (docs/language-models.md): 2,000 pieces and AdamW's weight decay 0.1
    below 4,000 pieces and Adam; a longer budget keeps the corpus rule, and a key the config sets is kept."""
    short, _ = fit_run(load_run_config(None, ["train=t.txt", "objective=causal_lm", "time_budget=20m"]), 5000, "cpu")
    assert (short.train.vocab_size, short.train.optimizer, short.train.weight_decay) == (2000, "adamw", 0.1)
    long, _ = fit_run(load_run_config(None, ["train=t.txt", "objective=causal_lm", "time_budget=5h", "threads=1",
                                             "processes=1"]), 5000, "cpu")
    assert (long.train.vocab_size, long.train.optimizer, long.train.weight_decay) == (4000, "auto", None)
    tiny, _ = fit_run(load_run_config(None, ["train=t.txt", "objective=causal_lm", "time_budget=20m"]), 500, "cpu")
    assert tiny.train.vocab_size == 2000 and tiny.train.optimizer == "auto"  # (the tiny model: not narrowed)
    kept, _ = fit_run(load_run_config(None, ["train=t.txt", "objective=causal_lm", "time_budget=20m",
                                             "vocab_size=3000", "weight_decay=0.01"]), 5000, "cpu")
    assert (kept.train.vocab_size, kept.train.optimizer, kept.train.weight_decay) == (3000, "adamw", 0.01)
    translation, _ = fit_run(load_run_config(None, ["train=t.tsv", "time_budget=20m"]), 5000, "cpu")
    assert (translation.train.vocab_size, translation.train.optimizer) == (4000, "auto")


def test_the_rows_cover_every_corpus_size():
    assert SIZES[-1][0] == 0 and [row[0] for row in SIZES] == sorted((row[0] for row in SIZES), reverse=True)
    with pytest.raises(ValueError, match="recipe must be one of"):
        TrainConfig(train="data.tsv", recipe="fast")


def test_a_short_budget_narrows_the_model_for_more_steps():
    short, _ = fit_run(load_run_config(None, ["train=data.tsv", "time_budget=10m"]), 40_000, "cpu")
    long, _ = fit_run(load_run_config(None, ["train=data.tsv", "time_budget=5h", "threads=1", "processes=1"]), 40_000,
                      "cpu")
    assert short.model_overrides["d_model"] == 128
    assert (short.train.max_tokens, short.train.vocab_size) == (SHORT[2], SHORT[1]) == (1024, 4000)
    assert "d_model" not in long.model_overrides and (long.train.max_tokens, long.train.vocab_size) == (4096, 8000)
    small, _ = fit_run(load_run_config(None, ["train=data.tsv", "time_budget=10m"]), 500)  # tiny: not narrowed
    assert small.model_preset == "tiny" and "d_model" not in small.model_overrides
    kept, _ = fit_run(load_run_config(None, ["train=data.tsv", "time_budget=10m", "model.d_model=256"]), 40_000)
    assert kept.model_overrides["d_model"] == 256 and kept.model_overrides["d_ff"] == 512


def test_a_preset_the_config_names_keeps_its_sizes_and_dropout():
    fitted, _ = fit_run(load_run_config(None, ["train=data.tsv", "model.preset=big", "time_budget=10m"]), 40_000)
    assert fitted.model_preset == "big" and fitted.model_overrides == {"norm_first": True}
    assert fitted.model_config(vocab_size=8000).dropout == 0.3  # the big preset's


@pytest.mark.parametrize(("budget", "threads", "short"), [
    ("60m", ["threads=1", "processes=1"], True),  # measured: the "small" sizes were 27 BLEU behind at the same minute
    ("4h", ["threads=1", "processes=1"], True), ("241m", ["threads=1", "processes=1"], False),
    ("2h", ["processes=2"], True), ("3h", ["processes=2"], False), ("90m", ["threads=4", "processes=1"], False),
    ("60m", ["threads=32", "processes=1"], True), ("61m", [], False)])  # more than four threads count as four
def test_the_budget_times_the_threads_it_trains_on_decides_the_narrow_model(monkeypatch, budget, threads, short):
    """The compute a budget buys on a CPU is its seconds times the threads the run trains on, its processes together."""
    monkeypatch.setattr("aiayn.training.recipe.usable_cores", lambda: 64)
    monkeypatch.setattr("torch.get_num_threads", lambda: 64)
    fitted, _ = fit_run(load_run_config(None, ["train=data.tsv", f"time_budget={budget}", *threads]), 40_000, "cpu")
    assert (fitted.model_overrides.get("d_model") == 128) is short
    assert short_budget(1800, 0) and not short_budget(3600, 0)  # on a GPU: the budget alone, under an hour


def test_a_short_budget_starts_without_dropout_until_its_pace_is_known():
    # the first steps only: the passes the plan buys choose it then (`compute_keys`, test_budget.py)
    assert fitted_keys(40_000, 600)[1]["dropout"] == fitted_keys(40_000, 1800)[1]["dropout"] == 0.0
    assert fitted_keys(40_000, 7200, threads=4)[1]["dropout"] == fitted_keys(40_000)[1]["dropout"] == 0.1
    kept, _ = fit_run(load_run_config(None, ["train=data.tsv", "time_budget=10m", "model.dropout=0.2"]), 40_000)
    assert kept.model_overrides["dropout"] == 0.2


def test_the_passes_over_the_data_choose_the_dropout():
    """Few passes: every step is new data, no dropout; many: the paper's 0.1 (docs/training.md, the measured rule).
    Without a budget the passes are the epochs, known before the first step."""
    assert [compute_keys(passes)["model.dropout"] for passes in (0.5, 5, 9.9, 10, 40, 400)] == [0, 0, 0, 0.1, 0.1, 0.1]
    assert [compute_keys(passes, "causal_lm")["model.dropout"] for passes in (5, 10, 19.9, 20, 400)] == [
        0, 0.1, 0.1, 0.2, 0.2]  # a language model: more from 20 passes
    few, _ = fit_run(load_run_config(None, ["train=data.tsv", "epochs=3"]), 40_000)
    many, _ = fit_run(load_run_config(None, ["train=data.tsv", "epochs=30"]), 40_000)
    assert (few.model_overrides["dropout"], many.model_overrides["dropout"]) == (0.0, 0.1)
    given, _ = fit_run(load_run_config(None, ["train=data.tsv", "epochs=3", "model.dropout=0.3"]), 40_000)
    assert given.model_overrides["dropout"] == 0.3


def test_a_fitted_run_decays_its_rate_to_zero_and_stops_when_the_data_runs_out():
    budget, _ = fit_run(load_run_config(None, ["train=data.tsv", "time_budget=20m"]), 40_000)
    assert (budget.train.schedule, budget.train.patience) == ("linear", PATIENCE)
    epochs, _ = fit_run(load_run_config(None, ["train=data.tsv"]), 40_000)
    assert (epochs.train.schedule, epochs.train.patience) == ("linear", 0)  # the epochs are the user's to count
    kept, _ = fit_run(load_run_config(None, ["train=data.tsv", "time_budget=20m", "schedule=noam", "patience=0"]),
                      40_000)
    assert (kept.train.schedule, kept.train.patience) == ("noam", 0)
