"""The decoding step a search runs (`aiayn.inference.steps`): the flat step over a static cache computes what the
modules' `decode` computes, for every way a backend prepares the model, with beams reordered and rows dropped."""

import pytest
import torch

from aiayn.backends import select
from aiayn.config import ModelConfig
from aiayn.inference import steps
from aiayn.inference.generation import GenerationConfig, continue_prompts, generate
from aiayn.inference.steps import CausalState, FixedState, ModuleState, StaticState, start
from aiayn.nn.attention import attention_weights
from aiayn.nn.model import build_model


def tiny(norm_first: bool, activation: str = "relu"):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=50, d_model=32, n_heads=4, d_ff=64, n_encoder_layers=2, n_decoder_layers=2,
                      max_len=64, dropout=0.0, norm_first=norm_first, activation=activation)
    return build_model(cfg).eval()


def prepared(model, how: str):
    return model if how == "plain" else select("cpu", "inference", how).prepare(model)


def source() -> torch.Tensor:
    src = torch.randint(4, 50, (3, 9), generator=torch.Generator().manual_seed(1))
    src[1, 6:] = 0  # padded: cross-attention takes the source mask
    return src


# The fixed step (CUDA graphs) is not run on int8, which is CPU-only: int8 scales a call's activations by all its
# rows, the carried ones too.
@pytest.mark.parametrize("how,fixed", [("plain", False), ("fp32", False), ("int8", False), ("bf16", False),
                                       ("plain", True), ("fp32", True)])
@pytest.mark.parametrize("norm_first,activation", [(False, "relu"), (True, "gelu")])
@torch.no_grad()
def test_the_flat_step_equals_the_modules_with_beams_reordered_and_rows_dropped(how, fixed, norm_first, activation):
    model = prepared(tiny(norm_first, activation), how)
    src, beams = source(), 2
    # Step by step, comparing logits; beams swap parents each step, and the first sentence leaves after step 3.
    tokens = torch.randint(4, 50, (src.shape[0] * beams, 7), generator=torch.Generator().manual_seed(2))
    flat = FixedState(model, src, 8, beams=beams, capture=False) if fixed else start(model, src, 8, beams=beams)
    modules = ModuleState(model, src, beams=beams)
    assert isinstance(flat, StaticState)
    # int8 quantises each call's activations over the range of all its rows, so float32 rounding before a product
    # (here the beams of a sentence attend as one product's queries, there one row at a time) can move a value by
    # one quantum: equal within a fraction of int8's own error against float32 (about 0.12 here), not to the last bit.
    # bf16 rounds every product's output to 8 bits of mantissa, and its sums run in another order where the beams
    # of a sentence are one product's rows: equal within a few of bf16's steps (2^-8 of the value).
    step_together(flat, modules, tokens, beams, leave_after=3, atol=5e-2 if how in ("int8", "bf16") else 1e-5)


def step_together(flat, modules, tokens: torch.Tensor, beams: int, *, leave_after: int, atol: float = 1e-5) -> None:
    """Step both states on the same tokens (N, T), comparing logits: each step the beams of a sentence swap
    parents, and after step `leave_after` the first sentence's rows leave the batch."""
    n = tokens.shape[0]
    for t in range(tokens.shape[1]):
        torch.testing.assert_close(flat.step(tokens[:n, t : t + 1]), modules.step(tokens[:n, t : t + 1]),
                                   rtol=min(atol, 1e-2), atol=atol, msg=f"step {t}")
        parents = torch.arange(n).view(-1, beams).flip(1).reshape(-1)  # each beam continues another's prefix
        memory_rows = None
        if t == leave_after:
            memory_rows = torch.arange(beams, n)
            parents, n = parents[memory_rows], n - beams
        for state in (flat, modules):
            state.reorder(parents, memory_rows=memory_rows)


