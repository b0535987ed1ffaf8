"""OpenAI's `POST /v1/completions` on a decoder-only model: the official client gets what the Generator gives."""

import httpx
import pytest
import torch

from aiayn.config import ModelConfig
from aiayn.inference.generator import Generator
from aiayn.nn import build_model
from aiayn.serve import create_app
from aiayn.tokenization import train_tokenizer
from tests.serving import serving

TEXT = ["one two three four five six", "seven eight nine ten", "two three four five"]


@pytest.fixture(scope="module")
def generator():
    tokenizer = train_tokenizer(TEXT * 5, vocab_size=300)
    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=tokenizer.vocab_size, d_model=16, n_heads=2, d_ff=32,
                                    n_encoder_layers=2, n_decoder_layers=0, dropout=0.0, causal=True, max_len=48,
                                    pad_id=tokenizer.pad_id))
    return Generator(model, tokenizer)


@pytest.fixture(scope="module")
def url(generator):
    with serving(create_app({"counting": generator})) as base:
        yield base


def test_the_openai_client_gets_the_generators_greedy_continuations(url, generator):
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="unused")
    prompts = ["one two", "seven eight nine"]
    answer = client.completions.create(model="counting", prompt=prompts, max_tokens=5, temperature=0)
    expected = generator.generate(prompts, max_new_tokens=5)
    assert [c.text for c in answer.choices] == [e.text for e in expected]
    assert answer.usage.completion_tokens == sum(len(e.tokens) for e in expected)
    for choice, e in zip(answer.choices, expected):
        assert choice.finish_reason == ("length" if len(e.tokens) == 5 else "stop")


def test_sampling_with_a_seed_stops_and_echo(url, generator):
    body = {"prompt": "one", "max_tokens": 6, "temperature": 0.7, "top_p": 0.9, "seed": 4}
    first = httpx.post(f"{url}/v1/completions", json=body).json()
    assert first == {**first, "object": "text_completion"}
    again = httpx.post(f"{url}/v1/completions", json=body).json()
    assert first["choices"][0]["text"] == again["choices"][0]["text"]
    expected = generator.generate("one", max_new_tokens=6, do_sample=True, temperature=0.7, top_p=0.9, seed=4)[0]
    assert first["choices"][0]["text"] == expected.text
    echoed = httpx.post(f"{url}/v1/completions", json={**body, "echo": True}).json()
    assert echoed["choices"][0]["text"] == "one" + expected.text


@pytest.mark.parametrize("body, message", [
    ({"prompt": "one", "n": 2}, "'n' must be 1"),
    ({"prompt": "one", "max_tokens": 0}, "'max_tokens' must be a positive integer"),
    ({"prompt": "one", "temperature": 3}, "'temperature' must be a number from 0.0 to 2.0"),
    ({"max_tokens": 3}, "'prompt' is missing"),
    ({"prompt": "one " * 200}, "shorten it"),
])
def test_bad_requests_get_422_naming_the_field(url, body, message):
    answer = httpx.post(f"{url}/v1/completions", json=body)
    assert answer.status_code == 422
    assert message in answer.text
