"""Hostile input to the language-model surface: `Generator`, `aiayn generate` and `POST /v1/completions`.

Bad input gets one line naming the problem and the fix (exit code 2 on the command line, a 4xx over HTTP), never
a traceback; what is answered follows the prompt exactly, and a request's answer does not depend on the requests
batched with it. Tiny models only.
"""

import io
import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

import aiayn
import aiayn.nn.sizes
from aiayn.cli.main import main
from aiayn.config import ModelConfig
from aiayn.inference.generation import GenerationConfig, continue_prompts
from aiayn.io import save_model
from aiayn.nn import build_model
from aiayn.serve import create_app
from aiayn.serve.models import batched_call
from aiayn.serve.workers import WorkerPool
from aiayn.tokenization import train_tokenizer
from tests.serving import serving

TEXT = ["one two three four five six", "seven eight nine ten", "two three four five", "café, naïve — déjà vu"]
MAX_LEN = 24


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """A tiny decoder-only model directory (`lm`) and an encoder-decoder one (`tr`)."""
    root = tmp_path_factory.mktemp("models")
    tokenizer = train_tokenizer(TEXT * 5, vocab_size=300)
    torch.manual_seed(0)
    common = dict(vocab_size=tokenizer.vocab_size, d_model=16, n_heads=2, d_ff=32, dropout=0.0, max_len=MAX_LEN,
                  pad_id=tokenizer.pad_id)
    save_model(build_model(ModelConfig(**common, n_encoder_layers=2, n_decoder_layers=0, causal=True)), root / "lm",
               tokenizer=tokenizer)
    save_model(build_model(ModelConfig(**common, n_encoder_layers=1, n_decoder_layers=1)), root / "tr",
               tokenizer=tokenizer)
    return root


@pytest.fixture(scope="module")
def generator(dirs):
    return aiayn.load(dirs / "lm")


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# -- the Python API ----------------------------------------------------------------------------------

@pytest.mark.parametrize("prompt", ["", " ", "   ", "\t", "one\r\ntwo", "\r\n", "one\n", "😀 one", "שלום one",
                                    "one\x00two", "\x07\x1b[31m", "e\u0301", "\ufeffone", "🏳️\u200d🌈", "one  two "])
def test_the_continuation_follows_any_prompt_exactly(generator, prompt):
    tokenizer = generator.tokenizer
    completion = generator.generate(prompt, max_new_tokens=4)[0]
    ids = tokenizer.encode(prompt, add_bos=True)
    assert tokenizer.decode(ids + completion.tokens) == prompt + completion.text


def test_a_prompt_too_long_is_named_before_any_work(generator):
    long = "one " * MAX_LEN
    with pytest.raises(ValueError, match=r"prompt 2 has \d+ tokens with <s>, .* at most 24 positions .*shorten it"):
        generator.generate(["one", long])


def test_a_beam_wider_than_the_vocabulary_is_refused(generator):
    vocab = generator.model.config.vocab_size
    with pytest.raises(ValueError, match=rf"num_beams {vocab + 1} is more than the target vocabulary \({vocab}"):
        generator.generate("one", num_beams=vocab + 1)


def test_a_search_that_would_not_fit_in_memory_is_refused_first(generator, monkeypatch):
    monkeypatch.setattr(aiayn.nn.sizes, "available_memory", lambda: 10_000)
    with pytest.raises(MemoryError, match=r"decoding 1 prompt with beam 8 needs about .* fewer prompts a batch "
                                          r"\(--max-tokens, --max-sentences\)"):
        generator.generate("one", num_beams=8, max_new_tokens=5)


def test_continue_prompts_refuses_ids_outside_the_vocabulary(generator):
    vocab = generator.model.config.vocab_size
    with pytest.raises(ValueError, match=rf"prompt ids must be in the vocabulary \(0 to {vocab - 1}\)"):
        continue_prompts(generator.model, torch.tensor([[1, vocab]]), eos_id=generator.tokenizer.eos_id)


