"""Sizes by arithmetic: a config's model is counted from its numbers before anything is built, so any config
is answered at once (refused with its sizes named, exit code 4), and what a model directory holds must agree
with its config (shapes, dtypes, nesting) before it runs."""

import json
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

import aiayn
import aiayn.nn.sizes
from aiayn.cli.main import main
from aiayn.config import PRESETS, ModelConfig
from aiayn.io import save_model
from aiayn.nn.model import build_model
from aiayn.nn.sizes import TABLE_BUILD_BYTES, model_bytes, parameter_count
from aiayn.tokenization import train_tokenizer

WORDS = ["the cat sat on the mat", "a dog ran in the park", "birds fly over the sea"] * 5
MACHINE = 16 * 2**30  # every test sees a machine with 16 GiB available, whatever this one has


@pytest.fixture(autouse=True)
def sixteen_gib(monkeypatch):
    monkeypatch.setattr(aiayn.nn.sizes, "available_memory", lambda: MACHINE)


@pytest.fixture
def model_dir(tmp_path):
    """A tiny encoder-decoder model directory with its tokenizer."""
    tokenizer = train_tokenizer(WORDS, vocab_size=60, kind="bpe")
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=tokenizer.vocab_size, pad_id=tokenizer.pad_id, d_model=16, n_heads=2, d_ff=32,
                      n_encoder_layers=1, n_decoder_layers=1, max_len=32)
    return save_model(build_model(cfg), tmp_path / "model", tokenizer=tokenizer)


def set_config(directory, **changes):
    path = directory / "config.json"
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def run_cli(args, capsys):
    code = main(args)
    err = capsys.readouterr().err.strip()
    return code, err


VARIANTS = [
    dict(share_embeddings=False, tie_embeddings=False, tgt_vocab_size=500, vocab_size=300),
    dict(n_decoder_layers=0, head="masked_lm", positional="learned", type_vocab_size=2, embedding_norm=True),
    dict(n_decoder_layers=0, head="masked_lm", tie_embeddings=False, norm_first=True, bias=False),
    dict(n_decoder_layers=0, head="sequence_classification", num_labels=3),
    dict(n_decoder_layers=0, head="token_classification", num_labels=5, positional="none"),
    dict(norm_first=True, bias=False, positional="learned", type_vocab_size=3, embedding_norm=True,
         share_embeddings=False),
]


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_the_arithmetic_counts_every_parameter_of_the_presets(name):
    cfg = PRESETS[name]
    with torch.device("meta"):
        model = build_model(cfg)
    assert parameter_count(cfg) == sum(p.numel() for p in model.parameters())


def test_the_base_preset_is_the_papers_65m_model():
    # Table 3 rounds to 65M; with the shared 37,000-token vocabulary the count is 63.1M
    assert parameter_count(PRESETS["base"]) == 63_082_496
    assert 60e6 < parameter_count(PRESETS["base"]) < 66e6
    assert 210e6 < parameter_count(PRESETS["big"]) < 215e6  # Table 3's 213M


@pytest.mark.parametrize("changes", VARIANTS, ids=lambda c: ",".join(c))
def test_the_arithmetic_counts_every_option(changes):
    cfg = PRESETS["tiny"].replace(**changes)
    assert parameter_count(cfg) == sum(p.numel() for p in build_model(cfg).parameters())


def test_the_estimate_bounds_what_building_a_model_takes():
    cfg = PRESETS["small"]
    model = build_model(cfg)
    held = sum(t.numel() * t.element_size() for t in {id(t): t for t in [*model.parameters(), *model.buffers()]}
               .values())
    # and one block of a sinusoidal table's float64 work, and Python's modules of six layers
    assert held <= model_bytes(cfg) < held * 1.1 + TABLE_BUILD_BYTES + 2**20


@pytest.mark.parametrize("layers", [10**6, 10**9])
def test_a_config_of_a_million_layers_is_answered_at_once(layers):
    cfg = PRESETS["tiny"].replace(n_encoder_layers=layers)
    start = time.perf_counter()
    with pytest.raises(MemoryError, match=rf"needs about [\d,.]+ GiB of memory, more than the 16.0 GiB available "
                                          rf"\(.*layers {layers:,}\+2.*\): make the layers \(n_encoder_layers"):
        build_model(cfg)
    assert time.perf_counter() - start < 1


