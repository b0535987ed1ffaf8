"""Hugging Face GPT-2 <-> aiayn's decoder-only model: the same logits and greedy tokens both ways, and what does
not map is named."""

import pytest
import torch

from aiayn.config import ModelConfig
from aiayn.inference.generation import GenerationConfig, continue_prompts
from aiayn.interop.gpt2 import from_gpt2, gpt2_problems, to_gpt2
from aiayn.nn import DecoderOnlyModel, build_model

transformers = pytest.importorskip("transformers")

ATOL = 1e-5  # fp32, tiny sizes: the two libraries add the same products in other orders


def gpt2_like(**changes) -> ModelConfig:
    base = dict(vocab_size=61, d_model=32, n_heads=4, d_ff=64, n_encoder_layers=2, n_decoder_layers=0, causal=True,
                dropout=0.1, attention_dropout=0.1, norm_first=True, positional="learned", scale_embeddings=False,
                activation="gelu_tanh", max_len=24, pad_id=0)
    return ModelConfig(**{**base, **changes})


def trained_looking(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every weight drawn at random (LayerNorms and biases too), so that no mapped weight hides behind its init."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            gain = name.endswith("weight") and ("norm" in name or ".ln_" in name)  # LayerNorm gains near 1
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3 + (1.0 if gain else 0.0))
    return model


def prompts(batch: int = 3, length: int = 5, vocab: int = 61, seed: int = 0) -> torch.Tensor:
    return torch.randint(1, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


MAPPED = {
    "gpt2": {},
    "gelu, eps 1e-6": dict(activation="gelu", layer_norm_eps=1e-6),
    "relu, untied head": dict(activation="relu", tie_embeddings=False),
    "sinusoidal positions, no biases": dict(positional="sinusoidal", bias=False),
    "scaled embeddings, untied head": dict(scale_embeddings=True, tie_embeddings=False),
    "d_model 16": dict(d_model=16, n_heads=2, d_ff=48),
}


@pytest.mark.parametrize("options", MAPPED.values(), ids=MAPPED.keys())
def test_gpt2_computes_aiayns_logits(options):
    torch.manual_seed(0)
    model = trained_looking(build_model(gpt2_like(**options)), seed=1).eval()
    hf = to_gpt2(model)
    ids = prompts(length=9)
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=ids).logits, model(ids), atol=ATOL, rtol=0)
    assert not hf.training and not model.training  # dropout off in both


@pytest.mark.parametrize("activation", ["gelu_new", "gelu", "relu"])
def test_aiayn_computes_gpt2s_logits(activation):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=53, n_positions=20, n_embd=24, n_layer=2, n_head=3, n_inner=40,
                                     activation_function=activation, layer_norm_epsilon=1e-5)
    hf = trained_looking(transformers.GPT2LMHeadModel(config), seed=2).eval()
    model = from_gpt2(hf)
    assert isinstance(model, DecoderOnlyModel)
    assert model.head.proj.weight is model.embed.tokens.weight  # tied, as GPT-2's head
    ids = prompts(length=11, vocab=53)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(input_ids=ids).logits, atol=ATOL, rtol=0)


def test_there_and_back_gives_the_same_weights():
    model = trained_looking(build_model(gpt2_like()), seed=3).eval()
    back = from_gpt2(to_gpt2(model))
    assert back.config == model.config
    for (name, ours), theirs in zip(model.state_dict().items(), back.state_dict().values()):
        torch.testing.assert_close(theirs, ours, atol=0, rtol=0, msg=name)


def test_generate_picks_the_tokens_of_aiayns_greedy_search():
    model = trained_looking(build_model(gpt2_like()), seed=4).eval()
    ids = prompts(batch=4, length=6, seed=5)
    greedy = GenerationConfig(max_new_tokens=12)
    eos = continue_prompts(model, ids, eos_id=0, config=greedy).tokens[0][3]  # a token it picks: rows end apart
    ours = continue_prompts(model, ids, eos_id=eos, config=greedy).tokens  # each row's new ids, without </s>
    assert len({len(row) for row in ours}) > 1
    hf = to_gpt2(model, eos_token_id=eos)
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_length=ids.shape[1] + 12,
                          do_sample=False, pad_token_id=model.config.pad_id)[:, ids.shape[1]:]
    theirs = [row[:row.index(eos)] if eos in row else row for row in out.tolist()]
    assert theirs == ours


def test_options_gpt2_cannot_express_are_named_with_their_fix():
    problems = gpt2_problems(gpt2_like(norm_first=False, scale_embeddings=True, embedding_norm=True,
                                       type_vocab_size=2))
    assert problems == [
        "GPT-2 is pre-LN (set norm_first=true)",
        "GPT-2 does not scale the embedding its head shares (set scale_embeddings=false, or tie_embeddings=false)",
        "GPT-2 has no LayerNorm on the embeddings (set embedding_norm=false)",
        "GPT-2 has no token-type embeddings (set type_vocab_size=0)",
    ]
    assert gpt2_problems(gpt2_like()) == []
    translator = ModelConfig(vocab_size=61, d_model=16, n_heads=2, d_ff=32, n_encoder_layers=1, n_decoder_layers=1)
    assert gpt2_problems(translator)[0].startswith("GPT-2 is a decoder-only language model (causal=true")
    with pytest.raises(ValueError, match=r"model cannot be mapped to GPT-2: GPT-2 is pre-LN \(set norm_first=true\)$"):
        to_gpt2(build_model(gpt2_like(norm_first=False)))


