"""The built-in demonstration: English -> German number words, small enough for two CPU cores."""

from __future__ import annotations

from typing import Any

# Tuned on two shared CPU cores (docs/training.md gives the measured time and scores).
DEMO_CONFIG: dict[str, Any] = {
    "objective": "seq2seq",
    "task": "numbers",
    "task_train": 8000,
    "task_valid": 300,
    "task_test": 500,
    "task_max_number": 10000,
    "tokenizer": "bpe",
    "vocab_size": 160,
    "max_tokens": 3000,
    "epochs": 20,
    "warmup": 300,
    "lr_scale": 0.7,
    "label_smoothing": 0.1,
    "log_every": 20,
    "threads": 1,
    "keep_last": 3,
    "average_last": 5,
    "show_examples": 6,
    "model": {"preset": "tiny", "d_model": 128, "n_heads": 4, "d_ff": 256, "n_encoder_layers": 2,
              "n_decoder_layers": 2, "dropout": 0.1},
}
