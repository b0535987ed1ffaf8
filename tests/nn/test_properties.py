"""Properties every Transformer must have, checked on tiny seeded models."""

import pytest
import torch
from torch import nn

from aiayn.config import ModelConfig
from aiayn.nn.attention import MultiHeadAttention, attention_weights
from aiayn.nn.model import build_decoder, build_encoder, build_model

ATOL = 1e-5
TINY = dict(vocab_size=40, d_model=16, n_heads=4, d_ff=32, n_encoder_layers=2, n_decoder_layers=2, max_len=32)
PAD = 0


def seq2seq(**options) -> nn.Module:
    return build_model(ModelConfig(**{**TINY, **options})).eval()


def explicit_forward(model: nn.Module, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    """The model's logits with every attention written out (`need_weights=True`, through `attention_weights`),
    walking the layers."""
    attentions = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]
    with attention_weights(attentions) as weights:
        src_mask = model.source_mask(src)
        x = model.src_embed(src)
        for layer in model.encoder.layers:
            x = layer(x, src_mask)
        memory = x if model.encoder.final_norm is None else model.encoder.final_norm(x)
        y = model.tgt_embed(tgt)
        for layer in model.decoder.layers:
            y = layer(y, memory, memory_mask=src_mask)
        logits = model.head(y if model.decoder.final_norm is None else model.decoder.final_norm(y))
    assert all(w is not None for w in weights)  # each wrote the equation out
    return logits


@pytest.mark.parametrize("options", [{}, dict(norm_first=True, activation="gelu", bias=False)],
                         ids=["post-LN", "pre-LN"])
def test_sdpa_path_equals_explicit_path(options):
    model = seq2seq(**options)
    src = torch.randint(1, 40, (3, 7))
    src[1, 3:] = PAD
    src[2, :] = PAD  # a fully padded row: both paths must agree on it too
    tgt = torch.randint(1, 40, (3, 6))
    torch.testing.assert_close(model(src, tgt), explicit_forward(model, src, tgt), atol=ATOL, rtol=0)


def test_attention_weights_from_the_explicit_path_are_a_distribution_over_allowed_keys():
    attn = MultiHeadAttention(16, 4).eval()
    x = torch.randn(2, 5, 16)
    mask = torch.tensor([[True] * 5, [True, True, False, False, False]])[:, None, None, :]
    out, weights = attn(x, mask=mask, need_weights=True)
    assert weights.shape == (2, 4, 5, 5)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 4, 5))
    assert torch.all(weights[1, :, :, 2:] == 0)
    sdpa, _ = attn(x, mask=mask)
    torch.testing.assert_close(out, sdpa, atol=ATOL, rtol=0)


@torch.no_grad()
def test_attention_weights_come_through_hooks_and_leave_the_layers_as_they_were():
    model = seq2seq()
    src, tgt = torch.randint(1, 40, (2, 7)), torch.randint(1, 40, (2, 5))
    src[1, 4:] = PAD
    layer = model.encoder.layers[0]
    x, mask = model.src_embed(src), model.source_mask(src)
    with attention_weights([layer.self_attn]) as weights:
        out = layer(x, mask)
    _, expected = layer.self_attn(x, mask=mask, need_weights=True)  # post-LN: the sub-layer sees x itself
    assert torch.equal(weights[0], expected) and weights[0].shape == (2, 4, 7, 7)
    torch.testing.assert_close(out, layer(x, mask), atol=ATOL, rtol=0)  # SDPA again, once the block is over
    attentions = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in attentions)
    with attention_weights(attentions, keep=False) as kept:
        model(src, tgt)
    assert kept == [None] * len(attentions)


@pytest.mark.parametrize("positional", ["sinusoidal", "learned"])
@torch.no_grad()
def test_a_sequence_alone_equals_the_same_sequence_in_a_padded_batch(positional, run_on):
    model = run_on(seq2seq(positional=positional))
    src_alone, tgt_alone = torch.tensor([[5, 6, 7, 8]]), torch.tensor([[1, 9, 10]])
    src = torch.tensor([[5, 6, 7, 8, PAD, PAD, PAD], [11, 12, 13, 14, 15, 16, 17]])
    tgt = torch.tensor([[1, 9, 10, PAD, PAD], [1, 18, 19, 20, 21]])
    torch.testing.assert_close(model.encode(src)[:1, :4], model.encode(src_alone), atol=ATOL, rtol=0)
    torch.testing.assert_close(model(src, tgt)[:1, :3], model(src_alone, tgt_alone), atol=ATOL, rtol=0)


