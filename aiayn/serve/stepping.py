"""Serving at the step: every request to a decoding model joins a running batch between two steps and leaves it as
soon as its own search ends (`aiayn.inference.running`), instead of waiting for a batch of other requests to end.

A request becomes a `Job`: its `Part`s (its batches, cut as `aiayn.load`'s object cuts them, of at most `PART_ROWS`
rows) and the call that makes its answer once they have ended. `Lanes` holds the parts waiting and the running
batches ("lanes") they join: waiting parts, oldest first, go to a lane while the lanes hold at most `max_rows` rows
and the parts' source or prompt tokens stay within `max_tokens` between two steps (at least one part: a long prompt is
prefilled between steps, not all at once); whoever works on the lane next encodes or prefills them, then steps the
lane once. The lanes: by model and number of beams (the beams of a sentence read its memory together), a small one
(parts of at most `SMALL_ROWS` rows: a request of a few sentences) apart from `large` large ones (a large part joins
the one with the fewest rows). The lane worked on next is the one that has had the least time so far (a lane that was
empty starts from the least of the others'): a short request takes many cheap steps of its own between two of a large
batch's, never waiting for it to end; and its joins and departures copy no other lane's cache.

Two ways to run the lanes: `Stepper`, threads of the server's process, each on `threads` torch threads (on a GPU, or
with `--in-threads`); and `aiayn.serve.stepping_workers`, one worker process a pass (on CPU), where two passes never
take turns at Python's lock (a short request's steps ran 4x slower beside a large batch's in a thread of the same
process than alone).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from aiayn.inference.running import Part, RunningBatch
from aiayn.inference.threads import own_count
from aiayn.serve.batching import QueueFull
from aiayn.serve.limits import Stopped

logger = logging.getLogger(__name__)

SMALL_ROWS = 16  # a part of at most this many rows (sentences x beams) decodes in the small lane
# A large lane takes more parts while it holds at most this many rows: beyond, large requests wait their turn, since
# sharing a lane's steps makes each as slow as all of them together (processor sharing), where one after another
# answers the first ones sooner; a step of this many rows already uses the products well.
LARGE_ROWS = 256
# In threads, a request's texts are cut into parts of at most this many rows, so that the large lanes share a large
# request's work (a lane is stepped by one thread at a time): three requests of 64 sentences on two threads otherwise
# left one idle while the other stepped two of them. (A worker process takes whole requests: no cut there.)
PART_ROWS = 64

Build = Callable[[object, Callable[[int, int], None] | None], tuple[list[Part], Callable[[], list]]]


def part_sentences(config, rows: int = PART_ROWS) -> int:
    """Most sentences of a part of at most `rows` rows searched with `config` (at least one sentence; 0: no cap)."""
    return max(1, rows // config.num_beams) if rows else 0


@dataclass(eq=False)
class Job:
    """One request's parts; `answered(finish())` once every part has ended, or `failed(error)` at the first error
    (each called once, in whichever thread ran the part's last step)."""

    parts: list[Part]
    finish: Callable[[], list]
    answered: Callable[[list], None]
    failed: Callable[[BaseException], None]
    model: str = ""
    queued_at: float = field(default_factory=time.perf_counter)
    settled: bool = False

    def __post_init__(self) -> None:
        left = [len(self.parts)]
        for part in self.parts:
            done, failed = part.on_done, part.on_error

            def on_done(tokens, scores, done=done):
                done(tokens, scores)
                left[0] -= 1
                if left[0] == 0:
                    self.settle(None)

            def on_error(err, failed=failed):
                failed(err)
                self.settle(err)

            part.on_done, part.on_error = on_done, on_error

    def settle(self, error: BaseException | None) -> None:
        if self.settled:
            return
        self.settled = True
        if error is not None:
            self.failed(error)
            return
        try:
            answer = self.finish()
        except Exception as err:  # noqa: BLE001 (the request's own error, handed to its caller)
            self.failed(err)
            return
        self.answered(answer)

    def cancel(self) -> None:
        """Nobody waits for the answer: the parts waiting never join, those running leave at the next step."""
        self.settled = True
        for part in self.parts:
            part.cancelled = True


@dataclass(eq=False)
class Lane:
    """One running batch (made when first worked on), the parts about to join it, the seconds its joins and steps
    have taken, and whether a thread holds it."""

    model: str
    beams: int
    batch: RunningBatch | None = None
    incoming: list = field(default_factory=list)
    spent: float = 0.0
    held: bool = False

    @property
    def rows(self) -> int:
        """Its rows, and those of the parts about to join."""
        return (0 if self.batch is None else self.batch.rows) + sum(part.rows for _, part in self.incoming)


class Lanes:
    """The parts waiting and the lanes they join, for the models `prepared` names (see the module docstring). Not
    thread-safe: where threads share it, they call `add`, `assign`, `next_lane` and `fail_all` holding one lock, and
    `work` with that lock as `lock` (it takes it around what it shares).

    Args:
        prepared: model name -> the model as the backend prepared it (called the first time a lane needs it).
        large: large lanes per model and number of beams.
        max_rows: most rows (sentences x beams) the lanes hold together; parts wait beyond it.
        max_tokens: most source or prompt tokens that join between two steps (at least one part).
        observe: called as observe(model, rows, seconds) after each step (metrics).
        first_token: called as first_token(model, seconds) when a request's first step has run (metrics).
    """

    def __init__(self, prepared: Callable[[str], torch.nn.Module], *, large: int = 1, max_rows: int = 1024,
                 max_tokens: int = 4096, observe: Callable[[str, int, float], None] | None = None,
                 first_token: Callable[[str, float], None] | None = None):
        self.prepared, self.large, self.max_rows, self.max_tokens = prepared, large, max_rows, max_tokens
        self.observe, self.first_token = observe, first_token
        self.waiting: deque[tuple[Job, Part]] = deque()
        self.lanes: dict[tuple, Lane] = {}  # by (model, beams, "small") or (model, beams, "large", i)
        self.unstepped: set[Job] = set()  # jobs whose parts joined but took no step yet (time to first token)

    def add(self, job: Job) -> None:
        """Queue the job's parts."""
        self.waiting.extend((job, part) for part in job.parts)

    def waiting_texts(self, model: str | None = None) -> int:
        """Texts waiting to join (of `model`, or of all), those given to a lane but not yet joined included."""
        waiting = list(self.waiting) + [entry for lane in list(self.lanes.values()) for entry in list(lane.incoming)]
        return sum(part.ids.shape[0] for job, part in waiting if not part.cancelled and model in (None, job.model))

    def rows(self, model: str | None = None) -> int:
        """Rows in the lanes (of `model`, or of all), those about to join included."""
        return sum(lane.rows for lane in list(self.lanes.values()) if model in (None, lane.model))

    def assign(self) -> None:
        """Move waiting parts, oldest first, to their lanes while the rows and the tokens allow (always one part into
        empty lanes); cancelled ones are dropped. A large part waits while every large lane it could join holds
        `LARGE_ROWS` rows (those behind it go on: a short request does not wait behind it)."""
        rows, tokens, held = self.rows(), 0, deque()
        while self.waiting:
            job, part = self.waiting.popleft()
            if part.cancelled:
                continue
            size = part.ids.numel()
            if rows and (rows + part.rows > self.max_rows or (tokens and tokens + size > self.max_tokens)):
                self.waiting.appendleft((job, part))
                break
            lane = self._lane(job.model, part)
            if part.rows > SMALL_ROWS and lane.rows and lane.rows + part.rows > LARGE_ROWS:
                held.append((job, part))  # one large request's rows at a time in a lane: first come, first done
                continue
            lane.incoming.append((job, part))
            rows += part.rows
            tokens += size
        self.waiting.extendleft(reversed(held))

    def _lane(self, model: str, part: Part) -> Lane:
        """The lane `part` joins (made the first time), its clock brought up to the least of the busy lanes'."""
        beams = part.config.num_beams
        if part.rows <= SMALL_ROWS:
            keys = [(model, beams, "small")]
        else:  # the large lane of the fewest rows
            keys = [(model, beams, "large", i) for i in range(self.large)]
        for key in keys:
            if key not in self.lanes:
                self.lanes[key] = Lane(model, beams)
        lane = min((self.lanes[key] for key in keys), key=lambda lane: lane.rows)
        busy = [other.spent for other in self.lanes.values() if other.rows and other is not lane]
        if not lane.rows and busy:
            lane.spent = max(lane.spent, min(busy))
        return lane

    def next_lane(self) -> Lane | None:
        """The lane nobody holds, with rows or parts to join, that has had the least time; None if none."""
        ready = [lane for lane in self.lanes.values() if not lane.held and lane.rows]
        return min(ready, key=lambda lane: lane.spent) if ready else None

    def work(self, lane: Lane, lock: threading.Condition | None = None) -> None:
        """Join the lane's incoming parts, then step it once (`lock`: what threads sharing the lanes hold)."""
        lock = lock or contextlib.nullcontext()
        with lock:
            joining, lane.incoming = lane.incoming, []
        start = time.perf_counter()
        if lane.batch is None:
            lane.batch = RunningBatch(self.prepared(lane.model), lane.beams)
        lane.batch.join(*(part for _, part in joining if not part.cancelled))  # (a part that cannot start fails alone)
        with lock:
            self.unstepped.update(job for job, _ in joining)
        rows = lane.batch.rows
        if lane.batch.searching:
            stepped = time.perf_counter()
            try:
                lane.batch.step()
            except Exception as err:  # noqa: BLE001 (a step of every row failed: each part is told)
                logger.error("a step of %d rows failed: %s: %s", rows, type(err).__name__, err, exc_info=err)
                lane.batch.cancel_all(RuntimeError(f"the decoding step failed ({type(err).__name__}: {err}); "
                                                   "retry it"))
            else:
                now = time.perf_counter()
                if self.observe is not None:
                    self.observe(lane.model, rows, now - stepped)
                with lock:
                    first = {job for job in self.unstepped if any(part.steps_run for part in job.parts)}
                    self.unstepped = {job for job in self.unstepped - first if not job.settled}
                if self.first_token is not None:
                    for job in first:
                        self.first_token(job.model, now - job.queued_at)
        lane.spent += time.perf_counter() - start

    def fail_all(self, err: BaseException) -> None:
        """Fail every part waiting or in a lane that nobody holds."""
        waiting, self.waiting = list(self.waiting), deque()
        for lane in self.lanes.values():
            waiting += lane.incoming
            lane.incoming = []
            if lane.batch is not None and not lane.held:
                lane.batch.cancel_all(err)
        for _, part in waiting:
            if not part.cancelled:
                part.on_error(err)


class Stepper:
    """One decoding model's lanes, worked on by threads of the server's process (see the module docstring).

    Args:
        build: build(payload, on_tokens) -> (parts, finish): a request's parts (ValueError for one the model cannot
            take) and the call that makes its answer once they have ended; `on_tokens(index, token)`, given, hears of
            each token made (streaming).
        prepared: a callable returning the model as the backend prepared it (called once, in a worker thread).
        threads: torch threads of each worker thread.
        workers: worker threads (and large lanes).
        max_queue: most texts waiting to join; a request beyond it raises `QueueFull` (HTTP 429).
        max_rows, max_tokens, observe, first_token: `Lanes`' (observe and first_token without the model's name).
    """

    def __init__(self, build: Build, prepared: Callable[[], torch.nn.Module], *, threads: int = 1, workers: int = 1,
                 max_rows: int = 1024, max_tokens: int = 4096, max_queue: int = 1024,
                 observe: Callable[[int, float], None] | None = None,
                 first_token: Callable[[float], None] | None = None):
        self.build, self.threads, self.workers, self.max_queue = build, threads, workers, max_queue
        self.model: torch.nn.Module | None = None
        self.preparing = threading.Lock()

        def model(_: str) -> torch.nn.Module:
            with self.preparing:
                if self.model is None:
                    self.model = prepared()
            return self.model

        self.lanes = Lanes(model, large=workers, max_rows=max_rows, max_tokens=max_tokens,
                           observe=None if observe is None else lambda _, rows, seconds: observe(rows, seconds),
                           first_token=None if first_token is None else lambda _, seconds: first_token(seconds))
        self.wake = threading.Condition()
        self.threads_running: list[threading.Thread] = []
        self.closed = False

    @property
    def waiting_texts(self) -> int:
        return self.lanes.waiting_texts()

    @property
    def running_rows(self) -> int:
        return self.lanes.rows()

    def check_room(self, texts: int) -> None:
        """Raise QueueFull when `texts` more would make too many wait (HTTP 429)."""
        check_room(self.waiting_texts, texts, self.max_queue)

    async def submit(self, payload: object, texts: int, on_tokens: Callable[[int, int], None] | None = None) -> list:
        """The answer to `payload` (`build`'s), its parts decoded in the lanes. Raises QueueFull when too many texts
        wait, ValueError for a payload the model cannot take; a cancelled caller cancels its parts."""
        self.check_room(texts)
        parts, finish = self.build(payload, on_tokens)
        if not parts:
            return finish()
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        job = Job(parts, finish, answered=lambda answer: loop.call_soon_threadsafe(settle, future, answer, None),
                  failed=lambda err: loop.call_soon_threadsafe(settle, future, None, err))
        with self.wake:
            self.lanes.add(job)
            self._start()
            self.wake.notify()
        try:
            return await future
        except asyncio.CancelledError:
            job.cancel()
            raise

    def _start(self) -> None:
        self.threads_running = [t for t in self.threads_running if t.is_alive()]
        while len(self.threads_running) < self.workers:
            thread = threading.Thread(target=self._run, name=f"aiayn-steps-{len(self.threads_running)}", daemon=True)
            self.threads_running.append(thread)
            thread.start()

    def close(self) -> None:
        """Stop the worker threads once their current steps end; the requests left get an error."""
        with self.wake:
            self.closed = True
            self.wake.notify_all()
        for thread in self.threads_running:
            thread.join(timeout=30)
        with self.wake:
            self.lanes.fail_all(Stopped())

    def _run(self) -> None:
        own_count(self.threads)
        try:
            with torch.inference_mode():
                while True:
                    with self.wake:
                        self.lanes.assign()
                        while not self.closed and (lane := self.lanes.next_lane()) is None:
                            self.wake.wait()
                            self.lanes.assign()
                        if self.closed:
                            return
                        lane.held = True
                    try:
                        self.lanes.work(lane, self.wake)
                    finally:
                        with self.wake:
                            lane.held = False
                            self.wake.notify_all()
        except Exception as err:  # noqa: BLE001 (every request waiting is told)
            logger.error("a stepping thread stopped: %s: %s", type(err).__name__, err, exc_info=err)
            with self.wake:
                self.closed = True
                self.wake.notify_all()
                self.lanes.fail_all(RuntimeError(f"the running batch failed ({type(err).__name__}: {err}); retry "
                                                 "the request"))


def check_room(waiting: int, texts: int, max_queue: int) -> None:
    """QueueFull (HTTP 429) where `texts` more beside `waiting` would be more than `max_queue` waiting to join."""
    if waiting + texts > max_queue:
        raise QueueFull(f"{waiting} texts wait to join a running batch (at most {max_queue}); retry later")


def settle(future: asyncio.Future, result: object, error: BaseException | None) -> None:
    """Give `future` its result or error, unless it is done already (cancelled: its client went away)."""
    if future.done():  # cancelled: its client went away
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
