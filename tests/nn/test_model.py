"""The decoder-only model (GPT's shape): no position sees a later one, and the cached step equals the full pass."""

import pytest
import torch

from aiayn.config import ModelConfig
from aiayn.nn import DecoderOnlyModel, build_model


def tiny(**changes) -> ModelConfig:
    base = dict(vocab_size=50, d_model=16, n_heads=2, d_ff=32, n_encoder_layers=2, n_decoder_layers=0, dropout=0.0,
                causal=True, max_len=32)
    return ModelConfig(**{**base, **changes})


@pytest.mark.parametrize("options", [{}, dict(norm_first=True, positional="learned", activation="gelu_tanh",
                                                scale_embeddings=False)])
def test_no_position_sees_a_later_one(options):
    torch.manual_seed(0)
    model = build_model(tiny(**options)).eval()
    assert isinstance(model, DecoderOnlyModel)
    ids = torch.randint(1, 50, (2, 10))
    changed = ids.clone()
    changed[:, 6:] = torch.randint(1, 50, (2, 4))
    torch.testing.assert_close(model(ids)[:, :6], model(changed)[:, :6])


def test_the_head_shares_the_token_embedding():
    model = build_model(tiny())
    assert model.head.proj.weight is model.embed.tokens.weight


@pytest.mark.parametrize("options", [{}, dict(norm_first=True, positional="learned")])
def test_cached_steps_equal_the_full_pass(options):
    torch.manual_seed(1)
    model = build_model(tiny(**options)).eval()
    ids = torch.randint(1, 50, (3, 9))
    full = model(ids)  # (B, L, V)
    caches = model.new_caches()
    prefix = model.head(model.decode(ids[:, :4], caches=caches))  # a prompt at once, then one token a step
    steps = [model.head(model.decode(ids[:, i:i + 1], caches=caches)) for i in range(4, 9)]
    torch.testing.assert_close(torch.cat([prefix, *steps], dim=1), full, atol=1e-5, rtol=1e-5)


def test_a_causal_config_has_no_decoder_layers_or_encoder_head():
    with pytest.raises(ValueError, match="n_decoder_layers=0 and head=none"):
        tiny(n_decoder_layers=2)
    with pytest.raises(ValueError, match="n_decoder_layers=0 and head=none"):
        tiny(head="masked_lm")


@pytest.mark.parametrize("tied", [True, False])
def test_the_parameter_arithmetic_counts_the_built_model(tied):
    from aiayn.inspect import parameter_table
    from aiayn.nn.sizes import parameter_count

    cfg = tiny(tie_embeddings=tied, norm_first=True, positional="learned")
    model = build_model(cfg)
    built = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    assert parameter_count(cfg) == built
    rows = dict(parameter_table(cfg))
    assert rows["total"] == built and "two decoder-only layers" in rows


@pytest.mark.parametrize("cfg", [ModelConfig(d_model=16, n_heads=2, d_ff=32, n_encoder_layers=1, n_decoder_layers=1,
                                             vocab_size=40, activation_dropout=0.05),
                                 ModelConfig(d_model=16, n_heads=2, d_ff=32, n_encoder_layers=1, n_decoder_layers=0,
                                             vocab_size=40, head="sequence_classification", num_labels=3)])
def test_set_dropout_sets_the_residual_dropout_of_a_built_model(cfg):
    """A fitted recipe sets the residual dropout once the run knows its pace: every sub-layer's, the embeddings' and a
    labelling head's `nn.Dropout`, and the config, as a model built with that value has; the other dropouts stay."""
    from aiayn.nn.model import set_dropout

    model = set_dropout(build_model(cfg), 0.3)
    built = build_model(cfg.replace(dropout=0.3))
    probabilities = [(name, m.p) for name, m in model.named_modules() if isinstance(m, torch.nn.Dropout)]
    assert probabilities == [(name, m.p) for name, m in built.named_modules() if isinstance(m, torch.nn.Dropout)]
    assert model.config == built.config and {p for _, p in probabilities} >= {0.3}
    assert all(p == cfg.activation_dropout for name, p in probabilities if "feed_forward" in name)