def test_a_tiny_temperature_samples_the_most_likely_token(generator):
    greedy = generator.generate("one two", max_new_tokens=5)[0]
    for temperature in (1e-30, 1e-300):
        sampled = generator.generate("one two", max_new_tokens=5, do_sample=True, temperature=temperature, seed=1)
        assert sampled[0].tokens == greedy.tokens


def test_ended_says_whether_the_model_ended_the_text(generator):
    # max_new_tokens far beyond the positions: the continuation stops at max_len, and that is not an ending
    prompt = "one two three"
    length = len(generator.tokenizer.encode(prompt, add_bos=True))
    completion = generator.generate(prompt, max_new_tokens=10**6)[0]
    ids = torch.tensor([generator.tokenizer.encode(prompt, add_bos=True)])
    expected = continue_prompts(generator.model, ids, eos_id=generator.tokenizer.eos_id,
                                config=GenerationConfig(max_new_tokens=MAX_LEN)).tokens[0]
    assert completion.tokens == expected
    assert completion.ended == (len(expected) < MAX_LEN - length)


def test_extra_len_0_still_gives_a_token(generator):
    completion = generator.generate("one", GenerationConfig(extra_len=0))[0]
    assert len(completion.tokens) == 1 or completion.ended


@pytest.mark.parametrize("precision", ["int8", "bf16"])
def test_other_precisions_generate_on_this_cpu(dirs, precision):
    generator = aiayn.Generator.from_pretrained(dirs / "lm", precision=precision)
    for completion in generator.generate(["one two", "seven"], max_new_tokens=3, num_beams=2):
        assert len(completion.tokens) <= 3


# -- the command line --------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["generate", "--run", "{tr}", "hello"], r"tr holds a translation model \(encoder-decoder\): use aiayn translate"),
    (["translate", "--run", "{lm}", "hello"], r"lm's model is decoder-only; translate needs.*continue text with aiayn"),
    (["embed", "--model", "{lm}", "hello"], r"lm holds a decoder-only language model .*embedding needs an encoder"),
    (["similarity", "--model", "{lm}", "a", "b"], r"lm holds a decoder-only language model"),
    (["trace", "--run", "{lm}", "hello"], r"this is a decoder-only language model: continue text with it"),
    (["predict", "--run", "{lm}", "hello"], r"use aiayn generate --run"),
    (["generate", "--run", "{lm}", "one", "--num-beams", "400"], r"num_beams 400 is more than the target vocabulary"),
    (["generate", "--run", "{lm}", "one", "--num-beams", "2", "--sample"], r"--sample draws one continuation"),
    (["generate", "--run", "{lm}", "one", "--sample", "--seed", "-1"], r"--seed must be at least 0"),
    (["generate", "--run", "{lm}", "one", "--sample", "--temperature", "0"], r"--temperature must be above 0"),
    (["generate", "--run", "{lm}", "one", "--max-new-tokens", "0"], r"--max-new-tokens must be at least 1"),
    (["generate", "--run", "{lm}", "one", "--top-k", "5"],
     r"top_k=5 shapes sampling only: set do_sample=True \(--sample"),
    (["generate", "--run", "{lm}", "one", "--top-p", "0.5", "--temperature", "0.7"],
     r"temperature=0.7 and top_p=0.5 shape sampling only"),
    (["translate", "--run", "{tr}", "one", "--top-k", "3"], r"top_k=3 shapes sampling only"),
    (["generate", "--run", "{lm}", "one", "one " * MAX_LEN], r"prompt 2 has \d+ tokens with <s>"),
    (["generate", "--run", "{empty}", "one"], r"empty is not an aiayn model directory: config.json is missing"),
    (["generate", "--run", "{lm}", "--input", "{empty}"], r"input file .*empty is a directory; give a file"),
    (["generate", "--run", "{lm}", "one", "--max-tokens", "0"], r"--max-tokens must be at least 1"),
    (["generate", "--run", "{lm}", "one", "--max-sentences", "-1"], r"--max-sentences must be at least 0"),
])
def test_cli_refusals_are_one_line_with_exit_code_2(dirs, capsys, argv, message):
    (dirs / "empty").mkdir(exist_ok=True)
    before = {p: p.read_bytes() for p in dirs.rglob("*") if p.is_file()}
    code, out, err = run_cli(capsys, *[a.format(lm=dirs / "lm", tr=dirs / "tr", empty=dirs / "empty") for a in argv])
    assert code == 2 and re.search(message, err), err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert {p: p.read_bytes() for p in dirs.rglob("*") if p.is_file()} == before


