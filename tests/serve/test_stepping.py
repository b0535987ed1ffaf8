"""Serving at the step (`aiayn.serve.stepping`): requests join a running batch and leave it when their own search
ends; a short request is answered before a long one that started first; a full queue answers 429 and a client that
goes away leaves; completions stream as OpenAI's client reads them, equal to the answer not streamed."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

import aiayn
from aiayn.config import ModelConfig
from aiayn.inference.generator import Generator
from aiayn.inference.running import RunningBatch
from aiayn.inference.translator import Translator
from aiayn.nn import build_model
from aiayn.serve import Limits, create_app
from aiayn.tokenization import train_tokenizer
from tests.serving import metric, serving, wait_until

TEXT = ["one two three four five six", "seven eight nine ten", "two three four five"]


@pytest.fixture(scope="module")
def translator(translation_run):
    return aiayn.load(str(translation_run))


@pytest.fixture(scope="module")
def generator():
    """A random language model whose tokenizer has no byte fallback: every token it writes is whole text, so a stream
    has text to send before its end."""
    tokenizer = train_tokenizer(TEXT * 5, vocab_size=60, kind="subword-nmt")
    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=tokenizer.vocab_size, d_model=16, n_heads=2, d_ff=32,
                                    n_encoder_layers=2, n_decoder_layers=0, dropout=0.0, causal=True, max_len=48,
                                    pad_id=tokenizer.pad_id))
    return Generator(model, tokenizer)


@pytest.fixture
def slow_steps(monkeypatch):
    """Each step of a running batch takes at least 20 ms: a request's time is its steps."""
    step = RunningBatch.step

    def slow(self):
        time.sleep(0.02)
        step(self)
    monkeypatch.setattr(RunningBatch, "step", slow)


def test_requests_of_every_length_at_once_get_what_the_translator_gives_each_alone(translator):
    texts = ["a b", "h g f e d c b a h g f e", "naïve café", "", "c d e f g", "b"] * 2
    with serving(create_app({"en-de": translator})) as url, ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda text: httpx.post(f"{url}/translate", json={"q": text, "target": "de"},
                                                        timeout=60).json()["translatedText"], texts))
        assert metric(url, "aiayn_steps_total", 'model="en-de"') > 0
    assert answers == [translator.translate(text) for text in texts]


@pytest.fixture(scope="module")
def untrained():
    """A translator whose random model writes until its length limit (the source's length + 50)."""
    tokenizer = train_tokenizer(TEXT * 5, vocab_size=300)
    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=tokenizer.vocab_size, d_model=16, n_heads=2, d_ff=32,
                                    n_encoder_layers=1, n_decoder_layers=1, dropout=0.0, max_len=160,
                                    pad_id=tokenizer.pad_id))
    return Translator(model, tokenizer)


def test_a_short_request_is_answered_while_a_long_one_that_came_first_decodes(untrained, slow_steps):
    translator = untrained
    long_texts = [" ".join(TEXT * 4)] * 3  # about 60 tokens: 110 steps
    assert len(translator.translations(long_texts[:1])[0].tokens) > 100
    assert len(translator.translations(["one"])[0].tokens) < 60
    with serving(create_app({"en-de": translator})) as url, ThreadPoolExecutor(2) as pool:
        long = pool.submit(httpx.post, f"{url}/translate", json={"q": long_texts, "target": "de"}, timeout=120)
        wait_until(lambda: metric(url, "aiayn_running_rows", 'model="en-de"') > 0, every=0.01)
        short = httpx.post(f"{url}/translate", json={"q": "one", "target": "de"}, timeout=120)
        assert short.json()["translatedText"] == translator.translate("one")
        assert not long.done()  # the short request joined the long one's batch and left it first
        assert long.result().json()["translatedText"] == translator.translate(long_texts)


