"""A decoder-only model's prompts go through the same searches as translation: greedy equals recomputing the whole
prefix each step, a beam of one equals greedy, and the prompt's length bounds what may follow."""

import pytest
import torch

from aiayn.config import ModelConfig
from aiayn.inference.generation import GenerationConfig, continue_prompts
from aiayn.nn import build_model

EOS = 2


def lm(seed: int = 0, **changes):
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=40, d_model=16, n_heads=2, d_ff=32, n_encoder_layers=2, n_decoder_layers=0,
                      dropout=0.0, causal=True, max_len=24, **changes)
    return build_model(cfg).eval()


def greedy_by_hand(model, prompt: torch.Tensor, steps: int) -> list[list[int]]:
    out = []
    for row in prompt:
        ids, new = row[None], []
        for _ in range(steps):
            token = int(model(ids)[0, -1].argmax())
            if token == EOS:
                break
            new.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
        out.append(new)
    return out


@pytest.mark.parametrize("options", [{}, dict(norm_first=True, positional="learned", activation="gelu_tanh")])
def test_greedy_equals_recomputing_the_prefix(options):
    model = lm(**options)
    prompts = torch.randint(3, 40, (3, 5))
    out = continue_prompts(model, prompts, eos_id=EOS, config=GenerationConfig(max_new_tokens=8))
    assert out.tokens == greedy_by_hand(model, prompts, 8)


def test_a_one_token_prompt_and_a_beam_of_one():
    model = lm(1)
    prompts = torch.tensor([[5], [7]])
    greedy = continue_prompts(model, prompts, eos_id=EOS, config=GenerationConfig(max_new_tokens=6))
    assert greedy.tokens == greedy_by_hand(model, prompts, 6)
    beam = continue_prompts(model, prompts, eos_id=EOS,
                            config=GenerationConfig(max_new_tokens=6, num_beams=1, length_penalty=0.0))
    assert beam.tokens == greedy.tokens


def test_beam_search_scores_at_least_greedy():
    model = lm(2)
    prompts = torch.randint(3, 40, (2, 4))
    greedy = continue_prompts(model, prompts, eos_id=EOS, config=GenerationConfig(max_new_tokens=5))
    beam = continue_prompts(model, prompts, eos_id=EOS,
                            config=GenerationConfig(max_new_tokens=5, num_beams=4, length_penalty=0.0))
    assert (beam.scores >= greedy.scores - 1e-5).all()


def test_sampling_is_seeded_and_the_prompt_bounds_the_length():
    model = lm(3)
    prompts = torch.randint(3, 40, (2, 20))
    config = GenerationConfig(max_new_tokens=10, do_sample=True, top_p=0.9, seed=7)
    first = continue_prompts(model, prompts, eos_id=EOS, config=config)
    assert first.tokens == continue_prompts(model, prompts, eos_id=EOS, config=config).tokens
    assert all(len(t) <= 24 - 20 for t in first.tokens)  # max_len 24 positions
    with pytest.raises(ValueError, match="no room in the model's max_len"):
        continue_prompts(model, torch.randint(3, 40, (1, 24)), eos_id=EOS)
