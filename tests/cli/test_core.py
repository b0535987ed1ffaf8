"""`aiayn params` and `aiayn trace`, run through the CLI entry point as a user would (docs/core.md)."""

import re

import pytest
import torch

from aiayn.cli.main import main
from aiayn.config import preset
from aiayn.inspect import demo_model
from aiayn.io import save_model
from aiayn.nn.model import build_model

SEED_004 = {
    "encoder layer: multi-head attention": "1,050,624",
    "encoder layer: feed-forward network": "2,099,712",
    "encoder layer: two layer norms": "2,048",
    "one encoder layer": "3,152,384",
    "six encoder layers": "18,914,304",
}


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def row(out: str, name: str) -> str:
    match = re.search(rf"^{re.escape(name)}\s+([\d,]+)$", out, re.MULTILINE)
    assert match, f"no row {name!r} in:\n{out}"
    return match.group(1)


def test_params_base_prints_seed_004_figures_and_the_total(capsys):
    code, out, _ = run(capsys, "params", "--preset", "base")
    assert code == 0
    for name, value in SEED_004.items():
        assert row(out, name) == value
    assert row(out, "total") == "63,082,496"
    assert row(out, "embeddings (shared, 37,000 x 512)") == "18,944,000"


def test_params_big_total(capsys):
    code, out, _ = run(capsys, "params", "--preset", "big")
    assert code == 0 and row(out, "total") == "214,245,376"


def test_params_counts_match_the_built_model(capsys):
    code, out, _ = run(capsys, "params", "--preset", "tiny", "n_heads=8", "norm_first=true")
    assert code == 0
    model = build_model(preset("tiny").replace(n_heads=8, norm_first=True))
    total = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    assert row(out, "total") == f"{total:,}"
    assert "final layer norms (pre-LN)" in out


def test_params_from_a_config_file(capsys, tmp_path):
    path = tmp_path / "config.json"
    preset("tiny").replace(n_decoder_layers=0, head="masked_lm").to_json(path)
    code, out, _ = run(capsys, "params", "--config", str(path))
    assert code == 0 and out.startswith("encoder-only:") and "head (masked_lm)" in out


