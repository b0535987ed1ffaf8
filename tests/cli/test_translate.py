"""`aiayn translate`: arguments, --input and stdin, search options, attention maps, clear errors."""

import io
from pathlib import Path

import pytest
import torch

from aiayn.cli.main import main
from aiayn.config import ModelConfig
from aiayn.inference.generation import GenerationConfig, generate
from aiayn.io import load_model, load_tokenizers, save_model
from aiayn.nn.model import build_model
from aiayn.tokenization import train_tokenizer

CORPUS = Path(__file__).resolve().parents[2] / "aiayn" / "assets" / "corpus.txt"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A saved tiny model with its tokenizer, as `aiayn train` leaves it."""
    tokenizer = train_tokenizer(CORPUS.read_text(encoding="utf-8").splitlines(), vocab_size=200)
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=tokenizer.vocab_size, d_model=32, n_heads=4, d_ff=64, n_encoder_layers=2,
                      n_decoder_layers=2, dropout=0.0, max_len=40)
    directory = tmp_path_factory.mktemp("run")
    save_model(build_model(cfg), directory, tokenizer=tokenizer)
    return directory


def _run(capsys, *argv: str) -> tuple[int, list[str], str]:
    code = main(["translate", *argv])
    captured = capsys.readouterr()
    return code, captured.out.splitlines(), captured.err


def test_translate_arguments_equal_the_python_api(run_dir, capsys):
    code, lines, _ = _run(capsys, "--run", str(run_dir), "The cat sat on the mat.", "", "Attention is all you need.",
                          "--num-beams", "2", "--alpha", "0.6", "--max-new-tokens", "6")
    assert code == 0 and len(lines) == 3 and lines[1] == ""
    model = load_model(run_dir)
    tok, _ = load_tokenizers(run_dir)
    for text, line in (("The cat sat on the mat.", lines[0]), ("Attention is all you need.", lines[2])):
        src = torch.tensor([tok.encode(text, add_eos=True)])
        out = generate(model, src, bos_id=tok.bos_id, eos_id=tok.eos_id,
                       config=GenerationConfig(num_beams=2, length_penalty=0.6, max_new_tokens=6))
        assert line == tok.decode(out.tokens[0])


def test_translate_precision_int8_runs_the_int8_copy(run_dir, capsys):
    code, lines, _ = _run(capsys, "--run", str(run_dir), "The cat sat on the mat.", "--num-beams", "2",
                          "--max-new-tokens", "6", "--precision", "int8")
    assert code == 0 and len(lines) == 1
    with pytest.raises(SystemExit) as exit_info:
        main(["translate", "--run", str(run_dir), "The cat", "--precision", "fp8"])
    assert exit_info.value.code == 2 and "invalid choice: 'fp8'" in capsys.readouterr().err


def test_translate_reads_a_file_or_stdin(run_dir, capsys, monkeypatch, tmp_path):
    text = "How are you today?\nThe dog sat on the rug.\n"
    source = tmp_path / "in.txt"
    source.write_text(text, encoding="utf-8")
    code, from_file, _ = _run(capsys, "--run", str(run_dir), "--input", str(source), "--max-new-tokens", "5",
                              "--num-beams", "1")
    assert code == 0 and len(from_file) == 2
    monkeypatch.setattr("sys.stdin", io.StringIO(text))
    code, from_stdin, _ = _run(capsys, "--run", str(run_dir), "--max-new-tokens", "5", "--num-beams", "1",
                               "--max-sentences", "1")
    assert code == 0 and from_stdin == from_file
    code, scored, _ = _run(capsys, "--run", str(run_dir), "--input", str(source), "--max-new-tokens", "5",
                           "--num-beams", "1", "--scores")
    assert [line.split("\t", 1)[1] for line in scored] == from_file
    assert all(float(line.split("\t", 1)[0]) <= 0 for line in scored)  # log-probabilities (NaN fails), when asked for


def test_old_option_spellings_still_work(run_dir, capsys):
    # Scripts written before the rename keep running; the help shows only the one name.
    argv = ("--run", str(run_dir), "The cat sat on the mat.", "How are you today?", "--num-beams", "1")
    new = _run(capsys, *argv, "--max-new-tokens", "5", "--max-sentences", "1")
    assert new[0] == 0 and _run(capsys, *argv, "--max-len", "5", "--batch-size", "1") == new
    old_beam = (*argv[:-2], "--beam", "1")
    assert _run(capsys, *old_beam, "--max-new-tokens", "5", "--max-sentences", "1") == new
    code, _, err = _run(capsys, *argv, "--max-new-tokens", "5", "--max-len", "4")
    assert code == 2 and "max_len=4 and max_new_tokens=5 disagree" in err
    with pytest.raises(SystemExit):
        main(["translate", "--help"])
    shown = capsys.readouterr().out
    assert "--max-new-tokens" in shown and "--max-sentences" in shown and "--num-beams" in shown
    assert "--max-len" not in shown and "--batch-size" not in shown and "--beam " not in shown


def test_translate_samples_with_a_seed(run_dir, capsys):
    argv = ("--run", str(run_dir), "The cat sat on the mat.", "--sample", "--top-k", "20", "--top-p", "0.9",
            "--temperature", "1.2", "--seed", "5", "--max-new-tokens", "6")
    first = _run(capsys, *argv)[1]
    assert _run(capsys, *argv)[1] == first


@pytest.mark.parametrize("layer", ["all", "mean", "2"])
def test_show_attention_saves_a_png(run_dir, capsys, tmp_path, layer):
    png = tmp_path / "attention.png"
    code, lines, err = _run(capsys, "--run", str(run_dir), "The cat sat on the mat.", "--min-len", "3",
                            "--max-new-tokens", "4", "--show-attention", str(png), "--attention-layer", layer)
    assert code == 0 and len(lines) == 1
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "attention map saved" in err


def test_clear_errors(run_dir, capsys, tmp_path):
    code, _, err = _run(capsys, "--run", str(tmp_path / "missing"), "hello")
    assert code == 2 and "missing is not an aiayn model directory" in err
    long_line = " ".join(["cat"] * 60)
    code, _, err = _run(capsys, "--run", str(run_dir), long_line)
    assert code == 2 and "more than the model's max_len (40)" in err and "--truncate" in err
    code, lines, _ = _run(capsys, "--run", str(run_dir), long_line, "--truncate", "--max-new-tokens", "3")
    assert code == 0 and len(lines) == 1
    code, _, err = _run(capsys, "--run", str(run_dir), "hello", "--num-beams", "0")
    assert code == 2 and "--num-beams must be at least 1" in err
    code, _, err = _run(capsys, "--run", str(run_dir), "hello", "--input", str(tmp_path / "nope.txt"))
    assert code == 2 and "not both" in err
    code, _, err = _run(capsys, "--run", str(run_dir), "--input", str(tmp_path / "nope.txt"))
    assert code == 2 and "does not exist" in err
    code, _, err = _run(capsys, "--run", str(run_dir), "cat", "--show-attention", str(tmp_path / "a.png"),
                        "--attention-layer", "9", "--min-len", "2", "--max-new-tokens", "3")
    assert code == 2 and "outside 1..2" in err


def test_translate_a_file_to_a_file_equals_the_python_api(translation_run, capsys, tmp_path, monkeypatch):
    import aiayn
    from tests.conftest import SAMPLE_LINES

    monkeypatch.setattr("aiayn.cli.options.PROGRESS_FROM", 10)
    lines = SAMPLE_LINES * 3
    source = tmp_path / "in.txt"
    source.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "out.txt"
    code, stdout, err = _run(capsys, "--run", str(translation_run), "--input", str(source), "--output", str(out),
                             "--max-tokens", "20")
    assert code == 0 and stdout == []
    written = out.read_text(encoding="utf-8").split("\n")
    # Without --precision it decodes as Python's `precision=None` chooses (bf16 where measured as good and faster)
    chosen = aiayn.Translator.from_pretrained(translation_run, precision=None)
    assert written[-1] == "" and written[:-1] == chosen.translate(lines)
    assert "translating: 100%" in err and "sent/s" in err and f"translated {len(lines)} lines" in err
    assert f"sentences/s, {chosen.backend.precision})" in err  # the precision it decoded in
    if chosen.backend.precision == "fp32":
        assert written[:-1] == aiayn.load(translation_run).translate(lines)


def test_runaway_guards_from_the_command_line(translation_run, capsys):
    import aiayn

    translator = aiayn.load(translation_run)
    argv = ("--run", str(translation_run), "d d d d d", "a b c", "--num-beams", "1")
    plain = _run(capsys, *argv)[1]
    guarded = _run(capsys, *argv, "--length-ratio", "1.2", "--extra-len", "1", "--no-repeat-ngram-size", "2",
                   "--repetition-penalty", "1.3")[1]
    assert guarded == translator.translate(["d d d d d", "a b c"], num_beams=1, length_ratio=1.2, extra_len=1,
                                           no_repeat_ngram_size=2, repetition_penalty=1.3)
    assert guarded != plain and max(len(line) for line in guarded) < max(len(line) for line in plain)


def test_an_output_line_break_never_shifts_the_lines(translation_run, capsys, monkeypatch, tmp_path):
    from aiayn.inference.translator import Translation, Translator

    monkeypatch.setattr(Translator, "translations",
                        lambda self, texts, *a, **k: [Translation(f"two\nlines\r{t}", [], 0.0) for t in texts])
    out = tmp_path / "out.txt"
    code, _, _ = _run(capsys, "--run", str(translation_run), "x", "y", "--output", str(out))
    assert code == 0 and out.read_text(encoding="utf-8") == "two lines x\ntwo lines y\n"
