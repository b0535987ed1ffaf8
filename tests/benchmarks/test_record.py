"""Benchmark records (`aiayn bench NAME --record`) and the tables the README and docs render from them."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from aiayn.cli.bench import load_benchmark, split_record
from aiayn.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
KEYS = {"bench", "command", "date", "commit", "cpu", "cores", "threads", "load_before", "load_after", "versions",
        "figures", "output", "note"}


def test_every_rendered_table_equals_its_rendering_from_the_committed_records():
    report = load_benchmark("report")
    records = report.load()
    blocks = 0
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        blocks += len(report.BLOCK.findall(text))
        assert report.update(text, records) == text, (
            f"{path.name}: a bench-table differs from the records; run `aiayn bench report --update {path.name}`")
    assert blocks >= 2  # the README's Speed table and the encoder guide's


def test_the_committed_records_carry_their_date_machine_threads_and_versions():
    paths = sorted((ROOT / "benchmarks" / "results").glob("*.json"))
    assert paths
    for path in paths:
        record = json.loads(path.read_text())
        assert KEYS <= set(record), path.name
        assert record["cpu"]["model"] and set(record["cpu"]["isa"]) >= {"avx2", "avx512f", "amx_bf16"}, path.name
        assert record["threads"] >= 1 and "torch" in record["versions"] and record["figures"], path.name
        for fig in record["figures"]:  # every figure also in the printed text the record keeps
            assert fig["name"].split(" / ")[0].split(",")[0] in record["output"], (path.name, fig["name"])


def test_record_writes_what_the_run_printed_and_the_report_shows_it(tmp_path, capsys, monkeypatch):
    """The record keeps the command with the settings that decided aiayn's choices before it, as a shell runs it."""
    monkeypatch.setenv("AIAYN_DROPOUT", "bernoulli")
    monkeypatch.delenv("AIAYN_INT8_RANGE", raising=False)
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # as the CLI sets it where torch is not loaded yet
    code = main(["bench", "encoder", "--preset", "tiny", "--batch", "2", "--length", "8", "--repeats", "1",
                 "--warmup", "0", "--matmul-size", "64", "--threads", "1", "--record", str(tmp_path)])
    assert code == 0
    out = capsys.readouterr().out
    (path,) = tmp_path.glob("*-encoder.json")
    record = json.loads(path.read_text())
    assert record["command"] == ("AIAYN_DROPOUT=bernoulli aiayn bench encoder --preset tiny --batch 2 --length 8 "
                                 "--repeats 1 --warmup 0 --matmul-size 64 --threads 1")
    assert record["threads"] == 1 and record["output"] in out and f"record: {path}" in out
    assert record["cpu"]["env"]["OMP_WAIT_POLICY"] == "PASSIVE"  # what more than one thread ran under
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", record["date"])
    ratio = next(f for f in record["figures"] if f["name"] == "aiayn Encoder / fast path")
    assert ratio["unit"] == "x" and f"{ratio['value']:.3f}x the torch fast path" in record["output"]
    assert main(["bench", "report", str(tmp_path)]) == 0
    table = capsys.readouterr().out
    assert f"{ratio['value']:.3f}x" in table and record["cpu"]["model"] in table
    assert "`AIAYN_DROPOUT=bernoulli --preset tiny --batch 2" in table


def test_the_fine_tuning_table_holds_the_encoder_records_of_bench_train_and_the_train_table_the_others():
    report = load_benchmark("report")
    records = [r for r in report.load() if r["bench"] == "train"]
    encoder = [r for r in records if report.model_of(r) == "encoder"]
    assert encoder and len(encoder) < len(records)
    finetune, train = report.render("finetune", records), report.render("train", records)
    assert finetune.count("\n") == 2 + len(encoder) and "| Hugging Face BERT |" in finetune.splitlines()[0]
    assert train.count("\n") == 2 + len(records) - len(encoder) and "--model encoder" not in train
    language_model = {**encoder[0], "command": "python benchmarks/train.py --model decoder-only",
                      "figures": [{**f, "model": "decoder-only"} for f in encoder[0]["figures"]]}
    table = report.render("decoder_only", [language_model])  # a command without `aiayn bench NAME` is shown whole
    assert table.count("\n") == 3 and "`python benchmarks/train.py --model decoder-only`" in table


def test_record_may_come_before_or_after_the_name_and_takes_an_optional_directory():
    assert split_record(["--threads", "1"]) == (["--threads", "1"], None)
    assert split_record(["--record", "--threads", "1"]) == (["--threads", "1"], "")
    assert split_record(["--threads", "1", "--record", "out"]) == (["--threads", "1"], "out")


