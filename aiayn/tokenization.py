"""Subword tokenizers: train, save and load them (Hugging Face `tokenizers` underneath).

aiayn's own tokenizers reserve four special tokens at fixed ids: `<pad>`=0, `<s>`=1, `</s>`=2,
`<unk>`=3 (then `<mask>` and `<cls>` where a task uses them).

The default kinds are lossless: `decode(encode(text)) == text` for any text. They work the way
SentencePiece does: a space is kept as the symbol "▁" inside the pieces, nothing is normalised
away, and a character the training text never showed falls back to its UTF-8 bytes (`<0xE2>`
...) instead of `<unk>`. Special-token strings inside user text (a literal "<s>") are plain text.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

from aiayn.paths import check_input_file
from aiayn.rundir import TOKENIZER as TOKENIZER_NAME
from aiayn.rundir import TOKENIZER_META as META_NAME
from aiayn.rundir import atomic_output, atomic_write_text, load_json

logger = logging.getLogger(__name__)

PAD, BOS, EOS, UNK, MASK, CLS = "<pad>", "<s>", "</s>", "<unk>", "<mask>", "<cls>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
# Lossless kinds first; "subword-nmt" (BPE on whitespace-split words with `</w>`, Sennrich et al.)
# and "wordpiece" (BERT's) split punctuation off words and do not give the text back exactly.
KINDS = ("bpe", "unigram", "char", "byte", "subword-nmt", "wordpiece")
LOSSLESS_KINDS = ("bpe", "unigram", "char", "byte")
# The kinds whose vocabulary the text's symbols decide, not `vocab_size`: its characters, or the 256 bytes.
SYMBOL_KINDS = ("char", "byte")
SPACE = "▁"  # U+2581, SentencePiece's symbol for a space
# A literal "▁" in the text must not come back as a space (SentencePiece's own models lose it): before the
# spaces become "▁", the normaliser writes it as ESCAPE + "\ue002" and ESCAPE itself as ESCAPE + "\ue001"
# (private-use characters: ESCAPE then never stands alone, so the decoder undoes both exactly).
ESCAPE, ESCAPED_ESCAPE, ESCAPED_SPACE = "\ue000", "\ue000\ue001", "\ue000\ue002"
BYTE_TOKENS = tuple(f"<0x{b:02X}>" for b in range(256))


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the names of its special tokens.

    Args:
        hf: the Hugging Face tokenizer.
        pad, bos, eos, unk: special-token strings (BERT's are "[PAD]", "[CLS]", "[SEP]", "[UNK]").
        mask: the mask token, if any.
        literal_specials: special-token strings in the text are ordinary text (aiayn's own
            tokenizers); False keeps Hugging Face's matching of them (BERT checkpoints).
    """

    def __init__(self, hf: HFTokenizer, *, pad: str = PAD, bos: str = BOS, eos: str = EOS,
                 unk: str = UNK, mask: str | None = None, literal_specials: bool = False):
        self.hf = hf
        self.special = {"pad": pad, "bos": bos, "eos": eos, "unk": unk, "mask": mask}
        self.literal_specials = literal_specials
        hf.encode_special_tokens = literal_specials
        # Whether the normaliser puts a "▁" before the text (the lossless subword kinds do), and whether it escapes a
        # literal "▁" (the lossless kinds but bytes, which hold any text as it is).
        normalizer = json.dumps(json.loads(hf.to_str()).get("normalizer"))
        self._prepends, self._escapes = "Prepend" in normalizer, json.dumps(ESCAPE) in normalizer
        for role, token in self.special.items():
            if token is not None and hf.token_to_id(token) is None:
                raise ValueError(f"tokenizer has no {role} token {token!r}")

    # -- ids of the special tokens ----------------------------------------------------------
    def _id(self, role: str) -> int | None:
        token = self.special[role]
        return None if token is None else self.hf.token_to_id(token)

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
        return self.hf.get_vocab_size(with_added_tokens=True)

    @property
    def byte_fallback_size(self) -> int:
        """Number of byte-fallback ids (`<0x00>`..`<0xFF>`): 256 for the lossless kinds, else 0."""
        return sum(self.hf.token_to_id(token) is not None for token in BYTE_TOKENS)

    @property
    def learned_size(self) -> int:
        """Number of ids learned from the training text (neither special nor byte fallback)."""
        return self.vocab_size - len(self.hf.get_added_tokens_decoder()) - self.byte_fallback_size

    # -- text <-> ids -----------------------------------------------------------------------
    def tokenize(self, text: str) -> list[str]:
        """The subword strings of `text` as the vocabulary stores them, without special tokens."""
        return self.hf.encode(text, add_special_tokens=False).tokens

    def pieces(self, text: str) -> list[str]:
        """The tokens of `text` as a person reads them: one string per token, joining back to `text`.

        The space symbol "▁" shows as a space, a byte-fallback sequence shows as its character
        (on its first byte; the others show ""), BPE's `</w>` and WordPiece's `##` are dropped.
        """
        return display_pieces(self.tokenize(text), prepended=self._prepends, escaped=self._escapes)

    def id_pieces(self, ids: Iterable[int]) -> list[str]:
        """`pieces` for ids (special tokens show their names): labels for attention maps."""
        return display_pieces([self.hf.id_to_token(int(i)) for i in ids], prepended=self._prepends,
                              escaped=self._escapes)

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Ids of `text`, optionally wrapped in `<s>` ... `</s>`."""
        ids = self.hf.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if add_bos else []) + ids + ([self.eos_id] if add_eos else [])

    def encode_batch(self, texts: list[str], *, add_bos: bool = False, add_eos: bool = False) -> list[list[int]]:
        """`encode` for many texts at once (parallel in the Rust library)."""
        out = self.hf.encode_batch(list(texts), add_special_tokens=False)
        head, tail = ([self.bos_id] if add_bos else []), ([self.eos_id] if add_eos else [])
        return [head + enc.ids + tail for enc in out]

    def __call__(self, texts: str | list[str], *, add_bos: bool = False, add_eos: bool = False,
                 max_length: int | None = None, padding: bool = True, return_tensors: str | None = None) -> dict:
        """Hugging Face style: `{"input_ids", "attention_mask"}` of one text or a batch.

        Args:
            texts: one text (flat lists back) or a list of texts (rows).
            add_bos, add_eos: wrap each text in `<s>` ... `</s>` (encoders take both, translation
                sources end with `</s>`; Hugging Face's tokenizers decide this from their template).
            max_length: cut each row to this many ids, keeping a final `</s>` when `add_eos`.
            padding: right-pad rows with `<pad>` to the longest (the mask marks real ids with 1).
            return_tensors: None (lists), "pt" (torch int64) or "np" (numpy int64); tensors need padding.
        """
        if return_tensors not in (None, "pt", "np"):
            raise ValueError(f"return_tensors must be None, 'pt' or 'np', got {return_tensors!r}")
        single = isinstance(texts, str)
        rows = self.encode_batch([texts] if single else list(texts), add_bos=add_bos, add_eos=add_eos)
        if max_length is not None:
            if max_length < add_bos + add_eos + 1:
                raise ValueError(f"max_length {max_length} leaves no room for a token between the special ones")
            rows = [r if len(r) <= max_length else r[: max_length - add_eos] + r[len(r) - add_eos:] for r in rows]
        width = max((len(r) for r in rows), default=0) if padding else None
        if return_tensors is not None and not padding and len({len(r) for r in rows}) > 1:
            raise ValueError("rows of different lengths make no tensor: pass padding=True")
        ids = [r + [self.pad_id] * (width - len(r)) if padding else r for r in rows]
        mask = [[1] * len(r) + [0] * (len(i) - len(r)) for r, i in zip(rows, ids)]
        out = {"input_ids": ids, "attention_mask": mask}
        if single and return_tensors is None:
            return {name: value[0] for name, value in out.items()}
        if return_tensors == "pt":
            import torch

            return {name: torch.tensor(value, dtype=torch.long) for name, value in out.items()}
        if return_tensors == "np":
            import numpy as np

            return {name: np.array(value, dtype=np.int64) for name, value in out.items()}
        return out

    def decode(self, ids: Iterable[int], *, skip_special: bool = True) -> str:
        """Text of `ids`; special tokens are dropped unless `skip_special=False`."""
        return self.hf.decode(list(ids), skip_special_tokens=skip_special)

    def decode_batch(self, rows: Iterable[Iterable[int]], *, skip_special: bool = True) -> list[str]:
        """`decode` for many id lists at once."""
        return self.hf.decode_batch([list(r) for r in rows], skip_special_tokens=skip_special)

    def id_to_token(self, index: int) -> str:
        """The string of one id, as the vocabulary stores it."""
        return self.hf.id_to_token(index)

    # -- persistence ------------------------------------------------------------------------
    def save(self, directory: str | Path) -> None:
        """Write `tokenizer.json` and `tokenizer_meta.json` into `directory`."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        with atomic_output(directory / TOKENIZER_NAME) as tmp:
            self.hf.save(str(tmp))
        meta = {**self.special, "literal_specials": self.literal_specials}
        atomic_write_text(directory / META_NAME, json.dumps(meta, indent=2) + "\n")

    @classmethod
    def load(cls, directory: str | Path) -> Tokenizer:
        """Load what `save` wrote."""
        directory = Path(directory)
        path = directory / TOKENIZER_NAME
        if not path.exists() and not path.is_symlink():
            raise FileNotFoundError(f"{directory}: {TOKENIZER_NAME} is missing")
        check_input_file(path, "tokenizer file")  # a device (a link to /dev/zero would never end), a link loop
        meta_path = directory / META_NAME
        special = {}
        if meta_path.exists() or meta_path.is_symlink():
            check_input_file(meta_path, "tokenizer file")
            try:
                special = load_json(meta_path.read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                raise ValueError(f"{meta_path}: not valid JSON ({err})") from None
            if not isinstance(special, dict) or not set(special) <= {"pad", "bos", "eos", "unk", "mask",
                                                                     "literal_specials"}:
                raise ValueError(f"{meta_path}: expected an object naming the pad, bos, eos, unk and mask tokens")
        hf = read_hf(path)
        try:
            return cls(hf, **special)
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from None


def read_hf(path: str | Path) -> HFTokenizer:
    """A Hugging Face `tokenizer.json`; a damaged file is a ValueError that names it."""
    try:
        return HFTokenizer.from_file(str(path))
    except Exception as err:  # the Rust side raises a bare Exception for every parse problem
        raise ValueError(f"{path}: not a readable tokenizer file ({err})") from None


def display_pieces(tokens: list[str], *, prepended: bool = False, escaped: bool = True) -> list[str]:
    """Vocabulary strings -> the text each token stands for (see `Tokenizer.pieces`).

    `prepended`: the tokenizer put one "▁" before the text, which the first piece then drops. `escaped`: its
    normaliser escaped a literal "▁" (see ESCAPE), which the pieces then undo.
    """
    out: list[str] = []
    pending: list[int] = []  # byte values of an unfinished UTF-8 character
    start = 0
    for token in tokens:
        if token in _BYTE_VALUE:
            if not pending:
                start = len(out)
            pending.append(_BYTE_VALUE[token])
            out.append("")
            text = bytes(pending).decode("utf-8", errors="ignore")
            if text:
                out[start], pending = text, []
            continue
        out.append(token.replace(SPACE, " ").removesuffix("</w>").removeprefix("##"))
    if prepended and out and tokens[0].startswith(SPACE):
        out[0] = out[0][1:]  # the space the tokenizer put before the text (it is not in the text)
    return _unescape_pieces(out) if escaped else out


def _unescape_pieces(pieces: list[str]) -> list[str]:
    """Undo the ESCAPE codes, which may straddle two pieces: the character goes to the piece of its ESCAPE."""
    if not any(ESCAPE in piece for piece in pieces):
        return pieces
    out: list[list[str]] = [[] for _ in pieces]
    escaped_at = None  # the piece whose ESCAPE waits for its code character
    for index, piece in enumerate(pieces):
        for char in piece:
            if escaped_at is not None:
                out[escaped_at].append(SPACE if char == ESCAPED_SPACE[1] else ESCAPE)
                escaped_at = None
            elif char == ESCAPE:
                escaped_at = index
            else:
                out[index].append(char)
    return ["".join(chars) for chars in out]


_BYTE_VALUE = {token: value for value, token in enumerate(BYTE_TOKENS)}


def train_tokenizer(texts: Iterable[str], *, vocab_size: int = 8000, kind: str = "bpe",
                    extra_special: tuple[str, ...] = (), lowercase: bool = False,
                    min_frequency: int = 2) -> Tokenizer:
    """Train a subword tokenizer on `texts`.

    Args:
        texts: training text, one string per sentence or line.
        vocab_size: the most learned tokens plus special tokens; the lossless kinds add 256
            byte-fallback tokens on top. A small corpus may support fewer: BPE stops merging when
            no pair occurs `min_frequency` times, and the note says so.
        kind: "bpe" (lossless, SentencePiece-style, the default), "unigram" (lossless,
            SentencePiece's unigram model), "char" (lossless, one token per character), "byte" (lossless, one
            token per UTF-8 byte: 256 of them, whatever the text, as ByT5 reads text), "subword-nmt" (BPE on
            whitespace-split words with `</w>`) or "wordpiece" (BERT's).
        extra_special: more special tokens after the four fixed ones (e.g. `<mask>`, `<cls>`).
        lowercase: lowercase the text first (then nothing is lossless; "subword-nmt" and
            "wordpiece" also strip accents).
        min_frequency: least count of a pair for a BPE merge (2: no merge learned from one word).
    """
    if kind not in KINDS:
        raise ValueError(f"tokenizer kind must be one of {', '.join(KINDS)}, got {kind!r}")
    special = list(SPECIAL_TOKENS) + [tok for tok in extra_special if tok not in SPECIAL_TOKENS]
    texts = list(texts)
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < 1:
        raise ValueError(f"vocab_size must be a positive integer, got {vocab_size!r}")
    alphabet = {ch for text in texts for ch in (text.lower() if lowercase else text)} - {" "}
    if kind not in SYMBOL_KINDS and vocab_size < len(special) + len(alphabet):  # the trainer would silently take more
        raise ValueError(f"vocab_size {vocab_size} is too small for this text: its {len(special)} special tokens "
                         f"and {len(alphabet)} distinct characters need at least {len(special) + len(alphabet)}"
                         f"{' (the 256 byte-fallback tokens come on top)' if kind in LOSSLESS_KINDS else ''}; "
                         "raise vocab_size")
    if kind in LOSSLESS_KINDS:
        hf = _train_lossless(texts, kind, vocab_size, special, lowercase, min_frequency)
    else:
        hf = _train_word_split(texts, kind, vocab_size, special, lowercase, min_frequency)
    mask = MASK if MASK in special else None
    tokenizer = Tokenizer(hf, mask=mask, literal_specials=True)
    if kind not in SYMBOL_KINDS and tokenizer.learned_size + len(special) < vocab_size:
        logger.info("vocabulary: %d tokens learned of the %d asked (the corpus supports no more at min_frequency %d)",
                    tokenizer.learned_size, vocab_size - len(special), min_frequency)
    return tokenizer


def _escape(text: str) -> str:
    """What the lossless normalisers make of a literal ESCAPE and "▁" (see ESCAPE)."""
    return text.replace(ESCAPE, ESCAPED_ESCAPE).replace(SPACE, ESCAPED_SPACE)


def _unescaping_decoders() -> list:
    """After the tokens are fused into one string: the escaped "▁" and ESCAPE back (see ESCAPE)."""
    return [decoders.Fuse(), decoders.Replace(ESCAPED_SPACE, SPACE), decoders.Replace(ESCAPED_ESCAPE, ESCAPE)]


def _train_lossless(texts: list[str], kind: str, vocab_size: int, special: list[str], lowercase: bool,
                    min_frequency: int) -> HFTokenizer:
    """SentencePiece-style: spaces kept as "▁", byte fallback, no normaliser that rewrites text."""
    norm = [normalizers.Lowercase()] if lowercase else []
    norm += [normalizers.Replace(ESCAPE, ESCAPED_ESCAPE), normalizers.Replace(SPACE, ESCAPED_SPACE)]
    if kind == "byte":  # no piece but the bytes: every character falls back to its UTF-8 bytes, a space too
        hf = HFTokenizer(models.BPE(vocab={tok: i for i, tok in enumerate(special)}, merges=[], unk_token=UNK,
                                    byte_fallback=True))
        hf.add_special_tokens(special)
        hf.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
        hf.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
        return _with_byte_tokens(hf, len(special))
    if kind == "char":
        alphabet = sorted({ch for text in texts for ch in _escape(text.lower() if lowercase else text)} - {" "})
        vocab = {tok: i for i, tok in enumerate([*special, SPACE, *alphabet])}
        hf = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK, byte_fallback=True))
        hf.add_special_tokens(special)  # as the trainers do: skipped when decoding, never split
        hf.normalizer = normalizers.Sequence([*norm, normalizers.Replace(" ", SPACE)])
        hf.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
        hf.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(),
                                             *_unescaping_decoders()])
        return _with_byte_tokens(hf, len(special))
    # One "▁" before the text and one for each space; the pre-tokenizer cuts before every "▁", so
    # pieces never span two words; the decoder maps "▁" back and strips the one it added.
    norm += [normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)]
    if kind == "bpe":
        hf = HFTokenizer(models.BPE(unk_token=UNK, byte_fallback=True))
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special, min_frequency=min_frequency,
                                      show_progress=False)
    else:
        hf = HFTokenizer(models.Unigram())
        trainer = trainers.UnigramTrainer(vocab_size=vocab_size, special_tokens=special, unk_token=UNK,
                                          show_progress=False)
    hf.normalizer = normalizers.Sequence(norm)
    hf.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="never", split=True)
    hf.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(),
                                         *_unescaping_decoders(), decoders.Strip(" ", 1, 0)])
    hf.train_from_iterator(texts, trainer=trainer)
    return _with_byte_tokens(hf, len(special))


