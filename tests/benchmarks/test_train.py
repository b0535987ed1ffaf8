"""`aiayn bench train`'s accounting: each row's share of the matmul peak of the precision it ran in."""

from types import SimpleNamespace

import torch

from aiayn.backends.devices import bf16_supported
from aiayn.cli.bench import load_benchmark


def test_a_bf16_row_is_a_share_of_the_bf16_peak_and_an_fp32_row_of_the_fp32_one(capsys):
    train = load_benchmark("train")
    seconds = {"aiayn": [1.0], "Hugging Face Marian": [2.0]}
    train.print_rates(seconds, 1000, 200e9, [100e9], [], "tokens", bf16_rows=("aiayn",), bf16_peak=400e9)
    out = capsys.readouterr().out
    assert "200.0 model GFLOP/s (50% of the bf16 peak)" in out  # not 200% of the fp32 peak
    assert "100.0 model GFLOP/s (100% of peak)" in out
    assert "bf16 matmul peak            400.0 GFLOP/s (for aiayn)" in out


def test_the_bf16_peak_is_measured_only_where_a_row_ran_in_bf16():
    train = load_benchmark("train")
    steps = {"aiayn": None, "Hugging Face Marian": None}
    assert train.bf16_rows_and_peak(steps, SimpleNamespace(precision="fp32"), torch.device("cpu")) == {}
    chosen = train.bf16_rows_and_peak({**steps, train.MARIAN_BF16: None}, SimpleNamespace(precision="bf16"),
                                      torch.device("cpu"))
    assert chosen["bf16_rows"] == ("aiayn", train.MARIAN_BF16)
    assert (chosen["bf16_peak"] > 0) == bf16_supported(torch.device("cpu"))  # emulated bf16 has no peak


def test_a_bf16_row_where_bf16_is_emulated_claims_no_share(capsys):
    train = load_benchmark("train")
    train.print_rates({"aiayn": [1.0]}, 1000, 200e9, [100e9], [], "tokens", bf16_rows=("aiayn",), bf16_peak=0.0)
    out = capsys.readouterr().out
    assert "(bf16 emulated here: no peak to hold it to)" in out and "bf16 matmul peak" not in out
