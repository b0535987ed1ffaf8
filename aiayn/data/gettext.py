"""A real parallel corpus that every Debian-like machine already has: its compiled gettext catalogs.

Programs translate their messages through `.mo` files (`/usr/share/locale/fr/LC_MESSAGES/*.mo`):
each maps an English `msgid` to its translation `msgstr`. Read together they make a corpus of
short, real, human-translated text (menu items, error messages, help lines, language and region
names) that needs no download:

- message contexts (`ctx\\x04msgid`) are dropped, plural entries give their singular form;
- messages with format directives (`%s`, `%(name)d`, `{0}`, `${var}`), escapes, tabs, newlines or
  other control characters are dropped: they are templates, not text;
- a message translated differently by several catalogs keeps its most frequent translation, so each
  English source occurs once and train, valid and test never share a source;
- the split is seeded;
- a catalog Python's `gettext` cannot read (one whose strings are not in the encoding its header names) is
  skipped and named in `skipped`; the corpus comes from the others.
"""

from __future__ import annotations

import gettext
import random
import re
import struct
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from aiayn.data.readers import ParallelExample

LOCALE_DIR = "/usr/share/locale"
# printf-style and brace/shell placeholders, backslash escapes, and control characters (tabs, newlines)
TEMPLATE = re.compile(r"%(\([^)]*\))?[-#0 +'I]*(\*|\d+\$)?\d*(\.\d+)?(hh|h|ll|l|L|q|j|z|t)?[diouxXeEfFgGaAcspnm%]"
                      r"|\{[^{}]*\}|\$\{?\w+\}?|\\[a-z0-9]|[\x00-\x1f\x7f]")


@dataclass
class GettextCorpus:
    """The seeded splits and where they came from."""

    train: list[ParallelExample]
    valid: list[ParallelExample]
    test: list[ParallelExample]
    catalogs: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # "name.mo: why" of each catalog that could not be read
    messages: int = 0  # entries read, before filtering and deduplication
    templates: int = 0  # entries dropped as format templates

    def write(self, directory: str | Path) -> None:
        """train.tsv, valid.tsv and test.tsv in `directory`, each written atomically."""
        for name in ("train", "valid", "test"):
            write_tsv(Path(directory) / f"{name}.tsv", getattr(self, name))


def catalog_files(lang: str, locale_dir: str | Path = LOCALE_DIR) -> list[Path]:
    """The compiled catalogs of `lang` (`LOCALE/lang/LC_MESSAGES/*.mo`), sorted."""
    return sorted((Path(locale_dir) / lang / "LC_MESSAGES").glob("*.mo"))


def read_gettext(lang: str, *, locale_dir: str | Path = LOCALE_DIR, seed: int = 0, n_valid: int = 1000,
                 n_test: int = 2000) -> GettextCorpus:
    """English -> `lang` pairs from the machine's catalogs, filtered, deduplicated and split (see the module doc)."""
    for name, value in (("n_valid", n_valid), ("n_test", n_test)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    files = catalog_files(lang, locale_dir)
    if not files:
        raise FileNotFoundError(f"no compiled gettext catalogs for {lang!r} under {locale_dir} "
                                f"({Path(locale_dir) / lang / 'LC_MESSAGES'}/*.mo); install the language's "
                                "translations (on Debian: the packages' locale files, e.g. without 'path-exclude' "
                                "for /usr/share/locale in /etc/dpkg/dpkg.cfg.d) or pass --locale-dir")
    translations: dict[str, Counter] = defaultdict(Counter)
    messages = templates = 0
    read, skipped = [], []
    for path in files:
        try:
            with open(path, "rb") as handle:
                catalog = gettext.GNUTranslations(handle)._catalog
        except (OSError, ValueError, IndexError, struct.error) as err:  # unreadable, mis-encoded, cut short
            skipped.append(f"{path.name}: not a readable gettext catalog ({err})")
            continue
        read.append(path.name)
        for key, value in catalog.items():
            if isinstance(key, tuple):  # plural forms: (msgid, n) -> msgstr[n]; keep the singular
                if key[1] != 0:
                    continue
                key = key[0]
            source, target = key.split("\x04")[-1].strip(), value.strip()
            if not source or not target:
                continue  # the header entry, or nothing to learn
            messages += 1
            if TEMPLATE.search(source) or TEMPLATE.search(target):
                templates += 1
                continue
            translations[source][target] += 1
    if not read:
        raise ValueError(f"no readable gettext catalog for {lang!r} under {locale_dir}: {skipped[0]}"
                         + (f" (and {len(skipped) - 1} more)" if len(skipped) > 1 else ""))
    pairs = [ParallelExample(source, min(counts, key=lambda t: (-counts[t], t)))
             for source, counts in sorted(translations.items())]
    random.Random(seed).shuffle(pairs)
    if len(pairs) < n_valid + n_test + 1:
        raise ValueError(f"only {len(pairs)} usable {lang!r} messages: too few for {n_valid} valid and {n_test} "
                         "test pairs")
    return GettextCorpus(train=pairs[n_valid + n_test:], valid=pairs[n_test:n_test + n_valid], test=pairs[:n_test],
                         catalogs=read, skipped=skipped, messages=messages, templates=templates)


def write_tsv(path: str | Path, pairs: list[ParallelExample]) -> Path:
    """One `source<TAB>target` line per pair (the pairs hold no tabs or newlines), written atomically."""
    from aiayn.rundir import atomic_write_bytes

    path = Path(path)
    atomic_write_bytes(path, "".join(f"{p.source}\t{p.target}\n" for p in pairs).encode("utf-8"))
    return path
