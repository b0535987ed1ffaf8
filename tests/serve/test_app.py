"""`aiayn serve`'s routes through real clients: LibreTranslate's and OpenAI's Python clients and plain HTTP; every
answer equals what the loaded object returns for that request alone, in any mix of concurrent requests; the limits
and faults each answered as documented (aiayn/serve/limits.py)."""

import asyncio
import importlib.util
import json
import os
import random
import re
import shlex
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx
import numpy as np
import pytest

import aiayn
from aiayn.serve import Limits, create_app
from aiayn.serve.models import batched_call
from aiayn.serve.workers import WorkerPool
from tests.conftest import CLASSIFIED, SAMPLE_LINES, TAGGED
from tests.serving import metric, serving, wait_until

TEXTS = ["A man is eating food.", "A man eats.", "Someone is having a meal.", "The cat sleeps on the sofa."]


@pytest.fixture(scope="module")
def sources(translation_run, classification_run, tagging_run):
    return {"en-de": str(translation_run), "sentiment": str(classification_run), "ner": str(tagging_run),
            "minilm": "minilm"}


@pytest.fixture(scope="module")
def objects(sources):
    return {name: aiayn.load(source) for name, source in sources.items()}


@pytest.fixture(scope="module")
def pool(sources):
    """Two worker processes holding the same models: how `aiayn serve` runs its passes on a CPU."""
    workers = WorkerPool(sources, 2, batched_call=batched_call)
    workers.start()
    yield workers
    workers.close()


@pytest.fixture(scope="module")
def url(objects, pool):
    with serving(create_app(objects, passes=2, max_wait=0.005, pool=pool)) as base:
        yield base


def test_libretranslate_client_translates_as_the_translator(url, objects):
    from libretranslatepy import LibreTranslateAPI

    client = LibreTranslateAPI(url + "/")
    assert client.languages() == [{"code": "en", "name": "en", "targets": ["de"]}]
    for line in ["a b c", "h g f e", "naïve café"]:
        assert client.translate(line, "en", "de") == objects["en-de"].translate(line)


def test_translate_takes_json_lists_and_form_data(url, objects):
    lines = [line for line in SAMPLE_LINES if line]
    out = httpx.post(f"{url}/translate", json={"q": lines, "source": "en", "target": "de", "format": "text"})
    assert out.status_code == 200 and out.json() == {"translatedText": objects["en-de"].translate(lines)}
    auto = httpx.post(f"{url}/translate", data={"q": "c a", "source": "auto", "target": "de"}).json()
    assert auto == {"translatedText": objects["en-de"].translate("c a"),
                    "detectedLanguage": {"confidence": 100.0, "language": "en"}}


def test_openai_client_gets_the_embedders_vectors(url, objects):
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    expected = objects["minilm"].embed(TEXTS)
    for encoding in ("float", "base64"):  # the client asks for base64 unless told otherwise
        kwargs = {"encoding_format": encoding} if encoding == "float" else {}
        out = client.embeddings.create(input=TEXTS, model="minilm", **kwargs)
        assert [d.index for d in out.data] == [0, 1, 2, 3] and out.model == "minilm"
        assert out.usage.prompt_tokens == sum(len(ids) for ids in objects["minilm"].tokenize(TEXTS))
        np.testing.assert_allclose(np.array([d.embedding for d in out.data]), expected, atol=1e-5)
    one = client.embeddings.create(input="A man eats.", model="minilm")
    np.testing.assert_allclose(one.data[0].embedding, expected[1], atol=1e-5)


def test_tei_embed_and_predict(url, objects):
    vectors = httpx.post(f"{url}/embed", json={"inputs": TEXTS[:2]}).json()
    np.testing.assert_allclose(vectors, objects["minilm"].embed(TEXTS[:2]), atol=1e-5)
    text = CLASSIFIED[1][0]
    labels = httpx.post(f"{url}/predict", json={"inputs": text, "model": "sentiment"}).json()
    expected = objects["sentiment"].predict(text)
    assert labels[0]["label"] == expected.label == "pos" and [item["label"] for item in labels] == ["pos", "neg"]
    assert labels[0]["score"] == pytest.approx(expected.score, abs=1e-6)
    sentence = " ".join(word for word, _ in TAGGED[3])
    tags = httpx.post(f"{url}/predict", json={"inputs": [sentence], "model": "ner"}).json()
    assert [[item["entity"] for item in row] for row in tags] == [[t.tag for t in objects["ner"].predict(sentence)]]


