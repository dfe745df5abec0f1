"""One rank's place in the engine's layout, without torch: the engine's and a --headless node's side of the ranks
(executor/multiproc.py, headless.py) imports it, and need not load torch to start ranks that load it themselves.

Ranks are numbered as vLLM numbers them: rank = pp_rank × tp_size + tp_rank, so the ranks of one pipeline stage
form one tensor-parallel group.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RankLayout:
    rank: int
    tp_size: int = 1
    pp_size: int = 1

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_driver(self) -> bool:
        """The rank that samples and returns the step's output: tensor rank 0 of the last stage."""
        return self.is_last_stage and self.tp_rank == 0

    @staticmethod
    def driver_rank(tp_size: int, pp_size: int) -> int:
        return (pp_size - 1) * tp_size

    def stage_layers(self, num_layers: int) -> range:
        """The layers this rank's stage runs: consecutive, the first stages one larger when they do not divide."""
        return stage_layers(num_layers, self.pp_size, self.pp_rank)


def stage_layers(num_layers: int, pp_size: int, pp_rank: int) -> range:
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return range(start, start + base + (1 if pp_rank < extra else 0))
