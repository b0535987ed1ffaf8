"""Short requests behind long ones: `aiayn serve` decoding at the step (one running batch that requests join and
leave at every step) against whole-request batching, in one run, on the same server settings.

Three measurements, each on a server started as its own process with `--batching steps` and with `--batching
requests`, the two modes taking turns (`--repeats`):

1. *Behind long requests*: a short request (the first `--short-words` words of a test sentence) alone, sequentially;
   then, for `--seconds`, three clients keep a request of `--long-texts` long sentences each in flight (sending the
   next when one is answered) while one client sends short requests one after another: the short requests' median,
   p99 and worst time, and the long requests' own median time (alone, and in the mix).
2. *Poisson arrivals* (`--rates`, requests a second): each request is long (`--long-texts` sentences) with probability
   `--long-share`, else short; for `--seconds` each: the short requests' p50 and p99, the long ones' p50, and the
   sentences answered a second.
3. *Time to first token* of a `--completion-tokens`-token completion (with `--lm RUN`): streamed while
   `--lm-clients` clients ask for completions, against the whole answer's time under request batching (which
   streams nothing).

With `--peer ctranslate2`, a third server takes its turns in 1 and 2: the run's CTranslate2 export behind the same
HTTP front, batching whole requests (`benchmarks/ctranslate2_front.py`: what a LibreTranslate-style deployment is).

    aiayn bench serve --mixed --run runs/x --texts DATA/test.tsv --pair en-es --lm runs/lm
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from record import figure  # noqa: E402
from serve import Connection, listening, percentile, sentences, start_server, stop_server  # noqa: E402

MODES = ("requests", "steps")
PEER = "ctranslate2"  # the run's CTranslate2 export behind the same front, batching whole requests


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="aiayn bench serve --mixed", description=__doc__.split("\n\n")[0])
    p.add_argument("--mixed", action="store_true", help="(this benchmark)")
    p.add_argument("--run", required=True, help="translation run to serve")
    p.add_argument("--pair", default="en-de", help="the language pair it is served as (default en-de)")
    p.add_argument("--texts", help="file of source texts, one a line (a TSV's first column)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per pass (default 1; passes: cores)")
    p.add_argument("--short-words", type=int, default=2, help="words of a short request (default 2)")
    p.add_argument("--long-texts", type=int, default=64, help="sentences of a long request (default 64)")
    p.add_argument("--rates", default="1,2,4", help="Poisson arrival rates, requests a second (default 1,2,4)")
    p.add_argument("--long-share", type=float, default=0.1, help="share of long requests (default 0.1)")
    p.add_argument("--seconds", type=float, default=30.0, help="seconds of arrivals at each rate (default 30)")
    p.add_argument("--repeats", type=int, default=1, help="turns of both modes (default 1)")
    p.add_argument("--lm", help="language model run for the time to first token (default: not measured)")
    p.add_argument("--completion-tokens", type=int, default=200, help="tokens of the timed completion (default 200)")
    p.add_argument("--lm-clients", type=int, default=4, help="clients asking for completions meanwhile (default 4)")
    p.add_argument("--skip", default="", help="comma-separated parts to leave out: behind, poisson, first-token")
    p.add_argument("--peer", choices=("", PEER), default="",
                   help="a third server: the run's CTranslate2 export behind the same front (default: none)")
    return p


def request_texts(args) -> tuple[list[str], list[list[str]]]:
    """Short texts, and the long requests' sentences: the longest sentences, `long_texts` a request."""
    pool = sentences("translate", n=5000, path=args.texts)
    short = [" ".join(text.split()[: args.short_words]) for text in pool if len(text.split()) >= args.short_words]
    longest = sorted(pool, key=len, reverse=True)[: 6 * args.long_texts]
    rng = random.Random(0)
    longs = [rng.sample(longest, args.long_texts) for _ in range(6)]
    return short, longs


async def timed(connection: Connection, route: str, body: dict) -> float:
    start = time.perf_counter()
    await connection.post(route, body)
    return time.perf_counter() - start


