"""`torchrun --nproc_per_node 2 -m aiayn train ...`: DDP and FSDP on gloo (CPU) train the model one process
trains on the same global batch, see every example once an epoch, stop together, and resume at any world size.

Each torchrun launch costs seconds, so one DDP run (a module fixture) serves several tests.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from aiayn.config import preset
from aiayn.data.collate import (
    collate_masked_lm,
    collate_seq2seq,
    collate_sequence_classification,
    collate_token_classification,
)
from aiayn.data.prepare import prepare_data
from aiayn.io import load_model
from aiayn.nn.model import build_model
from aiayn.tasks import SEQ2SEQ, get_task
from aiayn.training import Trainer, load_run_config
from aiayn.training.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint
from aiayn.training.distributed import data_parallel, process_group_backend
from aiayn.training.loss import label_smoothed_loss
from aiayn.training.objectives import forward
from aiayn.training.setup import read_run_config

# 120 examples make 7 batches an epoch: with 4 batches a step (2 processes x accum_steps 2) the second
# step of each epoch has 3, so rank 1 trains an empty micro-batch. No biases: the key projection's bias
# gets an exactly zero gradient (softmax ignores a shift), and Adam turns its rounding noise, which
# depends on the order gradients are summed in, into steps of size lr; it changes nothing the model computes.
ARGS = ["dataset=copy", "dataset_train=120", "dataset_valid=10", "dataset_test=10", "dataset_max_len=5",
        "vocab_size=20", "max_tokens=100", "threads=1", "model.d_model=16", "model.d_ff=32", "model.n_heads=2",
        "model.n_encoder_layers=1", "model.n_decoder_layers=1", "model.dropout=0.1", "model.bias=false",
        "warmup=10", "epochs=3", "save_every=2", "log_every=1", "final_model=last", "show_examples=0"]
STEPS = 6

# `aiayn train` under torchrun with test hooks: RECORD logs each step's batches (per rank) and counts DDP's
# gradient reductions; KILL_RANK is SIGKILLed after step KILL_AT; POISON_RANK's loss is NaN at step POISON_AT.
SCRIPT = """
import json, os, signal, sys
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from aiayn.training import loop

rank, env = int(os.environ["RANK"]), os.environ
taken, reductions = [], [0]
make_batch, train_step = loop.make_batch, loop.Trainer.train_step

def recording_make_batch(data, split, indices, **kwargs):
    taken.append(list(indices))
    return make_batch(data, split, indices, **kwargs)

def counting_hook(state, bucket):
    reductions[0] += 1
    return allreduce_hook(state, bucket)

def after_setup(self):
    if "RECORD" in env:
        self.parallel.module.register_comm_hook(self.parallel.module.process_group, counting_hook)

def recording_train_step(self, micro_batches, seeds):
    if env.get("POISON_RANK") == str(rank) and self.step + 1 == int(env["POISON_AT"]):
        real = loop.label_smoothed_loss
        loop.label_smoothed_loss = lambda *a, **k: tuple(v * float("nan") for v in real(*a, **k))
    stats = train_step(self, micro_batches, seeds)
    if "RECORD" in env:
        with open(f"{env['RECORD']}.{rank}", "a") as log:
            log.write(json.dumps({"step": self.step, "epoch": self.epoch, "batches": taken[-len(micro_batches):],
                                  "reductions": reductions[0]}) + "\\n")
    return stats

def after_step(self):
    if env.get("KILL_RANK") == str(rank) and self.step == int(env["KILL_AT"]):
        os.kill(os.getpid(), signal.SIGKILL)

