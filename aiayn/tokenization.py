"""Subword tokenizers: train, save and load them (Hugging Face `tokenizers` underneath).

aiayn's own tokenizers reserve four special tokens at fixed ids: `<pad>`=0, `<s>`=1, `</s>`=2,
`<unk>`=3 (then `<mask>` and `<cls>` where a task uses them).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

from aiayn.rundir import TOKENIZER as TOKENIZER_NAME
from aiayn.rundir import TOKENIZER_META as META_NAME
from aiayn.rundir import atomic_output, atomic_write_text

PAD, BOS, EOS, UNK, MASK, CLS = "<pad>", "<s>", "</s>", "<unk>", "<mask>", "<cls>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
KINDS = ("bpe", "wordpiece", "char")


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the names of its special tokens.

    Args:
        backend: the Hugging Face tokenizer.
        pad, bos, eos, unk: special-token strings (BERT's are "[PAD]", "[CLS]", "[SEP]", "[UNK]").
        mask: the mask token, if any.
    """

    def __init__(self, backend: HFTokenizer, *, pad: str = PAD, bos: str = BOS, eos: str = EOS,
                 unk: str = UNK, mask: str | None = None):
        self.backend = backend
        self.special = {"pad": pad, "bos": bos, "eos": eos, "unk": unk, "mask": mask}
        for role, token in self.special.items():
            if token is not None and backend.token_to_id(token) is None:
                raise ValueError(f"tokenizer has no {role} token {token!r}")

    # -- ids of the special tokens ----------------------------------------------------------
    def _id(self, role: str) -> int | None:
        token = self.special[role]
        return None if token is None else self.backend.token_to_id(token)

    @property
    def pad_id(self) -> int:
        """Id of the padding token."""
        return self._id("pad")

    @property
    def bos_id(self) -> int:
        """Id of the begin-of-sequence token (`<s>`, BERT's `[CLS]`)."""
        return self._id("bos")

    @property
    def eos_id(self) -> int:
        """Id of the end-of-sequence token (`</s>`, BERT's `[SEP]`)."""
        return self._id("eos")

    @property
    def unk_id(self) -> int:
        """Id of the unknown token."""
        return self._id("unk")

    @property
    def mask_id(self) -> int | None:
        """Id of the mask token, or None."""
        return self._id("mask")

    @property
    def vocab_size(self) -> int:
        """Number of ids, special tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    # -- text <-> ids -----------------------------------------------------------------------
    def tokenize(self, text: str) -> list[str]:
        """The subword strings of `text`, without special tokens."""
        return self.backend.encode(text, add_special_tokens=False).tokens

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Ids of `text`, optionally wrapped in `<s>` ... `</s>`."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if add_bos else []) + ids + ([self.eos_id] if add_eos else [])

    def encode_batch(self, texts: list[str], *, add_bos: bool = False, add_eos: bool = False) -> list[list[int]]:
        """`encode` for many texts at once (parallel in the Rust backend)."""
        out = self.backend.encode_batch(list(texts), add_special_tokens=False)
        head, tail = ([self.bos_id] if add_bos else []), ([self.eos_id] if add_eos else [])
        return [head + enc.ids + tail for enc in out]

    def decode(self, ids: Iterable[int], *, skip_special: bool = True) -> str:
        """Text of `ids`; special tokens are dropped unless `skip_special=False`."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special)

    def id_to_token(self, index: int) -> str:
        """The string of one id."""
        return self.backend.id_to_token(index)

    # -- persistence ------------------------------------------------------------------------
    def save(self, directory: str | Path) -> None:
        """Write `tokenizer.json` and `tokenizer_meta.json` into `directory`."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        with atomic_output(directory / TOKENIZER_NAME) as tmp:
            self.backend.save(str(tmp))
        atomic_write_text(directory / META_NAME, json.dumps(self.special, indent=2) + "\n")

    @classmethod
    def load(cls, directory: str | Path) -> Tokenizer:
        """Load what `save` wrote."""
        directory = Path(directory)
        path = directory / TOKENIZER_NAME
        if not path.is_file():
            raise FileNotFoundError(f"{directory}: {TOKENIZER_NAME} is missing")
        meta_path = directory / META_NAME
        special = {}
        if meta_path.is_file():
            try:
                special = json.loads(meta_path.read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                raise ValueError(f"{meta_path}: not valid JSON ({err})") from None
            if not isinstance(special, dict) or not set(special) <= {"pad", "bos", "eos", "unk", "mask"}:
                raise ValueError(f"{meta_path}: expected an object naming the pad, bos, eos, unk and mask tokens")
        backend = read_backend(path)
        try:
            return cls(backend, **special)
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from None


def read_backend(path: str | Path) -> HFTokenizer:
    """A Hugging Face `tokenizer.json`; a damaged file is a ValueError that names it."""
    try:
        return HFTokenizer.from_file(str(path))
    except Exception as err:  # the Rust side raises a bare Exception for every parse problem
        raise ValueError(f"{path}: not a readable tokenizer file ({err})") from None


def train_tokenizer(texts: Iterable[str], *, vocab_size: int = 8000, kind: str = "bpe",
                    extra_special: tuple[str, ...] = (), lowercase: bool = False,
                    min_frequency: int = 1) -> Tokenizer:
    """Train a subword tokenizer on `texts`.

    Args:
        texts: training text, one string per sentence or line.
        vocab_size: the most ids (special tokens included); a small corpus may give fewer.
        kind: "bpe" (byte-level-free BPE on whitespace-split words), "wordpiece", or "char".
        extra_special: more special tokens after the four fixed ones (e.g. `<mask>`, `<cls>`).
        lowercase: lowercase (and strip accents from) the text first.
        min_frequency: least count for a merge / piece.
    """
    if kind not in KINDS:
        raise ValueError(f"tokenizer kind must be one of {', '.join(KINDS)}, got {kind!r}")
    special = list(SPECIAL_TOKENS) + [tok for tok in extra_special if tok not in SPECIAL_TOKENS]
    norm = [normalizers.NFKC()]
    if lowercase:
        norm += [normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase()]
    if kind == "bpe":
        backend = HFTokenizer(models.BPE(unk_token=UNK, end_of_word_suffix="</w>"))
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special,
                                      min_frequency=min_frequency, end_of_word_suffix="</w>",
                                      show_progress=False)
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Whitespace(), pre_tokenizers.Digits(individual_digits=False)]
        )
        backend.decoder = decoders.BPEDecoder(suffix="</w>")
    elif kind == "wordpiece":
        backend = HFTokenizer(models.WordPiece(unk_token=UNK))
        trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=special,
                                            min_frequency=min_frequency, show_progress=False)
        backend.pre_tokenizer = pre_tokenizers.Whitespace()
        backend.decoder = decoders.WordPiece()
    else:  # character level: every character a token, spaces kept as "▁"
        backend = HFTokenizer(models.WordLevel(unk_token=UNK))
        trainer = trainers.WordLevelTrainer(vocab_size=vocab_size, special_tokens=special, min_frequency=1,
                                               show_progress=False)
        norm.append(normalizers.Replace(" ", "▁"))
        backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
        backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse()])
    backend.normalizer = normalizers.Sequence(norm)
    backend.train_from_iterator(texts, trainer=trainer)
    mask = "<mask>" if "<mask>" in special else None
    return Tokenizer(_canonical_ids(backend, len(special)), mask=mask)


def _canonical_ids(backend: HFTokenizer, n_special: int) -> HFTokenizer:
    """Renumber the learned (non-special) tokens in sorted order.

    The Hugging Face trainers number some tokens in hash-map order (BPE's end-of-word alphabet),
    which differs between processes; sorted ids make the same vocabulary get the same ids, so
    seeded training runs repeat exactly.
    """
    data = json.loads(backend.to_str())
    vocab = data["model"].get("vocab")
    if not isinstance(vocab, dict):
        return backend
    specials = sorted((i, t) for t, i in vocab.items() if i < n_special)
    learned = sorted(t for t, i in vocab.items() if i >= n_special)
    data["model"]["vocab"] = {t: i for i, t in specials} | {t: n_special + k for k, t in enumerate(learned)}
    return HFTokenizer.from_str(json.dumps(data))
