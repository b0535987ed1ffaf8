"""The oneDNN linear layers of the training step agree with PyTorch's default path (values and gradients)."""

import pytest
import torch
import torch.nn.functional as F

from aiayn.config import preset
from aiayn.nn.model import build_model
from aiayn.training.loss import label_smoothed_loss
from aiayn.training.objectives import forward
from aiayn.training.onednn import onednn_training

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="PyTorch built without oneDNN")


@pytest.mark.parametrize("bias", [True, False])
def test_linear_forward_and_backward_match_f_linear(bias):
    torch.manual_seed(0)
    x = torch.randn(3, 5, 8, requires_grad=True)  # (B, L, in)
    weight = torch.randn(6, 8, requires_grad=True)  # (out, in)
    b = torch.randn(6, requires_grad=True) if bias else None
    inputs = (x, weight) + ((b,) if bias else ())
    expected = F.linear(x, weight, b)
    expected_grads = torch.autograd.grad(expected.pow(2).sum(), inputs)
    with onednn_training():
        y = F.linear(x, weight, b)
        grads = torch.autograd.grad(y.pow(2).sum(), inputs)
    assert y.grad_fn is not None and "OneDnn" in type(y.grad_fn.next_functions[0][0]).__name__
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_other_dtypes_and_autocast_keep_f_linear():
    x, weight = torch.randn(4, 8, dtype=torch.float64, requires_grad=True), torch.randn(6, 8, dtype=torch.float64)
    with onednn_training():
        assert type(F.linear(x, weight).grad_fn).__name__ == "MmBackward0"
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = F.linear(torch.randn(4, 8, requires_grad=True), torch.randn(6, 8))
    assert y.dtype == torch.bfloat16


def test_training_step_loss_and_gradients_match_the_default_path():
    torch.manual_seed(0)
    cfg = preset("tiny").replace(vocab_size=50, d_model=32, n_heads=4, d_ff=64)
    model = build_model(cfg).train()
    src, tgt = torch.randint(4, 50, (3, 7)), torch.randint(4, 50, (3, 6))
    src[0, 5:] = cfg.pad_id
    labels = tgt.clone()
    labels[1, 4:] = -100
    batch = {"src": src, "tgt_in": tgt, "labels": labels}

    def step(onednn: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)  # the same dropout masks on both paths
        with onednn_training(onednn):
            logits, kept = forward(model, batch, "seq2seq")
            loss, _ = label_smoothed_loss(logits, kept, smoothing=0.1)
            loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    loss, grads = step(False)
    fast_loss, fast_grads = step(True)
    torch.testing.assert_close(fast_loss, loss, rtol=1e-5, atol=0)
    assert fast_grads.keys() == grads.keys()
    scale = max(float(g.abs().max()) for g in grads.values())
    for name, grad in grads.items():  # key biases get ~0 gradients (softmax ignores them): compare to the scale
        torch.testing.assert_close(fast_grads[name], grad, rtol=1e-5, atol=1e-5 * scale, msg=name)
