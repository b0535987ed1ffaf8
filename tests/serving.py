"""Helpers for the tests of `aiayn serve`: a server on a free loopback port in a thread, and polling its metrics."""

from __future__ import annotations

import contextlib
import re
import socket
import threading
import time
from collections.abc import Iterator

import httpx


@contextlib.contextmanager
def serving(app) -> Iterator[str]:
    """Run `app` under uvicorn on 127.0.0.1 (a free port) in a thread, with the settings of `aiayn serve`; yields
    its base URL."""
    import uvicorn

    from aiayn.serve import server_config

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(server_config(app))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        wait_until(lambda: server.started)
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def wait_until(condition, *, tries: int = 600, every: float = 0.05) -> None:
    """Poll `condition` (a bounded number of times) until it holds; AssertionError if it never does."""
    for _ in range(tries):
        if condition():
            return
        time.sleep(every)
    raise AssertionError(f"{condition} never held")


def metric(url: str, name: str, labels: str = "") -> float:
    """The value of one metric line of `GET /metrics` (0 when the line is absent)."""
    text = httpx.get(f"{url}/metrics").text
    pattern = re.escape(name + (f"{{{labels}}}" if labels else "")) + r" (\S+)"
    found = re.search(r"^" + pattern + "$", text, flags=re.M)
    return float(found.group(1)) if found else 0.0
