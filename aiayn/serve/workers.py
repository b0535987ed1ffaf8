"""Forward passes in worker processes: one process a pass, so that the passes never share Python's lock.

A decoding step of a small model is a few dozen small torch calls, and between them the Python that drives
them holds the interpreter's lock (the GIL). Two passes in threads of one process take turns at that lock
and run no faster than one; in processes of their own they run side by side, one core each. `WorkerPool`
starts `size` processes (`spawn`: nothing of the server's threads is copied into them), each loading the
served models itself from where the server loaded them and running one short call of each before it says
it is ready (so that the first request does not pay for loading or preparing the kernels).

`WorkerPool.call(name, texts, options)` sends one batch to an idle worker and waits for its answer (in the
server's pass thread, which waits without holding the lock); a translator's worker also sends each sentence's
translation as its search ends, which `on_result` hears before the batch's answer. The server bounds the calls
in flight by the pool's size, so an idle worker is always there. A worker that dies (a crash, the kernel's OOM
killer) is replaced, and the batch it was running fails with one clear line; the batcher then retries that
batch's requests not yet answered one at a time, so the others are answered.

A worker that stops answering without dying (stopped by SIGSTOP, frozen, starved of CPU) would hold its batch
forever: each worker has a heartbeat, a thread of its own writing the time into memory shared with the server every
`BEAT_SECONDS`, beside its work (torch's products release Python's lock, so a long batch does not silence it). The
pool's `Watchdog` kills a worker silent for `SILENT_SECONDS`; it is then replaced as one that died, and `/health`
says how many were (`health`).

Workers ignore SIGINT and SIGTERM (the server drains its requests first, and needs them for that) and exit
when the server closes their pipe or exits.
"""

from __future__ import annotations

import logging
import multiprocessing
import pickle
import queue
import signal
import threading
import time
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection
from typing import Any

from aiayn.serve.limits import WorkerLost

logger = logging.getLogger(__name__)

WARM_UP_TEXT = "Hello, world."
BEAT_SECONDS = 0.5  # how often a worker's heartbeat writes the time
SILENT_SECONDS = 10.0  # a worker whose heartbeat is older than this is killed and replaced


class WorkerPool:
    """`size` worker processes, each holding every served model, loaded from `sources`.

    Args:
        sources: model name -> what `aiayn.load` takes for it (a run directory, `minilm`, ...).
        size: worker processes (the server's passes).
        batched_call: runs a batch on a loaded object, `batched_call(obj, texts, **options)` -> one result per
            text (and, given `on_result`, each as soon as it is known): `aiayn.serve.models.batched_call`. A
            function at the top of a module, which each worker process imports by its name.
        threads: torch threads in each worker.
        device: the device the workers load the models on.
        silent_s: a worker silent this long is killed and replaced (`Watchdog`).
    """

    def __init__(self, sources: Mapping[str, str], size: int, *, batched_call: Callable[..., list], threads: int = 1,
                 device: str | None = None, silent_s: float = SILENT_SECONDS):
        if size < 1 or threads < 1:
            raise ValueError(f"worker processes and threads must be at least 1, got {size} and {threads}")
        self.sources, self.size, self.threads, self.device = dict(sources), size, threads, device
        self.batched_call = batched_call
        self._context = multiprocessing.get_context("spawn")
        self._idle: queue.SimpleQueue[WorkerProcess] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._workers: list[WorkerProcess] = []
        self.replaced = 0  # workers replaced since the start
        self.watchdog = Watchdog(lambda: list(self._workers), silent_s)

    def start(self) -> None:
        """Start the workers and wait until each has loaded the models (RuntimeError naming what failed). Whatever
        ends it (a worker that cannot load, Ctrl-C, SIGTERM), the workers it started are ended first: they
        ignore SIGTERM, and the interpreter would wait for them at exit."""
        workers: list[WorkerProcess] = []
        try:
            for _ in range(self.size):  # they load side by side
                workers.append(self._spawn())
            for worker in workers:
                worker.ready()
        except BaseException:
            for worker in workers:
                worker.stop(timeout=0)  # (one still loading does not read its pipe: no use waiting)
            raise
        for worker in workers:
            self._workers.append(worker)
            self._idle.put(worker)
        self.watchdog.start()

    def health(self) -> dict:
        """The workers for `/health`: how many run, how many answer, how many were replaced."""
        return health(self._workers, self.replaced, self.watchdog.silent_s)

    def call(self, name: str, texts: list, options: Mapping,
             on_result: Callable[[int, Any], None] | None = None) -> list:
        """The results of `texts` from model `name`'s batched call with `options`, computed in an idle worker;
        with `on_result`, each text's result as the worker sends it, before the batch's end."""
        worker = self._idle.get()
        try:
            if not worker.alive():  # it died while idle: replace it before it takes a batch
                worker = self._replace(worker)
            try:
                status, value = worker.ask((name, texts, dict(options), on_result is not None), on_result)
            except (EOFError, OSError):  # it died under this batch: replace it, fail only this batch
                dead, worker = worker, self._replace(worker)
                raise WorkerLost(f"batch {dead.ended()}") from None
        finally:
            self._idle.put(worker)
        if status == "error":
            raise value
        return value

    def _replace(self, worker: WorkerProcess) -> WorkerProcess:
        """A new worker in `worker`'s place (`worker` is stopped and reaped first)."""
        worker.stop()
        logger.warning("worker process %s %s; starting another", worker.process.pid, worker.ended())
        replacement = self._spawn()
        replacement.ready()
        with self._lock:
            self._workers = [replacement if w is worker else w for w in self._workers]
            self.replaced += 1
        return replacement

    def close(self) -> None:
        """Ask every worker to exit and wait for it (a worker that does not exit in time is killed)."""
        self.watchdog.close()
        with self._lock:
            workers, self._workers = self._workers, []
        stop_all(workers)

    def _spawn(self) -> WorkerProcess:
        return WorkerProcess.spawn(self._context, "aiayn-pass", _work, self.sources, self.batched_call, self.threads,
                                   self.device)


