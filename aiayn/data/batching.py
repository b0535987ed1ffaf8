"""Token-count batching with length buckets (like fairseq's `--max-tokens`), shuffled per epoch from a seed.

The batches of epoch `e` depend only on (lengths, max_tokens, seed, e), so a resumed run can
rebuild them and skip the ones it has already trained on.
"""

from __future__ import annotations

import logging
import random

logger = logging.getLogger(__name__)


def token_batches(lengths: list[int], max_tokens: int, *, seed: int = 0, epoch: int = 0,
                  shuffle: bool = True, max_sentences: int = 0) -> list[list[int]]:
    """Group example indices into batches of at most `max_tokens` padded tokens.

    Examples are sorted by length (ties broken by a seeded shuffle), cut into batches whose
    `size x longest` stays within `max_tokens`, and the batch order is shuffled per epoch.

    Args:
        lengths: padded length each example needs (for seq2seq, the longer of source and target).
        max_tokens: budget of padded tokens per batch; an example longer than it gets a batch of its own.
        seed: the run's seed; with `epoch` it fixes the order.
        epoch: 0-based epoch number.
        shuffle: shuffle within length buckets and the batch order (False for evaluation).
        max_sentences: cap on examples per batch (0 = no cap).

    Returns:
        Batches as lists of indices into `lengths`.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    order = list(range(len(lengths)))
    rng = random.Random(seed * 1_000_003 + epoch)
    if shuffle:
        rng.shuffle(order)
    order.sort(key=lambda i: lengths[i])  # stable: equal lengths keep the shuffled order
    batches: list[list[int]] = []
    batch: list[int] = []
    longest = 0
    for index in order:
        new_longest = max(longest, lengths[index])
        full = max_sentences and len(batch) >= max_sentences
        if batch and (new_longest * (len(batch) + 1) > max_tokens or full):
            batches.append(batch)
            batch, new_longest = [], lengths[index]
        batch.append(index)
        longest = new_longest
    if batch:
        batches.append(batch)
    if shuffle:
        rng.shuffle(batches)
    return batches
