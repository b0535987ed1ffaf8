"""Shared fixtures: every test starts from a fixed seed and uses few threads."""

import os
import struct
import tempfile
from pathlib import Path

import pytest
import torch

# Tiny test models spend more time waking a second OpenMP thread than computing, and on a busy
# two-core machine each parallel op then waits milliseconds: one thread is ~100x faster here.
torch.set_num_threads(1)
# CPU training draws dropout's masks as random integers where that measured faster than `F.dropout`: a timing, and
# other masks. Tests, and the runs they launch, keep `F.dropout`'s (tests/backends/test_dropout.py checks the choice).
os.environ["AIAYN_DROPOUT"] = "bernoulli"
# Calibration and layout measurements (`calibrate.cache_dir()`) go to a folder of this test run, removed at its end,
# not the user's ~/.cache/aiayn: the suite's tiny models would leave their entries there, and a user's cache would
# decide what the suite measures. Set before any test module copies the environment for the runs it launches.
_CACHE = tempfile.TemporaryDirectory(prefix="aiayn-test-cache-")
os.environ["AIAYN_CACHE_DIR"] = _CACHE.name


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _training_left_to_the_machine_in_fp32(monkeypatch):
    """A run that leaves its precision to the machine trains in bf16 where a step measured faster so on a CPU with
    native bf16: a timing, which no test's result may hang on. Here it trains in fp32 unless a test says otherwise
    (tests/backends/test_backend.py checks the measurement and the choice)."""
    from aiayn.backends import calibrate

    monkeypatch.setattr(calibrate, "bf16_training_faster", lambda *args: False)


def tree_bytes(root) -> dict[str, bytes]:
    """Every file under `root` (relative path -> bytes): a snapshot to compare after a command ran."""
    from pathlib import Path

    root = Path(root)
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def frozen():
    """`check = frozen(root)` snapshots a tree; `check()` asserts every file is still there, byte for byte.

    `check(new_files=False)` also asserts that nothing was added; `ignore` names files allowed to change.
    """

    def take(root):
        before = tree_bytes(root)

        def check(*, new_files: bool = True, ignore: tuple[str, ...] = ()) -> None:
            after = tree_bytes(root)
            changed = sorted(p for p in before if p not in ignore and after.get(p) != before[p])
            assert not changed, f"changed or removed: {changed}"
            if not new_files:
                added = sorted(set(after) - set(before) - set(ignore))
                assert not added, f"new files: {added}"

        return check

    return take


def force_choices(monkeypatch, *, one: str = "columns", few: str = "packed", many: str = "packed",
                  train_onednn: bool = True, fused_qkv: bool = True, torch_layers: bool = False):
    """Make `select` see these measured choices (whatever this machine measured), the same kernel for every
    shape kind of a row class: every kernel can be tested on every machine. Returns the forced `calibrate.Choices`."""
    import dataclasses

    from aiayn.backends import calibrate

    by_rows = calibrate.by_shape({"one": one, "few": few, "many": many})
    forced = dataclasses.replace(calibrate.choices(), inference=by_rows,
                                 train_onednn=train_onednn, fused_qkv_inference=fused_qkv, fused_qkv_train=fused_qkv,
                                 torch_layers_inference=torch_layers)
    monkeypatch.setattr(calibrate, "choices", lambda refresh=False: forced)
    monkeypatch.setattr(calibrate, "training_choices", lambda *shape: (train_onednn, fused_qkv))
    monkeypatch.setattr(calibrate, "inference_layers", lambda *shape: (fused_qkv, torch_layers))
    return forced


@pytest.fixture
def other_work(monkeypatch):
    """`other_work(cores)`: from then on, every reading of the other programs' work on this process's cores
    (`timing.other_work` now, `timing.competing` around a measurement) says `cores`."""
    from contextlib import contextmanager

    from aiayn.backends import timing

    def reads(cores: float) -> None:
        @contextmanager
        def competing():
            yield timing.Competition(cores)

        monkeypatch.setattr(timing, "competing", competing)
        monkeypatch.setattr(timing, "other_work", lambda seconds=timing.SAMPLE_SECONDS: cores)

    return reads


@pytest.fixture
def quiet_cores(other_work):
    """Every reading of the other programs' work says none: what a test measures is kept and read back as on a quiet
    machine, whatever else the machine runs meanwhile (a measurement taken busy is discarded once it is quiet)."""
    other_work(0.0)


@pytest.fixture
def measured(monkeypatch):
    """`measured(one=..., few=..., many=..., train_onednn=..., fused_qkv=...)`: see `force_choices`."""
    return lambda **choices: force_choices(monkeypatch, **choices)


@pytest.fixture(params=["plain", "backend", "oneDNN"])
def run_on(request, monkeypatch):
    """How the module under test runs: as written ("plain"), as this machine's CPU inference backend
    prepares it ("backend": the kernels measured fastest here, stacked Q/K/V where faster), or with every
    product on oneDNN's prepacked kernel and MKL for one row ("oneDNN": what an AVX-512 machine measures).
    Call under no_grad."""
    if request.param == "plain":
        return lambda module: module
    from aiayn.backends import cpu, select

    if request.param == "oneDNN":
        if not cpu.onednn_usable():
            pytest.skip("this build or CPU does not run oneDNN's products")
        force_choices(monkeypatch)
    return select("cpu", "inference", "fp32").prepare