class WorkerProcess:
    """One worker process, the server's end of its pipe, and its heartbeat (the time it last wrote, shared)."""

    def __init__(self, process, connection: Connection, beat):
        self.process, self.connection, self.beat = process, connection, beat
        self.silenced = 0.0  # how long it had been silent when the watchdog killed it (0: never)

    @classmethod
    def spawn(cls, context, name: str, work: Callable, *args) -> WorkerProcess:
        """A started process running `work(connection, beat, *args)`."""
        parent, child = context.Pipe()
        beat = context.RawValue("d", time.monotonic())
        process = context.Process(target=work, args=(child, beat, *args), name=name, daemon=True)
        process.start()
        child.close()
        return cls(process, parent, beat)

    def silent_for(self) -> float:
        """Seconds since its heartbeat last wrote."""
        return time.monotonic() - self.beat.value

    def ended(self) -> str:
        """How it ended, for a line: "died (exit code N)" or "stopped answering ..." (killed by the watchdog)."""
        if self.silenced:
            return f"stopped answering (silent for {self.silenced:.0f} s) and was killed"
        return f"died (exit code {self.process.exitcode})"

    def ready(self) -> None:
        """Wait for the worker's first message: ready, or why it could not load the models."""
        try:
            status, value = self.connection.recv()
        except EOFError:
            self.process.join()
            raise RuntimeError(f"a worker process exited while loading the models (exit code "
                               f"{self.process.exitcode})") from None
        if status != "ready":
            self.stop()
            raise RuntimeError(f"a worker process could not load the models: {value}")

    def alive(self) -> bool:
        """Whether the process is still running."""
        return self.process.is_alive()

    def ask(self, message: tuple, on_result: Callable[[int, Any], None] | None = None):
        """Send `message` and return the worker's answer, ("ok", results) or ("error", exception); the ("part",
        (i, result)) messages before it go to `on_result`."""
        self.connection.send(message)
        failed = None  # a listener that raised: the batch's messages are still read, so the pipe stays in step
        while True:
            status, value = self.connection.recv()
            if status != "part":
                if failed is not None:
                    raise failed
                return status, value
            if on_result is not None and failed is None:
                try:
                    on_result(*value)
                except Exception as err:  # noqa: BLE001 - raised once the batch's answer is read
                    failed = err

    def stop(self, timeout: float = 10.0) -> int | None:
        """Close the pipe (the worker exits on it), wait `timeout` seconds, kill it if still there; its exit code."""
        self.connection.close()
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        return self.process.exitcode


