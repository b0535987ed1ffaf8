"""Seed 004's six-layer NumPy encoder, reproduced by aiayn's Encoder and by aiayn.reference.

The seed draws, with `np.random.default_rng(42)`, the input x (3, 8) and then per layer WQ, WK, WV
(h, d_model, d_k), WO (d_model, d_model), W1 (d_model, d_ff), W2 (d_ff, d_model); b1, b2 are zeros,
the attention has no biases and the layer norms have gamma 1, beta 0. It prints the row of "suis"
after six layers starting [0.516, -1.794, 0.834, -0.455].
"""

import numpy as np
import torch

from aiayn import reference
from aiayn.config import ModelConfig
from aiayn.nn.attention import MultiHeadAttention
from aiayn.nn.feedforward import PositionwiseFeedForward
from aiayn.nn.layers import EncoderLayer
from aiayn.nn.model import Encoder

d_model, h, d_ff, n_layers = 8, 2, 32, 6
d_k = d_model // h
SUIS_IN = [-0.017, -0.853, 0.879, 0.778]
SUIS_OUT = [0.516, -1.794, 0.834, -0.455]


def seed_draws() -> tuple[np.ndarray, list[dict]]:
    """The seed's random draws, in the seed's order."""
    rng = np.random.default_rng(42)

    def new_params():
        w = lambda *s: rng.normal(0, 0.3, s)
        return {"WQ": w(h, d_model, d_k), "WK": w(h, d_model, d_k), "WV": w(h, d_model, d_k),
                "WO": w(d_model, d_model), "W1": w(d_model, d_ff), "b1": np.zeros(d_ff),
                "W2": w(d_ff, d_model), "b2": np.zeros(d_model)}

    x = rng.normal(0, 1, (3, d_model))  # "Je", "suis", "étudiant": embeddings + positions
    return x, [new_params() for _ in range(n_layers)]


def heads_side_by_side(w: np.ndarray) -> torch.Tensor:
    """(h, d_model, d_k) per-head matrices -> a Linear weight (d_model, d_model) whose rows i*d_k.. are head i."""
    concatenated = np.concatenate(list(w), axis=1)  # (d_model, h * d_k): x @ this = all heads side by side
    return torch.from_numpy(concatenated.T.copy())


def seed_encoder(layers: list[dict]) -> Encoder:
    """aiayn's Encoder with the seed's weights (float64)."""
    ours = []
    for p in layers:
        attn = MultiHeadAttention(d_model, h, bias=False)
        ffn = PositionwiseFeedForward(d_model, d_ff, activation="relu")
        layer = EncoderLayer(self_attn=attn, feed_forward=ffn, d_model=d_model, dropout=0.1, norm_first=False,
                             eps=1e-5).double()
        with torch.no_grad():
            attn.q_proj.weight.copy_(heads_side_by_side(p["WQ"]))
            attn.k_proj.weight.copy_(heads_side_by_side(p["WK"]))
            attn.v_proj.weight.copy_(heads_side_by_side(p["WV"]))
            attn.out_proj.weight.copy_(torch.from_numpy(p["WO"].T.copy()))  # concat @ WO
            ffn.linear1.weight.copy_(torch.from_numpy(p["W1"].T.copy()))
            ffn.linear1.bias.copy_(torch.from_numpy(p["b1"]))
            ffn.linear2.weight.copy_(torch.from_numpy(p["W2"].T.copy()))
            ffn.linear2.bias.copy_(torch.from_numpy(p["b2"]))
        for sub in (layer.attn_sublayer, layer.ffn_sublayer):  # gamma 1, beta 0 (nn.LayerNorm's init)
            assert torch.equal(sub.norm.weight, torch.ones(d_model))
            assert torch.equal(sub.norm.bias, torch.zeros(d_model))
        ours.append(layer)
    return Encoder(ours).eval()


def test_seed_input_row_is_the_printed_one():
    x, _ = seed_draws()
    assert np.round(x[1, :4], 3).tolist() == SUIS_IN


def test_six_layer_encoder_reproduces_seed_004():
    x, layers = seed_draws()
    encoder = seed_encoder(layers)
    with torch.no_grad():
        states = encoder.hidden_states(torch.from_numpy(x)[None])  # x straight in
    out = states[-1][0].numpy()
    assert out.shape == (3, 8)
    assert (np.round(out[1, :4], 3) + 0.0).tolist() == SUIS_OUT
    after_first = states[1][0].numpy()
    np.testing.assert_allclose(after_first.mean(axis=1), 0.0, atol=1e-12)  # the seed's "row means [0. 0. 0.]"
    np.testing.assert_allclose(after_first.std(axis=1), 1.0, atol=1e-4)  # "row stds [1. 1. 1.]"


def test_reference_reproduces_seed_004_and_the_seeds_own_code():
    x, layers = seed_draws()

    # The seed's code, verbatim in substance.
    def multi_head(x, p):
        heads = []
        for i in range(h):
            q, k, v = x @ p["WQ"][i], x @ p["WK"][i], x @ p["WV"][i]
            heads.append(reference.softmax(q @ k.T / np.sqrt(d_k)) @ v)
        return np.concatenate(heads, axis=-1) @ p["WO"]

    def ffn(x, p):
        return np.maximum(0, x @ p["W1"] + p["b1"]) @ p["W2"] + p["b2"]

    ones, zeros = np.ones(d_model), np.zeros(d_model)
    seed_out = x
    for p in layers:
        seed_out = reference.layer_norm(seed_out + multi_head(seed_out, p), ones, zeros)
        seed_out = reference.layer_norm(seed_out + ffn(seed_out, p), ones, zeros)

    # aiayn.reference's encoder layers on the weights exported from the torch Encoder.
    cfg = ModelConfig(vocab_size=10, d_model=d_model, n_heads=h, d_ff=d_ff, n_encoder_layers=n_layers,
                      n_decoder_layers=0)
    w = reference.export_weights(seed_encoder(layers))  # keys "layers.<i>.self_attn.q_proj.weight", ...
    out = x[None]
    for i in range(n_layers):
        out = reference.encoder_layer(out, w, f"layers.{i}", cfg)
    np.testing.assert_allclose(out[0], seed_out, atol=1e-12)
    assert (np.round(out[0, 1, :4], 3) + 0.0).tolist() == SUIS_OUT
