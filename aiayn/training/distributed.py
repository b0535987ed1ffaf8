"""Data parallelism under `torchrun`: the process group, DDP or FSDP around the objective's forward, and the
few collectives every process of a step joins.

One process and DDP (`Replicas`) keep the whole model in every process; FSDP (`Sharded`, PyTorch's
`fully_shard`) keeps 1/world of every parameter, gradient and optimizer state in each and gathers an
encoder or decoder layer only while it runs. Either way the trainer sees the same few calls, and
what it checkpoints is the one-process form (full weights, the optimizer state of a plain
optimizer over `model.parameters()`), so a checkpoint resumes at any number of processes.
"""

from __future__ import annotations

import copy
import errno
import os
import re
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, TypeVar

import torch
from torch import nn

from aiayn.nn.layers import DecoderLayer, EncoderLayer
from aiayn.tasks import Task

STRATEGIES = ("ddp", "fsdp")
T = TypeVar("T")


def process_group_backend(device: torch.device) -> str:
    """The collective backend for a device: NCCL for CUDA, gloo for the CPU (and anything else)."""
    return "nccl" if device.type == "cuda" else "gloo"


def launch_rank() -> int:
    """This process's rank as `torchrun` set it (0 outside torchrun); readable before and after the group exists."""
    return int(os.environ.get("RANK", "0"))


def init_distributed(device: torch.device | None = None) -> tuple[int, int]:
    """(rank, world size): under `torchrun` (WORLD_SIZE > 1) this joins the process group (`process_group_backend`)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group(process_group_backend(device or torch.device("cpu")))
    return dist.get_rank(), dist.get_world_size()


class PeerLost(ConnectionError):
    """Another process of the run went away (killed, out of memory, its machine lost), so this one stops too."""


@contextmanager
def peers_watched(world: int) -> Iterator[None]:
    """Around collectives: one that fails because another process is gone becomes `PeerLost`."""
    try:
        yield
    except RuntimeError as err:
        text = str(err)
        # gloo reports a vanished peer as a plain RuntimeError: "[.../pair.cc:553] Connection closed by peer ..."
        if world == 1 or not (isinstance(err, torch.distributed.DistError)
                              or ("gloo" in text and "Connection" in text)):
            raise
        reason = re.sub(r"^\[[^\]]*\]\s*", "", text.split(". ")[0])
        raise PeerLost(errno.ECONNRESET, f"a collective operation failed ({reason}): another process of the run "
                                         "has stopped, its own output says why") from err


def from_rank0(value: T, world: int) -> T:
    """Rank 0's `value` on every process of `world` (a decision only rank 0 can take, a message that must agree); a
    collective: every process calls it at the same point, the others with any value."""
    if world == 1:
        return value
    box = [value]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


class ObjectiveForward(nn.Module):
    """The task's forward as a module, for DDP and FSDP to wrap (their hooks run around a module's call):
    batch -> (logits, labels)."""

    def __init__(self, model: nn.Module, task: Task):
        super().__init__()
        self.model = model
        self.task = task

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """`Task.forward` of the model on one batch."""
        return self.task.forward(self.model, batch)


class Replicas:
    """One process, or DDP: every process holds the whole model and gradients are averaged in backward.

    Args:
        model: the model; its parameters are the ones trained.
        task: the objective's task object, whose `forward` gives the loss its inputs.
        optimizer: the optimizer over `model.parameters()`.
        rank, world: this process and the number of processes.
        device: where the model lives (CUDA: DDP on that device, collectives through NCCL).
        prepared: what runs the forward pass, when not `model` itself: a backend's prepared copy that
            shares `model`'s parameters (see `aiayn.backends`).
    """

    def __init__(self, model: nn.Module, task: Task, optimizer: torch.optim.Optimizer, *, rank: int = 0,
                 world: int = 1, device: torch.device | None = None, prepared: nn.Module | None = None):
        self.model, self.optimizer = model, optimizer
        self.rank, self.world = rank, world
        self.device = device or torch.device("cpu")
        self.module = self._wrap(ObjectiveForward(model if prepared is None else prepared, task))

    def _wrap(self, module: nn.Module) -> nn.Module:
        if self.world == 1:
            return module
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(module, device_ids=[self.device.index] if self.device.type == "cuda" else None)

    def micro_step(self, last: bool) -> AbstractContextManager:
        """Around one micro-batch's forward and backward: gradients are reduced only on the step's `last`."""
        return nullcontext() if last or self.world == 1 else self.module.no_sync()

    def peers_watched(self) -> AbstractContextManager:
        """Around training: a collective that fails because another process is gone becomes `PeerLost`."""
        return peers_watched(self.world)

    def total(self, values: Iterable[float]) -> list[float]:
        """`values` summed over all processes (a NaN on any process makes its sum NaN)."""
        values = list(values)
        if self.world == 1:
            return values
        summed = torch.tensor(values, dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(summed)
        return summed.tolist()

    def from_rank0(self, value: T) -> T:
        """Rank 0's `value` on every process (`from_rank0`)."""
        return from_rank0(value, self.world)

    def clip_grad_norm(self, max_norm: float) -> float:
        """Clip the gradients' global norm to `max_norm`; returns the norm before clipping (equal on every process)."""
        return float(torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm))

    def gather(self) -> None:
        """Collective: `model` and `optimizer_state()` on rank 0 catch up with training (nothing to do here)."""

    def optimizer_state(self) -> dict[str, Any]:
        """The optimizer state as a one-process run's optimizer over `model.parameters()` holds it."""
        return self.optimizer.state_dict()

    def close(self) -> None:
        """Leave the process group (after the last collective)."""
        if self.world > 1 and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


