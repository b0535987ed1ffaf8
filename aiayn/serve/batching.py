"""Batching across requests: jobs that arrive within a few milliseconds run as one batched call.

Each loaded object has a `Batcher`. A request becomes a job (its texts and their token count) in the
batcher's queue. The batcher waits for a free forward pass (`Passes`, shared by every model of
the server, so torch threads x concurrent passes stay within the cores), then until the oldest queued
job has waited the gathering window (`max_wait`) or the queued jobs fill the token budget, and hands
the texts of the jobs it took to the object's own batched call in a worker thread; that call sorts them
by length and cuts them into padded batches (`Translator.translations`, `Embedder.embed`, `.predict`).
Each job gets back its own slice. While every pass is busy, jobs keep queueing, so batches grow with
the load. While other passes are idle, a batch takes only its share of the queue (the queued texts over
the idle passes), so that the passes run side by side: taking everything would leave the other passes
idle, and the clients, all answered by one batch, would come back together for the next one (a convoy,
in which the workers take turns instead of running together: measured in docs/notes.md).

A job whose client went away before its batch started is dropped; a batch that raises is retried one
job at a time, so an error in one request fails only that request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from aiayn.inference.threads import own_count
from aiayn.serve.limits import Stopped

logger = logging.getLogger(__name__)


class QueueFull(Exception):
    """The model's queue holds `max_queue` texts already: the client should retry later (HTTP 429)."""


class Passes:
    """At most `size` forward passes at once, each in a worker thread of its own using `threads` torch threads.

    `size` x `threads` is what the server asks of the cores; keep it at or under their number.
    """

    def __init__(self, size: int, threads: int = 1):
        if size < 1 or threads < 1:
            raise ValueError(f"concurrent passes and threads must be at least 1, got {size} and {threads}")
        self.size, self.threads = size, threads
        self.executor = ThreadPoolExecutor(max_workers=size, thread_name_prefix="aiayn-pass",
                                           initializer=own_count, initargs=(threads,))
        self.busy = 0  # passes held now
        self.waiting = 0  # callers of `acquire` not yet given a pass
        self._free: asyncio.Semaphore | None = None  # made on the event loop that uses it

    @property
    def free(self) -> asyncio.Semaphore:
        """The semaphore of free passes (created on first use, inside the running loop)."""
        if self._free is None:
            self._free = asyncio.Semaphore(self.size)
        return self._free

    @property
    def idle(self) -> int:
        """Passes nobody holds now and nobody waits for (a released pass goes to a waiter, which counts it busy
        only once it runs again)."""
        return max(0, self.size - self.busy - self.waiting)

    async def acquire(self) -> None:
        """Wait for a free pass and hold it."""
        self.waiting += 1
        try:
            await self.free.acquire()
        finally:
            self.waiting -= 1
        self.busy += 1

    def release(self) -> None:
        """Give a held pass back."""
        self.busy -= 1
        self.free.release()

    @contextlib.asynccontextmanager
    async def held(self):
        """Hold a pass for the duration of the block."""
        await self.acquire()
        try:
            yield
        finally:
            self.release()

    def close(self) -> None:
        """Stop the worker threads once the passes running now have finished."""
        self.executor.shutdown(wait=True)


@dataclass(eq=False)
class Job:
    """One request's texts, their cost in tokens and the future its answer goes to."""

    texts: list
    tokens: int
    future: asyncio.Future
    queued_at: float = field(default_factory=time.perf_counter)


