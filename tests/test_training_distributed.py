"""`torchrun --nproc_per_node 2 -m aiayn train ...`: DistributedDataParallel on gloo (CPU)."""

import json
import os
import subprocess
import sys

import torch
from safetensors.torch import load_file

ARGS = ["task=copy", "task_train=200", "task_valid=20", "task_test=20", "task_max_len=5", "vocab_size=20",
        "max_tokens=120", "threads=1", "model.d_model=32", "model.d_ff=64", "model.n_heads=2",
        "model.n_encoder_layers=1", "model.n_decoder_layers=1", "warmup=20", "max_steps=6", "save_every=3",
        "log_every=1", "show_examples=0"]


def test_torchrun_two_processes_train_one_model(tmp_path):
    run = tmp_path / "ddp"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "aiayn", "train", *ARGS, "--run-dir", str(run), "--no-progress"],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "2 processes" in proc.stdout + proc.stderr
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["split"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]  # one log row per step: only rank 0 writes
    assert all(r["loss"] is not None for r in train)
    weights = load_file(run / "model.safetensors")
    best = (run / "checkpoints" / "best").read_text().strip()  # the final model is the best validated one
    checkpoint = load_file(run / "checkpoints" / best / "model.safetensors")
    assert all(torch.equal(weights[k], checkpoint[k]) for k in weights)
    assert json.loads((run / "eval.json").read_text())["step"] == 6
