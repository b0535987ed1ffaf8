"""Buffers handed from one search to the next (`aiayn.inference.buffers`): a search inside `reusing_buffers()` writes
its cache into the memory a finished search gave back, computes the same, and nothing is kept past the block."""

import torch

from aiayn.config import ModelConfig
from aiayn.inference.buffers import BufferPool, Owned, reusing_buffers
from aiayn.inference.generation import GenerationConfig, generate
from aiayn.inference.steps import ModuleState, start
from aiayn.nn.model import build_model


def tiny():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=50, d_model=32, n_heads=4, d_ff=64, n_encoder_layers=2, n_decoder_layers=2,
                      max_len=64, dropout=0.0)
    return build_model(cfg).eval()


def sources(rows: int, length: int, seed: int) -> torch.Tensor:
    src = torch.randint(4, 50, (rows, length), generator=torch.Generator().manual_seed(seed))
    src[0, length // 2:] = 0  # padded
    return src


def storages(state) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in (state.held, state.spare) if t is not None}


@torch.no_grad()
def test_a_search_inside_the_block_writes_into_the_buffers_of_the_search_before_and_computes_the_same():
    model = tiny()
    with reusing_buffers() as pool:
        first = start(model, sources(4, 9, 1), 12, beams=2)
        for t in range(5):  # written all over, and reordered: both of its buffers in use
            first.step(torch.full((8, 1), 4 + t))
            first.reorder(torch.arange(8).flip(0))
        given = storages(first)
        del first  # the search is over: its buffers go back to the pool
        assert len(given) == 2 and {s.data_ptr() for s in pool.free} == given
        src = sources(3, 7, 2)  # a smaller batch: it fits in what was given back
        second, reference = start(model, src, 8, beams=2), ModuleState(model, src, beams=2)
        for t in range(6):
            tokens = torch.full((6, 1), 5 + t)
            torch.testing.assert_close(second.step(tokens), reference.step(tokens), rtol=1e-5, atol=1e-5)
            rows = torch.arange(6).view(-1, 2).flip(1).reshape(-1)  # the beams of a sentence swap prefixes
            second.reorder(rows)
            reference.reorder(rows)
        assert storages(second) == given  # no new memory: the earlier search's two buffers
    assert not pool.free  # released when the block ends


@torch.no_grad()
def test_batches_decoded_in_one_block_give_what_each_gives_alone():
    model = tiny()
    config = GenerationConfig(num_beams=3, max_new_tokens=10)
    batches = [sources(5, 11, 3), sources(2, 6, 4), sources(4, 9, 5)]
    alone = [generate(model, src, bos_id=1, eos_id=2, config=config) for src in batches]
    with reusing_buffers() as pool:
        together = [generate(model, src, bos_id=1, eos_id=2, config=config) for src in batches]
        assert pool.free  # the searches gave their caches back
    for a, b in zip(alone, together):
        assert a.tokens == b.tokens
        torch.testing.assert_close(a.scores, b.scores)


def test_the_pool_keeps_the_largest_buffers_and_hands_out_the_smallest_that_fits():
    pool = BufferPool()
    cpu = torch.device("cpu")
    pool.give([torch.empty(100), torch.empty(400), torch.empty(50)])
    assert sorted(s.nbytes() for s in pool.free) == [400, 1600]  # the two largest (float32: 4 bytes each)
    small = pool.empty((10, 5), torch.float32, cpu)  # 200 bytes: the 400-byte storage, not the 1,600
    assert small.shape == (10, 5) and small.untyped_storage().nbytes() == 400
    large = pool.empty((1000,), torch.float32, cpu)  # nothing holds 4,000 bytes: new memory, the smaller let go
    assert large.untyped_storage().nbytes() == 4000 and not pool.free


@torch.no_grad()
def test_a_search_larger_than_the_buffers_kept_lets_them_go_and_one_that_grows_its_rows_still_computes_the_same():
    # Batches of a fixed number of sentences, sorted by length, grow: the buffers of the smaller search before are
    # not held beside the new ones.
    model = tiny()
    with reusing_buffers() as pool:
        small = start(model, sources(2, 5, 6), 6, beams=2)
        small.step(torch.full((4, 1), 4))
        small.reorder(torch.arange(4).flip(0))
        given = max(t.untyped_storage().nbytes() for t in (small.held, small.spare))
        del small
        src = sources(2, 9, 7)
        large, reference = start(model, src, 12, beams=2), ModuleState(model, src, beams=2)
        assert large.held.untyped_storage().nbytes() > given and not pool.free  # too small: let go, not kept
        # Rows that grow past the search's first (a reorder onto more rows) take a larger buffer and give the smaller
        # one back, and the step still computes what the modules do.
        tokens = torch.full((4, 1), 5)
        for grow in (torch.tensor([0, 1, 2, 3, 2, 3]), torch.tensor([0, 1, 2, 3, 4, 5, 4, 5])):
            torch.testing.assert_close(large.step(tokens), reference.step(tokens), rtol=1e-5, atol=1e-5)
            large.reorder(grow, memory_rows=grow)
            reference.reorder(grow, memory_rows=grow)
            tokens = torch.full((grow.numel(), 1), 6)
        torch.testing.assert_close(large.step(tokens), reference.step(tokens), rtol=1e-5, atol=1e-5)
        # The outgrown buffer went back (and, too small for the larger one asked next, was let go): the state owns,
        # and will give back, only the two it uses.
        assert {id(t) for t in large.owned.buffers} == {id(large.held), id(large.spare)} and not pool.free


def test_outside_the_block_nothing_is_kept():
    class Owner:
        pass
    owner = Owner()
    owned = Owned(owner)
    tensor = owned.empty((3, 4), dtype=torch.float32, device="cpu")
    assert tensor.shape == (3, 4) and owned.pool is None and not owned.buffers
