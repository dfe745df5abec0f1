"""The decoder layers of a step as one C++ call (kernels/layer_program.cpp): the CPU's counterpart of CUDA graphs.

On a small model Python between the ops is a quarter of a decode step (Gemma 3 270M: ~2 ms of ~9). The program holds
each layer's weights and settings once and calls the same kernels, in the same order, on the same tensors as the
eager forward, so a batch gets the same bits either way; it only takes batches whose eager forward would be exactly
those calls (every linear layer on its block kernel or on fbgemm's float16 weights, paged-cpu attention).
`--enforce-eager` keeps the Python loop, as vLLM's flag keeps it from CUDA graphs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lmserve.worker.prompt_rows import current_prompt_rows


class ProgramRefused(Exception):
    """Why a model's layers cannot run as a program (they run op by op from Python instead)."""


@dataclass(frozen=True)
class KernelCall:
    """One block kernel's product over some output rows: op(x, weight, out_features, bias)."""

    op_name: str  # lmserve::q4_k_int16_linear
    weight: torch.Tensor
    out_features: int
    bias: torch.Tensor | None


@dataclass(frozen=True)
class Float16Call:
    """fbgemm's product on float16 weights (batched_copies.Float16WeightLinear): rows padded to row_tile."""

    packed: Any  # torch.ops.quantized.linear_prepack_fp16's object
    in_features: int
    out_features: int
    row_tile: int
    bias: torch.Tensor | None


@dataclass(frozen=True)
class LinearPlan:
    """What a linear layer does for the batches a program takes: its kernel calls, concatenated over their rows;
    up to max_rows rows (larger ones take another path), and when prompt_rows_apart, no prompt rows at all."""

    calls: list[KernelCall | Float16Call]
    max_rows: int
    prompt_rows_apart: bool


@dataclass
class LayerProgram:
    program: Any  # torch.classes.lmserve.LayerProgram
    kv_heads: int
    num_groups: int  # KV-cache groups the layers attend through
    max_rows: int
    prompt_rows_apart: bool

    def takes(self, num_rows: int, md: Any) -> bool:
        """Whether this batch's eager forward is what the program runs."""
        if num_rows > self.max_rows:
            return False
        if self.prompt_rows_apart:
            rows = current_prompt_rows()
            if rows is not None and rows.prompt is not None and rows.num_rows == num_rows:
                return False
        return all(g.decode_requests is not None and not g.prefills for g in md.groups or [md])

    def run(self, x: torch.Tensor, residual: torch.Tensor | None, rope: Sequence[tuple[torch.Tensor, torch.Tensor]],
            md: Any) -> tuple[torch.Tensor, torch.Tensor]:
        groups = md.groups or [md] * self.num_groups
        return self.program.run(
            x, residual, [cos for cos, _ in rope], [sin for _, sin in rope],
            [g.cache_rows(self.kv_heads) for g in groups], [g.decode_block_tables for g in groups],
            [g.decode_requests for g in groups],
        )


def new_program(heads: int, kv_heads: int, head_dim: int, intermediate: int, eps: float, sandwich: bool,
                gelu: bool) -> Any:
    from lmserve.worker.kernels import cpu_kernels

    cpu_kernels()  # registers torch.classes.lmserve
    return torch.classes.lmserve.LayerProgram(heads, kv_heads, head_dim, intermediate, eps, sandwich, gelu)


def new_moe_block(top_k: int, intermediate: int, shared_intermediate: int, normalize_top_k: bool, gelu: bool,
                  router: torch.Tensor, shared_router: torch.Tensor | None, routed_tokens: torch.Tensor) -> Any:
    """kernels/moe_block.h's MoeBlock: routers in float64, expert layers added with add_linear(..., expert)."""
    from lmserve.worker.kernels import cpu_kernels

    cpu_kernels()
    return torch.classes.lmserve.MoeBlock(top_k, intermediate, shared_intermediate, normalize_top_k, gelu, router,
                                          shared_router, routed_tokens)


def add_linear(program: Any, slot: str, plan: LinearPlan | None, name: str, *expert: int) -> tuple[int, bool]:
    """Adds a linear layer's calls to a LayerProgram's slot, or (expert: its index, -1 for the shared one) to a
    MoeBlock's expert."""
    if plan is None:
        raise ProgramRefused(f"{name} is neither a block-format nor a float16 layer")
    for call in plan.calls:
        if isinstance(call, Float16Call):
            program.add_fp16_segment(*expert, slot, call.packed, call.in_features, call.out_features, call.row_tile,
                                     call.bias)
        else:
            program.add_segment(*expert, slot, call.op_name, call.weight, call.out_features, call.bias)
    return plan.max_rows, plan.prompt_rows_apart