def test_stdin_with_blank_lines_gives_one_line_per_prompt(dirs, generator, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"one\n\n\ntwo\r\n")))
    code, out, err = run_cli(capsys, "generate", "--run", str(dirs / "lm"), "--max-new-tokens", "3", "--only-new")
    expected = generator.generate(["one", "", "", "two"], max_new_tokens=3)
    assert code == 0
    assert out.splitlines() == [c.text.replace("\r", " ").replace("\n", " ") for c in expected]


@pytest.mark.parametrize("batching", [["--max-sentences", "1"], ["--max-tokens", "3"], ["--batch-size", "2"]])
def test_batch_options_change_no_output_line(dirs, capsys, batching):
    prompts = ["one two three", "seven", "one two", "eight nine ten", "seven", "two"]
    argv = ["generate", "--run", str(dirs / "lm"), "--max-new-tokens", "5", *prompts]
    code, together, _ = run_cli(capsys, *argv)
    assert code == 0 and len(together.splitlines()) == len(prompts)
    assert run_cli(capsys, *argv, *batching)[:2] == (0, together)


def test_large_max_new_tokens_stops_at_the_positions(dirs, capsys):
    code, out, _ = run_cli(capsys, "generate", "--run", str(dirs / "lm"), "one", "--max-new-tokens", "100000000")
    assert code == 0 and out.startswith("one")


# -- POST /v1/completions --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def url(dirs, generator):
    with serving(create_app({"lm": generator, "tr": aiayn.load(dirs / "tr")})) as base:
        yield base


@pytest.mark.parametrize("body, status, message", [
    ({"prompt": ["one", 3]}, 422, "a list holding a non-string"),
    ({"prompt": [[1, 2]]}, 422, "a list holding a non-string"),
    ({"prompt": []}, 422, "an empty list"),
    ({"prompt": "one", "stop": ""}, 422, "non-empty strings"),
    ({"prompt": "one", "stop": 0}, 422, "'stop' must be a string"),
    ({"prompt": "one", "stop": False}, 422, "'stop' must be a string"),
    ({"prompt": "one", "stop": ["a", "b", "c", "d", "e"]}, 422, "at most 4"),
    ({"prompt": "one", "n": True}, 422, "'n' must be 1"),
    ({"prompt": "one", "n": 1.0}, 422, "'n' must be 1"),
    ({"prompt": "one", "stream": 1}, 422, "'stream' must be true or false"),
    ({"prompt": "one", "logprobs": 2}, 422, "'logprobs' is not supported"),
    ({"prompt": "one", "best_of": 3}, 422, "'best_of' is not supported"),
    ({"prompt": "one", "suffix": "x"}, 422, "'suffix' is not supported"),
    ({"prompt": "one", "presence_penalty": 1.5}, 422, "'presence_penalty' is not supported"),
    ({"prompt": "one", "logit_bias": {"50": -100}}, 422, "'logit_bias' is not supported"),
    ({"prompt": "one", "seed": -1}, 422, "'seed' must be a non-negative integer"),
    ({"prompt": "one", "seed": 2**80, "temperature": 1}, 422, "'seed' must be at most 9,223,372,036,854,775,807"),
    ({"prompt": "one", "temperature": 0, "top_p": 0}, 422, "'top_p' must be above 0"),
    ({"prompt": "one", "model": "tr"}, 404, "the model 'tr' is a translate model, not a complete one"),
])
def test_bad_completion_requests_get_a_4xx_naming_the_field(url, body, status, message):
    answer = httpx.post(f"{url}/v1/completions", json=body)
    assert answer.status_code == status and message in answer.json()["error"]


