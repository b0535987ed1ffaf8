"""The key/value cache of decoding: it grows in place and reorders like concatenation and indexing."""

import torch

from aiayn.nn.attention import AttentionCache


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
