"""Serving throughput and latency: `aiayn serve` batching across requests, beside one-request-at-a-time serving
and the same sentences through the in-process object (batched), in one run.

N concurrent clients (a keep-alive HTTP/1.1 connection each, on asyncio's streams, in this process) send one
text per request for T seconds to a server started as its own process (`aiayn serve`), first batching (the
default: passes = cores // threads, a 5 ms gathering window), then answering one request at a time (one pass,
a batch budget of one request, no window: what a server that translates inside a critical section does). The
in-process figure is the object's own batched call (`Translator.translate` / `Embedder.embed`) on the
sentences the batching server answered, with as many torch threads as the server used cores, once in one call
and once in calls of as many texts as the server's batches held on average (from its `/metrics`), which
separates what HTTP and gathering cost from what smaller batches cost. Run it on a quiet machine:

    aiayn bench serve --run runs/demo --seconds 15       # or: python benchmarks/serve.py ...
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BATCHED = ["--max-wait-ms", "5"]
ONE_AT_A_TIME = ["--passes", "1", "--max-tokens", "1", "--max-wait-ms", "0"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="aiayn bench serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--run", help="translation run to serve (default: train the demo's run for 10 epochs, ~1 min)")
    p.add_argument("--model", default="minilm", help="encoder for the embeddings rows (default minilm; '' skips)")
    p.add_argument("--clients", type=int, default=16, help="concurrent translation clients (default 16)")
    p.add_argument("--embed-clients", type=int, default=32, help="concurrent embedding clients (default 32)")
    p.add_argument("--seconds", type=float, default=15.0, help="load time per configuration (default 15)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per forward pass (default 1)")
    p.add_argument("--passes", type=int, default=0,
                   help="concurrent passes of the batching server (default: its own, cores // threads)")
    p.add_argument("--max-batch", type=int, default=0, help="most texts per batch of the batching server (0: no cap)")
    p.add_argument("--texts", help="file of source texts for translation, one a line (a TSV's first column: "
                   "a test split); default: held-out English number words, the demo's")
    p.add_argument("--pair", default="en-de", help="the language pair the run is served as (default en-de)")
    p.add_argument("--skip", default="", help="comma-separated parts to leave out: translate, embed")
    p.add_argument("--mixed", action="store_true", help="short requests behind long ones instead, at the step against "
                   "whole-request batching (benchmarks/serve_mixed.py; its own options)")
    return p


def sentences(kind: str, n: int = 2000, path: str | None = None) -> list[str]:
    """Source texts: `path`'s first column, else held-out English number words for translation, varied English
    sentences for embeddings."""
    if path:
        sources = [line.split("\t")[0] for line in Path(path).read_text(encoding="utf-8").splitlines()]
        return [source for source in sources if source.strip()][:n]
    if kind == "translate":
        from aiayn.data.datasets import numbers_dataset

        return [example.source for example in numbers_dataset(n_train=10, n_valid=10, n_test=n).test]
    from embed import make_corpus  # benchmarks/embed.py

    return make_corpus(n)


def start_server(spec: list[str], options: list[str], threads: int) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads)}
    return listening(subprocess.Popen([sys.executable, "-m", "aiayn", "serve", *spec, "--port", "0", "--threads",
                                       str(threads), *options], env=env, stderr=subprocess.PIPE, text=True),
                     "aiayn serve")


def listening(server: subprocess.Popen, name: str) -> tuple[subprocess.Popen, str]:
    """`server` (started with its stderr piped) and its URL, once its `aiayn serve: http://...` line says it listens;
    RuntimeError with what it printed if it exits first."""
    seen = []
    for line in server.stderr:  # warnings of the loading may come first
        seen.append(line)
        if found := re.search(r"aiayn serve: (http://[\d.]+:\d+)", line):
            threading.Thread(target=server.stderr.read, daemon=True).start()  # a full pipe would stall the server
            return server, found.group(1)
    server.kill()
    raise RuntimeError(f"{name} did not start: {''.join(seen)}")


def stop_server(server: subprocess.Popen) -> None:
    server.send_signal(signal.SIGTERM)
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


class Connection:
    """One keep-alive HTTP/1.1 connection that POSTs JSON and reads the answer: a load generator's client.

    Written on asyncio's streams, as wrk or hey are written in C and Go, so that the load costs the cores it
    shares with the server little (httpx's AsyncClient took 1.7 ms of CPU a request here, 15% of 2 cores at
    the batching server's rate).
    """

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, route: str, payload: dict) -> bytes:
        """The answer's body; RuntimeError for a status other than 200. A kept-alive connection the server
        closed meanwhile (its keep-alive timeout) is opened again once."""
        body = json.dumps(payload).encode()
        request = (f"POST {route} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
                   f"Content-Length: {len(body)}\r\n\r\n").encode() + body
        reused = self.writer is not None
        try:
            return await self._exchange(route, request)
        except (asyncio.IncompleteReadError, ConnectionError):
            if not reused:
                raise
            self.close()
            return await self._exchange(route, request)

    async def _exchange(self, route: str, request: bytes) -> bytes:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        self.writer.write(request)
        head = (await self.reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        headers = {name.strip().lower(): value.strip()
                   for name, _, value in (line.partition(":") for line in head[1:] if ":" in line)}
        if "content-length" not in headers:
            raise RuntimeError(f"{route} answered without a Content-Length (this client reads no other framing)")
        answer = await self.reader.readexactly(int(headers["content-length"]))
        if head[0].split()[1] != "200":
            raise RuntimeError(f"{route} answered {head[0]}: {answer[:200]!r}")
        return answer

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


async def load(url: str, route: str, field: str, texts: list[str], clients: int, seconds: float,
               extra: dict, warmed: Callable[[], object] | None = None) -> tuple[list[float], list[str]]:
    """Latencies of every answered request and the texts answered, `clients` at a time for `seconds`
    (`warmed` is called between the warm-up requests and the timed ones)."""
    host, port = re.match(r"http://([\d.]+):(\d+)", url).groups()
    connections = [Connection(host, int(port)) for _ in range(clients)]
    latencies, sent = [], []

    async def one_client(k: int, deadline: float) -> None:
        i = k
        while time.perf_counter() < deadline:
            text = texts[i % len(texts)]
            i += clients
            start = time.perf_counter()
            await connections[k].post(route, {field: text, **extra})
            latencies.append(time.perf_counter() - start)
            sent.append(text)

    try:
        await asyncio.gather(*(connections[k].post(route, {field: text, **extra})  # warm up, not measured
                               for k, text in enumerate(texts[:clients])))
        if warmed is not None:
            warmed()
        await asyncio.gather(*(one_client(k, time.perf_counter() + seconds) for k in range(clients)))
    finally:
        for connection in connections:
            connection.close()
    return latencies, sent


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def row(name: str, count: int, seconds: float, latencies: list[float] | None) -> str:
    rate = count / seconds
    if latencies is None:
        return f"{name:<44} {rate:>9.1f} {'-':>8} {'-':>8} {'-':>8}"
    ms = [1000 * percentile(latencies, q) for q in (50, 95, 99)]
    return f"{name:<44} {rate:>9.1f} {ms[0]:>8.1f} {ms[1]:>8.1f} {ms[2]:>8.1f}"


def batch_totals(url: str) -> tuple[float, float]:
    """Texts and batched calls the server ran so far (from its `/metrics`: the batch histogram's sum and count)."""
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=30).text
    total = sum(float(v) for v in re.findall(r"^aiayn_batch_texts_sum\{.*\} (\S+)$", text, re.M))
    count = sum(float(v) for v in re.findall(r"^aiayn_batch_texts_count\{.*\} (\S+)$", text, re.M))
    return total, count


def mean_batch(before: tuple[float, float], after: tuple[float, float]) -> float:
    """Texts per batched call between two `batch_totals`."""
    calls = after[1] - before[1]
    return (after[0] - before[0]) / calls if calls else 0.0


def in_process(obj, call: str, texts: list[str], cores: int, chunk: int = 0) -> float:
    """Seconds the object's batched call takes on `texts` (in calls of `chunk` texts, 0: one call), with `cores`
    torch threads (best of two)."""
    import torch

    chunks = [texts[i : i + chunk] for i in range(0, len(texts), chunk)] if chunk else [texts]
    before = torch.get_num_threads()
    torch.set_num_threads(cores)
    try:
        getattr(obj, call)(texts[:32])  # warm up
        best = float("inf")
        for _ in range(2):
            start = time.perf_counter()
            for part in chunks:
                getattr(obj, call)(part)
            best = min(best, time.perf_counter() - start)
        return best
    finally:
        torch.set_num_threads(before)


def compare(name: str, spec: list[str], obj, call: str, route: str, field: str, texts: list[str], clients: int,
            args: argparse.Namespace, cores: int, extra: dict) -> dict[str, float]:
    print(f"\n{name}: {clients} concurrent clients, {args.seconds:g} s each, one text per request")
    print(f"{'':<44} {'texts/s':>9} {'p50 ms':>8} {'p95 ms':>8} {'p99 ms':>8}")
    rates = {}
    batched = BATCHED + (["--passes", str(args.passes)] if args.passes else []) + ["--max-batch", str(args.max_batch)]
    for label, options in (("aiayn serve (batching)", batched), ("one request at a time", ONE_AT_A_TIME)):
        server, url = start_server(spec, options, args.threads)
        try:
            marks = []  # the batch totals after the warm-up: the mean counts the timed batches only
            latencies, sent = asyncio.run(load(url, route, field, texts, clients, args.seconds, extra,
                                               warmed=lambda url=url, marks=marks: marks.append(batch_totals(url))))
            if label.startswith("aiayn serve"):
                answered, gathered = sent, mean_batch(marks[0], batch_totals(url))
        finally:
            stop_server(server)
        rates[label] = len(sent) / args.seconds
        print(row(label, len(sent), args.seconds, latencies), flush=True)
    name = f"in-process {type(obj).__name__}.{call}"
    seconds = in_process(obj, call, answered, cores)
    rates["in-process"] = len(answered) / seconds
    print(row(name, len(answered), seconds, None), flush=True)
    chunk = max(1, round(gathered))  # what the server's batches held: the rest of the gap is HTTP and gathering
    seconds = in_process(obj, call, answered, cores, chunk)
    print(row(f"{name}, {chunk} a call", len(answered), seconds, None), flush=True)
    batched = rates["aiayn serve (batching)"]
    print(f"ratios: batching / one-at-a-time {batched / rates['one request at a time']:.2f}x, "
          f"batching / in-process {batched / rates['in-process']:.2f}x (the server's batches held {gathered:.1f} "
          f"texts on average; in-process at that size {batched * seconds / len(answered):.2f}x)")
    return rates


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the tables; returns 0. `--mixed`: short requests behind long ones
    (benchmarks/serve_mixed.py)."""
    if "--mixed" in (argv if argv is not None else sys.argv[1:]):
        import serve_mixed  # benchmarks/serve_mixed.py

        return serve_mixed.main(argv)
    args = build_parser().parse_args(argv)
    import aiayn
    from aiayn.backends import usable_cores

    cores = usable_cores()
    with tempfile.TemporaryDirectory() as tmp:
        run = args.run
        if not run:
            from aiayn.cli.main import main as cli

            run = str(Path(tmp) / "demo")
            demo = Path(aiayn.__file__).parent / "examples" / "demo.toml"
            print("training the demo's numbers run for 10 epochs first (pass --run DIR to serve your own)", flush=True)
            if cli(["train", str(demo), "epochs=10", "show_examples=0", "--run", run, "--no-progress"]) != 0:
                return 1
        print(f"torch threads per pass {args.threads}, {cores} cores; load {open('/proc/loadavg').read().strip()}"
              if os.path.exists("/proc/loadavg") else f"{cores} cores")
        translator = aiayn.load(run)
        if "translate" not in args.skip:
            source, target = args.pair.split("-", 1)
            compare("translation (POST /translate)", ["--run", f"{args.pair}={run}"], translator, "translate",
                    "/translate", "q", sentences("translate", path=args.texts), args.clients, args, cores,
                    {"source": source, "target": target})
        if args.model and "embed" not in args.skip:
            embedder = aiayn.load(args.model)
            compare(f"embeddings (POST /v1/embeddings, {args.model})", ["--model", args.model], embedder, "embed",
                    "/v1/embeddings", "input", sentences("embed"), args.embed_clients, args, cores,
                    {"model": args.model})
    return 0


if __name__ == "__main__":
    sys.exit(main())
