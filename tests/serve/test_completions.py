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


def test_the_same_settings_give_the_same_text_from_the_api_the_cli_and_the_server(url, generator, tmp_path, capsys):
    """top_k, the repetition penalty and stop strings, through `Generator.generate`, `aiayn generate` and
    `/v1/completions` (vLLM's extra fields beside OpenAI's), sampled with a seed and greedy."""
    from aiayn.cli.main import main
    from aiayn.io import save_model

    directory = save_model(generator.model, tmp_path / "lm", tokenizer=generator.tokenizer)
    for sampled in (True, False):
        api = {"max_new_tokens": 12, "repetition_penalty": 1.3, "stop": ["nine", "e f"]}
        body = {"prompt": "one two", "max_tokens": 12, "repetition_penalty": 1.3, "stop": ["nine", "e f"]}
        cli = ["--max-new-tokens", "12", "--repetition-penalty", "1.3", "--stop", "nine", "--stop", "e f"]
        if sampled:
            api.update(do_sample=True, temperature=0.9, top_k=5, seed=7)
            body.update(temperature=0.9, top_k=5, seed=7)
            cli += ["--sample", "--temperature", "0.9", "--top-k", "5", "--seed", "7"]
        else:
            body["temperature"] = 0
        expected = generator.generate("one two", **api)[0]
        served = httpx.post(f"{url}/v1/completions", json=body).json()["choices"][0]
        assert served["text"] == expected.text
        assert served["finish_reason"] == ("stop" if expected.stop or expected.ended else "length")
        assert main(["generate", "--run", str(directory), "--only-new", "one two", *cli]) == 0
        assert capsys.readouterr().out == expected.text.replace("\n", " ") + "\n"


def test_a_stop_string_cuts_the_text_and_the_ids_at_its_first_occurrence(generator):
    full = generator.generate("one two", max_new_tokens=16)[0]
    assert len(full.text) > 2, full.text
    stop = full.text[-2:]
    cut = generator.generate("one two", max_new_tokens=16, stop=["never there", stop])[0]
    assert cut.text == full.text[:full.text.find(stop)] and cut.stop == stop
    assert cut.tokens == full.tokens[:len(cut.tokens)] and cut.score == full.score
    prompt = generator.encode("one two")[0]
    assert generator._continuation(prompt, cut.tokens).startswith(cut.text)  # the fewest ids that hold the text
    assert not cut.tokens or len(generator._continuation(prompt, cut.tokens[:-1])) < len(cut.text)
    with pytest.raises(ValueError, match="stop must be a non-empty string"):
        generator.generate("one", stop=[""])


@pytest.mark.parametrize("body, message", [
    ({"prompt": "one", "n": 2}, "'n' must be 1"),
    ({"prompt": "one", "max_tokens": 0}, "'max_tokens' must be a positive integer"),
    ({"prompt": "one", "temperature": 3}, "'temperature' must be a number from 0.0 to 2.0"),
    ({"max_tokens": 3}, "'prompt' is missing"),
    ({"prompt": "one " * 200}, "shorten it"),
    ({"prompt": "one", "temperature": 0, "top_p": 0.5}, "'top_p' shapes sampling, and 'temperature' 0"),
    ({"prompt": "one", "temperature": 0, "top_k": 5}, "'top_k' shapes sampling, and 'temperature' 0"),
    ({"prompt": "one", "top_k": -1}, "'top_k' must be a non-negative integer"),
    ({"prompt": "one", "repetition_penalty": 0}, "'repetition_penalty' must be above 0"),
])
def test_bad_requests_get_422_naming_the_field(url, body, message):
    answer = httpx.post(f"{url}/v1/completions", json=body)
    assert answer.status_code == 422
    assert message in answer.text
