"""`aiayn serve` against hostile input: options out of range and a port it cannot bind fail at once with one line
and nothing left running; connections that send slowly, send too much or go away are bounded and answered as
documented (aiayn/serve/connections.py, limits.py); every error has the server's JSON shape; metrics stay
parseable whatever a model is called."""

import logging
import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

import aiayn
from aiayn.cli.main import main
from aiayn.serve import Limits, create_app
from aiayn.serve.limits import urlencoded_fields
from tests.serving import metric, serving, wait_until

ROOT = Path(__file__).resolve().parents[2]


# -- start-up: every option checked first, the port bound before the workers start, nothing left behind ----------

@pytest.mark.parametrize(("option", "value", "message"), [
    ("--port", "99999", "--port must be at most 65535, got 99999"),
    ("--port", "-1", "--port must be at least 0, got -1"),
    ("--max-tokens", "0", "--max-tokens must be at least 1, got 0"),
    ("--max-wait-ms", "nan", "--max-wait-ms must be a finite number, got nan"),
    ("--max-wait-ms", "-5", "--max-wait-ms must be at least 0, got -5"),
    ("--max-wait-ms", "1e12", "--max-wait-ms must be at most 10000, got 1e+12"),
    ("--max-batch", "-1", "--max-batch must be at least 0, got -1"),
    ("--drain-seconds", "-5", "--drain-seconds must be at least 0, got -5"),
    ("--drain-seconds", "nan", "--drain-seconds must be a finite number, got nan"),
    ("--threads", "0", "--threads must be at least 1, got 0"),
    ("--passes", "100000", "--passes must be at most 1024, got 100000"),
    ("--max-connections", "0", "--max-connections must be at least 1, got 0"),
    ("--read-timeout", "0", "--read-timeout must be at least 0.1, got 0"),
    ("--max-body-bytes", "0", "--max-body-bytes must be at least 1, got 0"),
    ("--cors-origin", "evil.example", "CORS origin 'evil.example' is not an origin"),
    ("--allowed-host", "a b", "allowed host 'a b' is not a host name"),
    ("--port", "x", "argument --port: invalid int value: 'x'"),
])
def test_each_bad_option_is_one_line_and_exit_code_2_before_any_model_loads(capsys, tmp_path, option, value,
                                                                              message):
    missing = tmp_path / "no-such-run"  # never loaded: the options are checked first
    try:
        code = main(["serve", "--run", str(missing), option, value])
    except SystemExit as exited:  # (argparse's own refusals exit from the parser)
        code = exited.code
    assert code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err, err
    assert "no-such-run" not in err


def test_more_threads_than_cores_are_cut_to_the_cores_with_a_warning_as_in_training(capsys, tmp_path, monkeypatch):
    import torch

    cores = len(os.sched_getaffinity(0))
    set_to = []
    monkeypatch.setattr(torch, "set_num_threads", set_to.append)
    assert main(["serve", "--run", str(tmp_path / "no-such-run"), "--threads", "1000"]) == 2  # cut, then not found
    warning, error = capsys.readouterr().err.splitlines()
    assert warning == (f"aiayn serve: warning: --threads 1000 is more than the {cores} cores this process may use: "
                       f"serving with {cores} threads")
    assert error.startswith("aiayn serve: error: ") and "no-such-run" in error
    assert set_to == [cores]


def test_more_connections_than_the_process_may_open_is_a_bad_option(capsys, tmp_path):
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]  # (finite on Linux: nr_open bounds it)
    assert main(["serve", "--run", str(tmp_path), "--max-connections", str(hard)]) == 2
    assert f"--max-connections {hard} needs {hard + 64} open files, more than this process may open" in \
        capsys.readouterr().err