def test_translate_refuses_a_run_of_a_million_layers_within_a_second(model_dir, capsys):
    set_config(model_dir, n_encoder_layers=10**6)
    start = time.perf_counter()
    code, err = run_cli(["translate", "--run", str(model_dir), "the cat"], capsys)
    assert time.perf_counter() - start < 5  # (well under one second here; generous for a busy machine)
    assert code == 4
    assert err.count("\n") == 0 and "Traceback" not in err
    assert "layers 1,000,000+1" in err and "make the layers (n_encoder_layers" in err


def test_load_refuses_a_hundred_thousand_layers_at_once(model_dir):
    set_config(model_dir, n_decoder_layers=10**5, d_model=512, n_heads=8, d_ff=2048)
    start = time.perf_counter()
    with pytest.raises(MemoryError, match=r"layers 1\+100,000"):
        aiayn.load(model_dir)
    assert time.perf_counter() - start < 5


def test_a_position_table_too_long_for_the_memory_is_refused_naming_max_len():
    # 1.2 MB of parameters, but two sinusoidal tables of 50M x 64 (12.8 GB each)
    cfg = PRESETS["tiny"].replace(max_len=50_000_000)
    with pytest.raises(MemoryError, match=r"max_len 50,000,000.*make max_len smaller"):
        build_model(cfg)
    assert model_bytes(cfg) > 2 * 50_000_000 * 64 * 4


PEAK = """
import resource, sys
from aiayn.config import ModelConfig
from aiayn.nn.model import build_model
from aiayn.nn.sizes import model_bytes
cfg = ModelConfig(vocab_size=100, d_model=16, n_heads=2, d_ff=32, n_encoder_layers=1, n_decoder_layers=1,
                  max_len=4_000_000)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
model = build_model(cfg)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before, model_bytes(cfg))
"""


def test_the_estimate_bounds_the_peak_of_building_long_position_tables():
    import subprocess
    import sys

    # two tables of 4M x 16: 512 MB; built a block of rows at a time, the peak stays near them (not 6x)
    out = subprocess.run([sys.executable, "-c", PEAK], capture_output=True, text=True, timeout=120, check=True)
    peak, estimate = map(int, out.stdout.split())
    assert 2 * 4_000_000 * 16 * 4 <= estimate < 1.2 * 2 * 4_000_000 * 16 * 4
    assert peak <= estimate


def test_a_type_vocabulary_of_a_billion_is_refused_by_the_arithmetic():
    cfg = PRESETS["tiny"].replace(n_decoder_layers=0, type_vocab_size=10**9)
    with pytest.raises(MemoryError, match=r"type_vocab_size 1,000,000,000.*make type_vocab_size smaller"):
        build_model(cfg)


def test_loading_counts_the_weights_file_beside_the_model(model_dir, monkeypatch):
    weights = (model_dir / "model.safetensors").stat().st_size
    monkeypatch.setattr(aiayn.nn.sizes, "available_memory", lambda: weights + 2**10)  # the file alone fits
    with pytest.raises(MemoryError, match=r"the model in .* needs about"):
        aiayn.load(model_dir)


