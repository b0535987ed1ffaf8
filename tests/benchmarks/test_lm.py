"""`aiayn bench lm` end to end on a tiny text: both models train, are scored per character and continue a prompt."""

import json
import math
import random

import pytest

from aiayn.cli.bench import load_benchmark
from aiayn.cli.main import main
from aiayn.data.readers import read_documents
from aiayn.rundir import EVAL

WORDS = "the cat dog sat ran on under a mat rug house and then slept quietly loudly".split()


def tiny_text(path, paragraphs=60):
    """A few KB of seeded sentences, a few lines a paragraph, paragraphs between blank lines."""
    rng = random.Random(0)
    text = "\n\n".join("\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 9))).capitalize() + "."
                                 for _ in range(rng.randint(1, 3))) for _ in range(paragraphs)) + "\n"
    path.write_text(text, encoding="utf-8")
    return text


def test_bench_lm_trains_both_models_and_scores_them_per_character(tmp_path, capsys):
    text = tiny_text(tmp_path / "tiny.txt")
    code = main(["bench", "lm", "--text", str(tmp_path / "tiny.txt"), "--work", str(tmp_path / "work"),
                 "--budget", "8s", "--threads", "1", "--nanogpt-layers", "1", "--nanogpt-embd", "16",
                 "--nanogpt-heads", "2", "--nanogpt-block", "32", "--nanogpt-batch", "4", "--new-chars", "20",
                 "--record", str(tmp_path / "records"), "vocab_size=100", "model.d_model=16", "precision=fp32"])
    assert code == 0
    out = capsys.readouterr().out
    assert "valid loss/char" in out and "bits/char" in out and "greedy continuations of" in out
    results = json.loads((tmp_path / "work" / "results.json").read_text(encoding="utf-8"))
    valid_chars = len(text) - int(len(text) * 0.9)
    for name in ("aiayn", "nanoGPT"):
        r = results[name]
        assert math.isfinite(r["loss_per_char"]) and r["loss_per_char"] > 0
        assert r["steps"] > 0 and r["train_s"] > 0 and r["tokens"] > 0
        assert any(line.startswith(name) and f"{r['loss_per_char']:.4f}" in line for line in out.splitlines())
    assert results["nanoGPT"]["scored_tokens"] == valid_chars  # every character of the validation text, once
    # nanoGPT trains for the seconds aiayn's steps had (it stops at the first step past them)
    assert results["nanoGPT"]["train_s"] >= results["aiayn"]["train_s"]
    # The bench's sum over the validation text is aiayn's own evaluation of that split (the run's test = valid)
    own = json.loads((tmp_path / "work" / "aiayn" / EVAL).read_text(encoding="utf-8"))
    aiayn = results["aiayn"]
    assert aiayn["nll"] / aiayn["scored_tokens"] == pytest.approx(own["loss"], rel=1e-4)
    # and its loss a character: the same sum over the documents' characters, one more for each one's end
    documents, _ = read_documents(str(tmp_path / "work" / "valid.txt"))
    assert own["loss_per_char"] == pytest.approx(aiayn["nll"] / sum(len(d) + 1 for d in documents), rel=1e-4)
    assert own["bits_per_char"] == pytest.approx(own["loss_per_char"] / math.log(2))
    record = json.loads(next((tmp_path / "records").glob("*-lm.json")).read_text(encoding="utf-8"))
    figures = {f["name"]: f for f in record["figures"]}
    assert figures["nanoGPT, valid bits"]["unit"] == "bits/char"
    assert figures["aiayn, valid loss"]["value"] == pytest.approx(aiayn["loss_per_char"])


def test_the_bench_keeps_the_keys_it_sets_and_gives_aiayn_nanogpts_sizes_unless_overridden(tmp_path):
    lm = load_benchmark("lm")
    paths = {"train": tmp_path / "train.txt", "valid": tmp_path / "valid.txt"}
    args = lm.parser().parse_args(["--text", "x.txt", "model.n_heads=2"])
    items = lm.aiayn_overrides(paths, args)
    assert "model.d_model=128" in items and "model.d_ff=512" in items and "max_source_len=64" in items
    assert "model.n_heads=4" not in items and items[-1] == "model.n_heads=2"
    assert "model.n_layers=4" in items  # the depth by the language model's own name
    deeper = lm.aiayn_overrides(paths, lm.parser().parse_args(["--text", "x.txt", "model.n_encoder_layers=2"]))
    assert not any(item.startswith("model.n_layers") for item in deeper)  # not a second depth beside the user's
    fitted = lm.aiayn_overrides(paths, lm.parser().parse_args(["--text", "x.txt", "--aiayn-sizes", "fitted"]))
    assert not any(item.startswith(("model.", "max_source_len")) for item in fitted)
    with pytest.raises(SystemExit, match="use --budget"):
        lm.aiayn_overrides(paths, lm.parser().parse_args(["--text", "x.txt", "time_budget=1m"]))


def test_nanogpt_schedule_warms_up_then_decays_by_a_cosine_to_its_floor():
    lm = load_benchmark("lm")
    s = lm.NanoGPT()
    rates = [lm.nanogpt_lr(it, s, 1000) for it in range(1200)]
    assert rates[0] == pytest.approx(s.learning_rate / (s.warmup_iters + 1))
    assert max(rates) == pytest.approx(s.learning_rate) and rates[s.warmup_iters] == pytest.approx(s.learning_rate)
    assert rates[550] == pytest.approx((s.learning_rate + s.min_lr) / 2)  # halfway through the decay
    assert rates[1000] == pytest.approx(s.min_lr) and rates[-1] == s.min_lr
