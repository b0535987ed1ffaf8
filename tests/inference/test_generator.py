"""`aiayn.load` of a decoder-only model gives a Generator whose continuations follow the prompt exactly."""

import torch

import aiayn
from aiayn.config import ModelConfig
from aiayn.inference.generation import GenerationConfig, continue_prompts
from aiayn.io import save_model
from aiayn.nn import build_model
from aiayn.tokenization import train_tokenizer

TEXT = ["one two three four five six", "seven eight nine ten", "two three four five", "café, naïve — déjà vu"]


def saved_lm(tmp_path):
    tokenizer = train_tokenizer(TEXT * 5, vocab_size=300)
    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=tokenizer.vocab_size, d_model=16, n_heads=2, d_ff=32,
                                    n_encoder_layers=2, n_decoder_layers=0, dropout=0.0, causal=True, max_len=64,
                                    pad_id=tokenizer.pad_id))
    save_model(model, tmp_path / "lm", tokenizer=tokenizer)
    return model, tokenizer, tmp_path / "lm"


def test_load_gives_a_generator_that_continues_each_prompt(tmp_path):
    model, tokenizer, directory = saved_lm(tmp_path)
    generator = aiayn.load(directory)
    assert isinstance(generator, aiayn.Generator)
    prompts = ["one two", "seven eight nine", "", "déjà"]
    completions = generator.generate(prompts, max_new_tokens=6)
    assert len(completions) == len(prompts)
    for prompt, completion in zip(prompts, completions):
        ids = torch.tensor([tokenizer.encode(prompt, add_bos=True)])
        expected = continue_prompts(model.eval(), ids, eos_id=tokenizer.eos_id,
                                    config=GenerationConfig(max_new_tokens=6)).tokens[0]
        assert completion.tokens == expected
        assert tokenizer.decode(tokenizer.encode(prompt) + completion.tokens) == prompt + completion.text


def test_sampling_settings_pass_through(tmp_path):
    _, _, directory = saved_lm(tmp_path)
    generator = aiayn.load(directory)
    first = generator.generate("one", max_new_tokens=8, do_sample=True, top_p=0.9, temperature=0.8, seed=3)
    again = generator.generate("one", max_new_tokens=8, do_sample=True, top_p=0.9, temperature=0.8, seed=3)
    assert first[0].tokens == again[0].tokens
