"""Built-in data sets that need no files, each generated from a seed with disjoint train/valid/test splits.

- `numbers`: translate English number words to German (`num2words`): "twenty-one" -> "einundzwanzig".
  German puts units before tens, so the model has to attend across the source, not copy it. The English
  side is written as people write it: each number in one of `SPELLINGS`, chosen by the number.
- `compare`: encoder-only classification: which of two number phrases is larger ("first"/"second").
  The answer depends on both phrases at once, so it needs attention across positions; the
  majority-class baseline is 50%.
- `copy`: copy a random letter string (a smoke test for sequence-to-sequence training).
- `counting`: text for a language model: lines that count on from a number in English words ("one hundred and
  five, one hundred and six, ..."). Continuing a line needs the words of the number before, several tokens back;
  each split starts from numbers of its own.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from aiayn.data.readers import LabelledText, ParallelExample
from aiayn.tasks.names import CAUSAL_LM, SEQ2SEQ, SEQUENCE_CLASSIFICATION

DATASETS = ("numbers", "compare", "copy", "counting")
OBJECTIVE_OF = {"numbers": SEQ2SEQ, "compare": SEQUENCE_CLASSIFICATION, "copy": SEQ2SEQ, "counting": CAUSAL_LM}


@dataclass
class Splits:
    """train/valid/test examples of one data set."""

    train: list
    valid: list
    test: list


def _split_sizes(total: int, n_train: int, n_valid: int, n_test: int) -> None:
    if min(n_train, n_valid, n_test) < 1:
        raise ValueError("data set split sizes must be at least 1")
    if n_train + n_valid + n_test > total:
        raise ValueError(f"data set splits of {n_train}+{n_valid}+{n_test} examples need more than the {total} "
                         "distinct items available; lower them or raise dataset_max_number")


def number_words(n: int, lang: str) -> str:
    """`n` spelled out in `lang` ("en" or "de") by num2words."""
    from num2words import num2words

    return num2words(n, lang=lang)


# How people write an English number: num2words' "three thousand, four hundred and twenty-one", and the same
# without the comma, without "and", and with "twenty one" for "twenty-one" (each form drops one more mark).
SPELLINGS = ("num2words", "no comma", "no comma or and", "no comma, and or hyphen")


def english_spelling(n: int, form: str) -> str:
    """`n` in English words in one of `SPELLINGS`: "three thousand four hundred twenty one" for the last."""
    if form not in SPELLINGS:
        raise ValueError(f"unknown spelling {form!r}; choose one of {', '.join(SPELLINGS)}")
    words = number_words(n, "en")
    level = SPELLINGS.index(form)
    if level >= 1:
        words = words.replace(",", "")
    if level >= 2:
        words = words.replace(" and ", " ")
    if level >= 3:
        words = words.replace("-", " ")
    return words


def spelling_of(n: int) -> str:
    """The form number `n` is written in on the English side: fixed by `n`, spread evenly over `SPELLINGS`."""
    return SPELLINGS[random.Random(n).randrange(len(SPELLINGS))]


def numbers_dataset(*, seed: int = 0, n_train: int = 8000, n_valid: int = 500, n_test: int = 500,
                    max_number: int = 10000) -> Splits:
    """English -> German number words for numbers in [0, max_number); each number is in one split only."""
    _split_sizes(max_number, n_train, n_valid, n_test)
    numbers = list(range(max_number))
    random.Random(seed).shuffle(numbers)

    def pairs(chunk: list[int]) -> list[ParallelExample]:
        return [ParallelExample(english_spelling(n, spelling_of(n)), number_words(n, "de")) for n in chunk]

    return Splits(train=pairs(numbers[:n_train]), valid=pairs(numbers[n_train:n_train + n_valid]),
                  test=pairs(numbers[n_train + n_valid:n_train + n_valid + n_test]))


def compare_dataset(*, seed: int = 0, n_train: int = 8000, n_valid: int = 500, n_test: int = 500,
                    max_number: int = 1000) -> Splits:
    """Pairs "A ; B" of English number phrases, each marked "first" or "second" (the larger one); pairs are disjoint."""
    total = max_number * (max_number - 1)
    _split_sizes(total, n_train, n_valid, n_test)
    rng = random.Random(seed)
    seen: set[tuple[int, int]] = set()
    items: list[LabelledText] = []
    while len(items) < n_train + n_valid + n_test:
        a, b = rng.randrange(max_number), rng.randrange(max_number)
        if a == b or (a, b) in seen:
            continue
        seen.add((a, b))
        items.append(LabelledText(f"{number_words(a, 'en')} ; {number_words(b, 'en')}",
                                  "first" if a > b else "second"))
    return Splits(train=items[:n_train], valid=items[n_train:n_train + n_valid],
                  test=items[n_train + n_valid:])


def copy_dataset(*, seed: int = 0, n_train: int = 2000, n_valid: int = 100, n_test: int = 100,
                 max_len: int = 8) -> Splits:
    """Random strings of 1..`max_len` letters from "abcdefgh", each copied as its own target; splits disjoint."""
    if 8 ** max_len < 2 * (n_train + n_valid + n_test):
        raise ValueError(f"copy strings of at most {max_len} letters are too few for the splits; raise dataset_max_len")
    rng = random.Random(seed)
    seen: set[str] = set()
    items: list[ParallelExample] = []
    while len(items) < n_train + n_valid + n_test:
        word = " ".join(rng.choice("abcdefgh") for _ in range(rng.randint(1, max_len)))
        if word in seen:
            continue
        seen.add(word)
        items.append(ParallelExample(word, word))
    return Splits(train=items[:n_train], valid=items[n_train:n_train + n_valid], test=items[n_train + n_valid:])


def counting_dataset(*, seed: int = 0, n_train: int = 8000, n_valid: int = 500, n_test: int = 500,
                     max_number: int = 10000) -> Splits:
    """Lines of 3 to 8 consecutive numbers in English words, each from its own start in [0, max_number)."""
    _split_sizes(max_number, n_train, n_valid, n_test)
    starts = list(range(max_number))
    rng = random.Random(seed)
    rng.shuffle(starts)

    def line(start: int) -> str:
        return ", ".join(english_spelling(n, "no comma") for n in range(start, start + rng.randint(3, 8)))

    lines = [line(n) for n in starts[: n_train + n_valid + n_test]]
    return Splits(train=lines[:n_train], valid=lines[n_train:n_train + n_valid], test=lines[n_train + n_valid:])


def builtin_dataset(name: str, *, seed: int, n_train: int, n_valid: int, n_test: int, max_number: int = 10000,
                    max_len: int = 8) -> Splits:
    """The named built-in data set's splits (`max_number` bounds the numbers, `max_len` the copy strings)."""
    if name == "copy":
        return copy_dataset(seed=seed, n_train=n_train, n_valid=n_valid, n_test=n_test, max_len=max_len)
    makers = {"numbers": numbers_dataset, "compare": compare_dataset, "counting": counting_dataset}
    if name not in makers:
        raise ValueError(f"unknown built-in data set {name!r}; choose one of {', '.join(DATASETS)}")
    return makers[name](seed=seed, n_train=n_train, n_valid=n_valid, n_test=n_test, max_number=max_number)
