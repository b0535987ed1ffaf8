"""Buffers that the searches of one call hand on to each other: `with reusing_buffers(): ...`.

A search's largest allocation is its self-attention cache (`steps.StaticState`), rows x heads x the positions
it has made room for. Memory that large comes from the operating system fresh for every search and goes back when the
search ends, and each of its pages costs a fault on its first write (measured: docs/notes.md, "Decoding").
Inside `reusing_buffers()` a search takes its cache from the buffers the searches before it gave back, so a
file's batches write into memory already mapped.

What is kept is bounded: at most the `KEPT` largest buffers given back, which one search holds at once anyway;
a buffer too small for the search that asks is let go; and nothing outlives the `with` block (a call of
`Translator.translate`, an evaluation pass). Outside such a block, and on devices with their own caching
allocator (CUDA), `empty` is `torch.empty`. The pool belongs to the context it was made in (a thread's calls;
code that copies the context shares it), and a lock keeps it whole when a state is collected in another thread.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch


class BufferPool:
    """Storages given back by finished searches, handed out again to the next ones (see the module docstring)."""

    KEPT = 2  # a search holds two caches at once: the one it reads and the one a reorder writes into

    def __init__(self) -> None:
        self.free: list[torch.UntypedStorage] = []
        self.lock = threading.Lock()
        self.kept = self.KEPT  # `KEPT` for each search that runs at once (`searches_at_once`)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialised tensor of `shape`, on the smallest free storage that holds it, else on a new one (the
        free storages too small for it let go: the batches of a call grow more often than they shrink)."""
        nbytes = dtype.itemsize
        for size in shape:
            nbytes *= size
        with self.lock:
            fits = [s for s in self.free if s.nbytes() >= nbytes and s.device == device]
            if not fits:
                self.free[:] = [s for s in self.free if s.device != device]
                storage = None
            else:
                storage = min(fits, key=lambda s: s.nbytes())
                self.free.remove(storage)
        if storage is None:
            return torch.empty(shape, dtype=dtype, device=device)
        return torch.empty(0, dtype=dtype, device=device).set_(storage, 0, shape)

    def give(self, tensors: list[torch.Tensor]) -> None:
        """Keep the storages of `tensors` (their owner is done with them) for later searches: the `KEPT` largest."""
        with self.lock:
            self.free.extend(t.untyped_storage() for t in tensors)
            self.free.sort(key=lambda s: s.nbytes(), reverse=True)
            del self.free[self.kept :]


_POOL: ContextVar[BufferPool | None] = ContextVar("aiayn_buffer_pool", default=None)


@contextmanager
def reusing_buffers() -> Iterator[BufferPool]:
    """Inside the block, searches hand their caches on to the next (in this context: see the module docstring); on
    leaving, the buffers are released. Nested blocks share the outer one's pool."""
    pool = _POOL.get()
    if pool is not None:
        yield pool
        return
    pool = BufferPool()
    token = _POOL.set(pool)
    try:
        yield pool
    finally:
        _POOL.reset(token)
        with pool.lock:
            pool.free.clear()


def searches_at_once(searches: int) -> None:
    """Inside `reusing_buffers()`, keep buffers for `searches` searches running side by side (batches in threads of
    their own: `aiayn.inference.threads.side_by_side`), each taking the buffers the ones before gave back."""
    pool = _POOL.get()
    if pool is not None:
        with pool.lock:
            pool.kept = max(pool.kept, BufferPool.KEPT * searches)


class Owned:
    """The buffers an object (a search's state) takes with `empty`: each given back to the pool it came from when
    the object is collected, or dropped with it outside `reusing_buffers()`."""

    def __init__(self, owner: object) -> None:
        self.pool = _POOL.get()
        self.buffers: list[torch.Tensor] = []
        if self.pool is not None:
            weakref.finalize(owner, self.pool.give, self.buffers)  # the list, not the owner: it must not keep it alive

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """`torch.empty(shape)`, from the pool on a CPU inside `reusing_buffers()`."""
        if self.pool is None or torch.device(device).type != "cpu":
            return torch.empty(shape, dtype=dtype, device=device)
        tensor = self.pool.empty(shape, dtype, torch.device(device))
        self.buffers.append(tensor)
        return tensor

    def drop(self, tensor: torch.Tensor) -> None:
        """Give `tensor` back now (its owner replaced it by a larger one)."""
        for i, t in enumerate(self.buffers):
            if t is tensor:
                del self.buffers[i]
                if self.pool is not None:
                    self.pool.give([tensor])
                return