def test_health_models_and_metrics(url):
    health = httpx.get(f"{url}/health").json()
    assert health["status"] == "ok"
    assert {m["name"]: m["kind"] for m in health["models"]} == {"en-de": "translate", "sentiment": "predict",
                                                               "ner": "predict", "minilm": "embed"}
    assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == ["en-de", "sentiment", "ner", "minilm"]
    httpx.post(f"{url}/translate", json={"q": "a b", "target": "de"})
    text = httpx.get(f"{url}/metrics").text
    for line in ("# TYPE aiayn_requests_total counter", "# TYPE aiayn_request_seconds histogram",
                 'aiayn_queue_texts{model="en-de"}', "# TYPE aiayn_batch_texts histogram",
                 'aiayn_tokens_total{model="en-de"}'):
        assert line in text
    assert metric(url, "aiayn_requests_total", 'route="/translate",status="200"') >= 1


def test_concurrent_mixed_requests_each_equal_the_object_alone(url, objects):
    rng = random.Random(0)
    lines = [line for line in SAMPLE_LINES if line] + ["a", "g g g g g g g", "f e d c b a"]
    sentences = [" ".join(w for w, _ in s) for s in TAGGED[:6]]
    requests = []
    for i in range(48):
        kind = ["translate", "embed", "classify", "tag"][i % 4]
        many = rng.random() < 0.5
        pool = {"translate": lines, "embed": TEXTS, "classify": [t for t, _ in CLASSIFIED[:8]], "tag": sentences}[kind]
        texts = rng.sample(pool, rng.randint(2, 3)) if many else rng.choice(pool)
        requests.append((kind, texts))
    before = metric(url, "aiayn_batch_texts_count", 'model="en-de"')

    def send(request):
        kind, texts = request
        with httpx.Client(timeout=60) as client:
            if kind == "translate":
                return client.post(f"{url}/translate", json={"q": texts, "source": "en", "target": "de"}).json()
            if kind == "embed":
                return client.post(f"{url}/v1/embeddings", json={"input": texts, "model": "minilm"}).json()
            model = "sentiment" if kind == "classify" else "ner"
            return client.post(f"{url}/predict", json={"inputs": texts, "model": model}).json()

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(send, requests))
    for (kind, texts), answer in zip(requests, answers):
        if kind == "translate":
            assert answer["translatedText"] == objects["en-de"].translate(texts)
        elif kind == "embed":
            got = np.array([d["embedding"] for d in answer["data"]])
            np.testing.assert_allclose(got, np.atleast_2d(objects["minilm"].embed(texts)), atol=1e-5)
        elif kind == "classify":
            alone = objects["sentiment"].predict(texts)
            rows, alone = (answer, alone) if isinstance(texts, list) else ([answer], [alone])
            assert [row[0]["label"] for row in rows] == [p.label for p in alone]
        else:
            alone = objects["ner"].predict(texts)
            rows = answer if isinstance(texts, list) else [answer]
            alone = alone if isinstance(texts, list) else [alone]
            assert [[item["entity"] for item in row] for row in rows] == [[t.tag for t in tags] for tags in alone]
    translated = sum(len(t) if isinstance(t, list) else 1 for k, t in requests if k == "translate")
    assert metric(url, "aiayn_batch_texts_count", 'model="en-de"') - before <= translated
    for name in objects:  # nothing is kept once every request is answered
        assert metric(url, "aiayn_queue_texts", f'model="{name}"') == 0


@pytest.mark.parametrize(("body", "status", "message"), [
    (b"{not json", 400, "not valid JSON"),
    (b'["a list"]', 422, "must be a JSON object"),
    (b'{"target": "de"}', 422, "'q' is missing"),
    (b'{"q": 3, "target": "de"}', 422, "must be a string or a list of strings, got int"),
    (b'{"q": ["a", 3], "target": "de"}', 422, "a list holding a non-string"),
    (b'{"q": [], "target": "de"}', 422, "empty list"),
    (b'{"q": "a", "target": "de", "format": "pdf"}', 422, "'format' must be one of text, html"),
    (b'{"q": "' + b"a b c d e f g h " * 12 + b'", "target": "de"}', 422, "more than the model's max_len"),
])
def test_malformed_requests_get_one_clear_message(url, body, status, message):
    out = httpx.post(f"{url}/translate", content=body, headers={"Content-Type": "application/json"})
    assert out.status_code == status and message in out.json()["error"]


