"""Hostile input through the CLI: each case gets one line `aiayn CMD: error: ...`, its documented exit code,
and leaves every file that existed before byte-for-byte as it was (README "When things go wrong").

The cases live by area in tests/hardening/test_cli_*.py and run there, each in a fresh scene (cwd) holding a trained
run (`run/`), a Hugging Face BERT checkpoint (`bert/`), an aiayn encoder (`enc/`), an earlier export (`export/`), a
plain file and files aiayn did not write (tests/hardening/conftest.py). Tiny models only: the whole table takes
seconds. Here: the table as a whole, and the README's summary of it.
"""

from pathlib import Path

from tests.hardening.test_cli_arguments import ARGUMENTS, CONFIGS, VALUES
from tests.hardening.test_cli_inputs import DATA, STREAMS
from tests.hardening.test_cli_models import MODELS
from tests.hardening.test_cli_outputs import OUTPUTS, SYSTEM
from tests.hardening.test_cli_runs import DIRECTORIES, PLACES

AREAS = {"directories": DIRECTORIES, "configs": CONFIGS, "data": DATA, "models": MODELS,
         "arguments": ARGUMENTS, "system": SYSTEM, "outputs": OUTPUTS, "streams": STREAMS, "values": VALUES,
         "places": PLACES}
CASES = [case for cases in AREAS.values() for case in cases]


def test_the_table_covers_every_exit_code():
    assert {c.code for c in CASES} == {2, 3, 4, 5}
    assert len(CASES) >= 50


AREA_TEXT = {
    "directories": ("directories the command did not write",
                    "`--run \"\"`, `--run` at a BERT checkpoint, `export --out` at a run or inside one even with "
                    "`--force`, a second `train` on a locked run (5)"),
    "configs": ("configs, from CLI, TOML and JSON alike",
                '`"shared_vocab": "false"` in JSON, a list instead of an object, `dataset=numbers train=good.tsv`'),
    "data": ("data and text inputs", "a directory where a file belongs, a malformed TSV row, text that is not UTF-8"),
    "models": ("models, checkpoints, tokenizers",
               "truncated or empty `model.safetensors`, a NaN weight, `config.json` missing a key, a pickle `.bin`, "
               "every checkpoint damaged"),
    "arguments": ("arguments", "`--min-len` above `--max-new-tokens`, a local-looking `--model` path (never sent to "
                               "the network)"),
    "system": ("system and numbers", "`embed -o out.npy` on a full disk leaves the old file whole (4), `eval` with a "
                                     "NaN loss (3)"),
    "outputs": ("outputs that would replace what they must not",
                "`translate --input a.txt -o a.txt`, `-o runs/other/model.safetensors`, `corpus --out` at the user's "
                "`train.tsv`, `--quantization int3` (no directory left), `bench report --update` from an empty folder"),
    "streams": ("streams, pipes, devices and links",
                "`--input /dev/zero`, a symlink loop, `model.safetensors` a directory or a link to `/dev/zero`, stdin "
                "closed (`<&-`) or Latin-1"),
    "values": ("values (finite, in range, the right type), checked before any work",
               "`--alpha nan`, `--num-beams 1000000`, `lr=inf`, `max_steps=10**23`, `model.d_model=1048576` (4), "
               "`model.max_len=1` against the data, a classifier on one label"),
    "places": ("places aiayn wrote, but not the one the command takes",
               "`--run RUN/checkpoints`, a run that did not finish, `--resume max_steps=8` on a run at step 40"),
}
API_TEXT = ("Python API", "`build_model(dict)`, an ambiguous 2-D mask, `TrainConfig(bf16=\"yes\")`, "
                          "`translate(..., length_penalty=nan)`, `num_beams=True`, `translate(b\"abc\")`")


def readme_table() -> str:
    """The README's "When things go wrong" table of hostile cases, made from the case lists here."""
    from tests.hardening.test_api import API_CASES

    rows = ["| area | cases | for example |", "| --- | --- | --- |"]
    rows += [f"| {AREA_TEXT[area][0]} | {len(cases)} | {AREA_TEXT[area][1]} |" for area, cases in AREAS.items()]
    rows.append(f"| {API_TEXT[0]} | {len(API_CASES)} | {API_TEXT[1]} |")
    return "\n".join(rows)


def test_the_readme_table_is_made_from_these_cases():
    """`python -m tests.hardening.test_cli` prints the table to paste into the README."""
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    assert set(AREA_TEXT) == set(AREAS)
    assert readme_table() in text


def test_the_readme_summarises_this_table_and_the_exit_codes():
    from aiayn.cli import errors
    from tests.hardening.test_api import API_CASES

    text = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    section = text.split("## When things go wrong", 1)[1].split("\n## ", 1)[0]
    rows = [[cell.strip() for cell in row.split("|")[1:-1]] for row in section.splitlines() if row.startswith("| ")]
    counts = {cells[0].split()[0].strip(","): int(cells[1]) for cells in rows if len(cells) == 3 and cells[1].isdigit()}
    assert counts == {**{area: len(cases) for area, cases in AREAS.items()}, "Python": len(API_CASES)}
    assert f"runs {len(CASES)} hostile cases" in section and f"{len(API_CASES)} through the Python API" in section
    codes = {int(cells[0]) for cells in rows if len(cells) == 2 and cells[0].isdigit()}
    assert codes == {errors.OK, errors.INTERNAL, errors.BAD_INPUT, errors.NON_FINITE, errors.SYSTEM, errors.BUSY,
                     errors.INTERRUPTED}


if __name__ == "__main__":
    print(readme_table())