@torch.no_grad()
def test_encoder_only_sequence_alone_equals_padded_batch_with_attention_mask(run_on):
    model = run_on(build_model(ModelConfig(**{**TINY, "n_decoder_layers": 0, "positional": "learned"})).eval())
    alone = torch.tensor([[5, 6, 7]])
    ids = torch.tensor([[5, 6, 7, 3, 3], [8, 9, 10, 11, 12]])  # padded with a non-pad id, masked out
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    torch.testing.assert_close(model(ids, attention_mask=mask)[:1, :3], model(alone), atol=ATOL, rtol=0)


@torch.no_grad()
def test_changing_later_target_tokens_never_changes_earlier_outputs(run_on):
    model = run_on(seq2seq())
    src = torch.randint(1, 40, (2, 6))
    tgt = torch.randint(1, 40, (2, 8))
    before = model(src, tgt)
    for t in range(1, 8):
        changed = tgt.clone()
        changed[:, t:] = torch.randint(1, 40, (2, 8 - t))
        torch.testing.assert_close(model(src, changed)[:, :t], before[:, :t], atol=ATOL, rtol=0)


@pytest.mark.parametrize("explicit", [False, True], ids=["sdpa", "explicit"])
def test_fully_padded_rows_give_finite_outputs_and_gradients(explicit):
    model = seq2seq(dropout=0.0).train()
    src = torch.randint(1, 40, (2, 5))
    src[1] = PAD  # nothing to attend to in the source
    tgt = torch.randint(1, 40, (2, 4))
    logits = explicit_forward(model, src, tgt) if explicit else model(src, tgt)
    assert torch.isfinite(logits).all()
    logits.logsumexp(-1).sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name

    encoder_only = build_model(ModelConfig(**{**TINY, "n_decoder_layers": 0, "head": "sequence_classification",
                                              "num_labels": 3, "pooling": "mean"}))
    ids = torch.tensor([[4, 5, 6], [PAD, PAD, PAD]])
    out = encoder_only(ids)
    out.sum().backward()
    assert torch.isfinite(out).all()
    assert all(torch.isfinite(p.grad).all() for p in encoder_only.parameters() if p.grad is not None)


def test_without_positions_permuting_the_input_permutes_the_output():
    # Seed 002: self-attention alone does not know word order.
    model = build_model(ModelConfig(**{**TINY, "n_decoder_layers": 0, "positional": "none"})).eval()
    ids = torch.tensor([[4, 9, 17, 23, 5, 31]])
    perm = torch.tensor([3, 0, 5, 1, 4, 2])
    torch.testing.assert_close(model(ids[:, perm]), model(ids)[:, perm], atol=ATOL, rtol=0)
    with_positions = build_model(ModelConfig(**{**TINY, "n_decoder_layers": 0})).eval()
    assert not torch.allclose(with_positions(ids[:, perm]), with_positions(ids)[:, perm], atol=1e-3)


@pytest.mark.parametrize("norm_first", [False, True], ids=["post-LN", "pre-LN"])
def test_float64_gradcheck_on_tiny_layers(norm_first):
    cfg = ModelConfig(vocab_size=10, d_model=4, n_heads=2, d_ff=8, n_encoder_layers=1, n_decoder_layers=1,
                      dropout=0.0, activation="gelu", norm_first=norm_first)
    enc_layer = build_encoder(cfg).layers[0].double()
    dec_layer = build_decoder(cfg).layers[0].double()
    x = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    memory = torch.randn(2, 4, 4, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[True] * 3, [True, True, False]])[:, None, None, :]
    memory_mask = torch.tensor([[True] * 4, [True, False, False, False]])[:, None, None, :]
    assert torch.autograd.gradcheck(lambda x: enc_layer(x, mask), (x,))
    assert torch.autograd.gradcheck(lambda x, m: dec_layer(x, m, memory_mask=memory_mask), (x, memory))
    weight = enc_layer.self_attn.q_proj.weight
    assert torch.autograd.gradcheck(
        lambda w: torch.func.functional_call(enc_layer, {"self_attn.q_proj.weight": w}, (x.detach(), mask)),
        (weight.detach().clone().requires_grad_(True),))


def test_layers_do_not_share_parameters():
    model = seq2seq()
    for stack in (model.encoder.layers, model.decoder.layers):
        storages = [{p.data_ptr() for p in layer.parameters()} for layer in stack]
        for i in range(len(storages)):
            for j in range(i + 1, len(storages)):
                assert not storages[i] & storages[j], f"layers {i} and {j} share parameters"
        before = stack[1].feed_forward.linear1.weight.clone()
        with torch.no_grad():
            stack[0].feed_forward.linear1.weight.add_(1.0)
        assert torch.equal(stack[1].feed_forward.linear1.weight, before)
    layer = model.decoder.layers[0]
    assert layer.self_attn.q_proj.weight.data_ptr() != layer.cross_attn.q_proj.weight.data_ptr()


