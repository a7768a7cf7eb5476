"""TPGroup: this process's rank, the ranks' process group and the two collectives the layers use.

The process group is built directly on a ``TCPStore`` (``ProcessGroupGloo`` on CPU,
``ProcessGroupNCCL`` on CUDA) rather than through ``torch.distributed.init_process_group``: no
default group is registered, so one process may hold several engines (tests build TP=1, 2 and
4 engines side by side) and shutting one down leaves the others alone.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch

# NVLink multicast (NVLS) reserves GPU memory per communicator and has hung on some drivers;
# the all-reduces here are small, so it buys nothing.
NCCL_NVLS_ENV = "NCCL_NVLS_ENABLE"


@dataclass(frozen=True)
class TPGroup:
    """One rank's view of the tensor-parallel ranks.

    Attributes:
        rank: this process's rank, ``0 <= rank < world_size``; rank 0 schedules and samples.
        world_size: the number of ranks (the tensor-parallel size).
        device: the device this rank computes on.
        process_group: the c10d process group of the ranks; None when ``world_size`` is 1.
    """

    rank: int
    world_size: int
    device: torch.device
    process_group: Any = None

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank: expected 0 <= rank < world_size={self.world_size}, "
                             f"got {self.rank}")
        if (self.process_group is None) != (self.world_size == 1):
            raise ValueError("process_group: expected one exactly when world_size > 1")

    @classmethod
    def single(cls, device: torch.device | str) -> TPGroup:
        """The group of a process that computes alone (TP=1)."""
        return cls(0, 1, torch.device(device))

    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Sum (or "min") ``x`` over the ranks, in place; returns ``x``. Any shape and dtype,
        on this rank's device. Capturable in a CUDA graph (NCCL)."""
        if self.process_group is None:
            return x
        from torch import distributed as dist
        opts = dist.AllreduceOptions()
        opts.reduceOp = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN}[op]
        self.process_group.allreduce([x], opts).wait()
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., d]`` on every rank -> ``[..., world_size * d]``, rank 0's columns first."""
        if self.process_group is None:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        self.process_group.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=-1)

    def close(self) -> None:
        """Release the communicator; harmless for TP=1. NCCL's is aborted rather than shut
        down: its orderly shutdown waits until every rank shuts down, but rank 0 closes only
        after its workers have exited, and a rank whose peer died would wait forever. By the
        time a rank closes, its steps are done (or failed). Destroy the CUDA graphs that
        captured its collectives first (``ModelRunner.release_graphs``,
        ``TPWorkers.track_graphs``): NCCL's teardown waits while they exist."""
        pg = self.process_group
        release = getattr(pg, "abort" if self.device.type == "cuda" else "shutdown", None)
        if release is not None:
            try:
                release()
            except RuntimeError:        # a peer is already gone
                pass


def init_tp_group(rank: int, world_size: int, device: torch.device | str, *, host: str,
                  port: int, timeout_s: float, store: Any = None) -> TPGroup:
    """Join the ``world_size`` ranks rendezvousing at ``host:port`` (blocks until all have).

    Args:
        rank, world_size: this rank and the group's size.
        device: this rank's device; CUDA uses NCCL (one GPU per rank), anything else gloo.
        host, port: the ``TCPStore`` rank 0 serves.
        timeout_s: how long the rendezvous and every collective may wait for a peer.
        store: rank 0 passes the store it created (to learn a free port first); None: connect.
    """
    from torch import distributed as dist

    device = torch.device(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(host, port, world_size, False, timeout=timeout)
    if world_size == 1:
        return TPGroup.single(device)
    if device.type == "cuda":
        os.environ.setdefault(NCCL_NVLS_ENV, "0")   # before the communicator exists
        torch.cuda.set_device(device)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(store, rank, world_size, opts)
    else:
        pg = dist.ProcessGroupGloo(store, rank, world_size, timeout)
    return TPGroup(rank, world_size, device, pg)


def serve_store(world_size: int, timeout_s: float, host: str = "127.0.0.1") -> Any:
    """Rank 0's ``TCPStore`` on a free port (read it as ``store.port``)."""
    from torch import distributed as dist
    return dist.TCPStore(host, 0, world_size, True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


__all__ = ["NCCL_NVLS_ENV", "TPGroup", "init_tp_group", "serve_store"]
