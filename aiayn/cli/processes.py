"""`aiayn train processes=N`: the run as N data-parallel processes on this machine, launched by the CLI itself.

Each process is `aiayn train` with the same arguments, told its place as `torchrun` would tell it (`RANK`,
`WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`) and one thread unless `threads` says otherwise; the trainer then
runs as under `torchrun --standalone --nproc_per_node N` (DDP over gloo on the CPU; see docs/training.md). On
a CPU the small products of a narrow model gain little from a second thread, while a second process computes
a batch of its own: on 2 cores, 2 processes trained more tokens a second than 2 threads (docs/training.md,
"Speed"). Each step then holds N batches.

The processes run in a process group of their own, so a Ctrl-C at the terminal reaches this launcher alone,
which passes each signal it gets to every process once: the first makes them finish the step and save a
checkpoint, a second aborts them, as for one process. When one process fails, the others stop by
themselves (a collective loses its peer); any still running after `GRACE_S` are terminated. The exit code is
the first failing rank's, in rank order (rank 0 prints the one line that says why).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time

from aiayn.interrupts import INTERRUPT_SIGNALS, handling

GRACE_S = 60.0  # after one process failed: how long the others may take to stop by themselves
POLL_S = 0.1


def free_port() -> int:
    """A TCP port on this machine that nothing listens on now (for the processes to meet on)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def train_processes(argv: list[str], processes: int, threads: int) -> int:
    """Run `aiayn *argv` as `processes` ranks of one run; returns the exit code (0 when every rank succeeded).

    Raises:
        ValueError: more processes than the cores this process may run on (each would wait for a core).
    """
    from aiayn.backends.devices import over_cores, usable_cores

    cores = usable_cores()
    if processes > cores:
        raise ValueError(f"{over_cores(f'processes={processes}', cores)}: each process trains on a core of its own; "
                         f"give processes={cores} or fewer")
    env = {**os.environ, "WORLD_SIZE": str(processes), "LOCAL_WORLD_SIZE": str(processes),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": str(threads or 1)}
    ranks = [subprocess.Popen([sys.executable, "-m", "aiayn", *argv], start_new_session=True,
                              env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)})
             for rank in range(processes)]
    def forward(signum: int, frame: object) -> None:
        for proc in ranks:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signum)

    with handling(INTERRUPT_SIGNALS, forward):
        failed_at = None
        while any(proc.poll() is None for proc in ranks):
            if failed_at is None and any(proc.poll() not in (None, 0) for proc in ranks):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > GRACE_S:
                for proc in ranks:
                    if proc.poll() is None:
                        proc.kill()
            time.sleep(POLL_S)
    codes = [proc.returncode for proc in ranks]
    failed = [code for code in codes if code != 0]
    if not failed:
        return 0
    return failed[0] if failed[0] > 0 else 128 - failed[0]  # killed by signal N: 128 + N, as a shell says
