"""aiayn.inspect: the parameter table by part and the stage-by-stage trace."""

import pytest
import torch

from aiayn.config import ModelConfig, preset
from aiayn.inspect import Stage, count, demo_model, format_table, parameter_table, trace
from aiayn.nn.model import build_model


@pytest.fixture(scope="module")
def demo():
    return demo_model(seed=0)


def test_parameter_table_rows_add_up_to_the_model():
    for cfg in (preset("tiny"), preset("tiny").replace(share_embeddings=False, tie_embeddings=False,
                                                         tgt_vocab_size=500, norm_first=True)):
        rows = dict(parameter_table(cfg))
        model = build_model(cfg)
        assert rows["total"] == count(model)
        parts = ("two encoder layers", "two decoder layers", "final layer norms (pre-LN)")
        rest = rows["total"] - sum(rows.get(p, 0) for p in parts)
        assert rest == sum(v for k, v in rows.items() if k.startswith(("embeddings", "output projection")))


def test_parameter_table_of_an_encoder_only_model_with_a_head():
    cfg = preset("tiny").replace(n_decoder_layers=0, head="sequence_classification", num_labels=5)
    rows = dict(parameter_table(cfg))
    assert rows["head (sequence_classification)"] == 64 * 5 + 5
    assert rows["total"] == count(build_model(cfg))
    text = format_table(parameter_table(cfg))
    assert "encoder layer: multi-head attention" in text and text.splitlines()[-1].endswith(f"{rows['total']:,}")


def test_trace_values_are_the_models(demo):
    model, tokenizer = demo
    stages = trace(model, tokenizer, "How are you")
    by_name = {s.name: s for s in stages if isinstance(s, Stage)}
    ids = torch.tensor([tokenizer.encode("How are you")])
    with torch.no_grad():
        memory = model.encode(ids)
    assert by_name["encoder output (memory)"].values == pytest.approx(memory[0].flatten()[:4].tolist(), abs=1e-6)
    weights = by_name["enc1 softmax weights"]
    assert weights.shape == (4, 3, 3)
    assert sum(weights.values[:3]) == pytest.approx(1.0, abs=2e-3)  # one row, rounded to 3 decimals
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())  # no hook left behind


def test_trace_of_an_encoder_only_model(demo):
    _, tokenizer = demo
    cfg = ModelConfig(vocab_size=tokenizer.vocab_size, d_model=32, n_heads=2, d_ff=64, n_encoder_layers=1,
                      n_decoder_layers=0, head="sequence_classification", num_labels=3, positional="learned",
                      max_len=16)
    stages = trace(build_model(cfg), tokenizer, "How are you")
    names = [s.name for s in stages if isinstance(s, Stage)]
    assert names[0] == "token embedding x sqrt(d_model)" and names[1] == "+ positional encoding (learned)"
    assert names[-1] == "head output (sequence_classification)" and stages[-1].shape == (3,)


def test_trace_rejects_text_without_tokens(demo):
    model, tokenizer = demo
    with pytest.raises(ValueError, match="the text has no tokens to trace"):
        trace(model, tokenizer, "")


def test_trace_names_a_prepared_copy_and_what_to_pass(demo):
    from aiayn.backends import select

    model, tokenizer = demo
    prepared = select("cpu", "inference").prepare(model)
    if not any(type(m).__name__ in ("FusedQKVAttention", "TorchEncoderLayer") for m in prepared.modules()):
        from aiayn.backends.fused import use_torch_encoder_layers

        prepared = use_torch_encoder_layers(prepared)  # (what another machine's calibration would choose)
    with pytest.raises(ValueError, match="prepared copy: pass the model itself"):
        trace(prepared, tokenizer, "How are you")
    assert trace(model, tokenizer, "How are you")  # the model itself still traces