class Batcher:
    """Gathers the jobs for one model into batches of at most `max_tokens` tokens and runs them.

    Args:
        run: the object's batched call: a list of texts -> a list of results, one per text, in order.
        passes: the server's forward passes.
        max_tokens: token budget of one gathered batch (a single larger job still runs, alone).
        max_texts: most texts in one gathered batch (0: no cap): smaller batches let the next batch
            compute while the answers of the last one are written and their clients send again.
        max_wait: seconds the oldest queued job waits (from its arrival) for others to join its batch; a job
            that waited that long for a free pass already runs at once.
        max_queue: most texts waiting; a job beyond it raises `QueueFull`.
        observe: called as observe(texts, tokens, seconds) after each batch ran (metrics).
        streams: `run` also takes `on_result(i, result)`, called (in the pass's thread) as each text's result
            is known: a job is answered once its own texts are, not when the slowest text of its batch is.
    """

    def __init__(self, run: Callable[[list], Sequence], passes: Passes, *, max_tokens: int = 4096,
                 max_texts: int = 0, max_wait: float = 0.005, max_queue: int = 1024,
                 observe: Callable[[int, int, float], None] | None = None, streams: bool = False):
        self.run, self.passes, self.streams = run, passes, streams
        self.max_tokens, self.max_texts, self.max_wait, self.max_queue = max_tokens, max_texts, max_wait, max_queue
        self.observe = observe
        self.queue: deque[Job] = deque()
        self._arrived: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._running: set[asyncio.Task] = set()

    @property
    def queued_texts(self) -> int:
        """Texts waiting for a batch."""
        return sum(len(job.texts) for job in self.queue if not job.future.done())

    async def submit(self, texts: list, tokens: int) -> list:
        """The results of `texts` (one per text), computed in a batch with whatever else is queued.

        Raises QueueFull when the queue is full; if the caller is cancelled (its client went away)
        before the batch started, its job leaves the queue.
        """
        if self.queued_texts + len(texts) > self.max_queue:
            raise QueueFull(f"the queue holds {self.queued_texts} texts (at most {self.max_queue}); retry later")
        self._start()
        job = Job(list(texts), tokens, asyncio.get_running_loop().create_future())
        self.queue.append(job)
        self._arrived.set()
        try:
            return await job.future
        except asyncio.CancelledError:  # the caller went away (the future is cancelled with it): free its place
            job.future.cancel()
            if job in self.queue:
                self.queue.remove(job)
            raise

    def _start(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._arrived = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._gather_loop())
            self._loop_task.add_done_callback(self._gathering_ended)

    def _gathering_ended(self, task: asyncio.Task) -> None:
        """The gathering loop never returns; if it raised, fail the queued jobs (not leave them waiting forever)."""
        if task is not self._loop_task or task.cancelled() or task.exception() is None:
            return  # (a submit in between may have started another loop: its jobs are not this one's)
        err = task.exception()
        logger.error("the batcher of %d queued jobs stopped: %s: %s", len(self.queue), type(err).__name__, err,
                     exc_info=err)
        while self.queue:
            _settle(self.queue.popleft(), error=RuntimeError(f"the batcher failed ({type(err).__name__}: {err}); "
                                                             "retry the request"))

    async def _gather_loop(self) -> None:
        while True:
            while not self.queue:
                self._arrived.clear()
                await self._arrived.wait()
            await self.passes.acquire()
            try:
                jobs = await self._gather()
            except BaseException:
                self.passes.release()
                raise
            if not jobs:
                self.passes.release()
                continue
            self._start_batch(jobs)

    def _start_batch(self, jobs: list[Job]) -> asyncio.Task:
        """Run the jobs as a task on the pass the gathering loop holds; `_batch_ended` gives the pass back."""
        task = asyncio.get_running_loop().create_task(self._run_batch(jobs))
        self._running.add(task)
        task.add_done_callback(lambda task: self._batch_ended(task, jobs))
        return task

    def _batch_ended(self, task: asyncio.Task, jobs: list[Job]) -> None:
        """Give the batch's pass back, also when its task was cancelled (the server stopping) before it ran or
        failed outside the model's call; the jobs it left unanswered get an error rather than wait forever."""
        self._running.discard(task)
        self.passes.release()
        err = None if task.cancelled() else task.exception()
        if err is not None:
            logger.error("a batch of %d requests failed: %s: %s", len(jobs), type(err).__name__, err, exc_info=err)
        unanswered = [job for job in jobs if not job.future.done()]
        if not unanswered:
            return
        if err is None:
            error = Stopped()
        else:
            error = RuntimeError(f"the batch of this request failed ({type(err).__name__}: {err}); retry it")
        for job in unanswered:
            _settle(job, error=error)

    async def _gather(self) -> list[Job]:
        """The jobs of the next batch, once the oldest has waited its window or the queue fills a batch."""
        while self.queue and self.queue[0].future.done():  # clients that went away while it waited
            self.queue.popleft()
        if not self.queue:
            return []  # the loop gives the pass back and waits for the next job
        deadline = self.queue[0].queued_at + self.max_wait
        while (remaining := deadline - time.perf_counter()) > 0 and not self._full():
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), remaining)
            except asyncio.TimeoutError:
                break
        return self._take(share=1 + self.passes.idle)

    def _full(self) -> bool:
        """Whether the queued jobs already fill a batch (its token budget or its number of texts)."""
        waiting = [job for job in self.queue if not job.future.done()]
        return (sum(job.tokens for job in waiting) >= self.max_tokens
                or 0 < self.max_texts <= sum(len(job.texts) for job in waiting))

    def _take(self, share: int = 1) -> list[Job]:
        """Jobs from the head of the queue while they fit the token budget, the text cap and 1 / `share` of the
        queued texts (the passes that could take the rest); always at least one."""
        jobs: list[Job] = []
        tokens = texts = 0
        mine = -(-self.queued_texts // share)  # ceil
        while self.queue:
            job = self.queue[0]
            if job.future.done():
                self.queue.popleft()
                continue
            if jobs and (tokens + job.tokens > self.max_tokens
                         or 0 < self.max_texts < texts + len(job.texts) or texts >= mine):
                break
            jobs.append(self.queue.popleft())
            tokens += job.tokens
            texts += len(job.texts)
        return jobs

    async def _run_batch(self, jobs: list[Job]) -> None:
        """Run the jobs as one call (the model's batched call in a pass's thread); a failed batch runs job by job."""
        loop = asyncio.get_running_loop()
        texts = [text for job in jobs for text in job.texts]
        args = (texts, self._answering(jobs, loop)) if self.streams else (texts,)
        start = time.perf_counter()
        try:
            results = list(await loop.run_in_executor(self.passes.executor, self.run, *args))
        except Exception as err:
            if len(jobs) == 1:
                _settle(jobs[0], error=err)
                return
            logger.warning("a batch of %d requests failed (%s); running them one at a time", len(jobs), err)
            for job in jobs:
                if not job.future.done():  # (answered before the failure, or its client went away)
                    await self._run_alone(job)
            return
        if self.observe is not None:
            self.observe(len(texts), sum(job.tokens for job in jobs), time.perf_counter() - start)
        offset = 0
        for job in jobs:
            _settle(job, results=results[offset : offset + len(job.texts)])
            offset += len(job.texts)

    @staticmethod
    def _answering(jobs: list[Job], loop: asyncio.AbstractEventLoop) -> Callable[[int, object], None]:
        """`on_result` for a streaming `run` of `jobs`' texts: each job is answered on the loop once its own
        texts' results have all come (from the pass's thread)."""
        owner = [(job, k) for job in jobs for k in range(len(job.texts))]  # text i -> its job and place there
        partial = {id(job): [None] * len(job.texts) for job in jobs}
        missing = {id(job): len(job.texts) for job in jobs}

        def arrived(i: int, result: object) -> None:  # on the loop
            job, k = owner[i]
            partial[id(job)][k] = result
            missing[id(job)] -= 1
            if missing[id(job)] == 0:
                _settle(job, results=partial[id(job)])

        return lambda i, result: loop.call_soon_threadsafe(arrived, i, result)

    async def _run_alone(self, job: Job) -> None:
        loop = asyncio.get_running_loop()
        args = (job.texts, self._answering([job], loop)) if self.streams else (job.texts,)
        try:
            _settle(job, results=list(await loop.run_in_executor(self.passes.executor, self.run, *args)))
        except Exception as err:
            _settle(job, error=err)


def _settle(job: Job, *, results: list | None = None, error: BaseException | None = None) -> None:
    if job.future.done():  # its client went away meanwhile
        return
    if error is not None:
        job.future.set_exception(error)
    else:
        job.future.set_result(results)
