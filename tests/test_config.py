"""ModelConfig: the paper's defaults, presets, validation, JSON round trip and key=value overrides."""

import dataclasses
import json

import pytest

from aiayn.config import PRESETS, ModelConfig, parse_overrides, preset


def test_defaults_are_the_papers_base_model():
    cfg = ModelConfig()
    assert (cfg.d_model, cfg.n_heads, cfg.d_k, cfg.d_ff) == (512, 8, 64, 2048)
    assert (cfg.n_encoder_layers, cfg.n_decoder_layers, cfg.dropout) == (6, 6, 0.1)
    assert (cfg.activation, cfg.norm_first, cfg.positional, cfg.pe_layout) == ("relu", False, "sinusoidal",
                                                                               "interleaved")
    assert cfg.scale_embeddings and cfg.tie_embeddings and cfg.layer_norm_eps == 1e-5
    assert preset("base") == cfg
    big = preset("big")
    assert (big.d_model, big.n_heads, big.d_ff, big.dropout) == (1024, 16, 4096, 0.3)
    assert set(PRESETS) >= {"base", "big", "tiny"}


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        ModelConfig().d_model = 256


@pytest.mark.parametrize(("changes", "message"), [
    (dict(n_heads=7), r"d_model \(512\) must be divisible by n_heads \(7\)"),
    (dict(d_model=0), "d_model must be a positive integer, got 0"),
    (dict(d_ff=-1), "d_ff must be a positive integer, got -1"),
    (dict(n_encoder_layers=2.5), "n_encoder_layers must be a positive integer, got 2.5"),
    (dict(vocab_size=True), "vocab_size must be a positive integer, got True"),
    (dict(n_decoder_layers=-1), "n_decoder_layers must be a non-negative integer"),
    (dict(activation="swish"), "activation must be one of relu, gelu, gelu_tanh; got 'swish'"),
    (dict(positional="rotary"), "positional must be one of sinusoidal, learned, none"),
    (dict(pe_layout="halves"), "pe_layout must be one of interleaved, split"),
    (dict(dropout=1.0), r"dropout must be in \[0, 1\), got 1.0"),
    (dict(attention_dropout=-0.1), "attention_dropout must be in"),
    (dict(layer_norm_eps=0), "layer_norm_eps must be positive"),
    (dict(layer_norm_eps=True), "layer_norm_eps must be positive"),
    (dict(pad_id=37000), r"pad_id 37000 is outside the vocabulary \(size 37000\)"),
    (dict(tgt_vocab_size=100), "share_embeddings needs one vocabulary"),
    (dict(tgt_vocab_size=0, share_embeddings=False), "tgt_vocab_size must be a positive integer or null"),
    (dict(n_decoder_layers=0, head="sequence_classification"), "needs num_labels >= 1"),
    (dict(norm_first="yes"), "norm_first must be true or false"),
    (dict(d_model=510, n_heads=3, positional="sinusoidal", n_encoder_layers=1), None),
    (dict(d_model=9, n_heads=3), "sinusoidal positions need an even d_model, got 9"),
])
def test_validation_names_the_problem(changes, message):
    if message is None:
        assert ModelConfig(**changes).d_model == changes["d_model"]
        return
    with pytest.raises(ValueError, match=message):
        ModelConfig(**changes)
    with pytest.raises(ValueError, match=message):
        ModelConfig().replace(**changes)


@pytest.mark.parametrize("name", ["base", "big", "tiny"])
def test_json_round_trip(name, tmp_path):
    cfg = preset(name).replace(tgt_vocab_size=None, norm_first=True, pe_layout="split")
    assert ModelConfig.from_json(cfg.to_json()) == cfg
    path = tmp_path / "config.json"
    cfg.to_json(path)
    assert ModelConfig.from_json(path) == cfg
    assert json.loads(path.read_text())["d_model"] == cfg.d_model


def test_from_dict_rejects_unknown_keys():
    with pytest.raises(ValueError, match="unknown config key.s.: d_modle"):
        ModelConfig.from_dict({**ModelConfig().to_dict(), "d_modle": 3})
    with pytest.raises(ValueError, match="unknown config key"):
        ModelConfig().replace(heads=4)


def test_overrides_parse_each_value_to_the_fields_type():
    cfg = preset("tiny").with_overrides(["d_model=128", "n_heads = 8", "norm_first=true", "dropout=0.2",
                                         "activation=gelu", "tgt_vocab_size=null", "share_embeddings=no"])
    assert (cfg.d_model, cfg.n_heads, cfg.norm_first, cfg.dropout) == (128, 8, True, 0.2)
    assert (cfg.activation, cfg.tgt_vocab_size, cfg.share_embeddings) == ("gelu", None, False)
    assert parse_overrides(["max_len=64"]) == {"max_len": 64}


@pytest.mark.parametrize(("override", "message"), [
    ("d_modle=128", "unknown config key 'd_modle'; known keys: activation"),
    ("d_model=big", "d_model expects an integer, got 'big'"),
    ("d_model=512.5", "d_model expects an integer"),
    ("dropout=high", "dropout expects a number, got 'high'"),
    ("norm_first=maybe", "norm_first expects true or false, got 'maybe'"),
    ("d_model", "override 'd_model' must look like key=value"),
    ("n_heads=7", r"d_model \(64\) must be divisible by n_heads \(7\)"),
    ("activation=tanh", "activation must be one of"),
])
def test_overrides_reject_unknown_or_mistyped_keys(override, message):
    with pytest.raises(ValueError, match=message):
        preset("tiny").with_overrides([override])


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown preset 'huge'; choose one of base, big.*tiny"):
        preset("huge")


@pytest.mark.parametrize("head", ["sequence_classification", "token_classification", "masked_lm"])
def test_an_encoder_head_on_an_encoder_decoder_is_refused_not_dropped(head):
    """The encoder-decoder builds no such head: a classifier asked for would silently be a translation model."""
    with pytest.raises(ValueError, match=f"head '{head}' sits on an encoder: set n_decoder_layers=0"):
        ModelConfig(vocab_size=50, d_model=16, n_heads=2, d_ff=32, head=head, num_labels=2)
    ModelConfig(vocab_size=50, d_model=16, n_heads=2, d_ff=32, head=head, num_labels=2, n_decoder_layers=0)
