"""The page at `/` in a real browser: headless Chromium (Debian's `chromium`, installed here where missing) opens it
with a sentence (in the address, or typed and submitted over the DevTools protocol); the page translates it and
draws the cross-attention heatmap, the pipeline, and for an encoder the ranked search; the test reads what it
rendered from the DOM and keeps a screenshot as its artifact."""

import os
import shutil
import subprocess
from html.parser import HTMLParser
from urllib.parse import quote

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx
import numpy as np
import pytest

import aiayn
from aiayn.serve import create_app
from aiayn.serve.app import page_html
from tests.serving import serving

CANDIDATES = ["g f e d c b a", "e e e", "c a", "h g f e", "a b c"]


def chromium() -> str:
    """The chromium binary; installed with apt-get where it is missing (skips only if that cannot be done)."""
    found = shutil.which("chromium")
    if found:
        return found
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        pytest.skip("chromium is not installed and cannot be: installing it needs apt-get as root")
    for command in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "chromium"]):
        done = subprocess.run(command, capture_output=True, text=True, timeout=1200,
                              env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
        if done.returncode != 0:
            pytest.skip(f"installing chromium failed ({' '.join(command)}): {done.stderr.strip()[-300:]}")
    return shutil.which("chromium") or pytest.fail("apt-get installed chromium but it is not on PATH")


def browse(url: str, *extra: str) -> str:
    """Chromium's headless run of `url` until the page's scripts are done; returns its stdout."""
    command = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
               "--virtual-time-budget=15000", "--window-size=1100,1400", *extra, url]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


class Rendered(HTMLParser):
    """The texts of elements by class and by id, the attributes of elements by id and of the heatmap's cells."""

    def __init__(self):
        super().__init__()
        self.texts: dict[str, list[str]] = {}
        self.cells: list[dict] = []
        self.by_id: dict[str, dict] = {}
        self._open: list[tuple[str, ...]] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if "id" in attrs:
            self.by_id[attrs["id"]] = attrs
        if attrs.get("class") == "cell":
            self.cells.append(attrs)
        if tag not in ("input", "br", "meta", "option"):
            self._open.append(tuple(attrs[key] for key in ("class", "id") if attrs.get(key)))

    def handle_endtag(self, tag):
        if tag not in ("input", "br", "meta", "option") and self._open:
            self._open.pop()

    def handle_data(self, data):
        for key in self._open[-1] if self._open else ():
            self.texts.setdefault(key, []).append(data)


def rendered(dom: str) -> Rendered:
    parser = Rendered()
    parser.feed(dom)
    return parser


@pytest.fixture(scope="module")
def page_url(translation_run):
    objects = {"en-de": aiayn.load(translation_run), "minilm": aiayn.load("minilm")}
    with serving(create_app(objects)) as url:
        yield url, objects


def test_the_page_is_self_contained():
    html = page_html()
    assert "<script src" not in html and "<link" not in html and "http://" not in html and "https://" not in html


def test_browser_shows_translation_heatmap_and_pipeline(page_url, tmp_path):
    url, objects = page_url
    views = [httpx.post(f"{url}/v1/inspect", json={"q": q}).json() for q in CANDIDATES]
    q, view = next((q, v) for q, v in zip(CANDIDATES, views) if v["output_tokens"])  # a non-empty translation
    page = f"{url}/?q={quote(q)}"
    dom = rendered(browse(page, "--dump-dom"))
    assert dom.by_id["translation"].get("data-done") == "1"
    assert "".join(dom.texts["translation"]) == objects["en-de"].translate(q) == view["translation"]
    assert dom.texts["src-token"] == view["source_tokens"]
    assert dom.texts["out-token"] == view["output_tokens"]
    rows, cols = len(view["output_tokens"]), len(view["source_tokens"])
    assert len(dom.cells) == rows * cols  # one cell per (output token, source token)
    last = np.array(view["attention"][-1]).mean(axis=0)  # the page opens on the last layer, mean of heads
    shown = np.zeros((rows, cols))
    for cell in dom.cells:
        shown[int(cell["data-row"]), int(cell["data-col"])] = float(cell["data-weight"])
    np.testing.assert_allclose(shown, last, atol=1e-4)
    np.testing.assert_allclose(shown.sum(axis=1), 1.0, atol=1e-3)  # each output token's weights over the source
    names = dom.texts["name"]
    for stage in ("token embedding x sqrt(d_model)", "+ positional encoding (sinusoidal)", "enc1 softmax weights",
                  "dec1 cross-attn weights over source", "softmax: next-token probabilities"):
        assert stage in names
    assert "top:" in dom.texts["top"][-1]
    screenshot = tmp_path / "page.png"
    browse(page, f"--screenshot={screenshot}")
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and screenshot.stat().st_size > 10_000