async def behind_long(url: str, extra: dict, short: list[str], longs: list[list[str]], seconds: float) -> dict:
    """Measurement 1 (see the module docstring): three clients keep a long request each in flight for `seconds`
    while one client sends short requests one after another."""
    host, port = re.match(r"http://([\d.]+):(\d+)", url).groups()
    one = Connection(host, int(port))
    for text in short[:5]:  # warm up
        await one.post("/translate", {"q": text, **extra})
    alone = [await timed(one, "/translate", {"q": short[i % len(short)], **extra}) for i in range(20)]
    long_alone = [await timed(one, "/translate", {"q": texts, **extra}) for texts in longs[:3]]
    others = [Connection(host, int(port)) for _ in range(3)]
    deadline = time.perf_counter() + seconds
    long_times: list[float] = []

    async def keep_in_flight(k: int) -> None:
        i = k
        while time.perf_counter() < deadline:
            long_times.append(await timed(others[k], "/translate", {"q": longs[3 + i % 3], **extra}))
            i += 1

    longs_running = [asyncio.ensure_future(keep_in_flight(k)) for k in range(3)]
    behind, i = [], 0
    await asyncio.sleep(0.05)  # the long requests arrive first
    while time.perf_counter() < deadline:
        behind.append(await timed(one, "/translate", {"q": short[i % len(short)], **extra}))
        i += 1
    await asyncio.gather(*longs_running)
    for c in [one, *others]:
        c.close()
    return {"alone": statistics.median(alone), "behind": statistics.median(behind),
            "p99": percentile(behind, 99), "worst": max(behind), "long_alone": statistics.median(long_alone),
            "long_mixed": statistics.median(long_times), "count": len(behind), "longs": len(long_times)}


async def poisson(url: str, extra: dict, short: list[str], longs: list[list[str]], rate: float, seconds: float,
                  long_share: float, seed: int) -> dict:
    """Measurement 2 at one rate: arrivals for `seconds`, then every answer awaited."""
    host, port = re.match(r"http://([\d.]+):(\d+)", url).groups()
    rng = random.Random(seed)
    short_times, long_times, texts_done = [], [], [0]

    async def one(texts: list[str] | str, into: list) -> None:
        connection = Connection(host, int(port))
        try:
            into.append(await timed(connection, "/translate", {"q": texts, **extra}))
            texts_done[0] += 1 if isinstance(texts, str) else len(texts)
        finally:
            connection.close()

    tasks, start = [], time.perf_counter()
    next_at = start
    while (next_at := next_at + rng.expovariate(rate)) < start + seconds:
        await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
        if rng.random() < long_share:
            tasks.append(asyncio.ensure_future(one(longs[rng.randrange(len(longs))], long_times)))
        else:
            tasks.append(asyncio.ensure_future(one(short[rng.randrange(len(short))], short_times)))
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - start
    return {"short_p50": percentile(short_times, 50), "short_p99": percentile(short_times, 99),
            "long_p50": percentile(long_times, 50) if long_times else float("nan"),
            "texts_per_s": texts_done[0] / elapsed, "shorts": len(short_times), "longs": len(long_times)}


