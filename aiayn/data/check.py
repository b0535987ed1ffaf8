"""A check of the training data before training: what real, messy corpora hold and small runs suffer from.

Counted for parallel text (and, where they apply, classification rows):
- duplicates: the same pair (text and label) again in the training split;
- a length ratio over `max_ratio` between the sides (in characters): usually a misaligned pair;
- identical sides (source == target): untranslated strings, reported only (the built-in copy data set is all of them);
- conflicting labels: one text with two labels in the training split (reported only);
- overlap: valid or test examples that also occur in training, which inflates their scores.

Everything is counted and reported; with `drop=True` (the `clean=true` option) duplicates and
extreme ratios leave the training split, and overlapping examples leave valid and test.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from aiayn.data.readers import LabelledText, ParallelExample

MAX_RATIO = 9.0  # Moses' clean-corpus-n.perl default


@dataclass
class DataCheck:
    """What the check found (and dropped, when asked)."""

    duplicates: int = 0
    extreme_ratio: int = 0
    identical_sides: int = 0
    conflicting_labels: int = 0
    overlap: dict[str, int] = field(default_factory=dict)
    dropped: int = 0

    def summary(self) -> str:
        """One line: `data check: 12 duplicate pairs, 3 ... (clean=true drops them)`."""
        found = [(self.duplicates, "duplicates in train"), (self.extreme_ratio, f"pairs with a length ratio over "
                                                                                f"{MAX_RATIO:g}"),
                 (self.identical_sides, "pairs with identical sides (kept)"),
                 (self.conflicting_labels, "texts with conflicting labels (kept)")]
        found += [(n, f"{name} examples also in train") for name, n in self.overlap.items()]
        parts = [f"{n} {what}" for n, what in found if n]
        if not parts:
            return "data check: no duplicates, extreme length ratios or train/valid/test overlap"
        tail = f"; dropped {self.dropped}" if self.dropped else ("; clean=true drops the duplicates, extreme ratios "
                                                                 "and overlaps" if self._droppable else "")
        return "data check: " + ", ".join(parts) + tail

    @property
    def _droppable(self) -> bool:
        return bool(self.duplicates or self.extreme_ratio or any(self.overlap.values()))


def _key(example: object) -> object:
    if isinstance(example, ParallelExample):
        return (example.source, example.target)
    if isinstance(example, LabelledText):
        return (example.text, example.label)
    return example


def _extreme(example: object, max_ratio: float) -> bool:
    if not isinstance(example, ParallelExample):
        return False
    a, b = len(example.source), len(example.target)
    return max(a, b) / max(min(a, b), 1) > max_ratio


def check_splits(train: list, valid: list, test: list, *, drop: bool = False,
                 max_ratio: float = MAX_RATIO) -> tuple[list, list, list, DataCheck]:
    """Count (and with `drop`, remove) duplicates, extreme length ratios and train overlap; see the module doc."""
    report = DataCheck()
    seen: set = set()
    kept_train = []
    for example in train:
        key = _key(example)
        duplicate, extreme = key in seen, _extreme(example, max_ratio)
        seen.add(key)
        report.duplicates += duplicate
        report.extreme_ratio += extreme and not duplicate
        if not (drop and (duplicate or extreme)):
            kept_train.append(example)
    report.identical_sides = sum(isinstance(e, ParallelExample) and e.source == e.target for e in kept_train)
    labels_of = Counter(e.text for e in {(e.text, e.label): e for e in train if isinstance(e, LabelledText)}.values())
    report.conflicting_labels = sum(1 for n in labels_of.values() if n > 1)
    kept = {}
    for name, split in (("valid", valid), ("test", test)):
        inside = [e for e in split if _key(e) in seen]
        report.overlap[name] = len(inside)
        kept[name] = [e for e in split if _key(e) not in seen] if drop else split
    report.dropped = (len(train) - len(kept_train)) + sum(len(s) for s in (valid, test)) - sum(map(len, kept.values()))
    return kept_train, kept["valid"], kept["test"], report