# A tiny translation run as `aiayn train` leaves it (the paper's interleaved positions, a shared BPE
# vocabulary): 60 steps of the built-in copy data set, enough that some outputs end with </s> and others run to the
# length limit. Shared by the tests of the loaded objects, `aiayn translate` and the exports.
TINY_RUN = ["dataset=copy", "dataset_train=200", "dataset_valid=10", "dataset_test=10", "model.d_model=32",
            "model.d_ff=64", "model.n_heads=4", "model.n_encoder_layers=1", "model.n_decoder_layers=1",
            "model.dropout=0", "model.max_len=64", "threads=1", "max_steps=60", "max_tokens=400", "vocab_size=60",
            "lr=3e-3", "warmup=10", "show_examples=0"]
# Inputs for translation runs: copy data set strings, other text, non-ASCII, a literal special token, an empty line.
SAMPLE_LINES = ["a b c", "h g f e", "d d d d d", "c a", "The cat sat.", "naïve café", "literal <s> here", "",
                "b h a g c f d e"]


@pytest.fixture(scope="session")
def translation_run(tmp_path_factory):
    """The directory of a tiny trained translation run."""
    from aiayn.cli.main import main

    run = tmp_path_factory.mktemp("translation") / "run"
    assert main(["train", *TINY_RUN, "--run", str(run), "--no-progress"]) == 0
    return run


WORDS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]
GERMAN = ["eins", "zwei", "drei", "vier", "fünf", "sechs", "sieben", "acht", "neun", "zehn"]
TINY_ENCODER = ["model.d_model=16", "model.d_ff=32", "model.n_heads=2", "model.n_encoder_layers=1", "model.dropout=0",
                "threads=1", "max_steps=40", "warmup=5", "lr=3e-3", "max_tokens=200", "vocab_size=60",
                "show_examples=0"]
# Texts the tiny classification run learns: odd-numbered words are "good" (pos), even ones "bad" (neg).
CLASSIFIED = [(f"{WORDS[i % 10]} is {'good' if i % 2 else 'bad'}", "pos" if i % 2 else "neg") for i in range(60)]
# Sentences the tiny tagging run learns: "Four visits Drei" -> B-PER O B-LOC.
TAGGED = [[(WORDS[i % 10].title(), "B-PER"), ("visits", "O"), (GERMAN[i % 10].title(), "B-LOC")] for i in range(30)]


def _train_run(tmp_path_factory, name: str, data_name: str, lines: list[str], objective: str):
    from aiayn.cli.main import main

    root = tmp_path_factory.mktemp(name)
    data = root / data_name
    data.write_text("\n".join(lines) + "\n", encoding="utf-8")
    run = root / "run"
    assert main(["train", f"train={data}", f"objective={objective}", *TINY_ENCODER, "--run", str(run),
                 "--no-progress"]) == 0
    return run


@pytest.fixture(scope="session")
def classification_run(tmp_path_factory):
    """A tiny trained sentiment-like classification run (labels neg, pos); 100% on its test split."""
    return _train_run(tmp_path_factory, "classification", "train.csv",
                      ["text,label", *(f"{text},{label}" for text, label in CLASSIFIED)], "sequence_classification")


@pytest.fixture(scope="session")
def tagging_run(tmp_path_factory):
    """A tiny trained tagging run (tags B-LOC, B-PER, O) from CoNLL."""
    lines = [line for sentence in TAGGED for line in [*(f"{w} {t}" for w, t in sentence), ""]]
    return _train_run(tmp_path_factory, "tagging", "train.conll", lines, "token_classification")


def around_steps(monkeypatch, around) -> None:
    """Run every decoding step `generate` takes as `around(step, tokens)`, `step` the state's own (tokens -> logits):
    to count the steps, or to watch what happens inside them."""
    from aiayn.inference import generation

    begin = generation.start_decoding

    def start(*args, **kwargs):
        state = begin(*args, **kwargs)
        step = state.step
        state.step = lambda tokens: around(step, tokens)
        return state

    monkeypatch.setattr(generation, "start_decoding", start)


def write_mo(path: Path, messages: dict[str, str | bytes]) -> None:
    """A compiled gettext catalog (GNU .mo, little-endian, no hash table) holding `messages` (a value given as bytes
    is written as it is, in whatever encoding)."""
    keys = sorted(messages)
    ids = [k.encode() for k in keys]
    strs = [v if isinstance(v, bytes) else v.encode() for v in (messages[k] for k in keys)]
    start = 7 * 4 + 16 * len(keys)
    table, data = [], b""
    for item in ids + strs:
        table.append((len(item), start + len(data)))
        data += item + b"\0"
    header = struct.pack("<7I", 0x950412DE, 0, len(keys), 28, 28 + 8 * len(keys), 0, 0)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(header + b"".join(struct.pack("<2I", *entry) for entry in table) + data)
