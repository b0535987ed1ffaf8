"""Freed memory kept in the process, so that a step's tensors land on pages the step before mapped.

A training step allocates and frees the same large tensors every step: activations, the vocabulary logits, their
gradients (a few MiB to tens of MiB each at the recipe's shapes); so does a decoding step over a large batch (a
4,096-token batch of short sentences: its logits, each layer's activations), smaller each time sentences leave.
glibc's `malloc` serves a block above its mmap threshold (128 KiB at first, raised to the size of the largest block
freed so far) with new pages from the kernel, and hands the top of its heap back to the kernel when more than twice
that threshold lies free there. Either way the next step writes into pages the kernel must map and zero again, one
4 KiB page fault at a time: thousands a step, a share of a small model's step worth keeping (measured:
docs/notes.md, "Training" and "Decoding").

`keep_freed_memory` sets both thresholds for the process: blocks up to `MMAP_THRESHOLD` (1 GiB) come from the heap
where glibc takes so high a threshold (2.36 does), else up to its largest default one (32 MiB, which older versions
hold to), and freed memory stays with the process up to `trim_threshold`. Above 32 MiB are a large batch's logits:
a beam search over a 4,096-token batch of short sentences projects 2,728 rows onto the vocabulary, 46 MiB at 4,256
pieces, mapped anew at every step under the 32 MiB threshold (measured: docs/notes.md, "Decoding"). The process then
holds about its peak use until it exits, which a training run reaches at every step anyway. The setting is the
process's, not the library's: the `aiayn` command makes it for every command it runs, and `aiayn.training` when it
trains on the CPU, as it sets the process's threads; a program that translates through the Python API may call it
once itself.
"""

from __future__ import annotations

import ctypes
import logging
import os

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # mallopt's parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 1 << 30  # blocks up to this size from the heap, where glibc takes a threshold this high
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's largest default mmap threshold on a 64-bit system (DEFAULT_MMAP_THRESHOLD_MAX)
TRIM_THRESHOLD = 1 << 30
mmap_threshold: int | None = None  # the threshold `keep_freed_memory` set, None before it did


def keep_freed_memory(trim_threshold: int = TRIM_THRESHOLD) -> bool:
    """Tell glibc's allocator to serve blocks up to `MMAP_THRESHOLD` from its heap (up to 32 MiB where it refuses a
    threshold above its default largest) and keep up to `trim_threshold` bytes of freed memory instead of returning
    them to the system. Returns whether it was set (False where the C library is not glibc: macOS, Windows, musl)."""
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc"):
            return False
    except (AttributeError, ValueError, OSError):  # no confstr (Windows), or not a GNU C library
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own C library
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    threshold = next((t for t in (MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) if mallopt(M_MMAP_THRESHOLD, t) == 1), None)
    done = threshold is not None and mallopt(M_TRIM_THRESHOLD, trim_threshold) == 1
    global mmap_threshold
    mmap_threshold = threshold if done else None
    logger.debug("glibc keeps freed memory (mmap threshold %s bytes, trim threshold %d bytes): %s", threshold,
                 trim_threshold, done)
    return done
