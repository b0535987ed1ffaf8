"""Hostile input through the Python API: the same one-line messages as the CLI, raised before anything runs,
and files left as they were. Readers, run-directory kinds, atomic writes and the exit-code mapping too."""

import errno
import json
import os
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import aiayn
from aiayn.cli.errors import describe
from aiayn.config import ModelConfig, preset
from aiayn.data.gettext import read_gettext
from aiayn.data.readers import read_classification, read_lines, read_parallel, read_text
from aiayn.inference.embeddings import Embedder
from aiayn.inference.generation import GenerationConfig
from aiayn.inference.translator import Translator
from aiayn.io import load_model, save_model
from aiayn.nn.masks import check_mask
from aiayn.nn.model import build_model
from aiayn.paths import check_output_file
from aiayn.rundir import (
    EMPTY,
    EXPORT,
    FILE,
    FOREIGN,
    HF_CHECKPOINT,
    MISSING,
    MODEL,
    RUN,
    DirectoryRefused,
    OutputRefused,
    RunBusy,
    RunLock,
    atomic_write_bytes,
    inspect_dir,
    open_run_dir,
)
from aiayn.tokenization import Tokenizer, train_tokenizer
from aiayn.training import TrainConfig, Trainer, TrainingError, load_run_config
from aiayn.weights import WeightsError, WeightsMismatch, read_torch_file

TINY = ModelConfig(vocab_size=40, d_model=16, n_heads=2, d_ff=32, n_encoder_layers=1, n_decoder_layers=1, max_len=16)


@pytest.fixture
def saved(tmp_path):
    """TINY with its tokenizer's vocabulary (the parts of a model directory agree)."""
    tokenizer = train_tokenizer(["a b c", "b c d"] * 3, vocab_size=20)
    torch.manual_seed(0)
    model = build_model(TINY.replace(vocab_size=tokenizer.vocab_size))
    save_model(model, tmp_path / "m", tokenizer=tokenizer)
    return tmp_path / "m"


def edit_config(**changes):
    def prepare(p):
        path = Path(p, "config.json")
        path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return prepare


def _edit_weights(directory, change):
    from safetensors.torch import load_file

    state = load_file(directory / "model.safetensors")
    change(state)
    save_file(state, directory / "model.safetensors")


class Evil:
    def __reduce__(self):
        return (os.system, ("true",))


def nothing(p):
    return None


def write(name, text):
    return lambda p: Path(p, name).write_text(text)


def weights(change):
    return lambda p: _edit_weights(p, change)


def unfinished_run(p):
    """A run interrupted before its final model: train_config.json and a checkpoint, no config.json."""
    run = Path(p).parent / "r"
    (run / "checkpoints" / "step-00000001").mkdir(parents=True)
    (run / "train_config.json").write_text("{}")
    (run / "checkpoints" / "latest").write_text("step-00000001\n")


def pooling_config(text):
    def prepare(p):
        (Path(p) / "1_Pooling").mkdir()
        (Path(p) / "1_Pooling" / "config.json").write_text(text)
    return prepare


def pooling_settings(p):
    from aiayn.inference.embeddings import SentenceSettings

    return SentenceSettings.read(Path(p), model_max_len=16)


