"""What the kernels are chosen by: a product's number of rows (its row class) and its shape kind.

The first link of the backends' chain (shapes -> kernels -> calibrate -> select): the kernels read the row
class of each call, `calibrate` times one weight of each shape kind per row class, and `select` keeps the
kernel measured fastest for each pair.
"""

from __future__ import annotations

ROW_CLASSES = (("one", 1), ("few", 4), ("many", 256))  # (name, rows measured); few = 2..16 rows
FEW_ROWS_MAX = 16
# A base model's products by shape kind (in_features, out_features): FFN up, attention projection, FFN down,
# and the vocabulary projection (a 32,768-token vocabulary). The last differs from FFN up by its weight, 64 MiB
# here, far beyond a CPU's cache: PyTorch's default product repacks the weight on every call, and over weights
# streamed from memory that costs more than the product at up to hundreds of rows (measured on an AVX2 EPYC:
# docs/notes.md, "Encoder and CPU kernels"), where over FFN up's 4 MiB it costs little.
SHAPE_KINDS = (("wide", (512, 2048)), ("square", (512, 512)), ("narrow", (2048, 512)), ("vocabulary", (512, 32768)))
VOCABULARY_WIDENING = 4  # a product widening its input more than this many times is of the vocabulary kind
# The vocabulary's many rows are a decoding step's (a batch's sentences x beams: tens to a couple of hundred), where
# its kernels differ most, and are timed there: at 256 rows they tie, at 24-128 oneDNN's prepacked product ran
# 1.15-1.35x PyTorch's default (docs/notes.md, "Decoding"). Other kinds' many rows are also encoders' and prompts'.
VOCABULARY_MANY_ROWS = 64


def row_class(rows: int) -> str:
    """The row class ("one", "few", "many") of a product over `rows` input rows."""
    return "one" if rows == 1 else "few" if rows <= FEW_ROWS_MAX else "many"


def shape_kind(in_features: int, out_features: int) -> str:
    """The shape kind ("wide", "square", "narrow", "vocabulary") of a product from `in_features` to `out_features`:
    FFN up (4x) and stacked Q/K/V (3x) are wide, an output layer over a vocabulary is "vocabulary"."""
    if out_features > VOCABULARY_WIDENING * in_features:
        return "vocabulary"
    return "wide" if out_features > in_features else "narrow" if out_features < in_features else "square"


def rows_measured(row_class_name: str, kind: str) -> int:
    """The rows `calibrate` times a product of this row class (a name of `ROW_CLASSES`) and shape kind over."""
    if row_class_name == "many" and kind == "vocabulary":
        return VOCABULARY_MANY_ROWS
    return dict(ROW_CLASSES)[row_class_name]
