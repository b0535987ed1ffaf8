"""Running batches in worker processes: one process a pass, each stepping its own lanes (`aiayn.serve.stepping`).

In threads of one process, two passes take turns at Python's lock between their torch calls: a short request's steps
ran 4x slower beside a large batch's than alone (docs/notes.md, "Serving"). Here each worker process loads the
decoding models itself (`spawn`, as `aiayn.serve.workers`), and runs one loop: read the requests the server sent
(without waiting while it has work), give them to its `Lanes`, work on the lane that has had the least time, send
back the tokens each step made (for the requests that stream) and the answers of the requests that ended. The server
sends a request to the worker with the fewest texts in flight, and a cancellation when its client goes away.

A worker that dies, or stops answering (the pool's `Watchdog` kills a worker whose heartbeat is silent, as
`aiayn.serve.workers` explains), fails the requests it held (one clear line each) and is replaced. Workers ignore
SIGINT and SIGTERM (the server drains first) and exit when the server closes their pipe.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import threading
import time
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection

from aiayn.serve.limits import Stopped, WorkerLost
from aiayn.serve.stepping import Job, Lanes, check_room, settle
from aiayn.serve.workers import (
    SILENT_SECONDS,
    WARM_UP_TEXT,
    Watchdog,
    WorkerProcess,
    health,
    heartbeat,
    loaded,
    sendable,
    stop_all,
)

logger = logging.getLogger(__name__)

REPORT_SECONDS = 0.25  # how often a worker sends its steps' counts (metrics)
# A streaming request's tokens are sent at most this often (the first at once): a message, and a chunk of the stream,
# a step cost the server's process as much as a step of a small model (the last tokens come with the answer)
TOKENS_SECONDS = 0.02


class StepWorkers:
    """`size` worker processes stepping the decoding models of `sources` (name -> what `aiayn.load` takes).

    Args:
        parts: parts(obj, payload, max_tokens=..., on_tokens=...) -> (parts, finish), a function at the top of a
            module (each worker imports it by name): `aiayn.serve.models.stepped_parts`.
        threads: torch threads in each worker.
        max_rows, max_tokens: each worker's `Lanes`'.
        max_queue: most texts waiting to join a model's lanes, as the workers last said (429 beyond).
        tokens_seconds: a streaming request's tokens are sent at most this often.
        observe, first_token: metrics, as observe(model, rows, seconds) and first_token(model, seconds).
        silent_s: a worker silent this long is killed and replaced (`Watchdog`).
    """

    def __init__(self, sources: Mapping[str, str], size: int, *, parts: Callable, threads: int = 1,
                 device: str | None = None, max_rows: int = 1024, max_tokens: int = 4096, max_queue: int = 1024,
                 tokens_seconds: float = TOKENS_SECONDS,
                 observe: Callable[[str, int, float], None] | None = None,
                 first_token: Callable[[str, float], None] | None = None, silent_s: float = SILENT_SECONDS):
        self.sources, self.size, self.parts, self.threads, self.device = dict(sources), size, parts, threads, device
        self.settings = {"max_rows": max_rows, "max_tokens": max_tokens}
        self.tokens_seconds = tokens_seconds
        self.max_queue = max_queue
        self.observe, self.first_token = observe, first_token
        self._context = multiprocessing.get_context("spawn")
        self._workers: list[_Worker] = []
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.replaced = 0  # workers replaced since the start
        self.watchdog = Watchdog(lambda: list(self._workers), silent_s)

    def start(self) -> None:
        """Start the workers and wait until each has loaded the models (RuntimeError naming what failed)."""
        workers: list[_Worker] = []
        try:
            workers = [self._spawn() for _ in range(self.size)]  # they load side by side
            for worker in workers:
                worker.ready()
        except BaseException:
            for worker in workers:
                worker.stop(timeout=0)
            raise
        self._workers = workers
        for worker in workers:
            threading.Thread(target=self._read, args=(worker,), name="aiayn-steps-reader", daemon=True).start()
        self.watchdog.start()

    def health(self) -> dict:
        """The workers for `/health`: how many run, how many answer, how many were replaced."""
        return health(self._workers, self.replaced, self.watchdog.silent_s)

    def close(self) -> None:
        """Answer the requests the workers hold with `Stopped`, then ask every worker to exit and wait for it."""
        self.watchdog.close()
        with self._lock:
            workers, self._workers = self._workers, []
        for worker in workers:
            worker.fail_all(Stopped(), self.loop)
        stop_all(workers)

    def model(self, name: str) -> StepWorkers.Model:
        """What a served model submits its requests to."""
        return StepWorkers.Model(self, name)

    class Model:
        """One model's view of the workers: `submit`, `check_room` and the metrics' counts, as `Stepper`'s."""

        def __init__(self, workers: StepWorkers, name: str):
            self.workers, self.name = workers, name

        @property
        def waiting_texts(self) -> int:
            """Texts waiting to join, as the workers last said (every quarter of a second while they work)."""
            return sum(w.waiting.get(self.name, 0) for w in self.workers._workers)

        @property
        def running_rows(self) -> int:
            """Rows in the workers' lanes, as they last said."""
            return sum(w.rows.get(self.name, 0) for w in self.workers._workers)

        def check_room(self, texts: int) -> None:
            check_room(self.waiting_texts, texts, self.workers.max_queue)

        async def submit(self, payload: list, texts: int, on_tokens: Callable[[int, int], None] | None = None):
            self.check_room(texts)
            return await self.workers.submit(self.name, payload, texts, on_tokens)

    async def submit(self, name: str, payload: list, texts: int,
                     on_tokens: Callable[[int, int], None] | None = None) -> list:
        """The answer of model `name` to `payload`, from the worker with the fewest texts in flight."""
        self.loop = asyncio.get_running_loop()
        future = self.loop.create_future()
        ident = next(self._ids)
        with self._lock:
            worker = min(self._workers, key=lambda w: w.texts())
            worker.pending[ident] = (name, texts, future, on_tokens)
        try:
            worker.send(("request", ident, name, payload, on_tokens is not None))
        except (OSError, ValueError) as err:
            worker.pending.pop(ident, None)
            raise RuntimeError(f"the worker process is gone ({err}); retry the request") from None
        try:
            return await future
        except asyncio.CancelledError:
            if worker.pending.pop(ident, None) is not None:
                try:
                    worker.send(("cancel", ident))
                except (OSError, ValueError):
                    pass
            raise

    def _read(self, worker: _Worker) -> None:
        """The server's reader of one worker's messages (a thread): tokens, answers, errors, counts."""
        while True:
            try:
                kind, *message = worker.connection.recv()
            except (EOFError, OSError, TypeError):  # (TypeError: `close` closed the pipe under this read)
                break
            if kind == "stepped":
                rows, waiting, steps, firsts = message
                worker.rows, worker.waiting = rows, waiting
                for model, count, seconds in steps:
                    if self.observe is not None:
                        self.observe(model, count, seconds)
                for model, seconds in firsts:
                    if self.first_token is not None:
                        self.first_token(model, seconds)
                continue
            ident, value = message
            entry = worker.pending.get(ident) if kind == "tokens" else worker.pending.pop(ident, None)
            if entry is None:
                continue
            _, _, future, on_tokens = entry
            if kind == "tokens":
                if on_tokens is not None:
                    for i, token in value:
                        on_tokens(i, token)
            else:
                self.loop.call_soon_threadsafe(settle, future, value if kind == "done" else None,
                                               value if kind == "error" else None)
        with self._lock:
            alive = worker in self._workers
        if not alive:
            return
        worker.stop()
        worker.fail_all(WorkerLost(f"request {worker.ended()}"), self.loop)
        logger.warning("worker process %s %s; starting another", worker.process.pid, worker.ended())
        replacement = self._spawn()
        try:
            replacement.ready()
        except RuntimeError as err:
            logger.error("could not replace a worker process: %s", err)
            return
        with self._lock:
            self._workers = [replacement if w is worker else w for w in self._workers]
            self.replaced += 1
        self._read(replacement)

    def _spawn(self) -> _Worker:
        return _Worker.spawn(self._context, "aiayn-steps", _work, self.sources, self.parts, self.threads, self.device,
                             self.settings, self.tokens_seconds)


