"""`aiayn serve` as a command: its help, its one-line errors, and SIGTERM draining the requests in flight."""

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from aiayn.backends import usable_cores
from aiayn.cli.main import main
from tests.serving import metric, wait_until

ROOT = Path(__file__).resolve().parents[2]


def test_help_names_every_route(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["serve", "--help"])
    assert stop.value.code == 0
    text = capsys.readouterr().out
    for word in ("/translate", "/languages", "/v1/embeddings", "/embed", "/predict", "/metrics", "--run", "--model",
                 "--host", "--port", "SIGTERM", "cores"):
        assert word in text


def test_nothing_to_serve_and_clashing_names_are_one_line_errors(capsys, translation_run):
    assert main(["serve"]) == 2
    assert capsys.readouterr().err.strip() == ("aiayn serve: error: nothing to serve: give --run DIR and/or "
                                               "--model minilm")
    assert main(["serve", "--run", f"x={translation_run}", "--run", f"x={translation_run}"]) == 2
    assert "two models share a name" in capsys.readouterr().err


def children(pid: int) -> list[int]:
    """The child processes of `pid` (Linux's /proc)."""
    listed = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(child) for child in listed.read_text().split()] if listed.exists() else []


@pytest.mark.parametrize("stop, batching", [(signal.SIGTERM, "requests"), (signal.SIGHUP, "requests"),
                                            (signal.SIGQUIT, "requests"), (signal.SIGTERM, "steps")])
