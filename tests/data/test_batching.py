"""Batching and collation."""

import pytest
import torch

from aiayn.data.batching import shard_steps, token_batches
from aiayn.data.collate import collate_masked_lm, collate_seq2seq


def test_token_batches_respect_the_budget_and_cover_every_example():
    lengths = [((i * 7) % 23) + 1 for i in range(200)]
    batches = token_batches(lengths, 64, seed=3, epoch=0)
    assert sorted(i for b in batches for i in b) == list(range(200))
    for batch in batches:
        assert len(batch) * max(lengths[i] for i in batch) <= 64


def test_token_batches_are_seeded_per_epoch():
    lengths = [((i * 5) % 17) + 1 for i in range(100)]
    assert token_batches(lengths, 50, seed=1, epoch=2) == token_batches(lengths, 50, seed=1, epoch=2)
    assert token_batches(lengths, 50, seed=1, epoch=2) != token_batches(lengths, 50, seed=1, epoch=3)
    assert token_batches(lengths, 50, shuffle=False) == token_batches(lengths, 50, shuffle=False, seed=9)


def test_token_batches_group_the_shorter_sides_by_their_ties():
    # pairs of one longer side (20) whose sources run from 2 to 20 tokens, dealt in random order
    rng = torch.Generator().manual_seed(0)
    src = [int(n) for n in torch.randint(2, 21, (400,), generator=rng)]
    tgt = [20 if s < 20 else int(n) for s, n in zip(src, torch.randint(2, 21, (400,), generator=rng))]
    lengths, ties = [max(s, t) for s, t in zip(src, tgt)], [s - t for s, t in zip(src, tgt)]

    def source_padding(batches):
        return sum(len(b) * max(src[i] for i in b) - sum(src[i] for i in b) for b in batches)

    plain, tied = token_batches(lengths, 200, seed=1), token_batches(lengths, 200, seed=1, ties=ties)
    assert sorted(i for b in tied for i in b) == list(range(400)) and len(tied) == len(plain)
    assert all(len(b) * max(lengths[i] for i in b) <= 200 for b in tied)  # the budget counts the longer side
    assert source_padding(tied) < source_padding(plain) / 4
    assert tied == token_batches(lengths, 200, seed=1, ties=ties)  # as seeded as without ties


def _shards(n_batches, per_step, world, start=0):
    """{rank: [(next_batch, micro-batch indices), ...]} of `shard_steps` for every rank."""
    return {rank: list(shard_steps(n_batches, per_step, rank=rank, world=world, start=start)) for rank in range(world)}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("per_step", [1, 2, 3, 5])
@pytest.mark.parametrize("n_batches", [0, 1, 7, 12])
def test_shard_steps_deal_every_batch_once_to_equal_micro_step_counts(world, per_step, n_batches):
    shards = _shards(n_batches, per_step, world)
    steps = {len(shards[rank]) for rank in shards}
    assert steps == {-(-n_batches // per_step)}  # every process takes as many steps
    seen = []
    for step in range(steps.pop()):
        stops = {shards[rank][step][0] for rank in shards}
        assert len(stops) == 1  # the position after a step is global: the same on every process
        micro = [shards[rank][step][1] for rank in shards]
        assert len({len(m) for m in micro}) == 1  # as many micro-batches each: the reductions line up
        taken = [i for m in micro for i in m if i is not None]
        first = step * per_step
        assert sorted(taken) == list(range(first, min(first + per_step, n_batches)))  # the step's own batches
        seen += taken
    assert sorted(seen) == list(range(n_batches))  # none twice, none dropped (the last step padded with None)


def test_shard_steps_resume_at_a_global_position_on_any_number_of_processes():
    one = [next_batch for next_batch, _ in shard_steps(11, 4, rank=0, world=1)]
    for world in (1, 2, 3, 8):
        resumed = _shards(11, 4, world, start=4)
        assert [next_batch for next_batch, _ in resumed[0]] == one[1:]
        assert sorted(i for r in resumed for _, m in resumed[r] for i in m if i is not None) == list(range(4, 11))
    with pytest.raises(ValueError, match="rank"):
        list(shard_steps(4, 2, rank=2, world=2))


def test_sharded_token_batches_cover_the_epoch_once_and_reshuffle_per_epoch():
    lengths = [((i * 7) % 23) + 1 for i in range(300)]
    orders = []
    for epoch in (0, 1):
        batches = token_batches(lengths, 64, seed=5, epoch=epoch)  # every process builds the same list
        assert len(batches) % 4  # the last step is short: padding is exercised
        per_rank = {rank: [i for _, micro in shard_steps(len(batches), 4, rank=rank, world=2)
                           for b in micro if b is not None for i in batches[b]] for rank in (0, 1)}
        assert not set(per_rank[0]) & set(per_rank[1])  # each process a distinct shard
        assert sorted(per_rank[0] + per_rank[1]) == list(range(300))
        orders.append(per_rank[0])
    assert orders[0] != orders[1]


def test_teacher_forcing_shifts_the_target_right_behind_bos():
    batch = collate_seq2seq([([5, 6, 2], [7, 8, 9]), ([5, 2], [7])], pad_id=0, bos_id=1, eos_id=2)
    assert batch["tgt_in"].tolist() == [[1, 7, 8, 9], [1, 7, 0, 0]]
    assert batch["labels"].tolist() == [[7, 8, 9, 2], [7, 2, -100, -100]]
    assert batch["src"].tolist() == [[5, 6, 2], [5, 2, 0]]
    # the decoder input at position t+1 is the label at position t
    assert torch.equal(batch["tgt_in"][0, 1:], batch["labels"][0, :-1])


def test_masked_lm_masks_about_15_percent_of_real_tokens_only():
    gen = torch.Generator().manual_seed(0)
    rows = [[1, *range(10, 60), 2] for _ in range(40)]
    batch = collate_masked_lm(rows, pad_id=0, mask_id=4, vocab_size=100, special_ids=[1, 2, 3], generator=gen)
    picked = batch["labels"] != -100
    rate = picked.float().mean().item()
    assert 0.12 < rate < 0.18
    assert not picked[:, 0].any() and not picked[:, -1].any()  # specials never masked
    assert (batch["ids"][picked] == 4).float().mean().item() > 0.7
    assert torch.equal(batch["ids"][~picked], torch.tensor(rows)[~picked])