class _Worker(WorkerProcess):
    """One worker process, the server's end of its pipe, and the requests it holds."""

    def __init__(self, process, connection: Connection, beat):
        super().__init__(process, connection, beat)
        self.pending: dict[int, tuple] = {}  # id -> (model, texts, future, on_tokens)
        self.rows: dict[str, int] = {}  # model -> rows in its lanes, as it last said
        self.waiting: dict[str, int] = {}  # model -> texts waiting to join them, as it last said
        self.sending = threading.Lock()

    def texts(self, model: str | None = None) -> int:
        """Texts of the requests it holds (of `model`, or of all)."""
        return sum(entry[1] for entry in list(self.pending.values()) if model in (None, entry[0]))

    def send(self, message: tuple) -> None:
        with self.sending:
            self.connection.send(message)

    def fail_all(self, err: BaseException, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Fail every request it holds (on `loop`, the server's)."""
        pending, self.pending = self.pending, {}
        for _, _, future, _ in pending.values():
            if loop is not None and not loop.is_closed():
                loop.call_soon_threadsafe(settle, future, None, err)


def _work(connection: Connection, beat, sources: Mapping[str, str], parts: Callable, threads: int,
          device: str | None, settings: dict, tokens_seconds: float) -> None:
    """A worker's life: its heartbeat started, load the models, warm each up, then read requests and work on the lanes
    until the pipe closes."""
    import torch

    heartbeat(beat)
    objects = loaded(connection, sources, threads, device, lambda obj: obj.prepared_model())
    if objects is None:
        return
    prepared = {name: obj.prepared_model() for name, obj in objects.items()}  # (prepared once, by the warm-up)
    steps: list[tuple[str, int, float]] = []
    firsts: list[tuple[str, float]] = []
    lanes = Lanes(prepared.__getitem__, large=1, observe=lambda *step: steps.append(step),
                  first_token=lambda *first: firsts.append(first), **settings)
    jobs: dict[int, Job] = {}
    with torch.inference_mode():
        for name, obj in objects.items():  # warm up: one short request each, through the lanes
            warm, finish = parts(obj, [WARM_UP_TEXT], max_tokens=settings["max_tokens"])
            lanes.add(Job(warm, finish, answered=lambda answer: None, failed=lambda err: None, model=name))
            while lanes.waiting or lanes.rows():
                lanes.assign()
                lanes.work(lanes.next_lane())
        steps.clear()
        firsts.clear()
        connection.send(("ready", None))
        reported = time.perf_counter()
        while True:
            try:
                busy = bool(lanes.waiting or lanes.rows())
                while not busy or connection.poll():
                    _receive(connection.recv(), connection, objects, parts, settings, lanes, jobs, tokens_seconds)
                    busy = bool(lanes.waiting or lanes.rows())
            except (EOFError, OSError):  # the server closed the pipe or exited
                return
            lanes.assign()
            lane = lanes.next_lane()
            try:
                if lane is not None:
                    lanes.work(lane)
                if steps and time.perf_counter() - reported > REPORT_SECONDS or not (lanes.waiting or lanes.rows()):
                    rows = {name: lanes.rows(name) for name in objects}
                    waiting = {name: lanes.waiting_texts(name) for name in objects}
                    connection.send(("stepped", rows, waiting, list(steps), list(firsts)))
                    steps.clear()
                    firsts.clear()
                    reported = time.perf_counter()
            except (BrokenPipeError, ConnectionResetError):  # the server closed the pipe while this step ran
                return


def _receive(message: tuple, connection: Connection, objects: dict, parts: Callable, settings: dict, lanes: Lanes,
             jobs: dict[int, Job], tokens_seconds: float) -> None:
    """Handle one message of the server: a request (its parts queued) or a cancellation."""
    kind, ident, *rest = message
    if kind == "cancel":
        job = jobs.pop(ident, None)
        if job is not None:
            job.cancel()
        return
    name, payload, streams = rest
    made: list[tuple[int, int]] = []
    last = [0.0]  # when tokens were last sent

    def answered(answer: list) -> None:
        jobs.pop(ident, None)
        connection.send(("done", ident, answer))

    def failed(err: BaseException) -> None:
        jobs.pop(ident, None)
        connection.send(("error", ident, sendable(err)))

    def on_tokens(i: int, token: int) -> None:  # a step's tokens of this request, sent together (`flushed`)
        made.append((i, token))

    try:
        found, finish = parts(objects[name], payload, max_tokens=settings["max_tokens"],
                              on_tokens=on_tokens if streams else None, part_rows=0)  # a whole request a worker
    except Exception as err:  # noqa: BLE001 - a request the model cannot take: its own error
        connection.send(("error", ident, sendable(err)))
        return
    if streams:
        for part in found:  # each step's tokens of this request, sent once the step is done
            told = part.on_tokens

            def flushed(sentences, tokens, told=told):
                told(sentences, tokens)
                if made and time.perf_counter() - last[0] >= tokens_seconds:
                    connection.send(("tokens", ident, list(made)))
                    made.clear()
                    last[0] = time.perf_counter()
            part.on_tokens = flushed
    job = Job(found, finish, answered, failed, model=name)
    if not found:
        answered(finish())
        return
    jobs[ident] = job
    lanes.add(job)
