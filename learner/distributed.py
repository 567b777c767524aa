"""Data-parallel learning on torch.distributed: `torchrun --nproc-per-node N -m learner ...`.

Rank 0 is the learner service as one process runs it: it reads the batches, writes and announces the
checkpoints and commits the offsets. Every update it broadcasts the trajectories (Avro, as the log holds them:
no pickle crosses a rank boundary) with the version and update count; every rank selects the same
trajectories, backpropagates its share, and one all-reduce sums the flat gradient, so each rank steps on
the whole batch's gradient and the weights stay equal on every rank. This is what DistributedDataParallel
does, without its backward hooks: ranks with uneven or empty shares never wait on each other, and gradient
accumulation needs no `no_sync`. Gloo on CPU, NCCL on CUDA (one GPU per rank, `cuda:LOCAL_RANK`).
"""
from __future__ import annotations

import json
import os
import struct
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Sequence, TypeVar

import torch

T = TypeVar("T")

NOOP, TRAIN, STOP, START, SAVE = 0, 1, 2, 3, 4  # SAVE: gather the sharded (--fsdp) state for a checkpoint
HEARTBEAT_S = 10.0  # rank 0 idle for want of data still speaks this often, so a rank that waits can tell


@dataclass
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")  # where collectives run: cuda for NCCL, cpu for gloo
    last_sent: float = 0.0

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    def describe(self) -> str:
        return f"rank {self.rank}/{self.size}" if self.distributed else "one process"

    # ---- rank 0 -> every rank ------------------------------------------------------------------
    def send(self, kind: int, version: int = 0, updates: int = 0, payload: bytes = b"") -> None:
        """Rank 0: a command for every other rank (TRAIN carries the encoded trajectories)."""
        if not self.distributed:
            return
        header = torch.tensor([kind, version, updates, len(payload)], dtype=torch.int64, device=self.device)
        torch.distributed.broadcast(header, src=0)
        if payload:
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device)
            torch.distributed.broadcast(data, src=0)
        self.last_sent = time.monotonic()

    def heartbeat(self) -> None:
        if self.distributed and time.monotonic() - self.last_sent > HEARTBEAT_S:
            self.send(NOOP)

    def receive(self) -> tuple[int, int, int, bytes]:
        """Another rank: the next command from rank 0 as (kind, version, updates, payload)."""
        header = torch.zeros(4, dtype=torch.int64, device=self.device)
        torch.distributed.broadcast(header, src=0)
        kind, version, updates, size = (int(v) for v in header.tolist())
        payload = b""
        if size:
            data = torch.empty(size, dtype=torch.uint8, device=self.device)
            torch.distributed.broadcast(data, src=0)
            payload = data.cpu().numpy().tobytes()
        return kind, version, updates, payload

    # ---- every rank together -------------------------------------------------------------------
    def shard(self, units: Sequence[T]) -> list[T]:
        """This rank's contiguous share of the units (empty when there are fewer units than ranks)."""
        if not self.distributed:
            return list(units)
        per, extra = divmod(len(units), self.size)
        start = self.rank * per + min(self.rank, extra)
        return list(units[start:start + per + (1 if self.rank < extra else 0)])

    def total(self, value: float) -> float:
        if not self.distributed:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(t)
        return float(t.item())

    def maximum(self, value: float) -> float:
        if not self.distributed:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return float(t.item())

    def sum_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """Every rank's figures summed, key by key (a rank with no share lacks the loss's keys)."""
        if not self.distributed:
            return metrics
        keys = sorted(set().union(*(json.loads(b) for b in self.gather_bytes(json.dumps(sorted(metrics)).encode()))))
        values = torch.tensor([metrics.get(k, 0.0) for k in keys], dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(values)
        return dict(zip(keys, values.tolist()))

    def sum_gradients(self, params: Sequence[torch.nn.Parameter]) -> None:
        """One all-reduce of the flat gradient; a parameter no rank touched keeps no gradient."""
        if not self.distributed or not params:
            return
        touched = torch.tensor([float(p.grad is not None) for p in params], device=self.device)
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
        torch.distributed.all_reduce(touched)
        torch.distributed.all_reduce(flat)
        offset = 0
        for p, any_rank in zip(params, touched.tolist()):
            n = p.numel()
            p.grad = flat[offset:offset + n].view_as(p).clone() if any_rank else None
            offset += n

    def gather_bytes(self, data: bytes) -> list[bytes]:
        sizes = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in range(self.size)]
        torch.distributed.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64, device=self.device))
        longest = max(int(s.item()) for s in sizes)
        mine = torch.zeros(longest, dtype=torch.uint8, device=self.device)
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else mine[:0]
        parts = [torch.empty(longest, dtype=torch.uint8, device=self.device) for _ in range(self.size)]
        torch.distributed.all_gather(parts, mine)
        return [p[:int(s.item())].cpu().numpy().tobytes() for p, s in zip(parts, sizes)]

    def close(self) -> None:
        if self.distributed and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()



def join(device: str, timeout_s: float = 1800.0) -> World:
    """The world torchrun describes in the environment (RANK, WORLD_SIZE, LOCAL_RANK), joined; one process
    without it. NCCL when this rank trains on CUDA, gloo otherwise."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return World()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    backend = "nccl" if cuda else "gloo"
    comm = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(comm)
    # The store torchrun hosts outlives a restart of the job: without a prefix per attempt, a rank of the
    # restarted job can read the gloo address a rank of the failed attempt wrote there, and never connect.
    store, _, _ = next(torch.distributed.rendezvous("env://", timeout=timedelta(seconds=timeout_s)))
    attempt = torch.distributed.PrefixStore(f"trajpipe/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}",
                                            store)
    torch.distributed.init_process_group(backend, store=attempt, rank=rank, world_size=size,
                                         timeout=timedelta(seconds=timeout_s))
    return World(rank=rank, size=size, local_rank=local_rank, device=comm)


def rank_device(device: str, world: World) -> str:
    """The device this rank trains on: its own GPU under torchrun, else the setting."""
    if world.distributed and world.device.type == "cuda":
        return str(world.device)
    return device


def pack(records: Sequence[bytes]) -> bytes:
    return b"".join(struct.pack(">I", len(r)) + r for r in records)


def unpack(data: bytes) -> list[bytes]:
    out, at = [], 0
    while at < len(data):
        (n,) = struct.unpack_from(">I", data, at)
        out.append(data[at + 4:at + 4 + n])
        at += 4 + n
    return out


__all__ = ["NOOP", "SAVE", "START", "STOP", "TRAIN", "World", "join", "pack", "rank_device", "unpack"]