def test_a_full_queue_answers_429_and_a_client_that_goes_away_leaves(translator, monkeypatch):
    hold, joined = threading.Event(), threading.Semaphore(0)
    step = RunningBatch.step

    def held(self):
        joined.release()
        hold.wait(timeout=60)
        step(self)
    monkeypatch.setattr(RunningBatch, "step", held)
    app = create_app({"en-de": translator}, limits=Limits(max_queue=3), passes=1)
    with serving(app) as url, ThreadPoolExecutor(2) as pool:
        first = pool.submit(httpx.post, f"{url}/translate", json={"q": "a b", "target": "de"}, timeout=60)
        assert joined.acquire(timeout=30)  # the first request is stepping (held); 3 texts then wait
        gone = pool.submit(httpx.post, f"{url}/translate", json={"q": ["c", "d", "e"], "target": "de"}, timeout=1)
        wait_until(lambda: metric(url, "aiayn_queue_texts", 'model="en-de"') == 3)
        full = httpx.post(f"{url}/translate", json={"q": "f", "target": "de"})
        assert full.status_code == 429 and "retry later" in full.json()["error"]
        with pytest.raises(httpx.TimeoutException):
            gone.result()
        wait_until(lambda: metric(url, "aiayn_queue_texts", 'model="en-de"') == 0)  # its parts were cancelled
        hold.set()
        assert first.result().json()["translatedText"] == translator.translate("a b")


def test_the_openai_client_streams_a_completion_equal_to_the_one_not_streamed(generator):
    from openai import OpenAI

    with serving(create_app({"counting": generator})) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused")
        for settings in ({"temperature": 0}, {"temperature": 0.8, "seed": 3}, {"temperature": 0, "stop": ["ve"]}):
            whole = client.completions.create(model="counting", prompt="one two", max_tokens=12, **settings)
            chunks = list(client.completions.create(model="counting", prompt="one two", max_tokens=12, stream=True,
                                                    **settings))
            assert len(chunks) > 2  # token by token, not one answer
            assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
            assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
        # two prompts: each chunk names its choice
        chunks = list(client.completions.create(model="counting", prompt=["one", "seven eight"], max_tokens=6,
                                                temperature=0, stream=True))
        expected = generator.generate(["one", "seven eight"], max_new_tokens=6)
        for i, completion in enumerate(expected):
            assert "".join(c.choices[0].text for c in chunks if c.choices[0].index == i) == completion.text
        assert metric(url, "aiayn_first_token_seconds_count", 'model="counting"') >= 4


def test_streaming_refusals_keep_their_status(generator):
    with serving(create_app({"counting": generator}, stepping=False)) as url:
        out = httpx.post(f"{url}/v1/completions", json={"prompt": "one", "stream": True})
        assert out.status_code == 422 and "running batch" in out.json()["error"]
    with serving(create_app({"counting": generator})) as url:
        out = httpx.post(f"{url}/v1/completions", json={"prompt": "one", "stream": "yes"})
        assert out.status_code == 422 and "'stream' must be true or false" in out.json()["error"]


@pytest.fixture(scope="module")
def in_workers(translation_run, generator, tmp_path_factory):
    """A server whose decoding models run in two worker processes (`--batching steps` on CPU, more than one pass)."""
    from aiayn.io import save_model
    from aiayn.serve.models import stepped_parts
    from aiayn.serve.stepping_workers import StepWorkers

    lm = save_model(generator.model, tmp_path_factory.mktemp("lm") / "lm", tokenizer=generator.tokenizer)
    sources = {"en-de": str(translation_run), "counting": str(lm)}
    steps = StepWorkers(sources, 2, parts=stepped_parts, tokens_seconds=0)  # every step's tokens sent
    steps.start()
    objects = {name: aiayn.load(source) for name, source in sources.items()}
    with serving(create_app(objects, passes=2, steps=steps)) as url:
        yield url, objects


def test_worker_processes_answer_and_stream_as_the_objects_do(in_workers):
    from openai import OpenAI

    url, objects = in_workers
    texts = ["a b", "h g f e d c b a h g f e", "naïve café", "", "c d e f g", "b"] * 2
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda text: httpx.post(f"{url}/translate", json={"q": text, "target": "de"},
                                                        timeout=60).json()["translatedText"], texts))
    assert answers == [objects["en-de"].translate(text) for text in texts]
    client = OpenAI(base_url=f"{url}/v1", api_key="unused")
    whole = client.completions.create(model="counting", prompt="one two", max_tokens=12, temperature=0)
    chunks = list(client.completions.create(model="counting", prompt="one two", max_tokens=12, temperature=0,
                                            stream=True))
    assert len(chunks) > 2 and "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert whole.choices[0].text == objects["counting"].generate("one two", max_new_tokens=12)[0].text
    wait_until(lambda: metric(url, "aiayn_steps_total", 'model="en-de"') > 0)
    too_long = httpx.post(f"{url}/translate", json={"q": "a " * 5000, "target": "de"})
    assert too_long.status_code in (413, 422)


