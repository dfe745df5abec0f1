"""Float layers that load straight into their float16 weights: no float32 copy of a checkpoint's matrices.

`--quantization fp16` (auto's choice on CPU for a Hugging Face directory, and for a GGUF's layers that have no
kernel format) runs each linear layer on float16 weights through fbgemm (batched_copies.Float16WeightLinear). Built as
float32 parameters and converted after loading, a 16-bit checkpoint (bfloat16 safetensors, most of the Hub) would
first be widened in full: twice its bytes, 4 GiB for a 1B model, before the float16 weights exist. Here those layers
are PendingFloat16Linear from the start (built on the meta device with the rest of the model): each checkpoint tensor
is rounded to float16 as it arrives, and a layer's rows go to fbgemm as soon as the last of them is in. The weights come out
bit for bit as the convert-after-loading path made them: float16 holds what rounding bfloat16 or float32 through
float32 gives, and values beyond float16's range saturate as fbgemm's packing saturates them.
"""

from __future__ import annotations

import torch
from torch import nn

from lmserve.worker.weights.batched_copies import Float16WeightLinear
from lmserve.worker.weights.block_packing import StoredBlocks
from lmserve.worker.weights.layer_format import LayerFormat, PendingLayer

FLOAT16_MAX = float(torch.finfo(torch.float16).max)
# The family's table: float16 weights, 2 bytes each, any shape.
FLOAT16_LAYER_FORMATS = (
    LayerFormat("fp16", Float16WeightLinear, "fbgemm's float16 GEMM (batched_copies.Float16WeightLinear)",
                "fbgemm's packed float16 matrix (PendingFloat16Linear stages the rows in float16)", ("float32",)),
)


class PendingFloat16Linear(PendingLayer):
    """A float16 layer whose rows are still loading into `staged` (float16, [out_features, in_features]). Once every
    row is in, they go to fbgemm at once and `staged` is freed: the model's layers are never all staged together."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        staged = torch.empty(out_features, in_features, dtype=torch.float16)
        self.register_buffer("staged", staged, persistent=False)
        self.rows_in: list[range] = []  # plain ranges, not a buffer: model_builder leaves buffers uninitialised
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.packed: Float16WeightLinear | None = None

    def load_rows(self, start: int, weight: torch.Tensor | StoredBlocks) -> None:
        """Rows start, start + 1, ... of the weight (a fused layer's q, k and v arrive one after another)."""
        values = weight.dequantize() if isinstance(weight, StoredBlocks) else weight
        if values.dim() != 2 or values.shape[1] != self.in_features or start + values.shape[0] > self.out_features:
            raise ValueError(
                f"rows of shape {tuple(values.shape)} do not fit at row {start} of a "
                f"[{self.out_features}, {self.in_features}] layer"
            )
        rows = range(start, start + values.shape[0])
        if any(rows.start < other.stop and other.start < rows.stop for other in self.rows_in):
            raise ValueError(f"rows {rows.start}..{rows.stop - 1} of a [{self.out_features}, {self.in_features}] "
                             "layer loaded twice")
        self.staged[rows.start : rows.stop].copy_(values.clamp(-FLOAT16_MAX, FLOAT16_MAX))
        self.rows_in.append(rows)
        if sum(len(r) for r in self.rows_in) == self.out_features:
            self.packed = Float16WeightLinear(self.staged, None)
            self.staged = torch.empty(0, dtype=torch.float16)  # fbgemm holds its own copy

    def finish(self) -> Float16WeightLinear:
        if self.packed is None:
            raise ValueError(f"a [{self.out_features}, {self.in_features}] layer is missing rows")
        layer, self.packed = self.packed, None
        layer.bias = None if self.bias is None else self.bias.detach().float()  # loaded by now, whatever the order
        return layer

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, float16 weights, loading"


def pend_float16_linears(module: nn.Module) -> int:
    """Replaces every nn.Linear under module (on the meta device: shapes only) with a PendingFloat16Linear, in place;
    returns how many were replaced. Layers already pending in a block format stay as they are."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, PendingFloat16Linear(child.in_features, child.out_features, child.bias is not None))
            count += 1
        else:
            count += pend_float16_linears(child)
    return count