def test_the_decoding_plot_draws_every_decoding_record_and_the_guide_shows_it(tmp_path):
    report = load_benchmark("report")
    records = report.load()
    decoding = [r for r in records if r["bench"] == "generate" and any(f["name"].endswith("vs CT2")
                                                                         for f in r["figures"])]
    assert decoding, "no decoding record with ratios against CTranslate2"
    path = report.plot_decoding(records, tmp_path / "decode.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    guide = (ROOT / "docs" / "generation.md").read_text(encoding="utf-8")
    assert "](images/decode-speed.png)" in guide and (ROOT / "docs" / "images" / "decode-speed.png").is_file()


def test_the_learning_curve_plot_draws_the_translation_records_and_the_training_guide_shows_it(tmp_path):
    report = load_benchmark("report")
    records = report.load()
    curves = [r for r in records if r["bench"] == "translate" and any("minutes" in f for f in r["figures"])]
    assert curves, "no translation record with a learning curve"
    path = report.plot_learning(records, tmp_path / "curve.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    guide = (ROOT / "docs" / "training.md").read_text(encoding="utf-8")
    assert "](images/learning-curve.png)" in guide and (ROOT / "docs" / "images" / "learning-curve.png").is_file()


def _blocks(path: Path, *tables: str) -> bytes:
    """A guide holding the rendered `tables`' blocks (rows the committed records give), as bytes to compare."""
    report = load_benchmark("report")
    records = report.load()
    text = "".join(f"# {t}\n<!-- bench-table: {t} -->\n{report.render(t, records)}<!-- /bench-table -->\n"
                   for t in tables)
    path.write_text(text, encoding="utf-8")
    return path.read_bytes()


def test_bench_report_refuses_a_folder_without_records_and_leaves_the_file(tmp_path, capsys):
    guide = tmp_path / "guide.md"
    before = _blocks(guide, "encoder", "generate")
    (tmp_path / "empty").mkdir()
    for folder, problem in (("empty", "holds no benchmark records"), ("missing", "does not exist")):
        assert main(["bench", "report", str(tmp_path / folder), "--update", str(guide)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"aiayn bench: error: {tmp_path / folder} {problem}") and err.count("\n") == 1, err
        assert guide.read_bytes() == before


def test_bench_report_names_the_benchmarks_there_are_for_one_it_has_no_records_of(capsys):
    assert main(["bench", "report", str(ROOT / "benchmarks" / "results"), "--bench", "nosuch"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"aiayn bench: error: {ROOT / 'benchmarks' / 'results'} holds no records of --bench nosuch: "
                          "it holds ") and "generate" in err and err.count("\n") == 1, err
    assert main(["bench", "report", str(ROOT / "benchmarks" / "results"), "--bench", "generate"]) == 0
    assert capsys.readouterr().out.startswith("## generate")


def test_bench_report_refuses_to_empty_a_table_it_has_no_records_for(tmp_path, capsys):
    guide = tmp_path / "guide.md"
    before = _blocks(guide, "encoder", "generate")
    (tmp_path / "records").mkdir()
    encoder = next((ROOT / "benchmarks" / "results").glob("*-encoder.json"))
    (tmp_path / "records" / encoder.name).write_bytes(encoder.read_bytes())
    assert main(["bench", "report", str(tmp_path / "records"), "--update", str(guide)]) == 2
    err = capsys.readouterr().err
    assert err == (f"aiayn bench: error: {tmp_path / 'records'} holds no records for the generate table of {guide}; "
                   "rewriting it would empty it: give the folder that holds them (default benchmarks/results/)\n")
    assert guide.read_bytes() == before


def test_bench_report_skips_files_that_are_not_records_with_a_line_naming_each(tmp_path, capsys):
    encoder = next((ROOT / "benchmarks" / "results").glob("*-encoder.json"))
    (tmp_path / encoder.name).write_bytes(encoder.read_bytes())
    (tmp_path / "a-list.json").write_text("[1, 2, 3]\n")
    (tmp_path / "b-broken.json").write_text('{"bench": "encoder", ')
    (tmp_path / "c-future.json").write_text(json.dumps({**json.loads(encoder.read_text()), "format": 2}))
    (tmp_path / "c-old.json").write_text('{"bench": "encoder", "results": {}}\n')
    (tmp_path / "c-wrong.json").write_text(json.dumps({**json.loads(encoder.read_text()), "format": "one"}))
    (tmp_path / "d-figures.json").write_text(json.dumps({**json.loads(encoder.read_text()), "figures": [1]}))
    os.mkfifo(tmp_path / "e-pipe.json")  # read, it would block: never opened
    assert main(["bench", "report", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert lines == [f"skipped {tmp_path / 'a-list.json'}: a JSON list, not a record (an object)",
                     f"skipped {tmp_path / 'b-broken.json'}: not valid JSON (JSONDecodeError: Expecting property "
                     "name enclosed in double quotes: line 1 column 22 (char 21))",
                     f"skipped {tmp_path / 'c-future.json'}: a record of format 2, written by a later aiayn (this "
                     "one reads up to 1): update aiayn",
                     f"skipped {tmp_path / 'c-old.json'}: not a benchmark record this version reads (missing or "
                     "of the wrong type: command, date, cpu, cores, threads, load_before, load_after, versions, "
                     "figures)",
                     f"skipped {tmp_path / 'c-wrong.json'}: not a benchmark record (its format is 'one', not a "
                     "number from 1)",
                     f"skipped {tmp_path / 'd-figures.json'}: not a benchmark record this version reads (malformed: "
                     "figures)",
                     f"skipped {tmp_path / 'e-pipe.json'}: not a regular file"], captured.err
    assert "## encoder" in captured.out


def test_two_records_of_the_same_second_are_both_kept(tmp_path):
    """Two runs started together stamp the same second: the second record goes beside the first, never over it."""
    load_benchmark("translate")  # puts the scripts' helpers (record.py) on the path, as `aiayn bench` does
    from record import write

    record = {"bench": "translate", "date": "2026-12-07T12:50:38+00:00", "figures": []}
    first = write({**record, "command": "one"}, tmp_path)
    second = write({**record, "command": "two"}, tmp_path)
    assert first.name == "20261207T125038-translate.json" and second.name == "20261207T125038-translate-2.json"
    assert [json.loads(p.read_text())["command"] for p in (first, second)] == ["one", "two"]
    assert {p.name for p in tmp_path.iterdir()} == {first.name, second.name}  # no temporary file left