def test_unknown_models_and_languages_are_404(url):
    out = httpx.post(f"{url}/v1/embeddings", json={"input": "x", "model": "nope"})
    assert out.status_code == 200  # one embedder: it answers whatever the model's name
    out = httpx.post(f"{url}/predict", json={"inputs": "x", "model": "nope"})
    assert out.status_code == 404 and "sentiment, ner" in out.json()["error"]


@pytest.fixture
def small(objects):
    """A server of the translator alone with tight limits, batching whole requests; its batches can be held back
    (`hold.clear()`)."""
    app = create_app({"en-de": objects["en-de"]}, limits=Limits(max_body_bytes=2000, max_texts=4, max_chars=50,
                                                                  max_queue=3), passes=1, stepping=False)
    served = app.state.models[0]
    hold, entered, seen, run = threading.Event(), threading.Semaphore(0), [], served.batcher.run
    hold.set()

    def held(texts, *on_result):  # (a translator's batcher also passes the callback that answers text by text)
        entered.release()
        hold.wait(timeout=60)
        seen.extend(texts)
        if "boom" in texts:
            raise RuntimeError("boom")
        return run(texts, *on_result)

    served.batcher.run = held
    with serving(app) as base:
        yield base, hold, entered, seen
    hold.set()


def test_limits_answer_413(small):
    url = small[0]
    too_big = httpx.post(f"{url}/translate", content=b'{"q": "' + b"a" * 3000 + b'"}',
                         headers={"Content-Type": "application/json"})
    assert too_big.status_code == 413 and "limit of 2000" in too_big.json()["error"]
    many = httpx.post(f"{url}/translate", json={"q": ["a"] * 5, "target": "de"})
    assert many.status_code == 413 and "5 texts" in many.json()["error"]
    long = httpx.post(f"{url}/translate", json={"q": "a" * 51, "target": "de"})
    assert long.status_code == 413 and "51 characters" in long.json()["error"]