def test_a_step_worker_that_stops_answering_fails_its_requests_with_one_line_and_is_replaced(translation_run):
    """A step worker frozen by SIGSTOP: `/health` notices, the watchdog kills it, the requests it held are answered 503
    naming why, and a new worker answers the next ones as the translator does."""
    import os
    import signal

    from aiayn.serve.models import stepped_parts
    from aiayn.serve.stepping_workers import StepWorkers

    steps = StepWorkers({"en-de": str(translation_run)}, 1, parts=stepped_parts, silent_s=1.0)
    steps.start()
    translator = aiayn.load(translation_run)
    with serving(create_app({"en-de": translator}, passes=1, steps=steps)) as url:
        frozen = steps._workers[0]
        os.kill(frozen.process.pid, signal.SIGSTOP)
        with ThreadPoolExecutor(2) as pool:
            sent = [pool.submit(httpx.post, f"{url}/translate", json={"q": text, "target": "de"}, timeout=60)
                    for text in ("a b", "c d e")]
            health = []
            wait_until(lambda: health.append(httpx.get(f"{url}/health").json()) or all(f.done() for f in sent),
                       every=0.05)
        assert any(h["status"] == "degraded" for h in health), health
        for answer in (f.result() for f in sent):
            assert answer.status_code == 503
            assert answer.json()["error"].startswith("the worker process running this request stopped answering "
                                                     "(silent for 1 s) and was killed; it was replaced")
        wait_until(lambda: httpx.get(f"{url}/health").json()["status"] == "ok")
        assert httpx.get(f"{url}/health").json()["workers"] == {"processes": 1, "answering": 1, "replaced": 1}
        answer = httpx.post(f"{url}/translate", json={"q": "h g f e", "target": "de"}, timeout=60)
        assert answer.json()["translatedText"] == translator.translate("h g f e")


def test_the_serving_guides_streaming_example_runs(generator, capsys):
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "serving.md").read_text(encoding="utf-8")
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "completions.create" in b]
    assert blocks
    with serving(create_app({"lm": generator})) as url:
        for block in blocks:
            exec(compile(block.replace("http://127.0.0.1:8000", url), "docs/serving.md", "exec"), {})
    assert capsys.readouterr().out == generator.generate("The", max_new_tokens=50)[0].text


def test_large_requests_take_turns_in_a_lane_and_short_ones_pass_them():
    from aiayn.inference.generation import GenerationConfig
    from aiayn.inference.running import Part
    from aiayn.serve.stepping import Job, Lanes

    beam = GenerationConfig(num_beams=4)

    def job(sentences: int) -> Job:
        part = Part(torch.ones(sentences, 5, dtype=torch.long), torch.ones(sentences, 1, dtype=torch.long),
                    torch.full((sentences,), 8), beam, 2, on_done=lambda *a: None, on_error=lambda err: None)
        return Job([part], lambda: [], answered=lambda answer: None, failed=lambda err: None, model="m")

    lanes = Lanes(lambda name: None, large=1)
    first, second, short = job(64), job(64), job(1)  # 256, 256 and 4 rows
    for j in (first, second, short):
        lanes.add(j)
    lanes.assign()
    large, small = lanes.lanes[("m", 4, "large", 0)], lanes.lanes[("m", 4, "small")]
    assert [j for j, _ in large.incoming] == [first] and [j for j, _ in small.incoming] == [short]
    assert [j for j, _ in lanes.waiting] == [second]  # its turn comes when the first leaves
    large.incoming = []
    lanes.assign()
    assert [j for j, _ in large.incoming] == [second] and not lanes.waiting
