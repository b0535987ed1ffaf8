"""The running batch (`aiayn.inference.running`): parts that join a decode under way, at other positions, with other
searches, give what `generate` and `continue_prompts` give each part alone."""

import pytest
import torch

from aiayn.backends import select
from aiayn.config import ModelConfig
from aiayn.inference.generation import GenerationConfig, continue_prompts, decoded_part, generate, prompt_limits
from aiayn.inference.running import Part, RunningBatch
from aiayn.nn.model import build_model

BOS, EOS, PAD = 1, 2, 0


def model_of(causal: bool, norm_first: bool = False, vocab: int = 30):
    torch.manual_seed(3)
    cfg = ModelConfig(vocab_size=vocab, d_model=32, n_heads=4, d_ff=64, n_encoder_layers=2,
                      n_decoder_layers=0 if causal else 2, max_len=64, dropout=0.0, norm_first=norm_first,
                      causal=causal)
    model = build_model(cfg).eval()
    with torch.no_grad():  # outputs that vary with the input (a random model's are nearly constant otherwise)
        for name, p in model.named_parameters():
            if "feed_forward" in name:
                p.mul_(3.0)
    return model


def sources(seed: int, rows: int, length: int) -> torch.Tensor:
    src = torch.randint(4, 30, (rows, length), generator=torch.Generator().manual_seed(seed))
    if rows > 1:
        src[1, length // 2 :] = PAD
    return src


SEARCHES = {
    "greedy": GenerationConfig(max_new_tokens=12),
    "beam": GenerationConfig(max_new_tokens=12, num_beams=3),
    "sampled": GenerationConfig(max_new_tokens=12, do_sample=True, top_k=8, seed=5),
    "constrained": GenerationConfig(max_new_tokens=12, repetition_penalty=1.5, no_repeat_ngram_size=2, min_len=3),
    "beam-constrained": GenerationConfig(max_new_tokens=10, num_beams=2, no_repeat_ngram_size=2,
                                         length_penalty=1.0),
}


class Answers:
    """Collects each part's outputs (or error)."""

    def __init__(self):
        self.done: dict[int, tuple] = {}

    def part(self, key: int, ids, start, limits, config, **extra) -> Part:
        return Part(ids, start, limits, config, EOS, on_done=lambda tokens, scores: self.done.__setitem__(
            key, (tokens, scores)), on_error=lambda err: self.done.__setitem__(key, err), **extra)


def run_staggered(model, parts: list[Part], every: int = 2) -> dict[int, RunningBatch]:
    """Join a part every `every` steps (each to the running batch of its number of beams), then step until all
    have left; the batches."""
    batches: dict[int, RunningBatch] = {}
    waiting = list(parts)
    step = 0
    while waiting or any(batch.searching for batch in batches.values()):
        if waiting and step % every == 0:
            part = waiting.pop(0)
            beams = part.config.num_beams
            batches.setdefault(beams, RunningBatch(model, beams)).join(part)
        for batch in batches.values():
            batch.step()
        step += 1
    return batches


@pytest.mark.parametrize("how", ["plain", "fp32"])
@pytest.mark.parametrize("norm_first", [False, True])
@torch.no_grad()
def test_translations_joining_a_running_batch_equal_each_alone(how, norm_first):
    model = model_of(causal=False, norm_first=norm_first)
    model = model if how == "plain" else select("cpu", "inference", how).prepare(model)
    answers, alone, parts = Answers(), {}, []
    for key, config in enumerate(SEARCHES.values()):
        src = sources(key, rows=3 - key % 2, length=5 + 2 * key)  # sources of other lengths and paddings
        out = generate(model, src, bos_id=BOS, eos_id=EOS, config=config)
        alone[key] = out.tokens
        rows = torch.arange(src.shape[0])
        sub, limits = decoded_part(model, src, rows, config)
        parts.append(answers.part(key, sub, torch.full((len(rows), 1), BOS), limits, config))
    batches = run_staggered(model, parts)
    assert sorted(batches) == [1, 2, 3] and all(batch.rows == 0 for batch in batches.values())
    for key, name in enumerate(SEARCHES):
        assert answers.done[key][0] == alone[key], name


@torch.no_grad()
def test_prompts_joining_a_running_batch_equal_each_alone():
    model = model_of(causal=True)
    answers, alone, parts = Answers(), {}, []
    for key, config in enumerate(SEARCHES.values()):
        prompts = torch.randint(4, 30, (2, 2 + 3 * key), generator=torch.Generator().manual_seed(key))
        alone[key] = continue_prompts(model, prompts, eos_id=EOS, config=config).tokens
        parts.append(answers.part(key, prompts, prompts, prompt_limits(model, prompts, EOS, config), config))
    run_staggered(model, parts, every=3)
    for key, name in enumerate(SEARCHES):
        assert answers.done[key][0] == alone[key], name


@torch.no_grad()
def test_a_cancelled_part_leaves_at_the_next_step_and_the_others_go_on():
    model = model_of(causal=False)
    config = GenerationConfig(max_new_tokens=20, min_len=15)
    answers, batch = Answers(), RunningBatch(model)
    src = sources(1, rows=2, length=6)
    sub, limits = decoded_part(model, src, torch.arange(2), config)
    streamed: list[tuple] = []
    first = answers.part(0, sub, torch.full((2, 1), BOS), limits, config)
    second = answers.part(1, sub, torch.full((2, 1), BOS), limits, config,
                          on_tokens=lambda sentences, tokens: streamed.append((sentences, tokens)))
    batch.join(first)
    batch.join(second)
    batch.step()
    assert batch.rows == 4
    first.cancelled = True
    batch.step()
    assert batch.rows == 2 and len(batch.state.where) == 2 and 0 not in answers.done  # its rows left the cache
    while batch.searching:
        batch.step()
    alone = generate(model, src, bos_id=BOS, eos_id=EOS, config=config).tokens
    assert answers.done[1][0] == alone
    # streamed: each step, the token each sentence still running added, in order, equal to the whole output
    for sentence in range(2):
        tokens = [t for sentences, added in streamed for s, t in zip(sentences, added) if s == sentence]
        assert tokens[: len(alone[sentence])] == alone[sentence]


@torch.no_grad()
def test_a_part_that_fails_fails_alone(monkeypatch):
    model = model_of(causal=False)
    config = GenerationConfig(max_new_tokens=8)
    answers, batch = Answers(), RunningBatch(model)
    src = sources(2, rows=2, length=5)
    sub, limits = decoded_part(model, src, torch.arange(2), config)
    bad = answers.part(0, sub, torch.full((2, 1), BOS), limits, config)
    good = answers.part(1, sub, torch.full((2, 1), BOS), limits, config)
    batch.join(bad)
    batch.join(good)
    bad_search = batch.running[0].search
    monkeypatch.setattr(bad_search, "advance", lambda logits, weights=None: 1 / 0)
    while batch.searching:
        batch.step()
    assert isinstance(answers.done[0], ZeroDivisionError)
    assert answers.done[1][0] == generate(model, src, bos_id=BOS, eos_id=EOS, config=config).tokens


def test_a_part_of_another_number_of_beams_is_refused():
    model = model_of(causal=False)
    config = GenerationConfig(max_new_tokens=4, num_beams=2)
    sub, limits = decoded_part(model, sources(0, 1, 4), torch.arange(1), config)
    answers = Answers()
    RunningBatch(model).join(answers.part(0, sub, torch.full((1, 1), BOS), limits, config))
    assert isinstance(answers.done[0], ValueError) and "one number of beams" in str(answers.done[0])
