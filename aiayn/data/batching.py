"""Token-count batching with length buckets (like fairseq's `--max-tokens`), shuffled per epoch from a seed.

The batches of epoch `e` depend only on (lengths, ties, max_tokens, seed, e), so a resumed run can
rebuild them and skip the ones it has already trained on, and every process of a distributed run
builds the same list; `shard_steps` deals them out to the processes step by step.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Iterator

logger = logging.getLogger(__name__)


def token_batches(lengths: list[int], max_tokens: int, *, seed: int = 0, epoch: int = 0,
                  shuffle: bool = True, max_sentences: int = 0, ties: list[int] | None = None) -> list[list[int]]:
    """Group example indices into batches of at most `max_tokens` padded tokens.

    Examples are sorted by length, then by `ties` where given (remaining ties broken by a seeded shuffle), cut
    into batches whose `size x longest` stays within `max_tokens`, and the batch order is shuffled per epoch.

    Args:
        lengths: padded length each example needs (for seq2seq, the longer of source and target).
        max_tokens: budget of padded tokens per batch; an example longer than it gets a batch of its own.
        seed: the run's seed; with `epoch` it fixes the order.
        epoch: 0-based epoch number.
        shuffle: shuffle within length buckets and the batch order (False for evaluation).
        max_sentences: cap on examples per batch (0 = no cap).
        ties: a second sort key among examples of one length (`EncodedSplit.ties`: for seq2seq the source's
            length less the target's), so that a batch's shorter sides are alike in length too and pad less.

    Returns:
        Batches as lists of indices into `lengths`.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    order = list(range(len(lengths)))
    rng = random.Random(seed * 1_000_003 + epoch)
    if shuffle:
        rng.shuffle(order)
    if ties:  # stable: equal keys keep the shuffled order
        order.sort(key=lambda i: (lengths[i], ties[i]))
    else:
        order.sort(key=lambda i: lengths[i])
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


def shard_steps(n_batches: int, batches_per_step: int, *, rank: int = 0, world: int = 1,
                start: int = 0) -> Iterator[tuple[int, list[int | None]]]:
    """The distributed sampler over one epoch's batches: what process `rank` of `world` trains at each step.

    Step k takes the `batches_per_step` consecutive batches from `start + k x batches_per_step` (the
    last step of an epoch takes what is left); process r takes every world-th of them from the r-th.
    Every process gets the same number of micro-batches per step, `None` where it has no batch left
    (it then trains an empty batch, so that all join the same gradient reductions). Over an epoch the
    processes' shards are disjoint and together hold every batch once, whatever `world` is: a
    position `start` counted in batches means the same thing at any number of processes.

    Args:
        n_batches: batches in the epoch (`len(token_batches(...))`: every process builds the same list).
        batches_per_step: batches per optimizer step over all processes (`global_batches`).
        rank, world: this process and the number of processes.
        start: global index of the first batch not trained yet (a resumed run's position).

    Yields:
        (next_batch, the global index of the first batch after the step; this process's batch indices
        padded with None).
    """
    if batches_per_step < 1 or not 0 <= rank < world:
        raise ValueError(f"need batches_per_step >= 1 and 0 <= rank < world, got {batches_per_step}, {rank}, {world}")
    for first in range(start, n_batches, batches_per_step):
        next_batch = min(first + batches_per_step, n_batches)
        mine: list[int | None] = list(range(first + rank, next_batch, world))
        yield next_batch, mine + [None] * (math.ceil((next_batch - first) / world) - len(mine))