@pytest.mark.parametrize("how", ["plain", "fp32"])
@torch.no_grad()
def test_beams_read_their_sentence_s_memory_once_and_rows_may_still_part_ways(how):
    # The flat step keeps one memory per sentence for its beams; rows that move onto other sentences' sources one by
    # one (no search does) get a memory each, and still compute what the modules compute.
    model = prepared(tiny(False), how)
    src, beams = source(), 2
    flat, modules = start(model, src, 6, beams=beams), ModuleState(model, src, beams=beams)
    assert flat.memory[0][0].shape[0] == src.shape[0]  # (B, h, S, d_k): not repeated per beam
    tokens = torch.randint(4, 50, (6, 4), generator=torch.Generator().manual_seed(3))
    n = 6
    for t in range(4):
        torch.testing.assert_close(flat.step(tokens[:n, t : t + 1]), modules.step(tokens[:n, t : t + 1]), rtol=1e-5,
                                   atol=1e-5, msg=f"step {t}")
        if t == 0:  # rows 1 and 2 (sentences 0 and 1) become a pair, rows 5 and 4 (sentence 2) the other
            for state in (flat, modules):
                state.reorder(torch.tensor([0, 3, 2, 5]), memory_rows=torch.tensor([1, 2, 5, 4]))
            n = 4
    assert flat.beams == 1 and flat.memory[0][0].shape[0] == 4  # a memory per row from the parting on
    fixed = FixedState(model, src, 6, beams=beams, capture=False)
    fixed.step(tokens[:, :1])
    cache = fixed.cache.clone()
    with pytest.raises(ValueError, match="keeps the rows of a sentence together"):
        fixed.reorder(torch.tensor([0, 3, 2, 5]), memory_rows=torch.tensor([1, 2, 5, 4]))
    assert torch.equal(fixed.cache, cache)  # refused before anything moved