async def first_token(url: str, tokens: int, clients: int) -> tuple[float, float]:
    """Measurement 3: (seconds to the first streamed chunk, or to the answer where nothing streams; the whole
    answer's seconds) of a `tokens`-token completion while `clients` clients ask for 50-token completions."""
    import httpx

    body = {"prompt": "The", "max_tokens": tokens, "temperature": 0}
    stop = asyncio.Event()

    async def background(client: httpx.AsyncClient) -> None:
        while not stop.is_set():
            await client.post(f"{url}/v1/completions", json={"prompt": "It was", "max_tokens": 50, "temperature": 0})

    async with httpx.AsyncClient(timeout=600) as client:
        await client.post(f"{url}/v1/completions", json={**body, "max_tokens": 5})  # warm up
        load = [asyncio.ensure_future(background(client)) for _ in range(clients)]
        await asyncio.sleep(0.5)
        start = time.perf_counter()
        first = None
        try:
            async with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as answer:
                if answer.status_code != 200:  # request batching streams nothing: the whole answer then
                    await answer.aread()
                    whole = await client.post(f"{url}/v1/completions", json=body)
                    whole.raise_for_status()
                    elapsed = time.perf_counter() - start
                    return elapsed, elapsed
                async for line in answer.aiter_lines():
                    if line.startswith("data: {") and first is None and json.loads(line[6:])["choices"][0]["text"]:
                        first = time.perf_counter() - start
            return first or float("nan"), time.perf_counter() - start
        finally:
            stop.set()
            await asyncio.gather(*load)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from aiayn.backends import usable_cores

    skip = set(filter(None, args.skip.split(",")))
    cores = usable_cores()
    source, target = args.pair.split("-", 1)
    extra = {"source": source, "target": target}
    short, longs = request_texts(args)
    rates = [float(r) for r in args.rates.split(",") if r]
    print(f"{cores} cores, {args.threads} torch threads a pass; short requests of {args.short_words} words, long ones "
          f"of {args.long_texts} sentences (mean {statistics.mean(len(t) for r in longs for t in r):.0f} characters)")
    modes = MODES + ((PEER,) if args.peer else ())
    results: dict[str, list[dict]] = {mode: [] for mode in modes}
    for repeat in range(args.repeats):
        for mode in modes if repeat % 2 == 0 else modes[::-1]:
            if mode == PEER:
                server, url = start_peer(args.run, args.pair, max(1, cores // args.threads))
            else:
                spec = ["--run", f"{args.pair}={args.run}"] + (["--run", f"lm={args.lm}"] if args.lm else [])
                server, url = start_server(spec, ["--batching", mode], args.threads)
            try:
                found: dict = {}
                if "behind" not in skip:
                    found["behind"] = asyncio.run(behind_long(url, extra, short, longs, args.seconds))
                if "poisson" not in skip:
                    found["poisson"] = {rate: asyncio.run(poisson(url, extra, short, longs, rate, args.seconds,
                                                                  args.long_share, seed=repeat)) for rate in rates}
                if args.lm and "first-token" not in skip and mode != PEER:
                    found["first_token"] = asyncio.run(first_token(url, args.completion_tokens, args.lm_clients))
                results[mode].append(found)
            finally:
                stop_server(server)
    report(results, rates, args)
    return 0


def start_peer(run: str, pair: str, passes: int) -> tuple[subprocess.Popen, str]:
    """`benchmarks/ctranslate2_front.py` serving the CTranslate2 export of `run`, `passes` batches at once."""
    front = Path(__file__).resolve().parent / "ctranslate2_front.py"
    return listening(subprocess.Popen([sys.executable, str(front), "--run", run, "--pair", pair, "--passes",
                                       str(passes)], env={**os.environ, "OMP_NUM_THREADS": "1"},
                                      stderr=subprocess.PIPE, text=True), "the CTranslate2 front")


def report(results: dict[str, list[dict]], rates: list[float], args) -> None:
    """Print the tables (medians over the repeats) and keep their figures."""
    def median(mode: str, *keys) -> float:
        values = []
        for found in results[mode]:
            value = found
            for key in keys:
                value = value.get(key, {}) if isinstance(value, dict) else {}
            if isinstance(value, (int, float)):
                values.append(value)
        return statistics.median(values) if values else float("nan")

    if results[MODES[0]] and "behind" in results[MODES[0]][0]:
        print(f"\n1. a {args.short_words}-word request behind three requests of {args.long_texts} sentences "
              "(ms; median over repeats)")
        print(f"{'batching':<10} {'alone':>8} {'behind':>8} {'x alone':>8} {'p99':>8} {'worst':>8} "
              f"{'long alone':>11} {'long mixed':>11} {'shorts':>7} {'longs':>6}")
        for mode in results:
            keys = ("alone", "behind", "p99", "worst", "long_alone", "long_mixed")
            row = {key: median(mode, "behind", key) for key in (*keys, "count", "longs")}
            print(f"{mode:<10} {1000 * row['alone']:>8.1f} {1000 * row['behind']:>8.1f} "
                  f"{row['behind'] / row['alone']:>8.1f} {1000 * row['p99']:>8.1f} {1000 * row['worst']:>8.1f} "
                  f"{1000 * row['long_alone']:>11.1f} {1000 * row['long_mixed']:>11.1f} {row['count']:>7.0f} "
                  f"{row['longs']:>6.0f}")
            for key in keys:
                figure(f"{mode}, short request behind long ones: {key}", 1000 * row[key], "ms")
    if results[MODES[0]] and "poisson" in results[MODES[0]][0]:
        print(f"\n2. Poisson arrivals, {args.long_share:.0%} long requests, {args.seconds:.0f} s a rate (ms; "
              "sentences a second)")
        print(f"{'rate /s':>7} {'batching':<10} {'short p50':>10} {'short p99':>10} {'long p50':>10} {'sent./s':>8}")
        for rate in rates:
            for mode in results:
                p50, p99, long50, tput = (median(mode, "poisson", rate, key)
                                          for key in ("short_p50", "short_p99", "long_p50", "texts_per_s"))
                print(f"{rate:>7g} {mode:<10} {1000 * p50:>10.1f} {1000 * p99:>10.1f} {1000 * long50:>10.1f} "
                      f"{tput:>8.1f}")
                figure(f"{mode}, Poisson short p99", 1000 * p99, "ms", rate=rate)
                figure(f"{mode}, Poisson short p50", 1000 * p50, "ms", rate=rate)
                figure(f"{mode}, Poisson sentences", tput, "sentences/s", rate=rate)
    if args.lm and results[MODES[0]] and "first_token" in results[MODES[0]][0]:
        print(f"\n3. a {args.completion_tokens}-token completion while {args.lm_clients} clients ask for others "
              "(ms: first text, whole answer)")
        for mode in MODES:  # (the peer serves no language model)
            firsts = [found["first_token"][0] for found in results[mode]]
            wholes = [found["first_token"][1] for found in results[mode]]
            first, whole = statistics.median(firsts), statistics.median(wholes)
            print(f"{mode:<10} first {1000 * first:>9.1f}   whole {1000 * whole:>9.1f}")
            figure(f"{mode}, first token of a {args.completion_tokens}-token completion", 1000 * first, "ms")


if __name__ == "__main__":
    sys.exit(main())
