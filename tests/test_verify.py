"""`aiayn verify`: every path this machine can use passes its oracles, and a broken fast path is caught."""

import pytest
import torch

from aiayn import verify
from aiayn.backends import select
from aiayn.backends.cpu import onednn_usable
from aiayn.backends.fused import FusedQKVAttention
from aiayn.cli.main import main
from aiayn.nn.attention import MultiHeadAttention


@pytest.mark.slow
def test_verify_passes_on_this_machine(capsys):
    assert main(["verify", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "== cpu inference fp32: plain" in out and "== cpu train fp32" in out and "FAIL" not in out
    assert "encoder layer = torch.nn.TransformerEncoderLayer" in out and "NumPy reference" in out
    assert ("kernels by rows (one columns, few packed, many packed), fused QKV" in out) == onednn_usable()
    assert "measured here" in out and "inference products: one row" in out
    total = sum(1 for line in out.splitlines() if line.startswith("  "))
    assert f"{total} of {total} checks passed" in out


def test_a_broken_fast_path_fails_verify(monkeypatch, capsys, measured):
    measured(fused_qkv=True)
    def swapped(self, x):  # Q and V exchanged: still runs, no longer the paper's attention
        q, k, v = MultiHeadAttention.project_qkv(self, x)
        return v, k, q

    monkeypatch.setattr(FusedQKVAttention, "project_qkv", swapped)
    monkeypatch.setattr(verify, "paths", lambda device: [select("cpu", "inference", "fp32")])
    assert main(["verify", "--device", "cpu"]) == 1
    out = capsys.readouterr().out
    assert "encoder layer = torch.nn.TransformerEncoderLayer (post-LN ReLU, padded)" in out and "FAIL" in out
    assert "checks passed;" in out and "FAILED" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_a_device_the_machine_lacks_is_one_line_and_exit_code_2(capsys):
    assert main(["verify", "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "device 'cuda' is not available on this machine" in err and "--device cpu" in err
