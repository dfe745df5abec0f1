"""The copies of a layer's weights for batches where arithmetic, not the weights' bytes, bounds a product: float16
through fbgemm, bfloat16 through oneDNN, bfloat16 on AMX tiles through lmserve's kernel (kernels/amx_linear.cpp).
A block layer builds the one its BatchedPath names (weights/kernel_choice.py), for prompt rows or for large batches."""

from __future__ import annotations

import sys

import torch
from torch import nn

from lmserve.worker.kernels import cpu_kernels
from lmserve.worker.layer_program import Float16Call, LinearPlan
from lmserve.worker.weights.kernel_choice import fbgemm_row_tile


class Float16WeightLinear(nn.Module):
    """y = x @ W.T + b with W stored in float16 and the arithmetic in float32, through fbgemm at every batch size: it
    also beats a float32 GEMM of the weights widened per call at 256 and 1,024 rows (benchmarks/quantization.py).
    The rows go in padded with zero rows to a multiple of fbgemm_row_tile(), so that each row's result is its own.
    The bias is added after the product, in float32 as fbgemm adds a packed one (the same bits), so that the weights
    can be packed before the bias is known (float16_layers.PendingFloat16Linear)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]
        self.bias = None if bias is None else bias.detach().float()
        self.packed = torch.ops.quantized.linear_prepack_fp16(weight.detach().float(), None)
        self.row_tile = fbgemm_row_tile()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        padding = -rows.shape[0] % self.row_tile
        if not padding:
            y = torch.ops.quantized.linear_dynamic_fp16(x.contiguous(), self.packed)
        else:
            padded = torch.cat([rows, rows.new_zeros(padding, self.in_features)])
            y = torch.ops.quantized.linear_dynamic_fp16(padded, self.packed)[: rows.shape[0]]
            y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y.add_(self.bias)

    def program_plan(self) -> LinearPlan:
        """What forward() is, for worker/layer_program.py: one fbgemm call at every batch size."""
        call = Float16Call(self.packed, self.in_features, self.out_features, self.row_tile, self.bias)
        return LinearPlan([call], sys.maxsize, prompt_rows_apart=False)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, float16 weights"


class Bfloat16WeightLinear(nn.Module):
    """y = x @ W.T + b with W and x rounded to bfloat16, products summed in float32 by oneDNN (AMX tiles or AVX-512
    BF16 where the CPU has them) and the sum rounded to bfloat16 (torch's bfloat16 linear), the bias added in float32:
    for batches where arithmetic, not the weights' bytes, bounds the layer. Against the 4-bit weights it serves, the
    rounding is small (perplexity and KL in docs/benchmarks.md)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]
        self.bias = None if bias is None else bias.detach().float()
        self.weight = weight.detach().to(torch.bfloat16).contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.linear(x.to(torch.bfloat16), self.weight).float()
        return y if self.bias is None else y.add_(self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bfloat16 weights"


class AmxBfloat16Linear(nn.Module):
    """y = bfloat16(x) @ W.T + b with W in bfloat16, products summed in float32 on AMX tiles and float32 out
    (kernels/amx_linear.cpp): each row's result is the same whatever other rows share the call."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else bias.detach().float().contiguous()
        ops = cpu_kernels()
        self.packed = ops.amx_pack_weight(weight.detach())
        self.linear_op = ops.amx_linear

    @staticmethod
    def fits(out_features: int, in_features: int) -> bool:
        return out_features % 32 == 0 and in_features % 32 == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_op(x, self.packed, self.out_features, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bfloat16 weights on AMX tiles"


BATCHED_LAYER_TYPES: dict[str, type[nn.Module]] = {"fp16": Float16WeightLinear, "bf16": Bfloat16WeightLinear}
PROMPT_LAYER_TYPES: dict[str, type[nn.Module]] = {"fp16": Float16WeightLinear, "bf16": AmxBfloat16Linear}