def test_a_full_queue_answers_429_and_a_gone_client_frees_its_place(small):
    url, hold, entered, seen = small
    hold.clear()
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(httpx.post, f"{url}/translate", json={"q": "a b", "target": "de"}, timeout=60)
        assert entered.acquire(timeout=30)
        # the first batch is running (held); this client queues 3 texts, then goes away
        gone = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])))
        body = b'{"q": ["c", "d", "e"], "target": "de"}'
        gone.sendall(b"POST /translate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        wait_until(lambda: metric(url, "aiayn_queue_texts", 'model="en-de"') == 3)
        full = httpx.post(f"{url}/translate", json={"q": "f", "target": "de"})
        assert full.status_code == 429 and "retry later" in full.json()["error"]
        gone.close()
        wait_until(lambda: metric(url, "aiayn_queue_texts", 'model="en-de"') == 0)
        hold.set()
        assert first.result().status_code == 200
    assert "c" not in seen  # the job of the client that left never ran


def test_an_error_in_one_request_fails_only_that_request(small, objects):
    url, hold, entered, _ = small
    hold.clear()
    with ThreadPoolExecutor(3) as pool:
        blocker = pool.submit(httpx.post, f"{url}/translate", json={"q": "h", "target": "de"}, timeout=60)
        assert entered.acquire(timeout=30)
        bad = pool.submit(httpx.post, f"{url}/translate", json={"q": "boom", "target": "de"}, timeout=60)
        good = pool.submit(httpx.post, f"{url}/translate", json={"q": "h g f e", "source": "en", "target": "de"},
                           timeout=60)
        wait_until(lambda: metric(url, "aiayn_queue_texts", 'model="en-de"') == 2)  # batched together
        hold.set()
        assert bad.result().status_code == 500 and "boom" in bad.result().json()["error"]
        assert good.result().json() == {"translatedText": objects["en-de"].translate("h g f e")}
        assert blocker.result().status_code == 200
    assert httpx.get(f"{url}/health").json()["status"] == "ok"


def readme_curl_lines() -> list[str]:
    """The `curl` lines of the README's "## Serving" section."""
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    section = text.split("## Serving", 1)[1].split("\n## ", 1)[0]
    return [line for block in re.findall(r"```sh\n(.*?)```", section, re.S) for line in block.splitlines()
            if line.startswith("curl ")]


def curl(line: str, url: str) -> httpx.Response:
    """What `curl -s URL [-H HEADER] [-d DATA]` sends (a -d body is form data unless a header says otherwise)."""
    words = shlex.split(line)[1:]
    headers, data, target = {"Content-Type": "application/x-www-form-urlencoded"}, None, None
    while words:
        word = words.pop(0)
        if word == "-H":
            key, _, value = words.pop(0).partition(":")
            headers[key.strip()] = value.strip()
        elif word == "-d":
            data = words.pop(0)
        elif word != "-s":
            target = word.replace("localhost:8000", url)
    if data is None:
        return httpx.get(target)
    return httpx.post(target, content=data.encode(), headers=headers)


def test_the_readme_curl_lines_work(url):
    lines = readme_curl_lines()
    routes = {shlex.split(line)[2].split("8000", 1)[1] for line in lines}
    assert routes == {"/translate", "/languages", "/v1/embeddings", "/embed", "/predict", "/health", "/metrics"}
    for line in lines:
        out = curl(line, url)
        assert out.status_code == 200, (line, out.text)


def test_the_serving_guides_python_example_runs(url, objects):
    text = (Path(__file__).resolve().parents[2] / "docs" / "serving.md").read_text(encoding="utf-8")
    scope: dict = {}
    for block in re.findall(r"```python\n(.*?)```", text, re.S):
        if "completions.create" in block:  # a language model's: tests/serve/test_stepping.py runs it
            continue
        exec(compile(block.replace("http://127.0.0.1:8000", url), "docs/serving.md", "exec"), scope)
    np.testing.assert_allclose(scope["vectors"], objects["minilm"].embed(["A man eats."]), atol=1e-5)


def test_a_worker_sends_each_translation_as_its_search_ends(pool, objects):
    texts = ["h g f e d c b a", "a b", "", "c d e"]
    heard = []
    answer = pool.call("en-de", texts, {"max_tokens": 4096}, on_result=lambda i, text: heard.append((i, text)))
    assert answer == objects["en-de"].translate(texts)
    assert sorted(heard) == sorted(enumerate(answer))
    assert pool.call("en-de", texts, {"max_tokens": 4096}) == answer  # without a listener, no parts are sent


def test_a_listener_that_raises_leaves_the_worker_in_step_for_the_next_batch(pool, objects):
    # (found in review) the rest of the batch's parts and its answer are still read, then the listener's error
    # raised: the next batch on that worker gets its own answer, not the last one's
    texts = ["a b c d e f g h", "b", "c c", "d e f", "h h h h"]

    def listener(i, result):
        raise RuntimeError("Event loop is closed")

    for _ in range(pool.size):  # (every worker once)
        with pytest.raises(RuntimeError, match="loop is closed"):
            pool.call("en-de", texts, {"max_tokens": 4096}, on_result=listener)
    for _ in range(pool.size):
        assert pool.call("en-de", ["h g f e"], {"max_tokens": 4096}) == objects["en-de"].translate(["h g f e"])


def test_a_worker_process_that_dies_is_replaced_and_fails_at_most_its_batch(url, pool, objects, monkeypatch):
    # (the translator decodes in the server's running batch; an embedder's batches go to the workers)
    texts = ["h g f e", "a b"]
    expected = [list(map(float, v)) for v in objects["minilm"].embed(texts)]
    request = {"inputs": texts}
    # A request is answered as soon as its sentences are, so a worker may still be finishing the batch of the
    # last answer: wait until both are back before killing one "while idle".
    wait_until(lambda: pool._idle.qsize() == pool.size)
    idle = pool._workers[1]  # killed while idle: replaced before it takes a batch
    idle.process.kill()
    idle.process.join()
    def close(answer) -> bool:
        return all(abs(a - b) < 1e-5 for got, want in zip(answer, expected) for a, b in zip(got, want))

    for _ in range(4):
        assert close(httpx.post(f"{url}/embed", json=request, timeout=120).json())
    wait_until(lambda: pool._idle.qsize() == pool.size)
    victim = pool._workers[0]  # killed under a batch: that batch fails with one line, the next is answered
    victim.process.kill()
    victim.process.join()
    monkeypatch.setattr(type(victim), "alive", lambda self: True)
    answers = [httpx.post(f"{url}/embed", json=request, timeout=120) for _ in range(3)]
    failed = [a for a in answers if a.status_code != 200]
    assert len(failed) == 1 and all(a.status_code == 503 and a.json()["error"].startswith(
        "the worker process running this batch died (exit code -9); it was replaced") for a in failed)
    assert all(close(a.json()) for a in answers if a.status_code == 200)
    monkeypatch.undo()
    assert all(worker.alive() for worker in pool._workers) and not {idle, victim} & set(pool._workers)
    assert httpx.get(f"{url}/health").json()["status"] == "ok"


def test_a_worker_that_stops_answering_is_noticed_by_health_killed_and_replaced(objects, sources):
    """A worker frozen by SIGSTOP (no exit, no answer) would hold its batch forever: its heartbeat falls silent,
    `/health` says "degraded", the watchdog kills it, the batch fails with one line naming why, a new worker takes
    its place and answers the next request."""
    import signal

    pool = WorkerPool({"sentiment": sources["sentiment"]}, 1, batched_call=batched_call, silent_s=1.0)
    pool.start()
    try:
        with serving(create_app({"sentiment": objects["sentiment"]}, passes=1, pool=pool)) as url:
            assert httpx.get(f"{url}/health").json()["workers"] == {"processes": 1, "answering": 1, "replaced": 0}
            time.sleep(1.5)  # an idle worker stays answering: its heartbeat runs beside its work
            assert httpx.get(f"{url}/health").json()["status"] == "ok"
            frozen = pool._workers[0]
            os.kill(frozen.process.pid, signal.SIGSTOP)
            answers = []
            sender = threading.Thread(target=lambda: answers.append(
                httpx.post(f"{url}/predict", json={"inputs": ["good"]}, timeout=60)))
            sender.start()
            health = []
            wait_until(lambda: health.append(httpx.get(f"{url}/health").json()) or not sender.is_alive(),
                       every=0.05)
            sender.join()
            assert any(h["status"] == "degraded" and h["workers"]["answering"] == 0 for h in health), health
            assert answers[0].status_code == 503
            assert answers[0].json()["error"].startswith("the worker process running this batch stopped answering "
                                                         "(silent for 1 s) and was killed; it was replaced")
            assert frozen.process.exitcode == -signal.SIGKILL and frozen not in pool._workers
            again = httpx.post(f"{url}/predict", json={"inputs": ["good"]}, timeout=60)
            assert again.status_code == 200 and again.json() == httpx.post(
                f"{url}/predict", json={"inputs": ["good"]}, timeout=60).json()
            assert httpx.get(f"{url}/health").json()["workers"] == {"processes": 1, "answering": 1, "replaced": 1}
    finally:
        pool.close()


def test_a_worker_that_cannot_load_its_models_says_why_and_the_pool_stops_the_others(tmp_path):
    import multiprocessing

    others = set(multiprocessing.active_children())  # the workers of the module's server, say
    pool = WorkerPool({"x": str(tmp_path / "missing")}, 2, batched_call=batched_call)
    with pytest.raises(RuntimeError, match="a worker process could not load the models: FileNotFoundError"):
        pool.start()
    assert not set(multiprocessing.active_children()) - others
    pool.close()


def test_the_serving_benchmarks_client_reads_each_answer_whole_and_names_a_refusal(url, objects):
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "serve.py"
    spec = importlib.util.spec_from_file_location("bench_serve", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    host, port = re.match(r"http://([\d.]+):(\d+)", url).groups()

    async def main():
        connection = bench.Connection(host, int(port))
        try:  # one keep-alive connection, several answers in a row, each read whole
            answers = [await connection.post("/translate", {"q": q, "source": "en", "target": "de"})
                       for q in ("a b c", "h g f e", "naïve café")]
            with pytest.raises(RuntimeError, match="answered HTTP/1.1 422"):
                await connection.post("/translate", {"source": "en", "target": "de"})
            after = await connection.post("/translate", {"q": "a b", "source": "en", "target": "de"})
        finally:
            connection.close()
        latencies, sent = await bench.load(url, "/translate", "q", ["a b c", "h g f e"], 2, 0.3,
                                           {"source": "en", "target": "de"})
        return answers, after, latencies, sent

    answers, after, latencies, sent = asyncio.run(main())
    assert [json.loads(a)["translatedText"] for a in answers] == objects["en-de"].translate(["a b c", "h g f e",
                                                                                             "naïve café"])
    assert json.loads(after)["translatedText"] == objects["en-de"].translate("a b")
    assert sent and len(latencies) == len(sent)
