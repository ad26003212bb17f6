"""Data-parallel training on torch.distributed: `torchrun --nproc-per-node N -m diffspec train-drafter ...`.

torchrun sets RANK / WORLD_SIZE / LOCAL_RANK; without them the run is one process and nothing here
does anything. Every rank holds the whole (small) drafter, computes its share of each global batch
(training/batches.py: rank r takes sequences r, r + N, ...), and DistributedDataParallel averages
the gradients; rank 0 alone logs, checkpoints and writes the drafter.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    device: str = "cpu"

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1


def join_world(device: str) -> World:
    """Join the process group torchrun describes (gloo on CPU, NCCL on CUDA); one process otherwise."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return World(device=device)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device.startswith("cuda"):
        device = f"cuda:{local}"
        torch.cuda.set_device(local)
    if not dist.is_initialized():  # a long timeout: rank 0 writes checkpoints while the others wait
        dist.init_process_group(backend="nccl" if device.startswith("cuda") else "gloo", timeout=timedelta(hours=2))
    return World(rank=dist.get_rank(), size=dist.get_world_size(), device=device)


def all_sum(values: torch.Tensor, world: World) -> torch.Tensor:
    """Sum over ranks (a copy; the identity for one process)."""
    out = values.detach().clone()
    if world.distributed:
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out


def all_max(value: float, world: World) -> float:
    """The largest of the ranks' values: collective decisions (stop now?) that every rank takes alike."""
    if not world.distributed:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=world.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def barrier(world: World) -> None:
    if world.distributed:
        dist.barrier()


def wrap(module: torch.nn.Module, world: World) -> torch.nn.Module:
    """DistributedDataParallel around the loss module when there are several ranks."""
    if not world.distributed:
        return module
    from torch.nn.parallel import DistributedDataParallel

    ids = [torch.device(world.device).index] if world.device.startswith("cuda") else None
    return DistributedDataParallel(module, device_ids=ids)


def leave_world(world: World) -> None:
    """Tear the process group down, after every object that holds it is gone.

    DistributedDataParallel can sit in a reference cycle (a first one in a process was seen to), so
    it outlives the function that made it until the cycle collector runs, and it keeps its process
    group alive: `destroy_process_group` then only drops the registry's reference, and gloo's worker
    threads are torn down during interpreter finalisation, where a rank aborted ("terminate called
    without an active exception", SIGABRT) in 9 of 40 two-rank runs on a loaded 2-core machine.
    Collecting first destroys the group here, while Python is whole: 0 of 40
    (benchmarks/results/issue16_training/gloo_teardown/).
    """
    if world.distributed and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()
