"""The collectives a rank's model calls, on torch.distributed (its place in the layout: distributed/layout.py).

gloo carries CPU tensors, NCCL CUDA ones. A single rank (tp = pp = 1) never initialises torch.distributed: every
collective is then the identity, at no cost.

Every collective counts the bytes this rank puts on the wire, so a benchmark can set the planner's prediction
(lmserve.plan) beside what the ranks actually sent.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from lmserve.distributed.layout import RankLayout

logger = logging.getLogger(__name__)

# A collective waits this long for a peer before failing: long enough for a first forward pass on a slow machine,
# short enough that a rank whose peer died exits instead of hanging (the executor notices the death sooner).
COLLECTIVE_TIMEOUT = timedelta(minutes=5)


@dataclass
class CommunicationStats:
    all_reduce_bytes: int = 0
    all_gather_bytes: int = 0
    send_bytes: int = 0
    calls: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class ParallelGroups:
    """The collectives of one rank. With one rank everything is a no-op."""

    layout: RankLayout
    tp_group: dist.ProcessGroup | None = None
    stats: CommunicationStats = field(default_factory=CommunicationStats)

    @property
    def tp_size(self) -> int:
        return self.layout.tp_size

    @property
    def tp_rank(self) -> int:
        return self.layout.tp_rank

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the tensor-parallel group, in place (row-parallel layers' partial sums)."""
        if self.tp_size == 1:
            return x
        self.stats.all_reduce_bytes += x.numel() * x.element_size()
        self.stats.calls += 1
        dist.all_reduce(x, group=self.tp_group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate each tensor rank's slice along the last dimension (vocab-parallel logits)."""
        if self.tp_size == 1:
            return x
        x = x.contiguous()
        self.stats.all_gather_bytes += x.numel() * x.element_size()
        self.stats.calls += 1
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        dist.all_gather(parts, x, group=self.tp_group)
        return torch.cat(parts, dim=-1)

    def send_to_next_stage(self, tensors: list[torch.Tensor]) -> None:
        """Hidden states and residual to the same tensor rank of the next stage."""
        peer = self.layout.rank + self.tp_size
        for t in tensors:
            t = t.contiguous()
            self.stats.send_bytes += t.numel() * t.element_size()
            self.stats.calls += 1
            dist.send(t, dst=peer)

    def recv_from_previous_stage(self, shapes: list[tuple[int, ...]], dtype: torch.dtype,
                                 device: torch.device) -> list[torch.Tensor]:
        peer = self.layout.rank - self.tp_size
        received = []
        for shape in shapes:
            t = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(t, src=peer)
            received.append(t)
        return received


def init_parallel_groups(layout: RankLayout, init_method: str | None, device: torch.device) -> ParallelGroups:
    """Joins the engine's process group (all of its ranks call this with the same init_method) and builds the
    tensor-parallel groups. One rank needs no process group."""
    if layout.world_size == 1:
        return ParallelGroups(layout)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=layout.rank, world_size=layout.world_size,
                            timeout=COLLECTIVE_TIMEOUT)
    tp_group = None
    # Every rank creates every group, in the same order, as torch.distributed requires.
    for pp_rank in range(layout.pp_size):
        ranks = list(range(pp_rank * layout.tp_size, (pp_rank + 1) * layout.tp_size))
        group = dist.new_group(ranks) if layout.tp_size > 1 else None
        if pp_rank == layout.pp_rank:
            tp_group = group
    logger.info("rank %d of %d joined (%s): tensor rank %d/%d, stage %d/%d", layout.rank, layout.world_size,
                backend, layout.tp_rank, layout.tp_size, layout.pp_rank, layout.pp_size)
    return ParallelGroups(layout, tp_group)


def destroy_parallel_groups() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
