"""No tensor is read back to the host inside a decoding step (on a GPU each read is a stall).

Every Python-level way to read a tensor's value (`item`, `bool`, `int`, `float`, `tolist`, indexing with a
tensor as a number) is counted while the step runs; the count must be zero. The loop around the steps may
read once a step (whether every sentence has finished), as Hugging Face's `generate()` does.
"""

import contextlib

import pytest
import torch

from aiayn.backends import select
from aiayn.config import ModelConfig
from aiayn.inference import GenerationConfig, generate
from aiayn.nn.model import build_model
from tests.conftest import around_steps

READS = ("item", "__bool__", "__int__", "__float__", "__index__", "tolist")


@contextlib.contextmanager
def counting_reads():
    """A list that grows by the name of each host read made while the block runs."""
    seen: list[str] = []
    with pytest.MonkeyPatch.context() as patch:
        for name in READS:
            original = getattr(torch.Tensor, name)

            def counted(self, *args, _name=name, _original=original, **kwargs):
                seen.append(_name)
                return _original(self, *args, **kwargs)

            patch.setattr(torch.Tensor, name, counted)
        yield seen


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=40, d_model=32, n_heads=4, d_ff=64, n_encoder_layers=2, n_decoder_layers=2,
                      max_len=32, dropout=0.0)
    return build_model(cfg).eval()


@pytest.mark.parametrize("prepared", [False, True])
@pytest.mark.parametrize("beam", [1, 4])
def test_a_decoding_step_reads_nothing_back_to_the_host(monkeypatch, prepared, beam):
    model = tiny_model()
    module = select("cpu", "inference", "fp32").prepare(model) if prepared else model
    src = torch.randint(4, 40, (3, 7))
    src[1, 5:] = 0  # padded: the source mask is used at every step
    in_steps: list[str] = []
    calls = []

    def step(real_step, tokens):
        calls.append(1)
        with counting_reads() as seen:
            out = real_step(tokens)
        in_steps.extend(seen)
        return out

    around_steps(monkeypatch, step)
    with torch.no_grad():
        result = generate(module, src, bos_id=1, eos_id=2, config=GenerationConfig(max_new_tokens=8, num_beams=beam))
    assert len(calls) >= 4 and len(result.tokens) == 3
    assert in_steps == [], f"host reads inside a decoding step: {sorted(set(in_steps))}"


def test_the_generation_loop_reads_at_most_once_a_step(monkeypatch):
    model = tiny_model()
    src = torch.randint(4, 40, (3, 7))
    config = GenerationConfig(max_new_tokens=8, min_len=8, num_beams=1)
    with torch.no_grad():
        generate(model, src, bos_id=1, eos_id=2, config=config)  # warm
        with counting_reads() as seen:
            generate(model, src, bos_id=1, eos_id=2, config=config)
    fixed = 12  # before and after the loop: request checks, lengths, the tokens as lists
    assert len(seen) <= 8 + fixed, sorted(seen)


def test_the_counter_sees_every_kind_of_read():
    t = torch.tensor([3])
    with counting_reads() as seen:
        bool(t), int(t), float(t), t.item(), t.tolist(), [0, 1, 2, 3][t]
    assert sorted(seen) == sorted(["__bool__", "__int__", "__float__", "item", "tolist", "__index__"])