def test_gpt2_settings_aiayn_lacks_are_named():
    config = transformers.GPT2Config(vocab_size=53, n_positions=20, n_embd=24, n_layer=1, n_head=3,
                                     scale_attn_by_inverse_layer_idx=True, activation_function="silu")
    with pytest.raises(ValueError, match="activation_function 'silu'.*scale_attn_by_inverse_layer_idx=True"):
        from_gpt2(transformers.GPT2LMHeadModel(config))


def language_model_dir(tmp_path, **changes):
    """A saved decoder-only model with its tokenizer, as `aiayn export` reads it."""
    from aiayn.io import save_model
    from aiayn.tokenization import train_tokenizer
    from tests.conftest import SAMPLE_LINES

    tokenizer = train_tokenizer(SAMPLE_LINES * 4, vocab_size=60)
    model = trained_looking(build_model(gpt2_like(vocab_size=tokenizer.vocab_size, max_len=64, **changes)), seed=8)
    return save_model(model, tmp_path / "lm", tokenizer=tokenizer), tokenizer


def test_export_writes_a_gpt2_directory_that_transformers_loads_and_checks_it(tmp_path, capsys):
    from aiayn.cli.main import main
    from aiayn.export import CHECK_TEXTS

    directory, tokenizer = language_model_dir(tmp_path)
    out = tmp_path / "gpt2"
    assert main(["export", "--model", str(directory), "--out", str(out)]) == 0
    stdout = capsys.readouterr().out
    assert "wrote gpt2 files" in stdout
    assert stdout.count(f"{len(CHECK_TEXTS)}/{len(CHECK_TEXTS)} agree") == 3, stdout  # ids, logits, greedy tokens
    hf = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tokenizer("a b c").input_ids == tokenizer.encode("a b c", add_bos=True)
    assert (hf.generation_config.bos_token_id, hf.generation_config.eos_token_id) == (tokenizer.bos_id,
                                                                                     tokenizer.eos_id)
    assert sorted(p.name for p in out.iterdir()) == [
        "aiayn_export.json", "config.json", "generation_config.json", "model.safetensors", "special_tokens_map.json",
        "tokenizer.json", "tokenizer_config.json"]


def test_the_export_check_reports_weights_that_compute_something_else(tmp_path):
    from aiayn.export import CHECK_TEXTS, check_causal_lm, export
    from aiayn.inference.generator import Generator

    directory, _ = language_model_dir(tmp_path)
    export(directory, tmp_path / "gpt2")
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "gpt2")
    with torch.no_grad():
        bias = hf.transformer.h[0].mlp.c_proj.bias
        bias.add_(3.0 * torch.randn(bias.shape, generator=torch.Generator().manual_seed(0)))
    hf.save_pretrained(tmp_path / "gpt2")
    checks = check_causal_lm(Generator.from_pretrained(directory), tmp_path / "gpt2")
    assert [check.agreed for check in checks][:2] == [len(CHECK_TEXTS), 0]  # the same ids, other logits
    assert checks[1].failed and "logits" in str(checks[1])


@pytest.mark.parametrize("tied", [True, False])
def test_the_papers_post_ln_decoder_exports_as_marian_for_causal_lm_with_its_checks_passing(tmp_path, capsys, tied):
    """GPT-2 cannot hold a post-LN decoder with sinusoids and a scaled embedding; Marian's decoder alone can."""
    from aiayn.cli.main import main
    from aiayn.export import CHECK_TEXTS

    directory, tokenizer = language_model_dir(tmp_path, norm_first=False, positional="sinusoidal",
                                              scale_embeddings=True, activation="relu", tie_embeddings=tied)
    out = tmp_path / "marian"
    assert main(["export", "--model", str(directory), "--out", str(out)]) == 0
    stdout = capsys.readouterr().out
    assert "wrote marian-causal-lm files" in stdout
    assert stdout.count(f"{len(CHECK_TEXTS)}/{len(CHECK_TEXTS)} agree") == 3, stdout  # ids, logits, greedy tokens
    assert "MarianForCausalLM logits" in stdout
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == "MarianForCausalLM" and not hf.config.is_encoder_decoder
    prompt = torch.tensor([tokenizer.encode("the cat", add_bos=True)])
    continued = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=5)
    assert continued.shape[1] > prompt.shape[1]


def test_a_decoder_only_model_no_architecture_holds_is_refused_before_writing(tmp_path):
    from aiayn.export import export

    directory, _ = language_model_dir(tmp_path, norm_first=False, positional="learned")
    with pytest.raises(ValueError, match=r"GPT-2 is pre-LN \(set norm_first=true\).* nor to MarianForCausalLM "
                                         r"\(Marian uses sinusoidal positions"):
        export(directory, tmp_path / "gpt2")
    assert not (tmp_path / "gpt2").exists()


def test_the_training_benchmark_times_the_decoder_only_model_beside_gpt2(capsys):
    from aiayn.cli.main import main

    code = main(["bench", "train", "--model", "decoder-only", "--preset", "tiny", "--max-tokens", "64",
                 "--seq-len", "16", "--steps", "1", "--threads", "1"])
    out = capsys.readouterr().out
    assert code == 0 and "decoder-only, preset tiny's decoder (2 layers" in out, out
    assert "batches of 4 sequences x 16 tokens" in out and "aiayn / Hugging Face GPT-2" in out