def test_openai_off_values_of_unsupported_fields_are_accepted(url):
    body = {"prompt": "one", "max_tokens": 2, "stream": False, "logprobs": None, "best_of": 1, "presence_penalty": 0,
            "frequency_penalty": 0.0, "logit_bias": {}, "n": 1, "user": "me"}
    assert httpx.post(f"{url}/v1/completions", json=body).status_code == 200


def test_a_tiny_temperature_is_answered(url, generator):
    answer = httpx.post(f"{url}/v1/completions", json={"prompt": "one", "temperature": 1e-300, "max_tokens": 3})
    assert answer.status_code == 200
    assert answer.json()["choices"][0]["text"] == generator.generate("one", max_new_tokens=3)[0].text


def test_huge_max_tokens_ends_at_the_positions_with_finish_reason_length(url, generator):
    answer = httpx.post(f"{url}/v1/completions", json={"prompt": "one", "max_tokens": 10**9, "temperature": 0})
    expected = generator.generate("one", max_new_tokens=4096)[0]
    choice = answer.json()["choices"][0]
    assert choice["text"] == expected.text
    assert choice["finish_reason"] == ("stop" if expected.ended else "length")


@pytest.mark.parametrize("stop", [["caf", " caf"], ["f c", "caf"], "x" * 500, ["\ufffd"]])
def test_stop_strings_cut_the_text_at_the_first(url, generator, stop):
    body = {"prompt": "one", "max_tokens": 8, "temperature": 0, "stop": stop}
    text = generator.generate("one", max_new_tokens=8)[0].text
    stops = [stop] if isinstance(stop, str) else stop
    ends = [text.find(s) for s in stops if s in text]
    cut = text[: min(ends)] if ends else text
    for echo in (False, True):
        choice = httpx.post(f"{url}/v1/completions", json={**body, "echo": echo}).json()["choices"][0]
        assert choice["text"] == ("one" if echo else "") + cut
        if ends:
            assert choice["finish_reason"] == "stop"


def test_concurrent_requests_each_get_what_the_generator_gives_alone(url, generator):
    requests = [({"prompt": p, "max_tokens": 5, "temperature": t, "seed": s}, p, t, s)
                for p in ("one", "two", "seven eight", "")
                for t, s in ((0, None), (0.7, 4), (1.3, 9))]

    def send(request):
        return httpx.post(f"{url}/v1/completions", json=request[0], timeout=60).json()["choices"][0]["text"]

    with ThreadPoolExecutor(8) as threads:
        answers = list(threads.map(send, requests * 2))
    for (_, prompt, temperature, seed), answer in zip(requests * 2, answers):
        settings = {"do_sample": True, "temperature": temperature, "seed": seed} if temperature else {}
        assert answer == generator.generate(prompt, max_new_tokens=5, **settings)[0].text


def test_a_worker_pool_serves_a_generator(dirs, generator):
    pool = WorkerPool({"lm": str(dirs / "lm")}, 2, batched_call=batched_call)
    pool.start()
    with serving(create_app({"lm": generator}, passes=2, pool=pool)) as base:
        bodies = [{"prompt": ["one two", "seven"], "max_tokens": 4, "temperature": 0},
                  {"prompt": "one", "max_tokens": 4, "temperature": 0.8, "seed": 3}]
        with ThreadPoolExecutor(2) as threads:
            answers = list(threads.map(lambda b: httpx.post(f"{base}/v1/completions", json=b, timeout=120), bodies))
        greedy = [c["text"] for c in answers[0].json()["choices"]]
        assert greedy == [c.text for c in generator.generate(["one two", "seven"], max_new_tokens=4)]
        sampled = answers[1].json()["choices"][0]["text"]
        assert sampled == generator.generate("one", max_new_tokens=4, do_sample=True, temperature=0.8, seed=3)[0].text
    assert os.path.isdir(dirs / "lm")
