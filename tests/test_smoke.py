import torch

from aiayn import build_model, preset


def test_tiny_model_runs():
    model = build_model(preset("tiny")).eval()
    src = torch.randint(1, 1000, (2, 7))
    tgt = torch.randint(1, 1000, (2, 5))
    assert model(src, tgt).shape == (2, 5, 1000)
