"""Data: file readers, built-in data sets, token-count batching and collation."""

from aiayn.data.batching import token_batches
from aiayn.data.datasets import DATASETS, builtin_dataset
from aiayn.data.prepare import PreparedData, prepare_data
from aiayn.data.readers import DataError, ReadStats

__all__ = ["DATASETS", "DataError", "PreparedData", "ReadStats", "builtin_dataset", "prepare_data", "token_batches"]