@pytest.mark.parametrize("fixed", [False, True])
@pytest.mark.parametrize("beam", [2, 4])
def test_beam_search_with_sentences_leaving_at_each_end_equals_the_modules_path(monkeypatch, beam, fixed):
    # Length limits by source length, so that sentences end at different steps, and every end retires its sentence:
    # the rows that go on keep reading their own sentences' memories.
    monkeypatch.setattr("aiayn.inference.searches.RETIRE_FRACTION", 10**6)
    model = prepared(tiny(False), "fp32")
    src = torch.randint(4, 50, (4, 8), generator=torch.Generator().manual_seed(4))
    src[1, 3:], src[3, 6:] = 0, 0
    config = GenerationConfig(max_new_tokens=None, length_ratio=1.0, extra_len=2, num_beams=beam)
    if fixed:
        monkeypatch.setattr(steps, "_flat_state", lambda model, ids: FixedState)
    flat = generate(model, src, bos_id=1, eos_id=2, config=config)
    monkeypatch.setattr(StaticState, "runs", staticmethod(lambda model: False))
    modules = generate(model, src, bos_id=1, eos_id=2, config=config)
    assert flat.tokens == modules.tokens and len({len(t) for t in flat.tokens}) > 1
    torch.testing.assert_close(flat.scores, modules.scores, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("beam", [1, 4])
@pytest.mark.parametrize("how", ["plain", "fp32"])
def test_generate_on_the_flat_step_equals_the_modules_path(monkeypatch, how, beam):
    model = prepared(tiny(False), how)
    config = GenerationConfig(max_new_tokens=10, min_len=10, num_beams=beam, no_repeat_ngram_size=2 if beam > 1 else 0)
    states = []
    begin = steps.start
    monkeypatch.setattr("aiayn.inference.generation.start_decoding",
                        lambda *a, **k: states.append(begin(*a, **k)) or states[-1])
    flat = generate(model, source(), bos_id=1, eos_id=2, config=config)
    assert isinstance(states[-1], StaticState)
    monkeypatch.setattr(StaticState, "runs", staticmethod(lambda model: False))
    modules = generate(model, source(), bos_id=1, eos_id=2, config=config)
    assert isinstance(states[-1], ModuleState)
    assert flat.tokens == modules.tokens
    torch.testing.assert_close(flat.scores, modules.scores, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_hooks_keep_every_step_on_the_modules():
    model = tiny(False)
    calls = []
    with attention_weights([model.decoder.layers[0].cross_attn], keep=False):  # pre-hooks only
        pre = model.decoder.layers[0].cross_attn.register_forward_pre_hook(lambda *args: calls.append("pre"))
        generate(model, source(), bos_id=1, eos_id=2, config=GenerationConfig(max_new_tokens=5, min_len=5))
        pre.remove()
    assert calls.count("pre") == 5
    handle = model.decoder.layers[1].register_forward_hook(lambda *args: calls.append("layer"))
    every = torch.nn.modules.module.register_module_forward_hook(
        lambda module, *args: calls.append("every") if module is model.decoder.layers[0] else None)
    try:
        assert not StaticState.runs(model)
        generate(model, source(), bos_id=1, eos_id=2, config=GenerationConfig(max_new_tokens=5, min_len=5))
    finally:
        handle.remove()
        every.remove()
    assert calls.count("layer") == 5 and calls.count("every") == 5  # each of the five steps through the modules
    assert StaticState.runs(model)  # hooks gone: the flat step again


@torch.no_grad()
def test_the_static_cache_is_allocated_once_for_a_short_search():
    model = tiny(False)
    state = start(model, source(), 6)
    cache = state.cache
    for t in range(6):
        state.step(torch.full((3, 1), 4 + t))
    assert state.cache is cache and cache.shape == (2, 2, 3, 4, 6, 8)  # (layers, K/V, rows, heads, steps, d_k)


@torch.no_grad()
def test_a_long_search_s_cache_makes_room_as_it_goes_never_past_the_search_s_length():
    # A cache made for the whole length spread a short sentence's keys over pages it never filled: it starts with
    # room for GROWTH positions and doubles.
    model = tiny(False)
    state = start(model, source(), 40)
    capacities = []
    for t in range(40):
        state.step(torch.full((3, 1), 4 + t % 40))
        capacities.append(state.cache.shape[4])
    assert capacities == [16] * 16 + [32] * 16 + [40] * 8
    fixed = FixedState(model, source(), 40, capture=False)  # a graph reads one buffer: all of it from the start
    assert fixed.cache.shape[4] == 40


@pytest.mark.parametrize("how", ["fp32", "int8"])
@torch.no_grad()
def test_a_cache_that_grows_between_reorders_and_leaving_rows_steps_as_the_modules_do(monkeypatch, how):
    monkeypatch.setattr(StaticState, "GROWTH", 2)  # room made at positions 2 and 4 (after rows left at 3) and 8
    model = prepared(tiny(True, "gelu"), how)
    src, beams = source(), 2
    tokens = torch.randint(4, 50, (src.shape[0] * beams, 10), generator=torch.Generator().manual_seed(2))
    flat, modules = start(model, src, 12, beams=beams), ModuleState(model, src, beams=beams)
    step_together(flat, modules, tokens, beams, leave_after=3, atol=5e-2 if how == "int8" else 1e-5)
    assert flat.cache.shape[4] == 12
    # A decoder-only model's prompt, longer than the room first made beyond it
    lm = prepared(tiny_lm(False), how)
    prompts = torch.randint(4, 50, (3, 7), generator=torch.Generator().manual_seed(1))
    steps_lm = torch.randint(4, 50, (3, 8), generator=torch.Generator().manual_seed(3))
    steps_lm[:, 0] = prompts[:, -1]
    flat, modules = StaticState(lm, prompts, 8), CausalState(lm, prompts)
    assert flat.position == 6 and flat.cache.shape[4] == 12
    step_together(flat, modules, steps_lm, 1, leave_after=2, atol=5e-2 if how == "int8" else 1e-5)
    assert flat.cache.shape[4] == 14  # room made at position 12, up to the search's length


@torch.no_grad()
def test_reordering_and_leaving_rows_reuse_two_buffers_for_the_whole_search():
    # A buffer allocated at each retirement paid its pages' first writes again: the cache moves between two buffers
    # of the first batch's size, and the rows that leave make it a view of the first rows.
    model = tiny(False)
    src, beams = source(), 2
    flat, modules = start(model, src, 8, beams=beams), ModuleState(model, src, beams=beams)
    tokens = torch.randint(4, 50, (src.shape[0] * beams, 7), generator=torch.Generator().manual_seed(2))
    buffers = set()
    original = flat.step
    def step(t: torch.Tensor) -> torch.Tensor:
        buffers.add(flat.cache.untyped_storage().data_ptr())
        return original(t)
    flat.step = step
    step_together(flat, modules, tokens, beams, leave_after=2)  # the logits stay equal to the modules'
    assert flat.cache.shape[2] == (src.shape[0] - 1) * beams and len(buffers) == 2


@torch.no_grad()
def test_the_flat_step_embeds_as_the_modules_with_learned_positions_token_types_and_an_embedding_norm():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=50, d_model=32, n_heads=4, d_ff=64, n_encoder_layers=1, n_decoder_layers=2,
                      max_len=64, dropout=0.0, positional="learned", type_vocab_size=2, embedding_norm=True,
                      scale_embeddings=False)
    model = build_model(cfg).eval()
    with torch.no_grad():
        model.tgt_embed.token_types.weight.normal_()  # not zero, so that leaving it out would show
    src = source()
    flat, modules = start(model, src, 5), ModuleState(model, src)
    for t in range(5):
        tokens = torch.full((3, 1), 4 + t)
        torch.testing.assert_close(flat.step(tokens), modules.step(tokens), rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_the_fixed_step_keeps_its_buffers_and_reads_only_written_positions():
    """What a CUDA graph needs: the same buffers at every step (the rows that leave stay, unread), and positions not
    yet written never reach the output, whatever they hold."""
    model = tiny(False)
    src = source()
    state, reference = FixedState(model, src, 6, capture=False), StaticState(model, src, 6)
    buffers = [t.data_ptr() for t in (state.cache, state.tokens, state.at, *state.memory[0])]
    state.cache[:, :, :, :, 3:] = 1e4  # would change every score if a later position were read
    for t in range(3):
        tokens = torch.full((3 - (t == 2), 1), 4 + t)
        torch.testing.assert_close(state.step(tokens), reference.step(tokens), rtol=1e-5, atol=1e-5)
        if t == 1:  # the first sentence leaves: two rows go on, gathered to the front
            state.reorder(torch.tensor([1, 2]), memory_rows=torch.tensor([1, 2]))
            reference.reorder(torch.tensor([1, 2]), memory_rows=torch.tensor([1, 2]))
    assert [t.data_ptr() for t in (state.cache, state.tokens, state.at, *state.memory[0])] == buffers
    assert state.cache.shape[2] == 3 and int(state.at) == 3


def tiny_lm(norm_first: bool, activation: str = "relu"):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=50, d_model=32, n_heads=4, d_ff=64, n_encoder_layers=2, n_decoder_layers=0,
                      max_len=64, dropout=0.0, causal=True, norm_first=norm_first, activation=activation)
    return build_model(cfg).eval()


@pytest.mark.parametrize("how,fixed", [("plain", False), ("fp32", False), ("int8", False), ("plain", True),
                                       ("fp32", True)])
@pytest.mark.parametrize("norm_first,activation", [(False, "relu"), (True, "gelu")])
@torch.no_grad()
def test_a_decoder_only_model_runs_the_same_flat_step_as_its_modules(how, fixed, norm_first, activation):
    model = prepared(tiny_lm(norm_first, activation), how)
    assert StaticState.runs(model)
    # int8 picks its kernel by the number of rows: the flat state runs a prompt once, the modules once per beam
    beams = 1 if how == "int8" else 2
    prompts = torch.randint(4, 50, (3, 5), generator=torch.Generator().manual_seed(1))
    tokens = torch.randint(4, 50, (prompts.shape[0] * beams, 6), generator=torch.Generator().manual_seed(2))
    tokens[:, 0] = prompts[:, -1].repeat_interleave(beams)  # the first step feeds each prompt's last token
    options = dict(capture=False) if fixed else {}
    flat = (FixedState if fixed else StaticState)(model, prompts, 7, beams=beams, **options)
    modules = CausalState(model, prompts, beams=beams)
    assert flat.position == 4  # the prompt but its last token, in the cache
    step_together(flat, modules, tokens, beams, leave_after=2)


@pytest.mark.parametrize("beam", [1, 3])
def test_continuing_prompts_on_the_flat_step_equals_the_modules_path(monkeypatch, beam):
    model = prepared(tiny_lm(False), "fp32")
    prompts = torch.randint(4, 50, (2, 4), generator=torch.Generator().manual_seed(5))
    config = GenerationConfig(max_new_tokens=9, min_len=9, num_beams=beam)
    flat = continue_prompts(model, prompts, eos_id=2, config=config)
    monkeypatch.setattr(StaticState, "runs", staticmethod(lambda model: False))
    modules = continue_prompts(model, prompts, eos_id=2, config=config)
    assert flat.tokens == modules.tokens
    torch.testing.assert_close(flat.scores, modules.scores, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_a_reorder_to_more_rows_than_the_search_began_with_still_holds():
    model = tiny(False)
    src = source()
    flat, modules = start(model, src, 6), ModuleState(model, src)
    tokens = torch.full((3, 1), 5)
    for state in (flat, modules):
        state.step(tokens)
        state.reorder(torch.tensor([0, 1, 2, 2, 1]), memory_rows=torch.tensor([0, 1, 2, 2, 1]))
    torch.testing.assert_close(flat.step(torch.full((5, 1), 7)), modules.step(torch.full((5, 1), 7)))


# Swaps, a cycle, a parent of several rows, no move at all, and every row moving.
@pytest.mark.parametrize("parents", [[1, 0, 3, 2, 5, 4], [2, 0, 1, 3, 4, 5], [0, 0, 0, 3, 3, 5], [0, 1, 2, 3, 4, 5],
                                     [5, 5, 4, 4, 0, 0]])
@pytest.mark.parametrize("how", ["fp32", "bf16"])
@torch.no_grad()
def test_a_reorder_in_place_gives_each_row_its_parent_s_prefix_as_a_gather_does(monkeypatch, parents, how):
    # A row whose prefix another row continues is read before it is written; the rows continuing their own stay.
    monkeypatch.setattr(StaticState, "ROW_COPY_BYTES", 0)  # in place at any size
    flat = start(prepared(tiny(False), how), source(), 8, beams=2)
    for token in (5, 9, 13):
        flat.step(torch.full((6, 1), token) + torch.arange(6)[:, None])
    filled = flat.cache[:, :, :, :, :flat.position]
    expected = filled.index_select(2, torch.tensor(parents))
    buffer = flat.cache.untyped_storage().data_ptr()
    flat.reorder(torch.tensor(parents))
    assert flat.cache.untyped_storage().data_ptr() == buffer
    assert torch.equal(flat.cache[:, :, :, :, :flat.position], expected)


@pytest.mark.parametrize("how", ["fp32", "int8"])
def test_beam_search_reordering_in_place_finds_what_gathering_finds(monkeypatch, how):
    model = prepared(tiny(False), how)
    config = GenerationConfig(max_new_tokens=12, num_beams=3, length_penalty=0.6)
    found = {}
    for name, row_bytes in (("gathered", 1 << 60), ("in place", 0)):
        monkeypatch.setattr(StaticState, "ROW_COPY_BYTES", row_bytes)
        found[name] = generate(model, source(), bos_id=1, eos_id=2, config=config)
    assert found["in place"].tokens == found["gathered"].tokens
    torch.testing.assert_close(found["in place"].scores, found["gathered"].scores, rtol=0, atol=0)


@torch.no_grad()
def test_a_search_state_is_freed_as_soon_as_its_search_drops_it():
    # Its cache is the largest thing a search holds (and, inside `reusing_buffers`, goes back to the pool when the
    # state is freed): nothing in the state may point back at it, or the cache waits for the garbage collector.
    import gc
    import weakref

    model = tiny(True)
    gc.disable()
    try:
        for make in (lambda: start(model, source(), 6, beams=2), lambda: FixedState(model, source(), 6, capture=False)):
            state = make()
            state.step(torch.full((state.cache.shape[2], 1), 4))
            state.reorder(torch.arange(state.cache.shape[2]).flip(0))
            ref = weakref.ref(state)
            del state
            assert ref() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("how", ["fp32", "int8"])
@torch.no_grad()
def test_a_short_source_steps_as_the_modules_do_where_cross_attention_may_be_absorbed(how):
    # One short sentence is where a float32 copy absorbs cross-attention into the memory: the flat step must still
    # compute what the modules' path (recorded attention, hooks) computes, in float32 and in int8.
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=50, d_model=64, n_heads=2, d_ff=128, n_encoder_layers=1, n_decoder_layers=1,
                      max_len=64, dropout=0.0)
    model = prepared(build_model(cfg).eval(), how)
    src = torch.tensor([[5, 9, 13, 7]])
    flat, modules = start(model, src, 6, beams=2), ModuleState(model, src, beams=2)
    tokens = torch.randint(4, 50, (2, 5), generator=torch.Generator().manual_seed(3))
    step_together(flat, modules, tokens, 2, leave_after=99, atol=5e-2 if how == "int8" else 1e-5)
