"""A fused layer whose parts a file stores in different block types: each part in its own kernel format.

llama.cpp's Q4_K_M files store V in Q6_K in about half of the layers and Q and K in Q4_K; Q, K and V are one fused
layer here (worker/models/llama.py). No kernel format holds both types exactly, so such a layer is run as segments of
rows, one block layer each (q, k and v's own formats), and their outputs are laid side by side: the file's values at
their stored size, where the whole layer would otherwise fall back to float16 weights.
"""

from __future__ import annotations

import torch
from torch import nn

from lmserve.worker.layer_program import LinearPlan
from lmserve.worker.weights.block_packing import StoredBlocks
from lmserve.worker.weights.layer_format import PendingLayer
from lmserve.worker.weights.pending import PendingBlockLinear


class PendingSegmentsLinear(PendingLayer):
    """The loading form: one PendingBlockLinear a segment (rows in order), the fused layer's bias whole (the checkpoint
    loads it as one parameter), rows routed to the segment that starts where they start."""

    def __init__(self, in_features: int, segments: list[tuple[int, str]], bias: bool, activations: str = "float32"
                 ) -> None:
        """segments: (rows, kernel format) in row order; activations: the block layers' (PendingBlockLinear)."""
        super().__init__()
        self.in_features = in_features
        self.out_features = sum(rows for rows, _ in segments)
        self.starts = [sum(rows for rows, _ in segments[:i]) for i in range(len(segments))]
        self.segments = nn.ModuleList(
            PendingBlockLinear(method, in_features, rows, False, activations) for rows, method in segments)
        self.bias = nn.Parameter(torch.empty(self.out_features)) if bias else None

    def load_rows(self, start: int, weight: torch.Tensor | StoredBlocks) -> None:
        for first, segment in zip(self.starts, self.segments, strict=True):
            if first <= start < first + segment.out_features:
                return segment.load_rows(start - first, weight)
        raise ValueError(f"rows at {start} are past this [{self.out_features}, {self.in_features}] layer")

    def finish(self) -> RowSegmentsLinear:
        layers = []
        for first, segment in zip(self.starts, self.segments, strict=True):
            layer = segment.finish()
            if self.bias is not None:
                layer.bias = self.bias.detach()[first : first + segment.out_features].float().contiguous()
            layers.append(layer)
        return RowSegmentsLinear(layers)

    def extra_repr(self) -> str:
        formats = ", ".join(f"{s.out_features} rows {s.method}" for s in self.segments)
        return f"in_features={self.in_features}, {formats}, loading"


class RowSegmentsLinear(nn.Module):
    """y = [x @ W_1.T + b_1, x @ W_2.T + b_2, ...]: block layers over consecutive rows of one weight. The block layers
    are its children, so whatever applies to every block layer of a model (prompt copies, activations, batched paths)
    applies to each segment."""

    def __init__(self, segments: list[nn.Module]) -> None:
        super().__init__()
        self.segments = nn.ModuleList(segments)
        self.in_features = segments[0].in_features
        self.out_features = sum(s.out_features for s in segments)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([segment(x) for segment in self.segments], dim=-1)

    def program_plan(self) -> LinearPlan | None:
        """The segments' kernel calls, for the batches every segment sends to its block kernel alone."""
        plans = [getattr(segment, "program_plan", lambda: None)() for segment in self.segments]
        if any(plan is None for plan in plans):
            return None
        return LinearPlan([call for plan in plans for call in plan.calls], min(plan.max_rows for plan in plans),
                          any(plan.prompt_rows_apart for plan in plans))

    def dequantized(self) -> torch.Tensor:
        return torch.cat([segment.dequantized() for segment in self.segments])

