"""Decoding's fast paths: oneDNN linear layers (aiayn.nn.fast_linear) and the growing key/value cache."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from aiayn.nn.attention import AttentionCache
from aiayn.nn.fast_linear import linear, matmul, onednn_linear


@pytest.mark.parametrize("shape", [(1, 64), (4, 64), (2, 5, 64), (0, 64)])
def test_onednn_linear_equals_f_linear_and_can_be_switched_off(shape):
    torch.manual_seed(0)
    layer = nn.Linear(64, 300)
    x = torch.randn(*shape)
    with torch.no_grad():
        expected = F.linear(x, layer.weight, layer.bias)  # (..., 300)
        with onednn_linear(False):
            assert torch.equal(linear(layer, x), expected)  # switched off: F.linear itself
        fast = linear(layer, x)  # on by default at inference
        no_bias = matmul(x, layer.weight)
    assert fast.shape == expected.shape
    torch.testing.assert_close(fast, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(no_bias, F.linear(x, layer.weight), atol=1e-5, rtol=1e-5)


def test_autograd_hooks_and_other_dtypes_keep_the_plain_path():
    torch.manual_seed(0)
    layer = nn.Linear(8, 6)
    x = torch.randn(3, 8)
    with onednn_linear():
        y = linear(layer, x)  # autograd on: F.linear, gradients flow
        y.sum().backward()
        assert layer.weight.grad is not None
        assert torch.equal(y, F.linear(x, layer.weight, layer.bias))
        seen = []
        handle = layer.register_forward_hook(lambda m, args, out: seen.append(out))
        with torch.no_grad():
            linear(layer, x)
        handle.remove()
        assert len(seen) == 1  # the module was called, so its hook ran
        with torch.no_grad():
            double = layer.double()
            assert torch.equal(linear(double, x.double()), F.linear(x.double(), double.weight, double.bias))


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