def stop_all(workers: list[WorkerProcess], timeout: float = 10.0) -> None:
    """Close every worker's pipe (they exit on it), wait `timeout` seconds for them all, kill those still there."""
    for worker in workers:
        worker.connection.close()
    deadline = time.monotonic() + timeout
    for worker in workers:
        worker.stop(timeout=max(0.0, deadline - time.monotonic()))


class Watchdog:
    """A thread killing the workers of `workers()` whose heartbeat is older than `silent_s` seconds (their pool then
    replaces each as one that died)."""

    def __init__(self, workers: Callable[[], list[WorkerProcess]], silent_s: float = SILENT_SECONDS):
        self.workers, self.silent_s = workers, silent_s
        self._closed = threading.Event()

    def start(self) -> None:
        threading.Thread(target=self._watch, name="aiayn-watchdog", daemon=True).start()

    def close(self) -> None:
        self._closed.set()

    def _watch(self) -> None:
        while not self._closed.wait(min(1.0, self.silent_s / 4)):
            for worker in self.workers():
                silent = worker.silent_for()
                if silent > self.silent_s and not worker.silenced and worker.process.is_alive():
                    worker.silenced = silent
                    logger.warning("worker process %s has not answered for %.0f s (stopped or frozen); killing it "
                                   "to start another", worker.process.pid, silent)
                    worker.process.kill()


def health(workers: list[WorkerProcess], replaced: int, silent_s: float) -> dict:
    """`/health`'s account of a pool: its processes, those answering (alive, heartbeat younger than `silent_s`),
    those replaced since the start."""
    answering = sum(w.alive() and not w.silenced and w.silent_for() <= silent_s for w in workers)
    return {"processes": len(workers), "answering": answering, "replaced": replaced}


def heartbeat(beat) -> None:
    """Start this worker process's heartbeat: a thread writing the time into `beat` every `BEAT_SECONDS`."""
    def beating():
        while True:
            beat.value = time.monotonic()
            time.sleep(BEAT_SECONDS)

    threading.Thread(target=beating, name="aiayn-heartbeat", daemon=True).start()


def loaded(connection: Connection, sources: Mapping[str, str], threads: int, device: str | None,
           warm: Callable[[Any], object]) -> dict[str, Any] | None:
    """A worker process's start: SIGINT and SIGTERM ignored (the server decides when to stop, and drains first), its
    torch threads set, the models of `sources` loaded and each given to `warm`; the objects by name, or None once
    ("failed", why) is sent to the server."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        import torch

        from aiayn.inference.loading import load_to_serve

        torch.set_num_threads(threads)
        objects = {name: load_to_serve(source, device=device) for name, source in sources.items()}
        for obj in objects.values():
            warm(obj)
    except Exception as err:  # noqa: BLE001 - sent to the server, which names it
        connection.send(("failed", f"{type(err).__name__}: {err}"))
        return None
    return objects


def _work(connection: Connection, beat, sources: Mapping[str, str], batched_call: Callable[..., list], threads: int,
          device: str | None) -> None:
    """A worker's life: its heartbeat started, load the models, warm each up, then answer batches by `batched_call`
    until the pipe closes."""
    heartbeat(beat)
    objects = loaded(connection, sources, threads, device, lambda obj: batched_call(obj, [WARM_UP_TEXT]))
    if objects is None:
        return
    connection.send(("ready", None))
    while True:
        try:
            name, texts, options, streams = connection.recv()
        except (EOFError, OSError):  # the server closed the pipe or exited
            return
        if streams:  # each text's result as soon as it is known, then the batch's
            options = {**options, "on_result": lambda i, result: connection.send(("part", (i, result)))}
        try:
            answer = ("ok", batched_call(objects[name], texts, **options))
        except Exception as err:  # noqa: BLE001 - one batch's error goes back to its requests
            answer = ("error", sendable(err))
        connection.send(answer)


def sendable(err: Exception) -> Exception:
    """`err` if it survives pickling, else a RuntimeError with its type and message."""
    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(err).__name__}: {err}")
