"""From a training config to encoded train/valid/test splits: read or generate, tokenize, drop and count.

What differs by objective (the reader, the texts tokenizers learn from, labels, encoding) is asked of the
config's task object, `cfg.objective_task` (`aiayn.tasks`). Encoding conventions (the generation and
evaluation code rely on them):
- seq2seq: source = tokenizer ids + `</s>`; target = tokenizer ids (collation adds `<s>` / `</s>`).
- encoder objectives: `<s>` (BERT's [CLS]) + ids + `</s>` (BERT's [SEP]); classification pools the first token.
- token classification: a word's tag sits on its first subword; other subwords and specials are ignored (-100).
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiayn.data.check import check_splits
from aiayn.data.datasets import OBJECTIVE_OF, builtin_dataset
from aiayn.data.readers import ReadStats
from aiayn.rundir import LABELS as LABELS_NAME
from aiayn.rundir import SOURCE_TOKENIZER, TARGET_TOKENIZER, atomic_write_text, load_json
from aiayn.tokenization import Tokenizer, train_tokenizer

logger = logging.getLogger(__name__)

@dataclass
class EncodedSplit:
    """One split: raw examples (for references), encoded examples, the padded length of each, and the second key
    its training batches are sorted by (`token_batches`' `ties`: the source's length less the target's, so that
    pairs whose longer sides are equal are also grouped by their shorter sides; empty: none). A language model's
    text also knows its characters a token (`Task.characters` over the split's labels; 0: not a text), by which
    a loss per token becomes a loss per character that tokenizers compare by."""

    raw: list
    items: list
    lengths: list[int]
    ties: list[int] = field(default_factory=list)
    chars_per_token: float = 0.0

    def head(self, most: int) -> EncodedSplit:
        """The first `most` examples (all of them when `most` is 0)."""
        if not most:
            return self
        return EncodedSplit(self.raw[:most], self.items[:most], self.lengths[:most], self.ties[:most],
                            self.chars_per_token)


@dataclass
class PreparedData:
    """Everything the training loop reads from the data side."""

    objective: str
    task: Any  # the objective's task object with the run's options (`aiayn.tasks`): collation, forward, scores
    source_tokenizer: Tokenizer
    target_tokenizer: Tokenizer
    labels: list[str]
    train: EncodedSplit
    valid: EncodedSplit
    test: EncodedSplit
    stats: list[ReadStats] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # the data check and vocabulary, for the run's report

    @property
    def shared_tokenizer(self) -> bool:
        """True when source and target use one tokenizer."""
        return self.source_tokenizer is self.target_tokenizer


def read_examples(cfg: Any, path: str) -> tuple[list, ReadStats]:
    """Read one data file with the reader of the config's objective."""
    return cfg.objective_task.read(cfg, path)


def raw_splits(cfg: Any) -> tuple[list, list, list, list[ReadStats]]:
    """Train/valid/test raw examples from a built-in data set or files (a seeded split when valid/test are missing)."""
    if cfg.dataset:
        splits = builtin_dataset(cfg.dataset, seed=cfg.seed, n_train=cfg.dataset_train, n_valid=cfg.dataset_valid,
                                 n_test=cfg.dataset_test, max_number=cfg.dataset_max_number,
                                 max_len=cfg.dataset_max_len)
        expected = OBJECTIVE_OF[cfg.dataset]
        if cfg.objective != expected:
            raise ValueError(f"built-in data set {cfg.dataset!r} is for objective {expected!r}, "
                             f"not {cfg.objective!r}")
        stats = [ReadStats(path=f"data set {cfg.dataset} {name}", kept=len(items))
                 for name, items in (("train", splits.train), ("valid", splits.valid), ("test", splits.test))]
        return splits.train, splits.valid, splits.test, stats
    train, train_stats = read_examples(cfg, cfg.train)
    stats = [train_stats]
    if not train:
        raise ValueError(f"{cfg.train}: no training examples")
    valid: list = []
    test: list = []
    if cfg.valid:
        valid, s = read_examples(cfg, cfg.valid)
        stats.append(s)
    if cfg.test:
        test, s = read_examples(cfg, cfg.test)
        stats.append(s)
    if not cfg.valid or not cfg.test:
        order = list(range(len(train)))
        random.Random(cfg.seed).shuffle(order)
        n_valid = 0 if cfg.valid else max(1, round(len(train) * cfg.valid_fraction))
        n_test = 0 if cfg.test else max(1, round(len(train) * cfg.test_fraction))
        if n_valid + n_test >= len(train):
            raise ValueError(f"{cfg.train}: {len(train)} examples are too few to split off valid and test sets")
        if not cfg.valid:
            valid = [train[i] for i in order[:n_valid]]
        if not cfg.test:
            test = [train[i] for i in order[n_valid:n_valid + n_test]]
        train = [train[i] for i in sorted(order[n_valid + n_test:])]
        logger.info("split %s seeded: %d train, %d valid, %d test", cfg.train, len(train), len(valid), len(test))
    return train, valid, test, stats


def train_tokenizers(cfg: Any, train: list) -> tuple[Tokenizer, Tokenizer]:
    """Train the source and target tokenizers on the training split (one shared unless `shared_vocab=false`)."""
    task = cfg.objective_task
    extra = task.special_tokens
    kind = cfg.tokenizer
    if len(task.text_sides) == 1 or cfg.shared_vocab:
        texts = [text for side in task.text_sides for text in task.texts(train, side)]
        shared = train_tokenizer(texts, vocab_size=cfg.vocab_size, kind=kind, extra_special=extra,
                                 lowercase=cfg.lowercase, min_frequency=cfg.vocab_min_frequency)
        return shared, shared
    source_side, target_side = task.text_sides
    source = train_tokenizer(task.texts(train, source_side), vocab_size=cfg.vocab_size, kind=kind,
                             lowercase=cfg.lowercase, min_frequency=cfg.vocab_min_frequency)
    target = train_tokenizer(task.texts(train, target_side),
                             vocab_size=cfg.target_vocab_size or cfg.vocab_size,
                             kind=cfg.target_tokenizer or kind, lowercase=cfg.lowercase,
                             min_frequency=cfg.vocab_min_frequency)
    return source, target


def vocabulary_note(tokenizer: Tokenizer, asked: int, side: str = "") -> str:
    """`vocabulary: 718 ids (458 learned of the 7996 asked: all the corpus supports), ...` for the run's report."""
    learned = tokenizer.learned_size
    special = tokenizer.vocab_size - learned - tokenizer.byte_fallback_size
    note = f"vocabulary{' ' + side if side else ''}: {tokenizer.vocab_size} ids ({learned} learned"
    if learned + special < asked:
        note += f" of the {asked - special} asked: all that pairs seen vocab_min_frequency times or more give"
    note += f", {special} special"
    if tokenizer.byte_fallback_size:
        note += f", {tokenizer.byte_fallback_size} byte fallback"
    return note + ")"


def encode_split(cfg: Any, raw: list, source: Tokenizer, target: Tokenizer, labels: list[str],
                 name: str, stats: ReadStats | None = None) -> EncodedSplit:
    """Encode one split; rows over the length limits are dropped and counted in `stats`."""
    kept_raw, items, lengths, ties = [], [], [], []
    task = cfg.objective_task
    encoded, sizes = task.encode(raw, source, target, labels, name)
    characters = task.characters(raw)
    if len(encoded) != len(raw):  # a stream cut into windows (a causal LM's text): no window is one raw example
        raw = [None] * len(encoded)
    dropped = 0
    for example, item, (src_len, tgt_len) in zip(raw, encoded, sizes):
        if src_len > cfg.max_source_len or tgt_len > cfg.max_target_len:
            dropped += 1
            continue
        kept_raw.append(example)
        items.append(item)
        lengths.append(max(src_len, tgt_len))
        ties.append(src_len - tgt_len)
    if stats is not None:
        stats.too_long += dropped
        stats.kept -= dropped
    if dropped:
        logger.warning("%s split: dropped %d of %d examples over the length limits (source %d, target %d tokens)",
                       name, dropped, len(raw), cfg.max_source_len, cfg.max_target_len)
    if dropped and characters:
        characters = task.characters(kept_raw)
    return EncodedSplit(kept_raw, items, lengths, ties, characters / sum(lengths) if characters and lengths else 0.0)


def prepare_data(cfg: Any, *, tokenizers: tuple[Tokenizer, Tokenizer] | None = None,
                 labels: list[str] | None = None) -> PreparedData:
    """Read (or generate) the splits, check them, train tokenizers unless given, and encode everything.

    Files (not built-in data sets) pass the data check (`aiayn.data.check`); its summary and, for
    trained tokenizers, the vocabulary sizes are in `PreparedData.notes`.
    """
    train, valid, test, stats = raw_splits(cfg)
    notes = []
    task = cfg.objective_task  # aiayn.tasks: what differs by objective
    if not cfg.dataset and task.checked:
        train, valid, test, report = check_splits(train, valid, test, drop=cfg.clean)
        notes.append(report.summary())
    if tokenizers is None:
        source, target = train_tokenizers(cfg, train)
        if source is target:
            notes.append(vocabulary_note(source, cfg.vocab_size))
        else:
            notes += [vocabulary_note(source, cfg.vocab_size, "source"),
                      vocabulary_note(target, cfg.target_vocab_size or cfg.vocab_size, "target")]
    else:
        source, target = tokenizers
    if labels is None:
        labels = task.label_names(train)  # a task with labels refuses fewer than two
    task.check_tokenizer(source)
    train_stats = stats[0] if not cfg.dataset else None
    splits = {}
    for name, raw in (("train", train), ("valid", valid), ("test", test)):
        splits[name] = encode_split(cfg, raw, source, target, labels, name,
                                    train_stats if name == "train" else None)
    if not splits["train"].items:
        raise ValueError("every training example is over the length limits (max_source_len / max_target_len)")
    note = task.encoding_note({name: (len(raw), splits[name]) for name, raw in
                               (("train", train), ("valid", valid), ("test", test))})
    if note:
        notes.append(note)
    return PreparedData(cfg.objective, task, source, target, labels, splits["train"], splits["valid"], splits["test"],
                        stats, notes)


def save_data_artifacts(directory: str | Path, data: PreparedData) -> None:
    """Write the tokenizer(s) (shared at the top, else `source/` and `target/`) and `labels.json`."""
    directory = Path(directory)
    if data.shared_tokenizer:
        data.source_tokenizer.save(directory)
    else:
        data.source_tokenizer.save(directory / SOURCE_TOKENIZER)
        data.target_tokenizer.save(directory / TARGET_TOKENIZER)
    if data.labels:
        atomic_write_text(directory / LABELS_NAME, json.dumps(data.labels, indent=2) + "\n")


def load_labels(directory: str | Path) -> list[str]:
    """The label names a run saved (empty for seq2seq and masked-LM)."""
    path = Path(directory) / LABELS_NAME
    if not path.is_file():
        return []
    try:
        labels = load_json(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(labels, list) or not all(isinstance(label, str) for label in labels):
        raise ValueError(f"{path}: expected a JSON list of label names")
    return labels