# (name, prepare the model directory, call, exception, message)
API_CASES = [
    ("build_model(dict)", nothing, lambda p: build_model(TINY.to_dict()), TypeError,
     r"build_model takes a ModelConfig, got dict \(from a dict: build_model\(ModelConfig.from_dict\(d\)\)\)"),
    ("ModelConfig: a string where a bool belongs", nothing,
     lambda p: ModelConfig.from_dict({**TINY.to_dict(), "bias": "no"}), ValueError,
     r"bias must be true or false, got 'no'"),
    ("ModelConfig: a string where an int belongs", nothing, lambda p: TINY.replace(max_len="16"), ValueError,
     r"max_len must be a positive integer, got '16'"),
    ("ModelConfig: a number where a choice belongs", nothing, lambda p: TINY.replace(pooling=1), ValueError,
     r"pooling must be one of first, mean; got 1"),
    ("TrainConfig: a string where a bool belongs", nothing, lambda p: TrainConfig(dataset="copy", bf16="yes"),
     ValueError, r"training key bf16 must be true or false, got 'yes' \(str\)"),
    ("TrainConfig: a float where an int belongs", nothing, lambda p: TrainConfig(dataset="copy", epochs=2.5),
     ValueError, r"training key epochs must be an integer, got 2.5"),
    ("TrainConfig: a data set and files", nothing, lambda p: TrainConfig(dataset="numbers", valid="v.tsv"), ValueError,
     r"dataset=numbers makes its own data but valid=v.tsv names files too"),
    ("load_run_config: JSON of the wrong type", write("c.json", '{"dataset": "copy", "lr": "fast"}'),
     lambda p: load_run_config(Path(p, "c.json")), ValueError, r"c.json: training key lr must be a number, got 'fast'"),
    ("GenerationConfig: min_len above max_len", nothing, lambda p: GenerationConfig(min_len=9, max_len=4),
     ValueError, r"min_len 9 is above max_len 4"),
    ("an ambiguous 2-D mask", nothing, lambda p: check_mask(torch.ones(3, 5, dtype=torch.bool), 3, 3, 5),
     ValueError, r"attention mask of shape \(3, 5\) is ambiguous: batch and query length are both 3"),
    ("a float mask", nothing, lambda p: check_mask(torch.ones(2, 5), 2, 4, 5), ValueError,
     r"attention mask must be a bool tensor \(True = may attend\), got torch.float32"),
    ("a mask that does not fit", nothing, lambda p: check_mask(torch.ones(2, 6, dtype=torch.bool), 2, 4, 5),
     ValueError, r"attention mask of shape \(1, 1, 2, 6\) does not fit \(batch 2, queries 4, keys 5\)"),
    ("ids outside the vocabulary", nothing, lambda p: build_model(TINY).encode(torch.tensor([[1, 40]])),
     ValueError, r"token id 40 is outside the vocabulary \(size 40\)"),
    ("float ids", nothing, lambda p: build_model(TINY).encode(torch.rand(1, 3)), ValueError,
     r"token ids must be an int64 or int32 tensor"),
    ("load_model: truncated weights",
     lambda p: Path(p, "model.safetensors").write_bytes(Path(p, "model.safetensors").read_bytes()[:100]),
     load_model, WeightsError, r"model.safetensors is not a complete safetensors file"),
    ("load_model: NaN weight", weights(lambda s: s["encoder.layers.0.feed_forward.linear1.weight"].fill_(float("nan"))),
     load_model, WeightsError,
     r"non-finite weights \(encoder.layers.0.feed_forward.linear1.weight has 512 NaN and 0 Inf values\)"),
    ("load_model: shapes listed key by key", edit_config(d_ff=64),
     load_model, WeightsMismatch, r"does not fit the model of its config: decoder.layers.0.feed_forward.linear1.bias "
                                  r"is \(32,\) in the file but \(64,\) in the model; .*; and 2 more$"),
    ("load_model: a key missing", weights(lambda s: s.pop("encoder.layers.0.feed_forward.linear2.bias")),
     load_model, WeightsMismatch, r"missing encoder.layers.0.feed_forward.linear2.bias"),
    ("load_model: config.json missing a key",
     write("config.json", json.dumps({k: v for k, v in TINY.to_dict().items() if k != "scale_embeddings"})),
     load_model, ValueError, r"config.json lacks scale_embeddings"),
    ("load_model: a file, not a directory", nothing, lambda p: load_model(Path(p, "config.json")),
     NotADirectoryError, r"config.json is not an aiayn model directory"),
    ("Tokenizer.load: corrupt tokenizer.json", write("tokenizer.json", '{"version": "1.0", "trunc'), Tokenizer.load,
     ValueError, r"tokenizer.json: not a readable tokenizer file \(EOF while parsing"),
    ("a pickle with code in it", lambda p: torch.save({"x": Evil()}, Path(p, "x.pt")),
     lambda p: read_torch_file(Path(p, "x.pt")), WeightsError, r"x.pt: refused: this pickle holds Python objects"),
    ("Trainer(run_dir='')", nothing, lambda p: Trainer(load_run_config(None, ["dataset=copy"]), ""), DirectoryRefused,
     r"--run is empty"),
    # values: finite, in range, the right type
    ("ModelConfig: layer_norm_eps=nan", nothing, lambda p: preset("tiny").replace(layer_norm_eps=float("nan")),
     ValueError, r"layer_norm_eps must be a finite number, got nan"),
    ("TrainConfig: lr=inf", nothing, lambda p: TrainConfig(dataset="copy", lr=float("inf")), ValueError,
     r"training key lr must be a finite number, got inf"),
    ("translate(length_penalty=nan)", nothing, lambda p: Translator.from_pretrained(p).translate(
        "a b", length_penalty=float("nan")), ValueError, r"decoding key length_penalty must be a finite number"),
    ("translate(num_beams=True)", nothing, lambda p: Translator.from_pretrained(p).translate("a b", num_beams=True),
     ValueError, r"decoding key num_beams must be an integer, got True \(bool\)"),
    ("translate(max_new_tokens=-5) names max_new_tokens", nothing,
     lambda p: Translator.from_pretrained(p).translate("a b", max_new_tokens=-5), ValueError,
     r"^max_new_tokens must be a positive integer or None, got -5$"),
    ("translate(b'abc')", nothing, lambda p: Translator.from_pretrained(p).translate(b"abc"), ValueError,
     r"texts must be a string or a list of strings, got bytes: decode it first"),
    ("translate(num_beams=1000000)", nothing, lambda p: Translator.from_pretrained(p).translate("a b",
                                                                                               num_beams=10**6),
     ValueError, r"num_beams 1000000 is more than the target vocabulary \(\d+ tokens\)"),
    ("Embedder(max_length=0)", nothing, lambda p: Embedder.from_pretrained(p, max_length=0), ValueError,
     r"max_length must be at least 3 \(\[CLS\] token \[SEP\]\), got 0"),
    ("sentence-transformers pooling_mode_cls_token: 'yes'", pooling_config('{"pooling_mode_cls_token": "yes"}'),
     pooling_settings, ValueError,
     r"1_Pooling/config.json: pooling_mode_cls_token must be true or false, got 'yes'"),
    ("read_gettext(n_valid=-1)", nothing, lambda p: read_gettext("fr", n_valid=-1), ValueError,
     r"n_valid must be a non-negative integer, got -1"),
    ("build_model: more than the memory", nothing,
     lambda p: build_model(TINY.replace(d_model=2**20, n_heads=1, d_ff=2**20)), MemoryError,
     r"a model of this config needs about [\d,.]+ GiB of memory, more than the [\d,.]+ GiB available"),
    # places
    ("aiayn.load(RUN/checkpoints)", unfinished_run, lambda p: aiayn.load(Path(p).parent / "r" / "checkpoints"),
     ValueError,
     r"r/checkpoints holds the checkpoints of the run .*r, not a model: give the run directory"),
    ("aiayn.load(a run that did not finish)", unfinished_run, lambda p: aiayn.load(Path(p).parent / "r"),
     FileNotFoundError,
     r"r: training did not finish \(no final config.json yet\): continue it with aiayn train --run .* --resume"),
    # outputs and streams
    ("check_output_file: an input", write("in.txt", "x"),
     lambda p: check_output_file(Path(p, "in.txt"), "--output", inputs=[("--input", Path(p, "in.txt"))]),
     OutputRefused, r"in.txt is the input --input .*in.txt: the output would replace it"),
    ("check_output_file: inside a model directory", nothing,
     lambda p: check_output_file(Path(p, "sub", "x.txt"), "--output"), OutputRefused,
     r"--output .*m/sub/x.txt is inside .*m, which holds an aiayn model"),
    ("read_lines: a character device", nothing, lambda p: read_lines("/dev/zero"), ValueError,
     r"input file /dev/zero is a character device, not a regular file"),
]



