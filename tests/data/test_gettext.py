"""The gettext corpus: a catalog that cannot be read is skipped and named; the others still make the corpus."""

import json

import pytest

from aiayn.cli.main import main
from aiayn.data.gettext import read_gettext
from tests.conftest import write_mo

HEADER = "Content-Type: text/plain; charset=UTF-8\n"  # the header entry names the encoding
# Its header says UTF-8, its strings are Latin-1, as one of a Debian machine's German catalogs has them.
MISENCODED = {"": HEADER, "Counter": "Z\xe4hler".encode("latin-1")}


def _catalogs(root):
    good = {f"Open file {i}": f"Ouvrir le fichier {i}" for i in range(30)} | {"": HEADER}
    write_mo(root / "fr" / "LC_MESSAGES" / "good.mo", good)
    write_mo(root / "fr" / "LC_MESSAGES" / "latin.mo", MISENCODED)
    return root


def test_an_unreadable_catalog_is_skipped_and_named(tmp_path):
    corpus = read_gettext("fr", locale_dir=_catalogs(tmp_path), n_valid=5, n_test=5)
    assert corpus.catalogs == ["good.mo"] and len(corpus.train) == 20
    [skipped] = corpus.skipped
    assert skipped.startswith("latin.mo: not a readable gettext catalog")


def test_the_command_says_what_it_skipped_and_records_it(tmp_path, capsys):
    assert main(["corpus", "--lang", "fr", "--locale-dir", str(_catalogs(tmp_path / "locale")), "--valid", "5",
                 "--test", "5", "--out", str(tmp_path / "corpus")]) == 0
    captured = capsys.readouterr()
    assert "skipped latin.mo: not a readable gettext catalog" in captured.err and "1 catalogs" in captured.out
    info = json.loads((tmp_path / "corpus" / "corpus.json").read_text())
    assert info["catalogs"] == ["good.mo"] and info["skipped"][0].startswith("latin.mo")


def test_no_readable_catalog_is_an_error_naming_one(tmp_path):
    write_mo(tmp_path / "fr" / "LC_MESSAGES" / "latin.mo", MISENCODED)
    with pytest.raises(ValueError, match="no readable gettext catalog for 'fr'.*latin.mo: not a readable"):
        read_gettext("fr", locale_dir=tmp_path)