def test_a_stopping_signal_answers_the_requests_in_flight_then_exits(translation_run, stop, batching):
    """SIGTERM, a terminal's hang-up and Ctrl-\\ alike: the requests in flight are answered (they got plain 500s on
    SIGHUP and SIGQUIT, which uvicorn does not drain on), then the server stops; a request in a running batch too."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    # batching whole requests, a long gathering window holds the request in the queue while the signal arrives; at the
    # step, a request of many sentences is decoding when it arrives
    server = subprocess.Popen([sys.executable, "-m", "aiayn", "serve", "--run", f"en-de={translation_run}",
                               "--port", "0", "--max-wait-ms", "3000", "--batching", batching], env=env, cwd=ROOT,
                              stderr=subprocess.PIPE, text=True, preexec_fn=lambda: signal.signal(stop, signal.SIG_DFL))
    # (under `nohup make test` SIGHUP would start ignored, and a signal ignored at start stays ignored: by design)
    texts = ["c a", "a b c"] if batching == "requests" else ["h g f e d c b a h g f e"] * 128
    try:
        first = server.stderr.readline()
        found = re.search(r"http://127\.0\.0\.1:(\d+)", first)
        assert found, first
        url = f"http://127.0.0.1:{found.group(1)}"
        answers = []
        sender = threading.Thread(target=lambda: answers.append(
            httpx.post(f"{url}/translate", json={"q": texts, "target": "de"}, timeout=60)))
        sender.start()
        if batching == "requests":
            wait_until(lambda: metric(url, "aiayn_queue_texts", 'model="en-de"') == 2)
        else:  # in flight (this very /metrics request is one): being decoded, unless it was answered already
            wait_until(lambda: answers or metric(url, "aiayn_requests_in_flight") >= 2, every=0.01)
        workers = children(server.pid)
        if usable_cores() > 1:  # on a CPU, a worker process a pass
            spawned = [pid for pid in workers if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
            assert "worker processes" in first and len(spawned) == usable_cores(), (first, workers)
        server.send_signal(stop)
        sender.join(timeout=60)
        assert server.wait(timeout=60) == 0
        wait_until(lambda: not [pid for pid in workers if Path(f"/proc/{pid}").exists()])  # they left with it
        import aiayn

        assert answers[0].status_code == 200
        assert answers[0].json()["translatedText"] == aiayn.load(translation_run).translate(texts)
        assert "stopped after the requests in flight were answered" in server.stderr.read()
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health")
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()



@pytest.mark.parametrize("how, batching", [("drain time", "requests"), ("second signal", "requests"),
                                          ("second signal", "steps")])
def test_requests_the_stopping_server_cuts_are_answered_503_in_its_shape_and_it_says_so(translation_run, how,
                                                                                        batching):
    """When `--drain-seconds` runs out, or a second Ctrl-C comes, the requests still in flight get the server's JSON
    503 (not uvicorn's plain-text 500 and a traceback each), and the last line and exit code say they were cut."""
    if batching == "steps" and usable_cores() < 2:
        pytest.skip("the step workers are processes (held still by SIGSTOP) from two cores")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    drain = "0.3" if how == "drain time" else "30"
    server = subprocess.Popen([sys.executable, "-m", "aiayn", "serve", "--run", f"en-de={translation_run}",
                               "--port", "0", "--max-wait-ms", "10000", "--drain-seconds", drain,
                               "--batching", batching], env=env, cwd=ROOT,
                              stderr=subprocess.PIPE, text=True,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        first = server.stderr.readline()
        url = "http://127.0.0.1:" + re.search(r"http://127\.0\.0\.1:(\d+)", first).group(1)
        answers = []
        # batching whole requests, one request waits in a 10 s gathering window; at the step, the worker processes
        # are held still (SIGSTOP, well within the watchdog's 10 s), so two requests are decoding when the signals come
        texts, requests = (["c a", "a b c"], 1) if batching == "requests" else (["h g f e"], 2)
        held = [pid for pid in children(server.pid) if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        if batching == "steps":
            for pid in held:
                os.kill(pid, signal.SIGSTOP)

        def send() -> None:
            try:
                answers.append(httpx.post(f"{url}/translate", json={"q": texts, "target": "de"}, timeout=60))
            except httpx.HTTPError:  # no longer listening
                pass

        senders = [threading.Thread(target=send) for _ in range(requests)]
        for sender in senders:
            sender.start()
        if batching == "requests":
            wait_until(lambda: metric(url, "aiayn_queue_texts", 'model="en-de"') == 2)
        else:  # sent to the workers (this /metrics request is in flight too)
            wait_until(lambda: metric(url, "aiayn_requests_in_flight") > requests, every=0.01)
        server.send_signal(signal.SIGINT)
        if how == "second signal":
            wait_until(lambda: server.poll() is not None or _refuses(url), every=0.05)
            server.send_signal(signal.SIGINT)
        for sender in senders:
            sender.join(timeout=60)
        if batching == "steps":
            assert len(answers) == requests  # answered while the workers were still held
            for pid in held:
                os.kill(pid, signal.SIGCONT)
        assert server.wait(timeout=60) == 130
        err = server.stderr.read()
        cut = [answer for answer in answers if answer.status_code != 200]
        assert cut and all(answer.status_code == 503 for answer in cut), [a.text for a in cut]
        assert all(answer.json() == {"error": "the server stopped before answering this request; send it again "
                                              "when the server is back"} for answer in cut)
        why = "a second signal came" if how == "second signal" else "--drain-seconds (0.3) ran out"
        n = len(cut)
        assert err.strip().splitlines()[-1] == (f"aiayn serve: stopped before finishing {n} request{'s' * (n > 1)} "
                                                f"in flight (each answered 503): {why}")
        assert "Traceback" not in err and "Exception in ASGI application" not in err, err
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def _refuses(url: str) -> bool:
    """Whether the server at `url` no longer takes connections (it is stopping)."""
    try:
        httpx.get(f"{url}/health", timeout=1)
    except httpx.HTTPError:
        return True
    return False

def test_bench_serve_reports_each_configuration_and_the_ratios(translation_run, capsys):
    from aiayn.cli.bench import load_benchmark

    bench = load_benchmark("serve")
    assert bench.main(["--run", str(translation_run), "--seconds", "1", "--clients", "2", "--skip", "embed"]) == 0
    out = capsys.readouterr().out
    for line in ("aiayn serve (batching)", "one request at a time", "in-process Translator.translate",
                 "batching / one-at-a-time", "batching / in-process", "p99 ms"):
        assert line in out


def test_bench_serve_mixed_runs_the_ctranslate2_peer_behind_the_same_front(translation_run, capsys, tmp_path):
    pytest.importorskip("ctranslate2")
    from aiayn.cli.bench import load_benchmark

    load_benchmark("serve")  # (puts benchmarks/ on the path)
    import serve_mixed

    texts = tmp_path / "texts.txt"
    texts.write_text("".join(f"{' '.join('abcdefgh'[(i + j) % 8] for j in range(2 + i % 6))}\n" for i in range(40)),
                     encoding="utf-8")
    assert serve_mixed.main(["--run", str(translation_run), "--texts", str(texts), "--seconds", "1", "--rates", "2",
                             "--long-texts", "4", "--peer", "ctranslate2", "--skip", "behind"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith("      2 ")]
    assert [row[1] for row in rows] == ["requests", "steps", "ctranslate2"], out
    assert all(float(row[-1]) > 0 for row in rows), out  # sentences answered a second, by each server