def _train_word_split(texts: list[str], kind: str, vocab_size: int, special: list[str], lowercase: bool,
                      min_frequency: int) -> HFTokenizer:
    """The word-splitting kinds: NFKC, punctuation split off words; not lossless."""
    norm = [normalizers.NFKC()]
    if lowercase:
        norm += [normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase()]
    if kind == "subword-nmt":
        hf = HFTokenizer(models.BPE(unk_token=UNK, end_of_word_suffix="</w>"))
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special, min_frequency=min_frequency,
                                      end_of_word_suffix="</w>", show_progress=False)
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Whitespace(), pre_tokenizers.Digits(individual_digits=False)]
        )
        hf.decoder = decoders.BPEDecoder(suffix="</w>")
    else:
        hf = HFTokenizer(models.WordPiece(unk_token=UNK))
        trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=special,
                                            min_frequency=min_frequency, show_progress=False)
        hf.pre_tokenizer = pre_tokenizers.Whitespace()
        hf.decoder = decoders.WordPiece()
    hf.normalizer = normalizers.Sequence(norm)
    hf.train_from_iterator(texts, trainer=trainer)
    return _canonical_ids(hf, len(special))


def _with_byte_tokens(hf: HFTokenizer, n_special: int) -> HFTokenizer:
    """Sorted ids for the learned tokens, then the 256 byte-fallback tokens `<0x00>`..`<0xFF>` at the end."""
    hf = _canonical_ids(hf, n_special)
    data = json.loads(hf.to_str())
    model = data["model"]
    if model["type"] == "Unigram":
        # The unigram model matches any piece inside the text: a literal "<s>" or "<0xE2>" must not become
        # the special or byte-fallback piece of that name. Those pieces get a score no path beats, and
        # every printable ASCII character a piece of its own (below any learned piece), so such strings
        # are spelled out. Byte fallback itself does not look at scores.
        floor = min((score for _, score in model["vocab"][n_special:]), default=0.0) - 10.0
        known = {piece for piece, _ in model["vocab"]}
        ascii_chars = [chr(c) for c in range(0x21, 0x7F)]
        model["vocab"] += [[piece, floor] for piece in ascii_chars if piece not in known]
        model["vocab"] += [[token, -1e9] for token in BYTE_TOKENS if token not in known]
        for entry in model["vocab"][:n_special]:
            entry[1] = -1e9
        model["byte_fallback"] = True
    else:
        vocab = model["vocab"]
        for token in BYTE_TOKENS:
            vocab.setdefault(token, len(vocab))
    return HFTokenizer.from_str(json.dumps(data))


def _canonical_ids(hf: HFTokenizer, n_special: int) -> HFTokenizer:
    """Renumber the learned (non-special) tokens in sorted order.

    The Hugging Face trainers number some tokens in hash-map order (BPE's alphabet), which
    differs between processes; sorted ids make the same vocabulary get the same ids, so seeded
    training runs repeat exactly. (Unigram's list is already in a fixed order.)
    """
    data = json.loads(hf.to_str())
    vocab = data["model"].get("vocab")
    if not isinstance(vocab, dict):
        return hf
    specials = sorted((i, t) for t, i in vocab.items() if i < n_special)
    learned = sorted(t for t, i in vocab.items() if i >= n_special)
    data["model"]["vocab"] = {t: i for i, t in specials} | {t: n_special + k for k, t in enumerate(learned)}
    return HFTokenizer.from_str(json.dumps(data))