class Sharded(Replicas):
    """FSDP (`fully_shard`): each process holds 1/world of every parameter, gradient and optimizer state.

    Every encoder and decoder layer is its own shard group (gathered only while it runs), the
    embeddings and head the root group. Training runs on a sharded copy of `model` as written (the
    backend's faster modules are not sharded); `gather()` copies
    the full weights back into `model` and the full optimizer state into one-process form on rank 0.

    Args:
        optimizer: a plain optimizer over `model.parameters()`, maybe with a resumed state; a new one
            over the shards takes its state (`self.optimizer`).
        make_optimizer: builds an optimizer like `optimizer` over other parameters.
        Others: as `Replicas`.
    """

    def __init__(self, model: nn.Module, task: Task, optimizer: torch.optim.Optimizer, *,
                 make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer], rank: int, world: int,
                 device: torch.device | None = None):
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        super().__init__(model, task, optimizer, rank=rank, world=world, device=device)
        # The checkpoint numbers parameters as the plain optimizer does; FSDP's state dicts name them.
        names = {id(p): f"model.{name}" for name, p in model.named_parameters()}
        self.layout = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
        self.optimizer = make_optimizer(self.module.parameters())
        state = optimizer.state_dict()
        if state["state"]:  # a resumed run
            set_optimizer_state_dict(self.module, self.optimizer, self._named(state), options=self._full())
        self._gathered: dict[str, Any] | None = None  # rank 0's optimizer state at the last gather()
        self.optimizer.register_step_post_hook(lambda *args: setattr(self, "_gathered", None))

    def _wrap(self, module: nn.Module) -> nn.Module:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        # FSDP warns that the objective's logits may be views; the loss reads them out of place.
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
        mesh = init_device_mesh(self.device.type, (self.world,))
        module = copy.deepcopy(module)  # `model` keeps full weights for validation and checkpoints
        for layer in module.modules():
            if isinstance(layer, (EncoderLayer, DecoderLayer)):
                fully_shard(layer, mesh=mesh)
        return fully_shard(module, mesh=mesh)

    @staticmethod
    def _full() -> Any:
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(full_state_dict=True, cpu_offload=True)

    def _named(self, state: dict[str, Any]) -> dict[str, Any]:
        return {"state": {self.layout[i]: value for i, value in state["state"].items()},
                "param_groups": [{**group, "params": [self.layout[i] for i in group["params"]]}
                                 for group in state["param_groups"]]}

    def _indexed(self, state: dict[str, Any]) -> dict[str, Any]:
        index = {name: i for i, name in enumerate(self.layout)}
        return {"state": {index[name]: value for name, value in state["state"].items()},
                "param_groups": [{**group, "params": [index[name] for name in group["params"]]}
                                 for group in state["param_groups"]]}

    def micro_step(self, last: bool) -> AbstractContextManager:
        """Gradients are reduce-scattered only on the step's `last` micro-batch."""
        self.module.set_requires_gradient_sync(last)
        return nullcontext()

    def clip_grad_norm(self, max_norm: float) -> float:
        """As `Replicas.clip_grad_norm`, over the shards."""
        norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    def gather(self) -> None:
        """Collective (every process calls it): full weights into `model` and the optimizer state, on rank 0."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        if self._gathered is not None:  # nothing changed since the last gather
            return
        weights = get_model_state_dict(self.module, options=self._full())
        state = get_optimizer_state_dict(self.module, self.optimizer, options=self._full())
        if self.rank == 0:
            with torch.no_grad():
                self.model.load_state_dict({name.removeprefix("model."): value for name, value in weights.items()})
            self._gathered = self._indexed(state)
        else:
            self._gathered = {}

    def optimizer_state(self) -> dict[str, Any]:
        """The optimizer state of the last `gather()` (rank 0), as a one-process run's."""
        if self._gathered is None:
            raise RuntimeError("the sharded optimizer state is stale: call gather() on every process first")
        return self._gathered


def data_parallel(model: nn.Module, task: Task, optimizer: torch.optim.Optimizer, *, strategy: str, rank: int,
                  world: int, make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
                  device: torch.device | None = None, prepared: nn.Module | None = None) -> Replicas:
    """`Sharded` for `strategy="fsdp"` with more than one process, else `Replicas` (one process, or DDP) running
    `prepared` (a backend's prepared copy of `model`, sharing its parameters) when given."""
    if strategy not in STRATEGIES:
        raise ValueError(f"distributed must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    if strategy == "fsdp" and world > 1:
        return Sharded(model, task, optimizer, make_optimizer=make_optimizer, rank=rank, world=world,
                       device=device)
    return Replicas(model, task, optimizer, rank=rank, world=world, device=device, prepared=prepared)