@pytest.mark.parametrize(("name", "prepare", "call", "kind", "message"), API_CASES, ids=[c[0] for c in API_CASES])
def test_api_errors_are_one_line_and_change_nothing(name, prepare, call, kind, message, saved, frozen):
    prepare(saved)
    check = frozen(saved.parent)
    with pytest.raises(kind) as caught:
        call(saved)
    text = str(caught.value)
    assert "\n" not in text and re.search(message, text), text
    assert "weights_only" not in text
    check(new_files=False)


def test_loading_refuses_before_touching_the_model_files(saved, frozen):
    _edit_weights(saved, lambda s: s["encoder.layers.0.feed_forward.linear1.weight"].fill_(float("inf")))
    check = frozen(saved)
    with pytest.raises(WeightsError, match="has 0 NaN and 512 Inf values"):
        load_model(saved)
    check(new_files=False)


# -- readers -----------------------------------------------------------------------------------------

def test_a_bom_is_dropped_and_does_not_hide_a_csv_header(tmp_path):
    path = tmp_path / "c.csv"
    path.write_bytes("\ufefftext,label\ngood film,pos\nbad film,neg\n".encode())
    examples, stats = read_classification(str(path))
    assert [(e.text, e.label) for e in examples] == [("good film", "pos"), ("bad film", "neg")]
    parallel = tmp_path / "p.tsv"
    parallel.write_bytes("\ufeffhello\thallo\n".encode())
    assert read_parallel(str(parallel))[0][0].source == "hello"