def test_tied_embeddings_are_one_matrix():
    # Section 3.4: the two embedding layers and the pre-softmax projection share one matrix.
    model = seq2seq()
    assert model.head.proj.weight is model.tgt_embed.tokens.weight is model.src_embed.tokens.weight


@pytest.mark.parametrize("options", [{}, dict(positional="learned", norm_first=True)], ids=["sinusoidal", "learned"])
def test_kv_cached_decoding_equals_uncached(options):
    model = seq2seq(**options)
    src = torch.randint(1, 40, (3, 6))
    src[1, 4:] = PAD
    tgt = torch.randint(1, 40, (3, 7))
    src_mask = model.source_mask(src)
    memory = model.encode(src, src_mask)
    full = model.head(model.decode(tgt, memory, memory_mask=src_mask))
    cache = model.new_cache()
    steps = []
    with torch.inference_mode():
        for t in range(tgt.shape[1]):
            hidden = model.decode(tgt[:, t:t + 1], memory, memory_mask=src_mask, cache=cache)
            steps.append(model.head(hidden))
    assert cache.length == tgt.shape[1]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=ATOL, rtol=0)
    # Two positions at once after a cached prefix also agree.
    cache = model.new_cache()
    with torch.inference_mode():
        first = model.decode(tgt[:, :3], memory, memory_mask=src_mask, cache=cache)
        rest = model.decode(tgt[:, 3:], memory, memory_mask=src_mask, cache=cache)
    torch.testing.assert_close(model.head(torch.cat([first, rest], 1)), full, atol=ATOL, rtol=0)


def test_kv_cache_reorder_keeps_the_chosen_rows():
    model = seq2seq()
    src = torch.randint(1, 40, (3, 5))
    memory = model.encode(src)
    cache = model.new_cache()
    model.decode(torch.ones(3, 1, dtype=torch.long), memory, cache=cache)
    keys = cache.self_attn[0].key.clone()
    cache.reorder(torch.tensor([2, 2, 0]))
    torch.testing.assert_close(cache.self_attn[0].key, keys[[2, 2, 0]])


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_weights_saved_when_the_head_was_called_generator_still_load(tmp_path, tied):
    from safetensors.torch import save_file

    from aiayn.io import CONFIG_NAME, WEIGHTS_NAME, load_model

    options = {} if tied else dict(tie_embeddings=False, share_embeddings=False, tgt_vocab_size=30)
    model = seq2seq(**options)
    state = {("generator." + k[len("head."):] if k.startswith("head.") else k): v.contiguous()
             for k, v in model.state_dict().items()}
    if tied:  # as safetensors de-duplicated the shared matrix then: one name, the first in sorted order
        del state["src_embed.tokens.weight"], state["tgt_embed.tokens.weight"]
    save_file(state, tmp_path / WEIGHTS_NAME)
    (tmp_path / CONFIG_NAME).write_text(model.config.to_json())
    loaded = load_model(tmp_path)
    src, tgt = torch.randint(1, 30, (2, 6)), torch.randint(1, 30, (2, 5))
    assert torch.equal(loaded(src, tgt), model(src, tgt))
    assert (loaded.head.proj.weight is loaded.src_embed.tokens.weight) == tied


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_masked_lm_weights_saved_when_its_vocabulary_linear_was_called_decoder_still_load(tmp_path, tied):
    from safetensors.torch import save_file

    from aiayn.io import CONFIG_NAME, WEIGHTS_NAME, load_model
    from aiayn.tasks.names import MASKED_LM

    model = build_model(ModelConfig(**{**TINY, "n_decoder_layers": 0, "head": MASKED_LM,
                                       "tie_embeddings": tied})).eval()
    state = {k.replace("head.proj.", "head.decoder."): v.contiguous() for k, v in model.state_dict().items()}
    if tied:  # safetensors keeps a shared matrix once, under the first name in sorted order
        del state["head.decoder.weight"]
    save_file(state, tmp_path / WEIGHTS_NAME)
    (tmp_path / CONFIG_NAME).write_text(model.config.to_json())
    loaded = load_model(tmp_path)
    ids = torch.randint(1, 40, (2, 6))
    assert torch.equal(loaded(ids), model(ids))
    assert (loaded.head.proj.weight is loaded.embed.tokens.weight) == tied
    fresh = build_model(model.config).eval()
    fresh.load_state_dict(state, strict=False)  # the module's own loader renames them too
    assert torch.equal(fresh(ids), model(ids))