@pytest.mark.parametrize(("argv", "message"), [
    (["params", "--preset", "tiny", "n_heads=3"], r"d_model \(64\) must be divisible by n_heads \(3\)"),
    (["params", "d_modle=5"], "unknown config key 'd_modle'"),
    (["params", "d_model=wide"], "d_model expects an integer, got 'wide'"),
    (["params", "--preset", "huge"], "unknown preset 'huge'"),
    (["params", "--config", "/nonexistent/config.json"], "No such file"),
])
def test_params_bad_input_is_one_line_and_exit_code_2(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert err.startswith("aiayn params: error:") and err.count("\n") == 1
    assert re.search(message, err)


STAGES = [
    r"^tokens \(3\): \['How", r"^token ids \(3,\): \[", r"^token embedding x sqrt\(d_model\) +\(3, 64\)",
    r"^\+ positional encoding \(sinusoidal\) +\(3, 64\)", r"^-- encoder layer 1 --",
    r"^enc1 Q = x W_Q, split into heads +\(4, 3, 16\)", r"^enc1 K = x W_K +\(4, 3, 16\)",
    r"^enc1 V = x W_V +\(4, 3, 16\)", r"^enc1 scores Q K\^T / sqrt\(d_k\) +\(4, 3, 3\)",
    r"^enc1 softmax weights +\(4, 3, 3\)", r"^enc1 heads concatenated +\(3, 64\)",
    r"^enc1 after Add & Norm 1 +\(3, 64\)", r"^enc1 FFN hidden \(relu\) +\(3, 256\)",
    r"^enc1 after Add & Norm 2 +\(3, 64\)", r"^-- encoder layer 2 --", r"^encoder output \(memory\) +\(3, 64\)",
    r"^-- decoder layer 1 --", r"^logits = Linear\(decoder output\)", r"^softmax: next-token probabilities",
]


def assert_stages_in_order(out: str) -> None:
    position = 0
    for pattern in STAGES:
        match = re.compile(pattern, re.MULTILINE).search(out, position)
        assert match, f"stage {pattern!r} missing or out of order in:\n{out}"
        position = match.end()


def test_trace_prints_every_stage_in_order(capsys):
    code, out, _ = run(capsys, "trace", "How are you")
    assert code == 0
    assert_stages_in_order(out)


def test_trace_works_on_a_saved_model(capsys, tmp_path):
    model, tokenizer = demo_model(seed=3)
    save_model(model, tmp_path / "run", tokenizer=tokenizer)
    code, out, _ = run(capsys, "trace", "--run", str(tmp_path / "run"), "How are you")
    assert code == 0
    assert_stages_in_order(out)
    assert "untrained" not in out
    with torch.no_grad():
        first_value = float(model.src_embed.tokens(torch.tensor([tokenizer.encode("How are you")]))[0, 0, 0])
    assert f"[{first_value:.3f}," in out  # the saved weights, not a fresh model


def test_trace_on_a_missing_run_is_an_error(capsys, tmp_path):
    code, _, err = run(capsys, "trace", "--run", str(tmp_path / "nothing"))
    assert code == 2 and "nothing is not an aiayn model directory (no such directory)" in err


def test_bench_encoder_runs_on_a_tiny_configuration(capsys):
    # The real measurement (`aiayn bench encoder`, base sizes) is for a quiet machine, not a test;
    # this checks that the script runs end to end, agrees with torch's output and prints its ratios.
    code, out, _ = run(capsys, "bench", "encoder", "--preset", "tiny", "--batch", "2", "--length", "8",
                       "--repeats", "2", "--warmup", "1", "--matmul-size", "64", "--profile")
    assert code == 0 and "where aiayn's forward spends its time" in out
    shares = [float(m) for m in re.findall(r"([\d.]+)% of the time", out)]
    assert len(shares) >= 3 and abs(sum(shares) - 100) < 0.5
    diff = float(re.search(r"max \|aiayn - torch\| = ([\d.e+-]+)", out).group(1))
    assert diff < 1e-5
    for name in ("aiayn Encoder", "aiayn Encoder, plain modules"):
        assert re.search(rf"{name}: [\d.]+x the torch fast path .*, [\d.]+% of the matmul peak", out)


def test_bench_runs_the_scripts_of_the_source_tree(capsys):
    code, out, _ = run(capsys, "bench", "train", "--preset", "tiny", "--max-tokens", "64", "--mean-len", "5",
                       "--steps", "1", "--warmup", "0", "--device", "cpu")
    assert code == 0 and "backend cpu train fp32" in out and "aiayn / torch.nn.Transformer" in out
    assert "aiayn / Hugging Face Marian" in out
    from aiayn.cli.bench import BENCHMARK_DIR, load_benchmark

    assert all((BENCHMARK_DIR / f"{name}.py").is_file() for name in ("encoder", "train", "generate", "embed", "long"))
    assert load_benchmark("embed").__name__ == "aiayn_benchmark_embed"
    with pytest.raises(FileNotFoundError, match="scripts in the aiayn source tree"):
        load_benchmark("nonexistent")


def test_bench_train_with_two_threads_also_times_two_data_parallel_processes(capsys):
    import torch

    before = torch.get_num_threads()
    try:
        code, out, _ = run(capsys, "bench", "train", "--preset", "tiny", "--max-tokens", "64", "--mean-len", "5",
                           "--steps", "2", "--warmup", "0", "--device", "cpu", "--threads", "2")
    finally:
        torch.set_num_threads(before)
    assert code == 0
    assert re.search(r"aiayn, 2 processes x 1 thread \(DDP\) +\d+ tokens/s", out)
    assert re.search(r"\(DDP\) / Hugging Face Marian \(2 threads\): [\d.]+x tokens/s", out)


def test_bench_long_measures_each_length_in_its_own_process(capsys):
    code, out, _ = run(capsys, "bench", "long", "--preset", "tiny", "--lengths", "96", "--naive-max", "96")
    assert code == 0
    rows = {path: line.split() for line in out.splitlines() for path in ("fused", "written")
            if line.strip().startswith("96") and path in line}
    assert rows.keys() == {"fused", "written"}
    assert all(float(row[-1]) > 0 for row in rows.values())  # a peak was measured for both paths


def test_bench_encoder_rejects_bad_sizes(capsys):
    code, _, err = run(capsys, "bench", "encoder", "--batch", "0")
    assert code == 2 and "--batch must be at least 1" in err


def test_docs_python_examples():
    # docs/core.md: build a tiny model, run it, and check it against the NumPy reference.
    from aiayn import build_model, preset, reference

    model = build_model(preset("tiny")).eval()
    src = torch.tensor([[5, 6, 7, 0]])  # 0 is <pad>
    tgt = torch.tensor([[1, 9, 10]])
    logits = model(src, tgt)
    assert logits.shape == (1, 3, 1000)
    weights = reference.export_weights(model)
    expected = reference.forward(weights, model.config, src.numpy(), tgt.numpy())
    torch.testing.assert_close(logits, torch.from_numpy(expected).float(), atol=1e-5, rtol=0)


def test_key_values_after_an_option_are_accepted(capsys):
    assert main(["params", "--preset", "tiny", "n_heads=2"]) == 0
    assert "h=2" in capsys.readouterr().out
    assert main(["params", "d_model=128", "--preset", "tiny", "n_heads=2"]) == 0
    out = capsys.readouterr().out
    assert "d_model=128" in out and "h=2" in out


def test_unknown_options_are_still_rejected(capsys):
    with pytest.raises(SystemExit) as err:
        main(["params", "--preset", "tiny", "--bogus"])
    assert err.value.code == 2
    assert "--bogus" in capsys.readouterr().err


def test_the_cli_lets_openmp_threads_sleep_while_they_wait_unless_told_otherwise():
    """Spinning OpenMP threads hold their cores, so a command on a shared machine waits for descheduled siblings
    (docs/training.md, "On a shared machine"): the CLI sets OMP_WAIT_POLICY=PASSIVE before torch loads libgomp,
    and keeps the user's own setting."""
    import os
    import subprocess
    import sys

    probe = ("import os, sys; from aiayn.cli.main import main; "
             "main(['params', '--preset', 'tiny']); print(os.environ.get('OMP_WAIT_POLICY'), file=sys.stderr)")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    for given, expected in ((None, "PASSIVE"), ("ACTIVE", "ACTIVE")):
        run_env = env if given is None else {**env, "OMP_WAIT_POLICY": given}
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=run_env, timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stderr.strip().splitlines()[-1] == expected


def test_bench_file_translates_a_test_file_with_the_run_and_its_ctranslate2_export(capsys, translation_run, tmp_path):
    from tests.conftest import SAMPLE_LINES

    data = tmp_path / "test.tsv"  # the copy task: each source is its own reference
    data.write_text("".join(f"{line}\t{line}\n" for line in SAMPLE_LINES if line), encoding="utf-8")
    code, out, err = run(capsys, "bench", "file", "--run", str(translation_run), "--data", str(data), "--threads", "1",
                       "--repeats", "1")
    assert code == 0 and "8 sentences" in out, err
    for search in ("greedy", "beam-4"):
        assert re.search(rf"{search} +aiayn fp32 +[\d.]+ s +[\d.]+ sentences/s +BLEU +[\d.]+ +chrF", out), out
    try:
        import ctranslate2  # noqa: F401
    except ImportError:
        assert "CTranslate2 not installed" in out
        return
    assert re.search(r"greedy +CTranslate2 fp32 +[\d.]+ s .*BLEU", out)
    assert re.search(r"beam-4 +aiayn fp32 / CTranslate2 fp32: [\d.]+x", out)
    # the same engine on aiayn's own batches, one call a batch
    assert re.search(r"greedy +CTranslate2 fp32, aiayn's batches +[\d.]+ s .*BLEU", out)
    assert re.search(r"beam-4 +aiayn fp32 / CTranslate2 fp32 on aiayn's batches: [\d.]+x", out)
