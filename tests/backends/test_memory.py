"""The process keeps the memory a step frees: the next step's tensors land on pages already mapped."""

import os
import subprocess
import sys

import pytest

GLIBC = (os.confstr("CS_GNU_LIBC_VERSION") or "") if hasattr(os, "confstr") else ""

# Four 8 MiB tensors alive at once, freed together, five times over: a training step's activations in small.
# Prints the minor page faults of the last three rounds and the pages they wrote.
ROUNDS = """
import resource, torch
torch.set_num_threads(1)
from aiayn.backends.memory import keep_freed_memory
assert keep_freed_memory()
faults = []
for _ in range(5):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    tensors = [torch.ones(2 << 20) for _ in range(4)]  # 4 x 8 MiB, every page written
    del tensors
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(sum(faults[2:]), 3 * 4 * (8 << 20) // 4096)
"""


@pytest.mark.skipif(not GLIBC.startswith("glibc"), reason="the setting is glibc's allocator's")
def test_tensors_freed_and_allocated_again_fault_few_new_pages():
    # Where the kernel places the heap varies from process to process, and now and then a process's blocks fault
    # again (seen: 0 or one block's 2,048 pages in most, four blocks' once): the fewest of three processes. By default
    # glibc hands the freed top of its heap back, and most of the pages fault in every round of every process.
    runs = [tuple(map(int, subprocess.run([sys.executable, "-c", ROUNDS], capture_output=True, text=True,
                                          check=True).stdout.split())) for _ in range(3)]
    faults, pages = min(runs)
    assert faults < pages // 4, runs


def test_another_c_library_is_left_alone(monkeypatch):
    from aiayn.backends import memory

    def no_gnu_libc(name):  # musl and macOS know no CS_GNU_LIBC_VERSION
        raise ValueError(f"unrecognized configuration name {name!r}")

    monkeypatch.setattr(memory.os, "confstr", no_gnu_libc)
    assert memory.keep_freed_memory() is False
