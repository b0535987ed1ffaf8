"""The key/value cache of decoding: it grows in place and reorders like concatenation and indexing; a mask made a bias
once attends as the mask."""

import pytest
import torch

from aiayn.nn.attention import AttentionCache, attend, attention_bias


def _steps(batch: int = 3, heads: int = 2, d_k: int = 4, n: int = 9):
    torch.manual_seed(0)
    return [(torch.randn(batch, heads, 1, d_k), torch.randn(batch, heads, 1, d_k)) for _ in range(n)]


def test_cache_appends_and_reorders_like_concatenation():
    cache, key, value = AttentionCache(), None, None
    for t, (k, v) in enumerate(_steps()):
        got_k, got_v = cache.append(k, v)
        key = k if key is None else torch.cat([key, k], dim=2)  # (B, h, t + 1, d_k)
        value = v if value is None else torch.cat([value, v], dim=2)
        assert torch.equal(got_k, key) and torch.equal(got_v, value)
        assert torch.equal(cache.key, key) and torch.equal(cache.value, value)
        if t % 2:  # beam search reorders most steps
            index = torch.tensor([t % 3, 0, 0])
            cache.reorder(index)
            key, value = key[index], value[index]
            assert torch.equal(cache.key, key) and torch.equal(cache.value, value)


def test_cache_replaced_from_outside_or_under_autograd():
    cache = AttentionCache()
    (k0, v0), (k1, v1), (k2, v2) = _steps(n=3)
    cache.append(k0, v0)
    cache.append(k1, v1)
    cache.key, cache.value = k0.clone(), v0.clone()  # someone rewinds the cache
    key, value = cache.append(k2, v2)
    assert torch.equal(key, torch.cat([k0, k2], dim=2)) and torch.equal(value, torch.cat([v0, v2], dim=2))

    grad_cache = AttentionCache()
    k0.requires_grad_()
    grad_cache.append(k0, v0)
    key, _ = grad_cache.append(k1, v1)
    (key * key).sum().backward()  # concatenated, not written in place: backward works
    torch.testing.assert_close(k0.grad, 2 * k0.detach())


@pytest.mark.parametrize("need_weights", [False, True])
def test_a_mask_made_a_bias_once_attends_exactly_as_the_mask(need_weights):
    # The decoding step converts its source mask once: SDPA and the written-out equation give the same outputs (and
    # weights) with the bias as with the bool mask, to the last bit.
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 2, 8, generator=g)
    k, v = torch.randn(3, 4, 6, 8, generator=g), torch.randn(3, 4, 6, 8, generator=g)
    mask = torch.ones(3, 1, 1, 6, dtype=torch.bool)
    mask[0, ..., 4:] = False
    mask[2, ..., :1] = False
    bias = attention_bias(mask, torch.float32)
    assert bias.dtype == torch.float32 and torch.equal(bias == 0, mask)
    out, weights = attend(q, k, v, mask, need_weights=need_weights)
    out_b, weights_b = attend(q, k, v, bias, need_weights=need_weights)
    assert torch.equal(out, out_b)
    if need_weights:
        assert torch.equal(weights, weights_b) and bool((weights_b[0, ..., 4:] == 0).all())


def test_a_mask_with_a_query_that_sees_nothing_stays_a_mask():
    mask = torch.ones(2, 1, 1, 5, dtype=torch.bool)
    mask[1] = False  # an empty source: attend zeroes its output, which a bias cannot say
    assert attention_bias(mask, torch.float32) is mask
    assert attention_bias(None, torch.float32) is None


def test_a_mask_neither_bool_nor_a_float_bias_is_refused():
    q = torch.randn(1, 2, 3, 4)
    with pytest.raises(TypeError, match="must be bool"):
        attend(q, q, q, torch.ones(1, 1, 1, 3, dtype=torch.long), need_weights=True)
