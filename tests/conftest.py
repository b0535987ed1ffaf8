"""Shared fixtures: every test starts from a fixed seed and uses few threads."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