loop.make_batch = recording_make_batch
loop.Trainer.train_step, loop.Trainer.after_setup = recording_train_step, after_setup
loop.Trainer.after_step = after_step
from aiayn.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def _torchrun(tmp_path, run_dir, args, **env):
    """`aiayn train` under torchrun with the test hooks; launched once more if gloo's C++ aborted a rank.

    A socket call that fails inside one of gloo's own threads is a C++ throw nothing catches, so the rank
    aborts (pytorch/gloo#514 is one such report); a rank that tore down the distributed library while its
    peer was still leaving aborted too ("terminate called without an active exception"), which the CLI now
    avoids by ending a rank without that teardown (`aiayn.cli.main._exit_rank`). Both are rare (one in
    dozens of launches, never on demand), and nothing in the run or its hooks raises SIGABRT, so one abort
    is taken as the machine's and a second fails the test. The second launch's output is the result (only
    it is counted); `first_launch` keeps the salient lines of the first for failure messages.
    """
    script = tmp_path / "train_hooked.py"
    script.write_text(SCRIPT)
    before = tmp_path / f"{run_dir.name}.before"  # what a resume starts from, to start from again
    if run_dir.exists():
        shutil.copytree(run_dir, before)
    first = None
    for _ in range(2):
        if first is not None:  # the second launch starts where the first did
            shutil.rmtree(run_dir, ignore_errors=True)
            if before.exists():
                shutil.copytree(before, run_dir)
            for rank in (0, 1) if "RECORD" in env else ():
                Path(f"{env['RECORD']}.{rank}").unlink(missing_ok=True)
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                               str(script), "train", *args, "--run-dir", str(run_dir), "--no-progress"],
                              capture_output=True, text=True, timeout=240,
                              env={**os.environ, "OMP_NUM_THREADS": "1", **{k: str(v) for k, v in env.items()}})
        if "(SIGABRT)" not in proc.stderr or first is not None:
            break
        first = proc
        warnings.warn(f"torchrun: a rank aborted in C++, launching once more:\n{_salient(proc.stderr)}",
                      stacklevel=2)
    proc.first_launch = "" if first is None else f"(a first launch aborted:\n{_salient(first.stderr)})\n"
    return proc


def _salient(stderr: str) -> str:
    """The lines of a torchrun's stderr that say what went wrong, without the elastic agent's boilerplate."""
    keys = ("terminate", "what()", "Error", "error:", "aiayn", "Signal", "Abort")
    return "\n".join(line for line in stderr.splitlines() if any(k in line for k in keys))[-3000:]