def test_a_config_nested_a_hundred_thousand_levels_is_one_line(model_dir, capsys):
    (model_dir / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    code, err = run_cli(["translate", "--run", str(model_dir), "the cat"], capsys)
    assert code == 2
    assert "config.json: not valid JSON (nested too deeply" in err
    assert err.count("\n") == 0 and "RecursionError" not in err


def test_a_weight_of_another_dtype_is_refused_naming_the_tensor(model_dir, capsys):
    path = model_dir / "model.safetensors"
    state = load_file(path)
    name = sorted(k for k in state if k.endswith("q_proj.weight"))[0]
    state[name] = (state[name] * 100).to(torch.int64)
    save_file(state, path)
    before = path.read_bytes()
    code, err = run_cli(["translate", "--run", str(model_dir), "the cat"], capsys)
    assert code == 2
    assert f"{name} is int64 in the file but float32 in the model" in err
    assert path.read_bytes() == before


def test_the_parameter_table_of_a_million_layers_is_arithmetic(tmp_path, capsys):
    from aiayn.inspect import parameter_table

    cfg = PRESETS["base"].replace(n_encoder_layers=10**6)
    start = time.perf_counter()
    rows = dict(parameter_table(cfg))
    assert time.perf_counter() - start < 5
    assert rows["total"] == parameter_count(cfg)
    assert rows["1000000 encoder layers"] == 10**6 * rows["one encoder layer"]
    assert main(["params", "--preset", "tiny", "n_decoder_layers=1000000"]) == 0
    total = parameter_count(PRESETS["tiny"].replace(n_decoder_layers=10**6))
    assert capsys.readouterr().out.splitlines()[-1].endswith(f"{total:,}")


def test_params_names_a_config_nested_too_deeply(tmp_path, capsys):
    path = tmp_path / "deep.json"
    path.write_text("{" + '"a": {' * 100_000 + "}" * 100_001)
    code, err = run_cli(["params", "--config", str(path)], capsys)
    assert code == 2
    assert err == (f"aiayn params: error: {path}: not valid JSON (nested too deeply (more levels of [ and {{ than a "
                   "parser can follow): line 1 column 1 (char 0))")


TINY_RUN = ["dataset=copy", "dataset_train=40", "dataset_valid=4", "dataset_test=4", "dataset_max_len=4",
            "vocab_size=20", "threads=1", "model.d_model=16", "model.d_ff=32", "model.n_heads=2",
            "model.n_encoder_layers=1", "model.n_decoder_layers=1", "warmup=10", "show_examples=0", "max_steps=1"]


def test_training_batches_too_large_for_the_memory_are_refused_before_the_model_is_built(tmp_path, capsys):
    code, err = run_cli(["train", *TINY_RUN, f"max_tokens={10**9}", "--run", str(tmp_path / "run"),
                         "--no-progress"], capsys)
    assert code == 4
    assert err.count("\n") == 0
    assert "training with batches of max_tokens=1000000000 needs about" in err
    assert "more than the 16.0 GiB available" in err and "make max_tokens or" in err
    assert not (tmp_path / "run" / "model.safetensors").exists()
    code, err = run_cli(["train", *TINY_RUN, "max_tokens=100", "--run", str(tmp_path / "ok"), "--no-progress"],
                        capsys)
    assert code == 0, err


def test_a_forward_pass_too_large_for_the_memory_is_refused_before_it_runs(monkeypatch):
    from aiayn.inference import Embedder

    tokenizer = train_tokenizer(WORDS, vocab_size=60, kind="bpe")
    cfg = ModelConfig(vocab_size=tokenizer.vocab_size, d_model=16, n_heads=2, d_ff=32, n_encoder_layers=1,
                      n_decoder_layers=0, max_len=64)
    embedder = Embedder(build_model(cfg), tokenizer)
    assert embedder.embed("the cat").shape == (16,)
    monkeypatch.setattr(aiayn.nn.sizes, "available_memory", lambda: 10_000)
    with pytest.raises(MemoryError, match=r"a batch of 1 text of \d+ tokens needs about .* smaller batch_size"):
        embedder.embed(["the cat sat on the mat " * 4])


LAYERS = """
import resource, sys
from aiayn.config import ModelConfig
from aiayn.nn.model import build_model
n = 2000
kind = sys.argv[1]
cfg = ModelConfig(vocab_size=10, d_model=2, n_heads=1, d_ff=2, max_len=4,
                  n_encoder_layers=n if kind == "encoder" else 1, n_decoder_layers=n if kind == "decoder" else 0)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
model = build_model(cfg)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before) // n)
"""


@pytest.mark.parametrize("kind", ["encoder", "decoder"])
def test_python_s_memory_for_a_layer_is_within_the_arithmetic(kind):
    import subprocess
    import sys

    from aiayn.nn.sizes import DECODER_LAYER_OVERHEAD, ENCODER_LAYER_OVERHEAD

    out = subprocess.run([sys.executable, "-c", LAYERS, kind], capture_output=True, text=True, timeout=120,
                         check=True)
    per_layer = int(out.stdout)  # with widths of 2, a layer's memory is its Python objects
    assert per_layer <= (ENCODER_LAYER_OVERHEAD if kind == "encoder" else DECODER_LAYER_OVERHEAD)
