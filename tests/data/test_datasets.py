"""The built-in data sets: disjoint seeded splits, and English number words as people write them."""

import pytest

from aiayn.data.datasets import (
    SPELLINGS,
    builtin_dataset,
    compare_dataset,
    copy_dataset,
    english_spelling,
    number_words,
    numbers_dataset,
    spelling_of,
)


def test_builtin_datasets_have_disjoint_splits():
    numbers = numbers_dataset(n_train=300, n_valid=50, n_test=50, max_number=1000)
    train = {e.source for e in numbers.train}
    assert not train & {e.source for e in numbers.test} and not train & {e.source for e in numbers.valid}
    assert number_words(21, "en") == "twenty-one" and number_words(21, "de") == "einundzwanzig"
    compare = compare_dataset(n_train=200, n_valid=20, n_test=20, max_number=100)
    assert not {e.text for e in compare.train} & {e.text for e in compare.test}
    labels = [e.label for e in compare.train]
    assert 0.3 < labels.count("first") / len(labels) < 0.7  # majority baseline near 50%
    copy = copy_dataset(n_train=50, n_valid=5, n_test=5)
    assert all(e.source == e.target for e in copy.train)


def test_the_numbers_dataset_writes_english_as_people_do():
    assert [english_spelling(3421, form) for form in SPELLINGS] == [
        "three thousand, four hundred and twenty-one", "three thousand four hundred and twenty-one",
        "three thousand four hundred twenty-one", "three thousand four hundred twenty one"]
    numbers = numbers_dataset(n_train=2000, n_valid=50, n_test=50, max_number=10000)
    again = numbers_dataset(n_train=2000, n_valid=50, n_test=50, max_number=10000)
    assert numbers.train == again.train  # the form is fixed by the number: the same data every run
    forms = [spelling_of(n) for n in range(2000)]
    assert all(0.2 < forms.count(form) / len(forms) < 0.3 for form in SPELLINGS)
    sources = {e.source for e in numbers.train}
    assert any("," in s for s in sources) and any(" and " in s for s in sources)
    assert any("-" in s for s in sources) and any(" one" in s and "-" not in s for s in sources)


def test_an_unknown_name_is_refused_naming_the_data_sets():
    with pytest.raises(ValueError, match="unknown built-in data set 'digits'; choose one of numbers, compare, copy"):
        builtin_dataset("digits", seed=0, n_train=10, n_valid=2, n_test=2)
