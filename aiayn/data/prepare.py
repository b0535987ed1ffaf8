"""From a training config to encoded train/valid/test splits: read or generate, tokenize, drop and count.

Encoding conventions (the generation and evaluation code rely on them):
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
from aiayn.data.readers import (
    ReadStats,
    read_classification,
    read_conll,
    read_parallel,
    read_text,
)
from aiayn.data.tasks import builtin_task
from aiayn.rundir import LABELS as LABELS_NAME
from aiayn.rundir import atomic_write_text
from aiayn.tasks.names import LABELLED, MASKED_LM, SEQ2SEQ, SEQUENCE_CLASSIFICATION, TOKEN_CLASSIFICATION
from aiayn.tokenization import MASK, Tokenizer, train_tokenizer

logger = logging.getLogger(__name__)

IGNORE = -100


@dataclass
class EncodedSplit:
    """One split: raw examples (for references), encoded examples, and the padded length of each."""

    raw: list
    items: list
    lengths: list[int]


@dataclass
class PreparedData:
    """Everything the training loop reads from the data side."""

    objective: str
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
    if cfg.objective == SEQ2SEQ:
        return read_parallel(path, fmt=cfg.data_format, source_field=cfg.source_field, target_field=cfg.target_field)
    if cfg.objective == SEQUENCE_CLASSIFICATION:
        return read_classification(path, fmt=cfg.data_format, text_field=cfg.text_field, label_field=cfg.label_field)
    if cfg.objective == TOKEN_CLASSIFICATION:
        return read_conll(path)
    return read_text(path)


def raw_splits(cfg: Any) -> tuple[list, list, list, list[ReadStats]]:
    """Train/valid/test raw examples from a built-in task or files (a seeded split when valid/test are missing)."""
    if cfg.task:
        splits = builtin_task(cfg.task, seed=cfg.seed, n_train=cfg.task_train, n_valid=cfg.task_valid,
                              n_test=cfg.task_test, max_number=cfg.task_max_number, max_len=cfg.task_max_len)
        expected = SEQUENCE_CLASSIFICATION if cfg.task == "compare" else SEQ2SEQ
        if cfg.objective != expected:
            raise ValueError(f"built-in task {cfg.task!r} is for objective {expected!r}, not {cfg.objective!r}")
        stats = [ReadStats(path=f"task {cfg.task} {name}", kept=len(items))
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


def _texts(objective: str, examples: list, side: str) -> list[str]:
    if objective == SEQ2SEQ:
        return [e.source if side == "source" else e.target for e in examples]
    if objective == SEQUENCE_CLASSIFICATION:
        return [e.text for e in examples]
    if objective == TOKEN_CLASSIFICATION:
        return [" ".join(e.tokens) for e in examples]
    return list(examples)


def train_tokenizers(cfg: Any, train: list) -> tuple[Tokenizer, Tokenizer]:
    """Train the source and target tokenizers on the training split (one shared unless `shared_vocab=false`)."""
    extra = (MASK,) if cfg.objective == MASKED_LM else ()
    kind = cfg.tokenizer
    if cfg.objective != SEQ2SEQ or cfg.shared_vocab:
        texts = _texts(cfg.objective, train, "source")
        if cfg.objective == SEQ2SEQ:
            texts += _texts(cfg.objective, train, "target")
        shared = train_tokenizer(texts, vocab_size=cfg.vocab_size, kind=kind, extra_special=extra,
                                 lowercase=cfg.lowercase, min_frequency=cfg.vocab_min_frequency)
        return shared, shared
    source = train_tokenizer(_texts(cfg.objective, train, "source"), vocab_size=cfg.vocab_size, kind=kind,
                             lowercase=cfg.lowercase, min_frequency=cfg.vocab_min_frequency)
    target = train_tokenizer(_texts(cfg.objective, train, "target"),
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


def label_names(objective: str, train: list) -> list[str]:
    """Sorted label (or tag) names seen in the training split."""
    if objective == SEQUENCE_CLASSIFICATION:
        return sorted({e.label for e in train})
    if objective == TOKEN_CLASSIFICATION:
        return sorted({tag for e in train for tag in e.tags})
    return []


def encode_split(cfg: Any, raw: list, source: Tokenizer, target: Tokenizer, labels: list[str],
                 name: str, stats: ReadStats | None = None) -> EncodedSplit:
    """Encode one split; rows over the length limits are dropped and counted in `stats`."""
    label_index = {label: i for i, label in enumerate(labels)}
    kept_raw, items, lengths = [], [], []
    if cfg.objective == SEQUENCE_CLASSIFICATION and raw and not {e.label for e in raw} & set(labels):
        seen = sorted({e.label for e in raw})
        raise ValueError(f"{name} split: none of its labels ({', '.join(map(repr, seen[:3]))}"
                         f"{', ...' if len(seen) > 3 else ''}) is one of the run's ({', '.join(labels)}): is this "
                         f"data for another kind of run? (this one is {cfg.objective})")

    def label_id(label: str) -> int:
        if label not in label_index:
            raise ValueError(f"{name} split: label {label!r} does not occur in the training data "
                             f"(known: {', '.join(labels)})")
        return label_index[label]

    if cfg.objective == SEQ2SEQ:
        src_ids = source.encode_batch([e.source for e in raw], add_eos=True)
        tgt_ids = target.encode_batch([e.target for e in raw])
        encoded = list(zip(src_ids, tgt_ids))
        sizes = [(len(s), len(t) + 1) for s, t in encoded]
    elif cfg.objective == TOKEN_CLASSIFICATION:
        encoded = []
        for example in raw:
            enc = source.backend.encode(list(example.tokens), is_pretokenized=True, add_special_tokens=False)
            tags = [IGNORE]
            previous = None
            for word in enc.word_ids:
                tags.append(label_id(example.tags[word]) if word is not None and word != previous else IGNORE)
                previous = word
            encoded.append(([source.bos_id, *enc.ids, source.eos_id], [*tags, IGNORE]))
        sizes = [(len(ids), 0) for ids, _ in encoded]
    else:
        texts = [e.text for e in raw] if cfg.objective == SEQUENCE_CLASSIFICATION else list(raw)
        ids = source.encode_batch(texts, add_bos=True, add_eos=True)
        if cfg.objective == SEQUENCE_CLASSIFICATION:
            encoded = [(i, label_id(e.label)) for i, e in zip(ids, raw)]
        else:
            encoded = ids
        sizes = [(len(i), 0) for i in ids]
    dropped = 0
    for example, item, (src_len, tgt_len) in zip(raw, encoded, sizes):
        if src_len > cfg.max_source_len or tgt_len > cfg.max_target_len:
            dropped += 1
            continue
        kept_raw.append(example)
        items.append(item)
        lengths.append(max(src_len, tgt_len))
    if stats is not None:
        stats.too_long += dropped
        stats.kept -= dropped
    if dropped:
        logger.warning("%s split: dropped %d of %d examples over the length limits (source %d, target %d tokens)",
                       name, dropped, len(raw), cfg.max_source_len, cfg.max_target_len)
    return EncodedSplit(kept_raw, items, lengths)


def prepare_data(cfg: Any, *, tokenizers: tuple[Tokenizer, Tokenizer] | None = None,
                 labels: list[str] | None = None) -> PreparedData:
    """Read (or generate) the splits, check them, train tokenizers unless given, and encode everything.

    Files (not built-in tasks) pass the data check (`aiayn.data.check`); its summary and, for
    trained tokenizers, the vocabulary sizes are in `PreparedData.notes`.
    """
    train, valid, test, stats = raw_splits(cfg)
    notes = []
    if not cfg.task and cfg.objective in (SEQ2SEQ, SEQUENCE_CLASSIFICATION):
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
        labels = label_names(cfg.objective, train)
        if cfg.objective in LABELLED and len(labels) < 2:
            what = "label" if cfg.objective == SEQUENCE_CLASSIFICATION else "tag"
            raise ValueError(f"the training data has one {what} ({', '.join(map(repr, labels))}): there is nothing "
                             f"to tell apart (every prediction would be right); add examples of other {what}s")
    if cfg.objective == MASKED_LM and source.mask_id is None:
        raise ValueError("masked-LM training needs a tokenizer with a mask token")
    train_stats = stats[0] if not cfg.task else None
    splits = {}
    for name, raw in (("train", train), ("valid", valid), ("test", test)):
        splits[name] = encode_split(cfg, raw, source, target, labels, name,
                                    train_stats if name == "train" else None)
    if not splits["train"].items:
        raise ValueError("every training example is over the length limits (max_source_len / max_target_len)")
    return PreparedData(cfg.objective, source, target, labels, splits["train"], splits["valid"], splits["test"],
                        stats, notes)


def save_data_artifacts(directory: str | Path, data: PreparedData) -> None:
    """Write the tokenizer(s) (shared at the top, else `source/` and `target/`) and `labels.json`."""
    directory = Path(directory)
    if data.shared_tokenizer:
        data.source_tokenizer.save(directory)
    else:
        data.source_tokenizer.save(directory / "source")
        data.target_tokenizer.save(directory / "target")
    if data.labels:
        atomic_write_text(directory / LABELS_NAME, json.dumps(data.labels, indent=2) + "\n")


def load_labels(directory: str | Path) -> list[str]:
    """The label names a run saved (empty for seq2seq and masked-LM)."""
    path = Path(directory) / LABELS_NAME
    if not path.is_file():
        return []
    try:
        labels = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(labels, list) or not all(isinstance(label, str) for label in labels):
        raise ValueError(f"{path}: expected a JSON list of label names")
    return labels
