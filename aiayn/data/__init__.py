"""Data: file readers, built-in tasks, token-count batching and collation."""

from aiayn.data.batching import token_batches
from aiayn.data.prepare import PreparedData, prepare_data
from aiayn.data.readers import DataError, ReadStats
from aiayn.data.tasks import TASKS, builtin_task

__all__ = ["DataError", "PreparedData", "ReadStats", "TASKS", "builtin_task", "prepare_data", "token_batches"]
