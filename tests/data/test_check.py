"""The data check: duplicates, extreme length ratios and train overlap are counted, and dropped on request."""

from aiayn.data.check import check_splits
from aiayn.data.readers import LabelledText, ParallelExample
from aiayn.training.config import load_run_config
from aiayn.training.loop import Trainer

P = ParallelExample


def test_counts_without_dropping_by_default():
    train = [P("Open", "Ouvrir"), P("Open", "Ouvrir"), P("OK", "OK"), P("A", "une phrase bien trop longue"),
             P("Save", "Enregistrer")]
    valid, test = [P("Save", "Enregistrer"), P("Quit", "Quitter")], [P("Cut", "Couper")]
    kept_train, kept_valid, kept_test, report = check_splits(train, valid, test)
    assert (kept_train, kept_valid, kept_test) == (train, valid, test)
    assert (report.duplicates, report.extreme_ratio, report.identical_sides) == (1, 1, 1)
    assert report.overlap == {"valid": 1, "test": 0} and report.dropped == 0
    assert "1 duplicates in train" in report.summary() and "clean=true drops" in report.summary()


def test_drop_removes_duplicates_extreme_ratios_and_overlap():
    train = [P("Open", "Ouvrir"), P("Open", "Ouvrir"), P("A", "une phrase bien trop longue"), P("OK", "OK")]
    kept_train, kept_valid, kept_test, report = check_splits(train, [P("Open", "Ouvrir")], [P("Cut", "Couper")],
                                                             drop=True)
    assert kept_train == [P("Open", "Ouvrir"), P("OK", "OK")]  # identical sides are kept
    assert kept_valid == [] and kept_test == [P("Cut", "Couper")] and report.dropped == 3


def test_classification_rows_with_conflicting_labels_are_reported():
    train = [LabelledText("fine", "pos"), LabelledText("fine", "neg"), LabelledText("bad", "neg")]
    _, _, _, report = check_splits(train, [], [])
    assert report.conflicting_labels == 1 and report.duplicates == 0


def test_trainer_reports_the_check_and_the_vocabulary(tmp_path):
    rows = [f"item {i}\tobjet {i}" for i in range(40)] + ["item 1\tobjet 1"] * 3
    data = tmp_path / "pairs.tsv"
    data.write_text("\n".join(rows) + "\n", encoding="utf-8")
    lines = []
    run = load_run_config(None, [f"train={data}", "clean=true", "max_steps=1", "threads=1", "model.d_model=16",
                                 "model.d_ff=32", "model.n_heads=2", "model.n_encoder_layers=1",
                                 "model.n_decoder_layers=1", "show_examples=0"])
    Trainer(run, tmp_path / "run", report=lines.append).fit()
    check = next(line for line in lines if line.startswith("data check:"))
    assert "duplicates in train" in check and "dropped" in check
    assert any(line.startswith("vocabulary: ") and "byte fallback" in line for line in lines)