def _assert_weights_close(actual, expected):
    assert actual.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(actual[name], tensor, rtol=0, atol=1e-5, msg=name)


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    """A 2-process DDP run of ARGS with accum_steps=2, its records, and what it printed."""
    tmp = tmp_path_factory.mktemp("ddp")
    proc = _torchrun(tmp, tmp / "run", [*ARGS, "accum_steps=2"], RECORD=tmp / "steps")
    assert proc.returncode == 0, proc.first_launch + proc.stdout[-2000:] + proc.stderr[-2000:]
    records = {rank: [json.loads(line) for line in (tmp / f"steps.{rank}").read_text().splitlines()]
               for rank in (0, 1)}
    return tmp / "run", records, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The same run in one process with the same global batch: 4 batches a step."""
    run_dir = tmp_path_factory.mktemp("one") / "run"
    Trainer(load_run_config(None, [*ARGS, "global_batches=4"]), run_dir).fit()
    return run_dir


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """The DDP run again, with rank 1 SIGKILLed after step 5."""
    tmp = tmp_path_factory.mktemp("killed")
    proc = _torchrun(tmp, tmp / "run", [*ARGS, "accum_steps=2"], KILL_RANK=1, KILL_AT=5)
    return tmp / "run", proc


def test_two_processes_train_the_weights_of_one_process_on_the_same_global_batch(ddp, one_process):
    run_dir, _, output = ddp
    _assert_weights_close(load_file(run_dir / "model.safetensors"), load_file(one_process / "model.safetensors"))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    reference = [json.loads(line) for line in (one_process / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["split"] == "train"]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))  # one row per step: only rank 0 logs
    for row, ref in zip(train, [r for r in reference if r["split"] == "train"]):
        assert row["loss"] == pytest.approx(ref["loss"], rel=1e-5)  # the loss of the whole global batch
    assert json.loads((run_dir / "train_config.json").read_text())["global_batches"] == 4  # kept for a resume
    assert json.loads((run_dir / "eval.json").read_text())["step"] == STEPS
    assert "2 processes" in output
    assert output.count(f"trained {STEPS} steps") == 1  # rank 0 speaks for both


def test_every_example_is_trained_once_an_epoch_across_the_ranks(ddp):
    _, records, _ = ddp
    n_train = len(prepare_data(load_run_config(None, ARGS).train).train.items)
    shards = []
    for epoch in range(3):
        mine = {rank: [i for r in records[rank] if r["epoch"] == epoch for b in r["batches"] for i in b]
                for rank in (0, 1)}
        assert not set(mine[0]) & set(mine[1])  # distinct shards
        assert sorted(mine[0] + mine[1]) == list(range(n_train))  # nothing twice, nothing dropped
        shards.append(mine[0])
    assert shards[0] != shards[1]  # reshuffled each epoch
    assert [] in [b for r in records[1] for b in r["batches"]]  # rank 1 padded a short last step


def test_gradients_are_reduced_once_per_step_not_per_micro_batch(ddp):
    _, records, _ = ddp
    for rank in (0, 1):
        assert all(len(r["batches"]) >= 1 for r in records[rank])
        assert [r["reductions"] for r in records[rank]] == list(range(1, STEPS + 1))  # no_sync before the last


def test_a_dead_rank_leaves_intact_checkpoints_and_a_one_process_resume_continues_the_run(killed, ddp, tmp_path):
    killed_dir, proc = killed
    assert proc.returncode != 0
    # rank 0 says why in one line: the lost peer, or torchrun's SIGTERM that may come first
    assert "internal error" not in proc.stderr
    assert ("another process of the run has stopped" in proc.stderr) or ("aiayn train: interrupted" in proc.stderr)
    assert not (killed_dir / "model.safetensors").exists()  # the run did not finish
    checkpoints = list_checkpoints(killed_dir / "checkpoints")
    assert latest_checkpoint(killed_dir / "checkpoints").name == "step-00000004"
    for checkpoint in checkpoints:  # every checkpoint written reads back whole
        model = load_model(checkpoint)
        assert load_checkpoint(checkpoint, model)["step"] == int(checkpoint.name.split("-")[1])
        assert all(torch.isfinite(p).all() for p in model.parameters())

    # the 2-process checkpoint of step 4, resumed in one process, ends where the 2-process run ended
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(killed_dir, resumed_dir)
    run = read_run_config(resumed_dir)
    result = Trainer(run, resumed_dir, resume=True).fit()
    assert result.step == STEPS
    _assert_weights_close(load_file(resumed_dir / "model.safetensors"), load_file(ddp[0] / "model.safetensors"))


def test_fsdp_resumes_a_ddp_checkpoint_and_trains_the_same_model(killed, ddp, one_process, tmp_path):
    killed_dir, _ = killed
    run_dir = tmp_path / "fsdp"
    shutil.copytree(killed_dir, run_dir)
    proc = _torchrun(tmp_path, run_dir, ["distributed=fsdp", "--resume"])  # the saved config, sharded
    assert proc.returncode == 0, proc.first_launch + proc.stdout[-2000:] + proc.stderr[-2000:]
    _assert_weights_close(load_file(run_dir / "model.safetensors"), load_file(one_process / "model.safetensors"))
    # rank 0 validated the gathered model: the same scores as the DDP run's (step 4's validation came
    # after its checkpoint, so the resumed run did it again: the newest row of a step counts)
    def valid(run):
        rows = map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
        return {r["step"]: r["loss"] for r in rows if r["split"] == "valid"}
    scores, reference = valid(run_dir), valid(ddp[0])
    assert list(scores) == list(reference) == [2, 4, 6]
    assert list(scores.values()) == pytest.approx(list(reference.values()), rel=1e-5)
    # its checkpoints hold the one-process optimizer state: equal to the DDP run's at the same step
    ours = torch.load(run_dir / "checkpoints" / "step-00000006" / "trainer_state.pt", weights_only=True)
    theirs = torch.load(ddp[0] / "checkpoints" / "step-00000006" / "trainer_state.pt", weights_only=True)
    groups = [json.dumps(state["optimizer"]["param_groups"]) for state in (ours, theirs)]  # (a tuple is a list)
    assert groups[0] == groups[1]
    assert ours["optimizer"]["state"].keys() == theirs["optimizer"]["state"].keys()
    for index, state in theirs["optimizer"]["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(ours["optimizer"]["state"][index][key], value, rtol=0, atol=1e-5)


def test_a_one_process_checkpoint_resumes_in_two_processes(one_process, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(one_process, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step-00000006")  # back to step 4 (the newest left)
    (run_dir / "model.safetensors").unlink()
    proc = _torchrun(tmp_path, run_dir, ["--resume"])
    assert proc.returncode == 0, proc.first_launch + proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "resumed from" in proc.stdout + proc.stderr
    _assert_weights_close(load_file(run_dir / "model.safetensors"), load_file(one_process / "model.safetensors"))
    assert [r["step"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if r["split"] == "train"] == list(range(1, STEPS + 1))


def test_a_non_finite_loss_on_one_rank_stops_both_with_one_message(tmp_path):
    run_dir = tmp_path / "run"
    proc = _torchrun(tmp_path, run_dir, [*ARGS, "accum_steps=2"], POISON_RANK=1, POISON_AT=3)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    message = f"aiayn train: error: non-finite loss (nan) at step 3: training stopped; " \
              f"the last good checkpoint is {run_dir / 'checkpoints' / 'step-00000002'}"
    assert output.count(message) == 1, proc.first_launch + output[-3000:]  # said once, by rank 0, for both
    # both processes stop with the code of one; torchrun may SIGTERM the second an instant after the first exits
    codes = re.findall(r"exitcode  : (-?\d+)", output)
    assert len(codes) == 2 and "3" in codes and set(codes) <= {"3", "-15"}, proc.first_launch + output[-3000:]
    assert latest_checkpoint(run_dir / "checkpoints").name == "step-00000002"
    assert not (run_dir / "model.safetensors").exists()


@pytest.mark.parametrize("objective", ["seq2seq", "sequence_classification", "token_classification", "masked_lm"])
def test_an_empty_micro_batch_gives_every_parameter_a_zero_gradient(objective):
    """What a process without a batch trains: it joins the reduction (every parameter has a gradient)
    and adds nothing to the update."""
    sizes = dict(vocab_size=30, d_model=16, n_heads=2, d_ff=32, n_encoder_layers=1)
    if objective == "seq2seq":
        model, batch = build_model(preset("tiny").replace(**sizes, n_decoder_layers=1)), collate_seq2seq(
            [], pad_id=0, bos_id=1, eos_id=2)
    else:
        model = build_model(preset("tiny").replace(**sizes, n_decoder_layers=0, head=objective,
                                                   num_labels=0 if objective == "masked_lm" else 3))
        batch = {"sequence_classification": lambda: collate_sequence_classification([], pad_id=0),
                 "token_classification": lambda: collate_token_classification([], pad_id=0),
                 "masked_lm": lambda: collate_masked_lm([], pad_id=0, mask_id=3, vocab_size=30, special_ids=[1, 2],
                                                        generator=torch.Generator())}[objective]()
    loss, _ = label_smoothed_loss(*forward(model, batch, objective), smoothing=0.1)
    loss.backward()
    assert float(loss.detach()) == 0.0
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None and not parameter.grad.any(), name


def test_the_backend_follows_the_device_and_one_process_needs_no_wrapper():
    assert process_group_backend(torch.device("cuda", 0)) == "nccl"
    assert process_group_backend(torch.device("cpu")) == "gloo"
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.Adam(model.parameters())
    plain = data_parallel(model, get_task(SEQ2SEQ), optimizer, strategy="fsdp", rank=0, world=1, make_optimizer=None)
    assert plain.optimizer is optimizer and plain.module.model is model  # FSDP in one process: nothing to shard
    assert plain.total([1.0, 2.0]) == [1.0, 2.0] and plain.from_rank0("x") == "x"
    with pytest.raises(ValueError, match="distributed must be one of ddp, fsdp"):
        data_parallel(model, get_task(SEQ2SEQ), optimizer, strategy="zero", rank=0, world=1, make_optimizer=None)
    with pytest.raises(ValueError, match="distributed must be one of ddp, fsdp"):
        load_run_config(None, ["dataset=copy", "distributed=zero"])
    with pytest.raises(ValueError, match="keep one"):
        load_run_config(None, ["dataset=copy", "accum_steps=2", "global_batches=4"])
