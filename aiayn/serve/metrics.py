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


def _family(name: str, kind: str, text: str, by: dict, key: str = "model") -> list[str]:
    """One metric's HELP and TYPE lines and a line (a histogram's lines) for each of `by`'s keys, labelled `key`: a
    value, a callable giving it now, or a `Histogram`."""
    lines = [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
    for item, value in sorted(by.items()):
        labels = f'{key}="{label(item)}"'
        if isinstance(value, Histogram):
            lines += value.lines(name, labels)
        else:
            lines.append(f"{name}{{{labels}}} {value() if callable(value) else value}")
    return lines


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
        self.cut = 0  # requests the stopping server did not answer (503)
        self.cut_midway = 0  # answers (streamed) the stopping server cut short
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
            lines += _family("aiayn_request_seconds", "histogram", "Time from request to answer, by route.",
                             self.latency, "route")
            lines += ["# HELP aiayn_requests_in_flight Requests being handled now.",
                      "# TYPE aiayn_requests_in_flight gauge", f"aiayn_requests_in_flight {self.in_flight}"]
            for name, kind, text, by in (
                    ("aiayn_queue_texts", "gauge", "Texts waiting for a batch, by model.", self.queues),
                    ("aiayn_batch_texts", "histogram", "Texts per batched forward call, by model.", self.batch_texts),
                    ("aiayn_running_rows", "gauge", "Rows (sentences x beams) in a model's running batch now.",
                     self.running),
                    ("aiayn_steps_total", "counter", "Steps of each model's running batch.", self.steps),
                    ("aiayn_step_rows", "histogram", "Rows per step of a running batch, by model.", self.step_rows),
                    ("aiayn_step_seconds", "histogram", "Time of one step of a running batch, by model.",
                     self.step_seconds),
                    ("aiayn_first_token_seconds", "histogram",
                     "Time from a request's arrival to its first token, by model.", self.first_step),
                    ("aiayn_tokens_total", "counter", "Input tokens run through each model.", self.tokens)):
                lines += _family(name, kind, text, by)
        return "\n".join(lines) + "\n"
