"""`aiayn bench translate` runs end to end on a tiny corpus: both models train, decode and are scored."""

import json

import pytest

from aiayn.cli.main import main
from aiayn.data.gettext import catalog_files, read_gettext

WORDS = ["open", "close", "file", "folder", "save", "print", "new", "copy"]
FRENCH = ["ouvrir", "fermer", "fichier", "dossier", "enregistrer", "imprimer", "nouveau", "copier"]


def tiny_corpus(tmp_path):
    """train / valid / test TSVs of 64 two-word pairs, as `aiayn corpus` lays them out."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    pairs = [f"{WORDS[i % 8]} {WORDS[i // 8 % 8]}\t{FRENCH[i % 8]} {FRENCH[i // 8 % 8]}" for i in range(64)]
    for name, rows in (("train", pairs), ("valid", pairs[:8]), ("test", pairs[8:16])):
        (corpus / f"{name}.tsv").write_text("\n".join(rows) + "\n", encoding="utf-8")
    return corpus


def test_bench_translate_trains_both_models_and_reports(tmp_path, capsys):
    pytest.importorskip("transformers")
    corpus = tiny_corpus(tmp_path)
    code = main(["bench", "translate", "--corpus", str(corpus), "--work", str(tmp_path / "work"), "--steps", "4",
                 "--threads", "1", "vocab_size=60", "eval_every=2", "max_tokens=64", "model.d_model=16",
                 "model.d_ff=32", "model.n_heads=2", "model.n_encoder_layers=1", "model.n_decoder_layers=1"])
    assert code == 0
    out = capsys.readouterr().out
    assert "BLEU difference" in out and "training time aiayn / Marian" in out
    # a corpus of the user's own, without `aiayn corpus`'s corpus.json or --lang, is named by its folder
    assert f"the pairs of {corpus}, gettext catalogs" not in out and f"the pairs of {corpus};" in out
    assert "French" not in out
    results = json.loads((tmp_path / "work" / "results.json").read_text(encoding="utf-8"))
    for name in ("aiayn", "marian"):
        assert results[name]["steps"] == 4 and results[name]["train_s"] > 0
        assert [step for step, _ in results[name]["valid"]] == [2, 4]


def test_bench_translate_curves_in_training_time_name_the_pair(tmp_path, capsys):
    pytest.importorskip("transformers")
    corpus = tiny_corpus(tmp_path)
    (corpus / "corpus.json").write_text(json.dumps({"lang": "es"}), encoding="utf-8")  # as `aiayn corpus` writes it
    code = main(["bench", "translate", "--corpus", str(corpus), "--work", str(tmp_path / "work"), "--steps", "40",
                 "--curve", "0.02s", "--threads", "1", "vocab_size=60", "max_tokens=64", "model.d_model=16",
                 "model.d_ff=32", "model.n_heads=2", "model.n_encoder_layers=1", "model.n_decoder_layers=1",
                 "num_beams=1"])
    assert code == 0
    out = capsys.readouterr().out
    assert "English -> Spanish, gettext catalogs" in out and "French" not in out
    assert "English -> Spanish: validation BLEU (greedy) after this much training time" in out
    results = json.loads((tmp_path / "work" / "results.json").read_text(encoding="utf-8"))
    for name in ("aiayn", "marian"):
        seconds = [t for t, _ in results[name]["curve"]]
        # each mark past its multiple of 0.02 s (the results round to 0.1 s); 40 steps of even the fastest
        # machine take longer than one multiple, so the curve is never empty
        assert seconds and seconds == sorted(seconds) and all(t >= 0.02 * (k + 1) - 0.05 for k, t in enumerate(seconds))
    assert results["marian"]["steps"] == results["aiayn"]["steps"] == 40


def test_bench_translate_trains_aiayn_in_the_processes_train_takes(tmp_path, capsys):
    pytest.importorskip("transformers")
    corpus = tiny_corpus(tmp_path)
    code = main(["bench", "translate", "--corpus", str(corpus), "--work", str(tmp_path / "work"), "--steps", "4",
                 "--curve", "0.02s", "--threads", "2", "processes=2", "vocab_size=60", "max_tokens=64",
                 "model.d_model=16", "model.d_ff=32", "model.n_heads=2", "model.n_encoder_layers=1",
                 "model.n_decoder_layers=1", "num_beams=1"])
    assert code == 0
    out = capsys.readouterr().out
    assert "aiayn trained as 2 processes; the peer on 2 threads" in out and "tokens a second aiayn / Marian" in out
    results = json.loads((tmp_path / "work" / "results.json").read_text(encoding="utf-8"))
    aiayn, marian = results["aiayn"], results["marian"]
    # a step of 2 processes holds a batch of each; the tokens are both processes' (same batches, same count)
    assert aiayn["processes"] == 2 and aiayn["steps"] == 4 and aiayn["batches"] == 8
    assert marian["steps"] == 4 and aiayn["tokens"] > marian["tokens"] > 0
    assert aiayn["curve"] and 0 <= aiayn["bleu"] <= 100


@pytest.mark.skipif(not catalog_files("fr"), reason="this machine has no compiled French gettext catalogs")
def test_gettext_corpus_has_no_templates_and_disjoint_sources():
    corpus = read_gettext("fr", n_valid=100, n_test=100)
    sources = [p.source for p in corpus.train + corpus.valid + corpus.test]
    assert len(sources) == len(set(sources)) and len(corpus.train) > 1000
    assert not any("%s" in s or "%d" in s or "\t" in s or "\n" in s for s in sources)
