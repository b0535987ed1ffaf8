"""The process keeps the memory a step frees: the next step's tensors land on pages already mapped."""

import os
import subprocess
import sys

import pytest

GLIBC = (os.confstr("CS_GNU_LIBC_VERSION") or "") if hasattr(os, "confstr") else ""

# Four tensors alive at once, freed together, eight times over, each time smaller: a batch whose finished rows
# leave, a training step's activations at the next batch's length. Prints the minor page faults of the passes after
# the first and the pages the first wrote.
PASSES = """
import resource, sys
from aiayn.memory import keep_freed_memory
if sys.argv[1] == "first":  # as the aiayn command sets it: before the process imports torch
    assert keep_freed_memory()
import torch
torch.set_num_threads(1)
if sys.argv[1] == "later":  # as training sets it
    assert keep_freed_memory()
faults = []
for r in range(8):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    tensors = [torch.ones((12 - r) << 18) for _ in range(4)]  # 4 x (12 - r) MiB, every page written
    del tensors
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(sum(faults[1:]), 4 * (12 << 20) // 4096)
"""


@pytest.mark.skipif(not GLIBC.startswith("glibc"), reason="the setting is glibc's allocator's")
@pytest.mark.parametrize("when", ["first", "later"])
def test_tensors_freed_and_allocated_again_fault_few_new_pages(when):
    # Where the kernel places the heap varies from process to process, and now and then a process's blocks fault
    # again: the fewest of three processes. By default glibc hands the freed top of its heap back, and the second
    # pass faults in about as many pages as the first wrote.
    runs = [tuple(map(int, subprocess.run([sys.executable, "-c", PASSES, when], capture_output=True, text=True,
                                          check=True).stdout.split())) for _ in range(3)]
    faults, pages = min(runs)
    assert faults < pages // 4, runs


# Blocks above glibc's default largest mmap threshold (32 MiB): a beam search's logits over a large batch. Prints the
# minor page faults of the passes after the first and the pages the first wrote; "refused" where this glibc takes no
# threshold so high.
LARGE = """
import resource
from aiayn import memory
assert memory.keep_freed_memory()
if memory.mmap_threshold < memory.MMAP_THRESHOLD:
    print("refused")
    raise SystemExit
import torch
faults = []
for r in range(6):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    tensors = [torch.ones((48 - 2 * r) << 18) for _ in range(2)]  # 2 x (48 - 2r) MiB, every page written
    del tensors
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(sum(faults[1:]), 2 * (48 << 20) // 4096)
"""


@pytest.mark.skipif(not GLIBC.startswith("glibc"), reason="the setting is glibc's allocator's")
def test_blocks_above_32_mib_are_kept_too_where_glibc_takes_the_threshold():
    outputs = [subprocess.run([sys.executable, "-c", LARGE], capture_output=True, text=True, check=True).stdout
               for _ in range(3)]
    if outputs[0].strip() == "refused":
        pytest.skip(f"{GLIBC} takes no mmap threshold above 32 MiB")
    faults, pages = min(tuple(map(int, out.split())) for out in outputs)
    assert faults < pages // 4, outputs


def test_another_c_library_is_left_alone(monkeypatch):
    from aiayn import memory

    def no_gnu_libc(name):  # musl and macOS know no CS_GNU_LIBC_VERSION
        raise ValueError(f"unrecognized configuration name {name!r}")

    monkeypatch.setattr(memory.os, "confstr", no_gnu_libc)
    assert memory.keep_freed_memory() is False


def test_every_aiayn_command_keeps_freed_memory(monkeypatch, capsys):
    # A decoding step over a large batch frees and allocates its logits and activations as a training step does
    from aiayn.cli import main as cli

    calls = []
    monkeypatch.setattr(cli, "keep_freed_memory", lambda: calls.append(True) or True)
    assert cli.main(["params"]) == 0 and calls == [True]