def test_browser_ranks_texts_for_an_encoder(page_url, tmp_path):
    url, objects = page_url
    query = "a man eats"
    dom = rendered(browse(f"{url}/?model=minilm&q={quote(query)}", "--dump-dom"))
    candidates = ["A man is eating food.", "A man is riding a horse.", "Someone is having a meal.",
                  "The cat sleeps on the sofa."]  # the page's default texts
    vectors = objects["minilm"].embed([query, *candidates])
    expected = [text for _, text in sorted(zip(vectors[1:] @ vectors[0], candidates), reverse=True)]
    hits = [text.split("  ", 1)[1] for text in dom.texts["hit"]]
    assert hits == expected


class DevTools:
    """A headless Chromium driven over its DevTools protocol: open a page, run script in it, take a screenshot."""

    def __init__(self, url: str):
        import json
        import re

        import websocket

        self.json = json
        self.browser = subprocess.Popen([chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                                         "--hide-scrollbars", "--remote-debugging-port=0", "--window-size=1100,1400",
                                         url], stderr=subprocess.PIPE, text=True)
        for _ in range(200):  # the line that says where the protocol listens
            line = self.browser.stderr.readline()
            found = re.search(r"DevTools listening on ws://([^/]+)/", line)
            if found or not line:
                break
        assert found, "chromium did not start its DevTools endpoint"
        targets = httpx.get(f"http://{found.group(1)}/json").json()
        page = next(t for t in targets if t["type"] == "page")
        self.socket = websocket.create_connection(page["webSocketDebuggerUrl"], timeout=60)
        self.calls = 0

    def send(self, method: str, **params) -> dict:
        self.calls += 1
        self.socket.send(self.json.dumps({"id": self.calls, "method": method, "params": params}))
        while True:  # events come in between; the answer carries our id
            message = self.json.loads(self.socket.recv())
            if message.get("id") == self.calls:
                assert "error" not in message, message
                return message["result"]

    def evaluate(self, expression: str):
        return self.send("Runtime.evaluate", expression=expression, awaitPromise=True,
                         returnByValue=True)["result"].get("value")

    def close(self) -> None:
        self.socket.close()
        self.browser.kill()
        self.browser.wait()


def test_typing_a_sentence_and_clicking_translate_draws_the_heatmap(page_url, tmp_path):
    import base64
    import time

    url, objects = page_url
    views = [httpx.post(f"{url}/v1/inspect", json={"q": q}).json() for q in CANDIDATES]
    q, view = next((q, v) for q, v in zip(CANDIDATES, views) if v["output_tokens"])
    browser = DevTools(f"{url}/")
    try:
        for _ in range(300):  # the page has loaded its models
            if browser.evaluate("document.body && document.body.dataset.ready") == "1":
                break
            time.sleep(0.05)
        browser.send("DOM.getDocument")
        browser.evaluate("document.getElementById('q').focus()")
        browser.send("Input.insertText", text=q)  # typed, as a keyboard would
        browser.evaluate("document.querySelector('#translate-form button').click()")
        for _ in range(300):
            if browser.evaluate("document.getElementById('translation').dataset.done") == "1":
                break
            time.sleep(0.05)
        dom = rendered(browser.evaluate("document.documentElement.outerHTML"))
        shot = browser.send("Page.captureScreenshot", format="png")["data"]
    finally:
        browser.close()
    assert "".join(dom.texts["translation"]) == objects["en-de"].translate(q)
    assert dom.texts["src-token"] == view["source_tokens"] and dom.texts["out-token"] == view["output_tokens"]
    assert len(dom.cells) == len(view["source_tokens"]) * len(view["output_tokens"])
    screenshot = tmp_path / "typed.png"
    screenshot.write_bytes(base64.b64decode(shot))
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
