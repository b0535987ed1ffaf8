"""Shared fixtures: every test starts from a fixed seed and uses few threads."""

import pytest
import torch

# Tiny test models spend more time waking a second OpenMP thread than computing, and on a busy
# two-core machine each parallel op then waits milliseconds: one thread is ~100x faster here.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(params=["plain", "backend"])
def run_on(request):
    """How the module under test runs: as written ("plain"), or as this machine's CPU inference backend
    prepares it ("backend": oneDNN prepacked weights where usable, stacked Q/K/V). Call under no_grad."""
    if request.param == "plain":
        return lambda module: module
    from aiayn.backends import select

    return select("cpu", "inference", "fp32").prepare
