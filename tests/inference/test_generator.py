"""`aiayn.load` of a decoder-only model gives a Generator whose continuations follow the prompt exactly."""

import pytest
import torch

import aiayn
import aiayn.inference.generator
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


def test_batches_of_any_size_give_what_all_prompts_at_once_give(tmp_path, monkeypatch):
    """Prompts sorted by length, cut into batches of one length within max_tokens / max_sentences: the same
    tokens as every prompt at once, back in the order given, greedy and beam alike."""
    _, tokenizer, directory = saved_lm(tmp_path)
    generator = aiayn.load(directory)
    prompts = ["one two three four", "seven", "one two", "eight nine ten", "seven", "one two", "café, naïve", "two"]
    lengths = [len(tokenizer.encode(p, add_bos=True)) for p in prompts]
    batches = []
    run = aiayn.inference.generator.continue_prompts
    monkeypatch.setattr(aiayn.inference.generator, "continue_prompts",
                        lambda model, ids, **kw: batches.append(tuple(ids.shape)) or run(model, ids, **kw))
    for beams in (1, 3):
        batches.clear()
        together = generator.generate(prompts, max_new_tokens=6, num_beams=beams)
        assert sorted(batches) == sorted((lengths.count(n), n) for n in set(lengths))  # one batch a length
        for batching, fits in (({"max_sentences": 1}, lambda b, p: b == 1),
                               ({"max_tokens": 5}, lambda b, p: b * p <= 5 or b == 1),
                               ({"max_tokens": 1}, lambda b, p: b == 1),
                               ({"max_tokens": 100, "max_sentences": 2}, lambda b, p: b <= 2)):
            batches.clear()
            apart = generator.generate(prompts, max_new_tokens=6, num_beams=beams, **batching)
            assert all(fits(b, p) for b, p in batches), (batching, batches)
            assert sum(b for b, _ in batches) == len(prompts)
            assert [c.tokens for c in apart] == [c.tokens for c in together], (beams, batching)
            torch.testing.assert_close(torch.tensor([c.score for c in apart]),
                                       torch.tensor([c.score for c in together]))


@pytest.mark.parametrize("batching, message", [({"max_tokens": 0}, r"max_tokens must be at least 1, got 0"),
                                               ({"max_sentences": -1}, r"max_sentences must not be negative"),
                                               ({"max_tokens": 1.5}, r"max_tokens must be an integer, got 1.5"),
                                               ({"max_tokens": "8"}, r"max_tokens must be an integer, got '8'"),
                                               ({"max_sentences": None}, r"max_sentences must be an integer")])
def test_batch_sizes_out_of_range_are_refused(tmp_path, batching, message):
    _, _, directory = saved_lm(tmp_path)
    with pytest.raises(ValueError, match=message):
        aiayn.load(directory).generate("one", **batching)