def test_an_address_not_of_this_machine_is_a_bad_host(capsys, translation_run):
    assert main(["serve", "--run", str(translation_run), "--host", "192.0.2.1", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("aiayn serve: error: cannot listen on 192.0.2.1:0: 192.0.2.1 is not an address of this machine; "
                   "give one of its addresses, or 0.0.0.0 for all")


def group_members(group: int) -> list[int]:
    """The processes of process group `group` (Linux's /proc)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == group:
            members.append(int(stat.parent.name))
    return members


def test_a_port_in_use_exits_with_one_line_code_4_and_no_worker_left(translation_run):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    # --passes 2: the worker-process mode, whose workers used to start first and keep the process from exiting
    server = subprocess.Popen([sys.executable, "-m", "aiayn", "serve", "--run", f"en-de={translation_run}",
                               "--port", str(port), "--passes", "2"], env=env, cwd=ROOT, stderr=subprocess.PIPE,
                              text=True, start_new_session=True)
    try:
        assert server.wait(timeout=60) == 4
        err = server.stderr.read().strip()
        assert err == (f"aiayn serve: error: cannot listen on 127.0.0.1:{port}: another program listens there; "
                       "close it, or choose another --port (0 picks a free one)")
        assert group_members(server.pid) == []  # no worker process survives it
    finally:
        taken.close()
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def test_a_failure_after_the_workers_started_closes_them(monkeypatch, capsys, translation_run):
    import uvicorn

    from aiayn.serve import workers

    pools = []

    class Pool:  # stands in for the worker processes: records that they were started, then closed
        def __init__(self, sources, size, **_):
            self.size, self.events = size, []
            pools.append(self)

        def start(self):
            self.events.append("start")

        def close(self):
            self.events.append("close")

    def refuse(self, sockets):
        assert sockets[0].getsockname()[1] > 0  # bound before this point
        raise RuntimeError("the event loop could not start")

    monkeypatch.setattr(workers, "WorkerPool", Pool)
    monkeypatch.setattr(uvicorn.Server, "run", refuse)
    # (a translator batching whole requests: in a running batch it decodes in the server's process, with no workers)
    assert main(["serve", "--run", str(translation_run), "--port", "0", "--passes", "2", "--batching",
                 "requests"]) == 1
    assert "the event loop could not start" in capsys.readouterr().err
    assert pools and pools[0].events[0] == "start" and pools[0].events[-1] == "close"


def test_listening_beyond_this_machine_without_a_key_warns(capsys):
    from types import SimpleNamespace

    from aiayn.cli.serve import _announce
    from aiayn.serve import Access

    class Bound:
        def __init__(self, host):
            self.host = host

        def getsockname(self):
            return (self.host, 8000)

    app = SimpleNamespace(state=SimpleNamespace(models=[]))
    _announce(app, Bound("0.0.0.0"), 1, 1, 1, False, Access())
    _announce(app, Bound("0.0.0.0"), 1, 1, 1, False, Access(api_key="k"))
    _announce(app, Bound("127.0.0.1"), 1, 1, 1, False, Access())
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if "warning" in line]
    assert warnings == ["aiayn serve: warning: listening on 0.0.0.0, beyond this machine, with no API key: anyone "
                        "who reaches it can use it; set --api-key or $AIAYN_API_KEY"]
    # what it serves, in the precision each object decodes in (a translator's is measured: aiayn translate's)
    served = SimpleNamespace(name="en-fr", kind="translate", obj=SimpleNamespace(backend=SimpleNamespace(
        precision="bf16")), stepper=None)
    _announce(SimpleNamespace(state=SimpleNamespace(models=[served])), Bound("127.0.0.1"), 1, 1, 1, False, Access())
    assert "serving en-fr (translate, bf16); 1 passes in threads" in capsys.readouterr().err
    stepped = SimpleNamespace(**{**vars(served), "stepper": object()})
    embedder = SimpleNamespace(name="minilm", kind="embed", obj=served.obj, stepper=None)
    _announce(SimpleNamespace(state=SimpleNamespace(models=[stepped, embedder])), Bound("127.0.0.1"), 2, 1, 2, True,
              Access())
    assert ("en-fr in running batches, 2 stepping threads x 1 torch threads; the others in 2 worker processes x 1 "
            "on 2 cores" in capsys.readouterr().err)


# -- connections -----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def translator(translation_run):
    return aiayn.load(translation_run)


@pytest.fixture(scope="module")
def tight(translator):
    """A server whose clients have 1 s to send a request and which keeps at most 3 connections."""
    app = create_app({"en-de": translator}, limits=Limits(read_seconds=1.0, max_connections=3, max_header_bytes=4096))
    with serving(app) as url:
        yield url


def connect(url: str) -> socket.socket:
    host, port = re.match(r"http://([\d.]+):(\d+)", url).groups()
    return socket.create_connection((host, int(port)), timeout=10)


def answer_of(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_headers_sent_too_slowly_are_answered_408_and_the_connection_closed(tight):
    with connect(tight) as sock:
        start = time.monotonic()
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")  # and never the rest
        answer = answer_of(sock)
        took = time.monotonic() - start
    assert answer.startswith(b"HTTP/1.1 408 ") and b'"error": "the request\'s headers did not all arrive within 1 s' \
        in answer
    assert 0.8 < took < 5


def test_a_connection_that_sends_nothing_is_closed(tight):
    with connect(tight) as sock:
        start = time.monotonic()
        assert answer_of(sock) == b""
        assert time.monotonic() - start < 5


def test_a_body_sent_too_slowly_is_answered_408(tight):
    with connect(tight) as sock:
        sock.sendall(b"POST /translate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"q\": ")
        sock.settimeout(5)
        head = sock.recv(65536)
    assert head.startswith(b"HTTP/1.1 408 ") and b"the body did not all arrive within 1 s" in head
    assert metric(tight, "aiayn_requests_total", 'route="/translate",status="408"') >= 1


def test_a_body_no_route_reads_gets_no_longer_to_arrive(tight):
    with connect(tight) as sock:  # /health answers at once; the 90 bytes it did not wait for never come
        start = time.monotonic()
        sock.sendall(b"POST /health HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n0123456789")
        answer = answer_of(sock)
    assert answer.startswith(b"HTTP/1.1 405 ") and time.monotonic() - start < 5


def test_headers_past_the_limit_are_answered_431_without_reading_the_rest(tight):
    with connect(tight) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: ")
        sent, answer = 0, b""
        while sent < 30 << 20:  # up to 30 MB of one header, 8 KiB at a time, until the server answers
            if select.select([sock], [], [], 0.02)[0]:
                answer = sock.recv(65536)
                break
            try:
                sock.sendall(b"a" * 8192)
            except OSError:  # closed under us: its answer is already in our buffer
                answer = sock.recv(65536)
                break
            sent += 8192
    assert answer.startswith(b"HTTP/1.1 431 ") and b"pass the limit of 4096 bytes" in answer
    assert sent < 64 * 1024



@pytest.mark.parametrize("size", [5000, 100_000])
def test_headers_past_the_limit_in_one_write_are_answered_431_and_the_request_never_runs(tight, size):
    """The bound holds for headers that arrive whole in one piece, not only for headers that trickle in."""
    before = metric(tight, "aiayn_requests_total", 'route="/translate",status="200"')
    with connect(tight) as sock:
        sock.sendall(b"POST /translate HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * size +
                     b"\r\nContent-Type: application/json\r\nContent-Length: 28\r\n\r\n"
                     b'{"q": "a b", "target": "de"}')
        answer = answer_of(sock)
    assert answer.startswith(b"HTTP/1.1 431 ") and answer.count(b"HTTP/1.1") == 1, answer[:200]
    assert b"pass the limit of 4096 bytes" in answer
    assert metric(tight, "aiayn_requests_total", 'route="/translate",status="200"') == before



def test_a_pipelined_request_past_the_header_limit_is_refused_after_the_answer_before_it(tight):
    """Two requests in one write, the second's headers too large: the first gets its own answer, then the 431."""
    with connect(tight) as sock:
        sock.sendall(b"POST /translate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b'Content-Length: 28\r\n\r\n{"q": "a b", "target": "de"}'
                     b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 5000 + b"\r\n\r\n")
        answer = answer_of(sock)
    first, _, second = answer.partition(b"HTTP/1.1 431 ")
    assert first.startswith(b"HTTP/1.1 200 ") and b'"translatedText"' in first and b"pass the limit" in second

@pytest.mark.parametrize("body", [b'{"q": "a b", "target": "de"}', b'{"q": '])
def test_a_client_that_half_closes_is_taken_as_gone_and_its_request_dropped(tight, body):
    """TCP cannot tell a client that shut its sending side (`nc -N`) from one that closed and left; as hyper (TEI's
    server) by default, both are gone: the connection closes without an answer, the request counted 499 (its texts
    never computed when it was still waiting)."""
    route = 'route="/translate",status="499"'
    before = metric(tight, "aiayn_requests_total", route)
    with connect(tight) as sock:
        sock.sendall(b"POST /translate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 28\r\n\r\n" + body)
        sock.shutdown(socket.SHUT_WR)
        start = time.monotonic()
        assert answer_of(sock) == b""
        assert time.monotonic() - start < 5
    wait_until(lambda: metric(tight, "aiayn_requests_total", route) == before + 1)


def test_connections_past_the_limit_are_answered_503(tight):
    held = [connect(tight) for _ in range(3)]
    try:
        for sock in held:  # each has begun a request, so each is open on the server's side
            sock.sendall(b"GET /health HTTP/1.1\r\n")
        wait_until(lambda: httpx.get(f"{tight}/health").status_code == 503, tries=20)
        refused = httpx.get(f"{tight}/health")
        assert refused.json() == {"error": "the server has 3 connections open, its limit (--max-connections); "
                                           "retry later"}
    finally:
        for sock in held:
            sock.close()
    wait_until(lambda: httpx.get(f"{tight}/health").status_code == 200)


class Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


def test_a_client_that_leaves_mid_body_is_one_log_line_and_not_a_500(translator):
    lines = Lines()
    loggers = [logging.getLogger("aiayn"), logging.getLogger("uvicorn.error")]
    for logger in loggers:
        logger.addHandler(lines)
    try:
        with serving(create_app({"en-de": translator})) as url:
            with connect(url) as sock:
                sock.sendall(b"POST /translate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                             b"Content-Length: 100\r\n\r\n{\"q\": ")
                time.sleep(0.2)
            wait_until(lambda: metric(url, "aiayn_requests_total", 'route="/translate",status="499"') == 1)
            assert metric(url, "aiayn_requests_total", 'route="/translate",status="500"') == 0
    finally:
        for logger in loggers:
            logger.removeHandler(lines)
    said = [r for r in lines.records if r.levelno >= logging.WARNING]
    assert [r.getMessage() for r in said] == ["POST /translate: the client closed the connection before sending "
                                              "its whole body (6 bytes came)"]
    assert said[0].exc_info is None


@pytest.mark.parametrize("route, field", [("/translate", "q"), ("/v1/inspect", "q")])
def test_a_lone_surrogate_in_a_text_is_422_not_500(tight, route, field):
    """JSON may escape half a surrogate pair; it is no Unicode text and is refused before it is counted or queued."""
    body = '{"' + field + '": "tw\\ud800enty", "source": "en", "target": "de"}'
    out = httpx.post(f"{tight}{route}", content=body.encode(), headers={"Content-Type": "application/json"})
    assert out.status_code == 422, out.text
    assert "text 0 holds a lone surrogate ('\\ud800') at character 2" in out.json()["error"]


def test_deeply_nested_json_is_400(tight):
    out = httpx.post(f"{tight}/translate", content=b"[" * 100_000, headers={"Content-Type": "application/json"})
    assert out.status_code == 400 and "nests too deeply" in out.json()["error"]


@pytest.mark.parametrize(("method", "path", "headers", "body", "status", "message"), [
    ("GET", "/nope", {}, b"", 404, "no route /nope; the routes are /, /health"),
    ("DELETE", "/translate", {}, b"", 405, "DELETE is not a method of /translate; it takes POST"),
    ("OPTIONS", "/translate", {}, b"", 405, "OPTIONS is not a method of /translate"),
    ("POST", "/translate", {"Content-Type": "multipart/form-data"}, b"q=a", 400, "Missing boundary in multipart"),
    ("POST", "/translate", {"Content-Type": "multipart/form-data; boundary=xyz"}, b"garbage\r\n", 400,
     "the body is not valid form data"),
    ("POST", "/translate", {"Content-Type": "multipart/form-data; boundary=xyz"},
     b'--xyz\r\nContent-Disposition: form-data; name="q"\r\n\r\na b', 400, "the body is not valid form data"),
    ("POST", "/translate", {"Content-Type": "application/x-www-form-urlencoded"}, b"q=tw%FFenty&target=de", 400,
     "the form field 'q' is not UTF-8 text"),
    ("POST", "/translate", {"Content-Type": "application/x-www-form-urlencoded"}, b"q=tw\xffenty&target=de", 400,
     "the form field 'q' is not UTF-8 text"),
    ("POST", "/translate", {"Content-Type": "multipart/form-data; boundary=xyz"},
     b'--xyz\r\nContent-Disposition: form-data; name="q"\r\n\r\ntw\xffenty\r\n--xyz--\r\n', 400,
     "the form field 'q' is not UTF-8 text"),
])
def test_the_frameworks_refusals_have_the_servers_error_shape(tight, method, path, headers, body, status, message):
    out = httpx.request(method, f"{tight}{path}", headers=headers, content=body)
    assert out.status_code == status and list(out.json()) == ["error"] and message in out.json()["error"]



@pytest.mark.parametrize("body", [b"q=caf\xc3\xa9+b&target=de", b"q=caf%C3%A9+b&target=de",
                                  b"q=caf%c3%a9%20b&target=de"])
def test_a_form_in_utf8_raw_or_escaped_is_the_same_text_as_json(tight, body):
    """curl --data sends raw UTF-8, a browser escapes it: both are read as UTF-8 (starlette reads raw bytes as
    Latin-1, which made "café" "cafÃ©")."""
    as_json = httpx.post(f"{tight}/translate", json={"q": "café b", "target": "de"}).json()
    out = httpx.post(f"{tight}/translate", content=body,
                     headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert out.status_code == 200 and out.json() == as_json
    assert urlencoded_fields(body) == [("q", "café b"), ("target", "de")]

def test_a_request_the_parser_refuses_is_answered_in_the_same_shape(tight):
    with connect(tight) as sock:
        sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        answer = answer_of(sock)
    assert answer.startswith(b"HTTP/1.1 400 ") and b'{"error": "not a valid HTTP/1.1 request' in answer


def test_model_names_are_escaped_in_the_metrics(translator):
    name = 'en-de "x" \\ y\nz'
    with serving(create_app({name: translator})) as url:
        assert httpx.post(f"{url}/translate", json={"q": "a b", "target": "de"}).status_code == 200
        text = httpx.get(f"{url}/metrics").text
    sample = re.compile(r'^[a-zA-Z_:][a-zA-Z0-9_:]*(\{([a-zA-Z_]+="([^"\\\n]|\\[\\"n])*",?)*\})? \S+$')
    for line in text.splitlines():
        assert line.startswith("# ") or sample.match(line), line
    assert 'aiayn_tokens_total{model="en-de \\"x\\" \\\\ y\\nz"} ' in text


# -- who may call: the API key, the Host, the calling page's origin --------------------------------------------

KEY = "k3y-for-tests"


@pytest.fixture(scope="module")
def keyed(translator):
    """A server of a translator and MiniLM that asks for an API key and lets one other page call it."""
    from aiayn.serve import Access

    objects = {"en-de": translator, "minilm": aiayn.load("minilm")}
    access = Access(api_key=KEY, allowed_hosts=("api.example",), cors_origins=("http://app.example:3000",))
    with serving(create_app(objects, access=access)) as url:
        yield url, objects


def test_openai_client_with_the_key_is_answered_and_without_it_refused(keyed):
    import numpy as np
    import openai

    url, objects = keyed
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    out = client.embeddings.create(input=["A man eats."], model="minilm")
    np.testing.assert_allclose(out.data[0].embedding, objects["minilm"].embed("A man eats."), atol=1e-5)
    wrong = openai.OpenAI(base_url=f"{url}/v1", api_key="not-the-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as refused:
        wrong.embeddings.create(input=["A man eats."], model="minilm")
    assert refused.value.status_code == 401 and "carries a wrong key" in refused.value.response.json()["error"]


def test_libretranslate_client_sends_the_key_in_its_body(keyed):
    from urllib.error import HTTPError

    from libretranslatepy import LibreTranslateAPI

    url, objects = keyed
    client = LibreTranslateAPI(url + "/", api_key=KEY)
    assert client.languages() == [{"code": "en", "name": "en", "targets": ["de"]}]  # a GET with a form body
    assert client.translate("a b c", "en", "de") == objects["en-de"].translate("a b c")
    with pytest.raises(HTTPError) as refused:
        LibreTranslateAPI(url + "/").translate("a b c", "en", "de")
    assert refused.value.code == 401


def test_every_route_but_health_and_the_page_asks_for_the_key(keyed):
    url, objects = keyed
    bearer = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(f"{url}/health").status_code == 200 and httpx.get(f"{url}/").status_code == 200
    for method, path, body in [("GET", "/metrics", None), ("GET", "/languages", None), ("GET", "/v1/models", None),
                               ("POST", "/embed", {"inputs": "a"}), ("POST", "/v1/inspect", {"q": "a b"}),
                               ("POST", "/translate", {"q": "a b", "target": "de"}), ("GET", "/nope", None)]:
        refused = httpx.request(method, f"{url}{path}", json=body)
        assert refused.status_code == 401 and "needs an API key and the request carries no key" in \
            refused.json()["error"], (path, refused.text)
        assert httpx.request(method, f"{url}{path}", json=body, headers=bearer).status_code == (
            404 if path == "/nope" else 200), path
    vectors = httpx.post(f"{url}/embed", json={"inputs": ["a b"]}, headers=bearer).json()  # TEI's header
    assert len(vectors) == 1 and len(vectors[0]) == objects["minilm"].dim
    assert httpx.post(f"{url}/translate", json={"q": "a b", "target": "de", "api_key": KEY}).status_code == 200


def test_hosts_other_than_this_machines_names_are_refused(keyed):
    url, _ = keyed
    port = url.rsplit(":", 1)[1]
    for host, status in [("evil.example", 400), (f"evil.example:{port}", 400), (f"localhost:{port}", 200),
                         (f"127.0.0.1:{port}", 200), (f"[::1]:{port}", 200), ("api.example", 200)]:
        out = httpx.get(f"{url}/health", headers={"Host": host})
        assert out.status_code == status, host
    refused = httpx.get(f"{url}/health", headers={"Host": "evil.example"}).json()["error"]
    assert refused == ("this server does not answer to the name 'evil.example' in the Host header; start it with "
                       "--allowed-host evil.example to allow it")


def test_a_host_header_is_one_host_and_port_and_nothing_else(keyed):
    url, _ = keyed
    for host in ("localhost:80@evil.example", "[::1", "localhost:abc", "localhost:8000/x", "local host", ""):
        out = httpx.get(f"{url}/health", headers={"Host": host})
        assert out.status_code == 400 and "must be one host[:port]" in out.json()["error"], host
    sock = connect(url)  # two Host headers: which one names the server is anyone's guess
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\nHost: evil.example\r\nConnection: close\r\n\r\n")
    assert answer_of(sock).startswith(b"HTTP/1.1 400 ")


def test_head_answers_the_get_routes_with_their_headers_and_no_body(keyed):
    url, _ = keyed
    for route in ("/", "/health"):
        head, get = httpx.head(f"{url}{route}"), httpx.get(f"{url}{route}")
        assert head.status_code == get.status_code == 200 and head.content == b"", route
        assert head.headers["content-type"] == get.headers["content-type"]
    assert httpx.head(f"{url}/metrics").status_code == 401  # the key is asked for as on GET
    assert httpx.head(f"{url}/translate", headers={"Authorization": f"Bearer {KEY}"}).status_code == 405


def test_the_page_says_it_runs_its_own_script_only_and_may_not_be_framed(keyed):
    url, _ = keyed
    headers = httpx.get(f"{url}/").headers
    assert headers["x-frame-options"] == "DENY" and "frame-ancestors 'none'" in headers["content-security-policy"]
    assert "connect-src 'self'" in headers["content-security-policy"]


@pytest.mark.parametrize("key", ["", "two words", "kéy", "tab\tkey", "bell\x07"])
def test_an_api_key_no_header_could_carry_is_refused(key, monkeypatch):
    from aiayn.cli.main import main
    from aiayn.serve import Access

    with pytest.raises(ValueError, match="printable ASCII"):
        Access(api_key=key)
    monkeypatch.setenv("AIAYN_API_KEY", key)  # set, even empty: refused as --api-key would be
    assert main(["serve", "--model", "minilm", "--port", "0"]) == 2


def test_pages_of_other_origins_may_not_post_but_the_servers_own_page_and_allowed_origins_may(keyed):
    url, objects = keyed
    form = {"q": "a b", "target": "de", "api_key": KEY}  # what a browser's form post would carry
    for headers in ({"Origin": "http://evil.example"}, {"Origin": "null"}, {"Sec-Fetch-Site": "cross-site"},
                    {"Origin": "http://127.0.0.1:1"}):  # another port of this machine is another origin
        out = httpx.post(f"{url}/translate", data=form, headers=headers)
        assert out.status_code == 403 and "--cors-origin" in out.json()["error"], headers
    own = {"Origin": url, "Sec-Fetch-Site": "same-origin", "Authorization": f"Bearer {KEY}"}  # the page at /
    out = httpx.post(f"{url}/v1/inspect", json={"q": "a b"}, headers=own)
    assert out.status_code == 200 and out.json()["translation"] == objects["en-de"].translate("a b")
    app = "http://app.example:3000"
    preflight = httpx.options(f"{url}/translate", headers={"Origin": app, "Access-Control-Request-Method": "POST",
                                                            "Access-Control-Request-Headers": "authorization"})
    assert preflight.status_code == 204 and preflight.headers["access-control-allow-origin"] == app
    assert "authorization" in preflight.headers["access-control-allow-headers"]
    allowed = httpx.post(f"{url}/translate", data=form, headers={"Origin": app, "Sec-Fetch-Site": "cross-site"})
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == app
    other = httpx.options(f"{url}/translate", headers={"Origin": "http://evil.example",
                                                        "Access-Control-Request-Method": "POST"})
    assert other.status_code == 403 and "access-control-allow-origin" not in other.headers


def test_the_page_in_a_browser_sends_the_key_it_is_given(keyed):
    from urllib.parse import quote

    from tests.serve.test_page import browse, rendered

    url, objects = keyed  # (/v1/inspect, which the page calls, answers 401 without the key: see above)
    with_key = rendered(browse(f"{url}/?q={quote('a b c')}#key={KEY}", "--dump-dom"))
    assert with_key.by_id["translation"].get("data-done") == "1"
    assert "".join(with_key.texts.get("translation", [])) == objects["en-de"].translate("a b c")


def test_a_pool_interrupted_while_its_workers_load_ends_them(monkeypatch, translation_run):
    import multiprocessing

    from aiayn.serve.models import batched_call
    from aiayn.serve.workers import WorkerPool, WorkerProcess

    others = set(multiprocessing.active_children())

    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(WorkerProcess, "ready", interrupted)
    pool = WorkerPool({"en-de": str(translation_run)}, 2, batched_call=batched_call)
    with pytest.raises(KeyboardInterrupt):
        pool.start()
    assert not set(multiprocessing.active_children()) - others


def test_a_text_longer_than_an_encoder_reads_is_422_unless_tei_asks_to_cut_it(keyed):
    url, objects = keyed
    headers = {"Authorization": f"Bearer {KEY}"}
    long = "word " * 600  # past MiniLM's 256 tokens
    for route, body in (("/embed", {"inputs": long}), ("/v1/embeddings", {"input": long, "model": "minilm"})):
        out = httpx.post(f"{url}{route}", json=body, headers=headers)
        assert out.status_code == 422 and "text 1 has" in out.json()["error"] and "truncate" in out.json()["error"]
    cut = httpx.post(f"{url}/embed", json={"inputs": long, "truncate": True}, headers=headers)
    assert cut.status_code == 200
    import numpy as np

    np.testing.assert_allclose(cut.json()[0], objects["minilm"].embed(long), atol=1e-5)
    assert httpx.post(f"{url}/embed", json={"inputs": "a", "truncate": "yes"}, headers=headers).status_code == 422


def test_an_empty_host_is_named_as_the_host_option(capsys):
    from aiayn.cli.main import main

    assert main(["serve", "--model", "minilm", "--host", "", "--port", "0"]) == 2
    assert "--host '' names no address" in capsys.readouterr().err