def test_lines_split_only_at_newlines(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("a\x0bb\r\nc\x1cd\u2028e\n\x85f\rg\n", encoding="utf-8", newline="")
    assert read_lines(path) == ["a\x0bb", "c\x1cd\u2028e", "\x85f\rg"]
    assert read_text(str(path))[0] == ["a\x0bb", "c\x1cd\u2028e", "f\rg"]  # stripped: \x85 is white space
    tsv = tmp_path / "p.tsv"
    tsv.write_text("one\x0ctwo\teins\x0czwei\n", encoding="utf-8")
    assert [(e.source, e.target) for e in read_parallel(str(tsv))[0]] == [("one\x0ctwo", "eins\x0czwei")]


def test_a_quoted_csv_field_may_hold_a_newline_and_errors_name_the_right_line(tmp_path):
    path = tmp_path / "c.csv"
    path.write_text('"first\nline",pos\nsecond,neg\n"open quote,neg\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"c.csv:4: unexpected end of data"):
        read_classification(str(path))
    path.write_text('"first\nline",pos\nsecond,neg\nthird,x,y\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"c.csv:4: expected 2 columns"):
        read_classification(str(path))
    path.write_text('"first\nline",pos\nsecond,neg\n', encoding="utf-8")
    assert [(e.text, e.label) for e in read_classification(str(path))[0]] == [("first\nline", "pos"), ("second", "neg")]


def test_a_path_with_a_comma_is_one_file_when_it_exists(tmp_path):
    path = tmp_path / "en,de.tsv"
    path.write_text("hello\thallo\n", encoding="utf-8")
    assert [(e.source, e.target) for e in read_parallel(str(path))[0]] == [("hello", "hallo")]
    (tmp_path / "a.en").write_text("one\n", encoding="utf-8")
    (tmp_path / "a.de").write_text("eins\n", encoding="utf-8")
    pair = f"{tmp_path / 'a.en'},{tmp_path / 'a.de'}"
    assert [(e.source, e.target) for e in read_parallel(pair)[0]] == [("one", "eins")]


def test_a_directory_where_a_file_belongs(tmp_path):
    with pytest.raises(IsADirectoryError, match="is a directory; give a file"):
        read_parallel(str(tmp_path) + "/")


# -- run directories, atomic writes, the lock ---------------------------------------------------------

def test_inspect_dir_tells_the_kinds_apart(tmp_path, saved):
    (tmp_path / "empty").mkdir()
    (tmp_path / "f.txt").write_text("x")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text('{"model_type": "bert"}')
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "train_config.json").write_text("{}")
    (tmp_path / "exp").mkdir()
    (tmp_path / "exp" / "aiayn_export.json").write_text("{}")
    (tmp_path / "hidden").mkdir()
    (tmp_path / "hidden" / ".gitkeep").write_text("")
    kinds = {name: inspect_dir(tmp_path / name).kind
             for name in ("nothing", "empty", "hidden", "f.txt", "hf", "run", "exp", "m")}
    assert kinds == {"nothing": MISSING, "empty": EMPTY, "hidden": EMPTY, "f.txt": FILE, "hf": HF_CHECKPOINT,
                     "run": RUN, "exp": EXPORT, "m": MODEL}
    assert inspect_dir(tmp_path).kind == FOREIGN


def test_open_run_dir_refuses_then_locks(tmp_path, saved, frozen):
    check = frozen(saved)
    for force in (False, True):  # a model's files have one writer: --force does not hand them to training
        with pytest.raises(DirectoryRefused, match=r"holds an aiayn model .*; training never writes into it"):
            open_run_dir(saved, resume=False, force=force)
        with pytest.raises(DirectoryRefused, match=r"inside .*, which holds an aiayn model"):
            open_run_dir(saved / "inner", resume=False, force=force)
    check(new_files=False)
    lock = open_run_dir(tmp_path / "new", resume=False)
    try:
        with pytest.raises(RunBusy, match=r"new is in use: process \d+ is training in it"):
            open_run_dir(tmp_path / "new", resume=False)
    finally:
        lock.release()
    assert not (tmp_path / "new").exists()  # created by the lock, left empty: removed again
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("the user's\n")
    with pytest.raises(DirectoryRefused, match=r"pass --force"):
        open_run_dir(tmp_path / "mine", resume=False)
    open_run_dir(tmp_path / "mine", resume=False, force=True).release()  # beside the user's own files: forced


def test_an_atomic_write_that_fails_leaves_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "out.npy"
    path.write_bytes(b"old contents")

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError) as caught:
        atomic_write_bytes(path, b"new contents")
    assert caught.value.errno == errno.ENOSPC and caught.value.filename == str(path)
    assert path.read_bytes() == b"old contents" and [p.name for p in tmp_path.iterdir()] == ["out.npy"]


def test_the_search_index_never_replaces_a_file_it_did_not_write(tmp_path):
    from aiayn.inference.search import SearchIndex

    path = tmp_path / "mine.npz"
    np.savez(path, other=np.ones(2))
    before = path.read_bytes()
    with pytest.raises(ValueError, match=r"mine.npz: not an aiayn search index .* left as it is"):
        SearchIndex.load_or_build(path, ["a"], embedder=SimpleNamespace(name="m", pooling="mean", max_length=8))
    assert path.read_bytes() == before


def test_a_search_too_large_for_the_memory_is_refused_before_it_starts(saved, monkeypatch):
    import aiayn.nn.sizes

    translator = Translator.from_pretrained(saved)
    monkeypatch.setattr(aiayn.nn.sizes, "available_memory", lambda: 2**16)  # a machine with 64 KiB free
    with pytest.raises(MemoryError, match=r"decoding 2 sentences with beam 40 needs about [\d.]+ GiB of memory, "
                                          r"more than the 0.0 GiB available: choose a smaller --num-beams"):
        translator.translate(["a b", "c"], num_beams=40)
    assert describe(MemoryError("x"))[0] == 4
    assert translator.translate(["a b"], num_beams=1, max_new_tokens=2)  # one hypothesis fits


def test_a_config_file_may_be_a_pipe(tmp_path):
    """`aiayn train <(cat run.toml)`: the pipe has no .toml ending; TOML or JSON is told from its text."""
    for text in (b'dataset = "copy"\nepochs = 2\n', b'{"dataset": "copy", "epochs": 2}'):
        read, written = os.pipe()
        os.write(written, text)
        os.close(written)
        try:
            assert load_run_config(f"/dev/fd/{read}").train.epochs == 2
        finally:
            os.close(read)


def test_a_failed_atomic_write_names_the_target_not_its_temporary_file(tmp_path, monkeypatch):
    import aiayn.rundir

    def read_only(path, *args, **kwargs):  # a read-only file system refuses the temporary file
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr(aiayn.rundir, "open", read_only, raising=False)
    with pytest.raises(OSError) as caught:
        atomic_write_bytes(tmp_path / "old.jsonl", b"new")
    assert caught.value.filename == str(tmp_path / "old.jsonl")
    assert describe(caught.value) == (4, f"{tmp_path / 'old.jsonl'}: Read-only file system; the file system is "
                                         "read-only: choose a writable place")
    assert list(tmp_path.iterdir()) == []


def test_the_replacement_rule_of_the_readme(tmp_path, saved):
    """An explicit output path may be replaced; never an input, never a file inside a run or model directory,
    never a directory."""
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    assert ("an explicit output file (`-o`, `--output`, `--show-attention`, `--index`) may be replaced; never an "
            "input of the same command, never a file inside a run, model, export or checkpoint directory, never a "
            "directory.") in " ".join(text.split())
    mine = tmp_path / "out.txt"
    mine.write_text("old")
    assert check_output_file(mine, "--output", inputs=[("--input", tmp_path / "in.txt")]) == mine
    with pytest.raises(OutputRefused, match="is the input --input"):
        check_output_file(mine, "--output", inputs=[("--input", mine)])
    with pytest.raises(OutputRefused, match="is the input --input"):  # the same file by another name
        (tmp_path / "link.txt").symlink_to(mine)
        check_output_file(tmp_path / "link.txt", "--output", inputs=[("--input", mine)])
    for inside in (saved / "config.json", saved / "new.txt", saved / "deeper" / "new.txt"):
        with pytest.raises(OutputRefused, match=r"is inside .*m, which holds an aiayn model"):
            check_output_file(inside, "--output")
    with pytest.raises(IsADirectoryError, match="is a directory; give a file name"):
        check_output_file(tmp_path, "--output")


def test_a_second_lock_on_the_same_run_is_refused_at_once(tmp_path):
    with RunLock(tmp_path / "run"):
        with pytest.raises(RunBusy):
            RunLock(tmp_path / "run").acquire()
    RunLock(tmp_path / "run").acquire().release()


# -- exit codes -------------------------------------------------------------------------------------

@pytest.mark.parametrize(("error", "code", "line"), [
    (OSError(errno.ENOSPC, "No space left on device", "a.npy"), 4,
     "a.npy: No space left on device; free some disk space and run it again"),
    (PermissionError(errno.EACCES, "Permission denied", "/r"), 4,
     "/r: Permission denied; check the file's permissions"),
    (OSError(errno.EROFS, "Read-only file system", "/m"), 4, "/m: Read-only file system; the file system is read-only"),
    (FileNotFoundError(errno.ENOENT, "No such file or directory", "x.toml"), 2, "x.toml: No such file or directory"),
    (FileNotFoundError("data file x does not exist"), 2, "data file x does not exist"),
    (ValueError("bad value"), 2, "bad value"),
    (KeyError("a key"), 2, "a key"),
    (RunBusy("r is in use"), 5, "r is in use"),
    (TrainingError("non-finite loss"), 3, "non-finite loss"),
    (KeyboardInterrupt(), 130, "interrupted"),
    (MemoryError(), 4, "out of memory"),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you tried "
                  "to allocate 4398046511104 bytes."), 4, "out of memory: PyTorch could not allocate 4,096.0 GiB; try"),
    (MemoryError("a model of this config needs about 9.0 GiB"), 4, "a model of this config needs about 9.0 GiB"),
    (TypeError("oops"), 1, "internal error: TypeError: oops"),
])
def test_every_error_maps_to_a_documented_exit_code(error, code, line):
    got_code, got_line = describe(error)
    assert got_code == code and got_line.startswith(line)


def test_preset_configs_pass_their_own_type_checks():
    for name in ("base", "big", "tiny"):
        assert ModelConfig.from_dict(preset(name).to_dict()) == preset(name)
