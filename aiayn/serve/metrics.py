"""The server's counters in the Prometheus text format (`GET /metrics`), kept in this process only.

Requests and latencies by route and status, texts waiting in each model's queue, batch sizes in texts
and tokens. Nothing here is shared between processes: each replica behind a load balancer is scraped
on its own.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable, Sequence

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class Histogram:
    """Cumulative-bucket histogram as Prometheus keeps one (le buckets, sum, count)."""

    def __init__(self, buckets: Sequence[float]):
        self.buckets = tuple(buckets)
        self.counts = [0] * len(self.buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        """Count one value."""
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str, labels: str) -> list[str]:
        """The `_bucket`, `_sum` and `_count` lines, with `labels` ('route="/x"', or '')."""
        sep = "," if labels else ""
        out = [f'{name}_bucket{{{labels}{sep}le="{_number(b)}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        out.append(f'{name}_bucket{{{labels}{sep}le="+Inf"}} {self.count}')
        braces = f"{{{labels}}}" if labels else ""
        return out + [f"{name}_sum{braces} {self.sum:.6f}", f"{name}_count{braces} {self.count}"]


def label(value: object) -> str:
    """A label value as the text format writes it: backslash, double quote and newline escaped."""
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


class Metrics:
    """Everything `/metrics` reports; safe to update from the event loop and from worker threads."""

    def __init__(self):
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = defaultdict(int)
        self.latency: dict[str, Histogram] = defaultdict(lambda: Histogram(LATENCY_BUCKETS))
        self.batch_texts: dict[str, Histogram] = defaultdict(lambda: Histogram(BATCH_BUCKETS))
        self.tokens: dict[str, int] = defaultdict(int)
        self.in_flight = 0
        self.queues: dict[str, Callable[[], int]] = {}  # model -> texts waiting now
        self.running: dict[str, Callable[[], int]] = {}  # model -> rows in its running batch now
        self.steps: dict[str, int] = defaultdict(int)
        self.step_rows: dict[str, Histogram] = defaultdict(lambda: Histogram(BATCH_BUCKETS))
        self.step_seconds: dict[str, Histogram] = defaultdict(lambda: Histogram(STEP_BUCKETS))
        self.first_step: dict[str, Histogram] = defaultdict(lambda: Histogram(LATENCY_BUCKETS))

    def request_done(self, route: str, status: int, seconds: float) -> None:
        """Count a finished request of `route` with its status and latency."""
        with self._lock:
            self.requests[(route, status)] += 1
            self.latency[route].observe(seconds)

    def batch_done(self, model: str, texts: int, tokens: int) -> None:
        """Count one batched forward call of `model`: how many texts and tokens it held."""
        with self._lock:
            self.batch_texts[model].observe(texts)
            self.tokens[model] += tokens

    def step_done(self, model: str, rows: int, seconds: float) -> None:
        """Count one step of `model`'s running batch: its rows and how long it took."""
        with self._lock:
            self.steps[model] += 1
            self.step_rows[model].observe(rows)
            self.step_seconds[model].observe(seconds)

    def first_token(self, model: str, seconds: float) -> None:
        """Count one request's time from its arrival to the end of its first step (its first token made)."""
        with self._lock:
            self.first_step[model].observe(seconds)

    def render(self) -> str:
        """The Prometheus text exposition of every metric."""
        with self._lock:
            lines = ["# HELP aiayn_requests_total Requests answered, by route and HTTP status.",
                     "# TYPE aiayn_requests_total counter"]
            lines += [f'aiayn_requests_total{{route="{label(r)}",status="{s}"}} {n}'
                      for (r, s), n in sorted(self.requests.items())]
            lines += ["# HELP aiayn_request_seconds Time from request to answer, by route.",
                      "# TYPE aiayn_request_seconds histogram"]
            for route, hist in sorted(self.latency.items()):
                lines += hist.lines("aiayn_request_seconds", f'route="{label(route)}"')
            lines += ["# HELP aiayn_requests_in_flight Requests being handled now.",
                      "# TYPE aiayn_requests_in_flight gauge", f"aiayn_requests_in_flight {self.in_flight}"]
            lines += ["# HELP aiayn_queue_texts Texts waiting for a batch, by model.", "# TYPE aiayn_queue_texts gauge"]
            lines += [f'aiayn_queue_texts{{model="{label(m)}"}} {size()}' for m, size in sorted(self.queues.items())]
            lines += ["# HELP aiayn_batch_texts Texts per batched forward call, by model.",
                      "# TYPE aiayn_batch_texts histogram"]
            for model, hist in sorted(self.batch_texts.items()):
                lines += hist.lines("aiayn_batch_texts", f'model="{label(model)}"')
            lines += ["# HELP aiayn_running_rows Rows (sentences x beams) in a model's running batch now.",
                      "# TYPE aiayn_running_rows gauge"]
            lines += [f'aiayn_running_rows{{model="{label(m)}"}} {rows()}' for m, rows in sorted(self.running.items())]
            lines += ["# HELP aiayn_steps_total Steps of each model's running batch.",
                      "# TYPE aiayn_steps_total counter"]
            lines += [f'aiayn_steps_total{{model="{label(m)}"}} {n}' for m, n in sorted(self.steps.items())]
            lines += ["# HELP aiayn_step_rows Rows per step of a running batch, by model.",
                      "# TYPE aiayn_step_rows histogram"]
            for model, hist in sorted(self.step_rows.items()):
                lines += hist.lines("aiayn_step_rows", f'model="{label(model)}"')
            lines += ["# HELP aiayn_step_seconds Time of one step of a running batch, by model.",
                      "# TYPE aiayn_step_seconds histogram"]
            for model, hist in sorted(self.step_seconds.items()):
                lines += hist.lines("aiayn_step_seconds", f'model="{label(model)}"')
            lines += ["# HELP aiayn_first_token_seconds Time from a request's arrival to its first token, by model.",
                      "# TYPE aiayn_first_token_seconds histogram"]
            for model, hist in sorted(self.first_step.items()):
                lines += hist.lines("aiayn_first_token_seconds", f'model="{label(model)}"')
            lines += ["# HELP aiayn_tokens_total Input tokens run through each model.",
                      "# TYPE aiayn_tokens_total counter"]
            lines += [f'aiayn_tokens_total{{model="{label(m)}"}} {n}' for m, n in sorted(self.tokens.items())]
        return "\n".join(lines) + "\n"
