"""What every family of weight formats shares: the row of its table (LayerFormat) and the loading form of its layers
(PendingLayer).

Each family module holds one table of its formats: float16.py (fp16), block_linear.py (q4_1, q8_0: the block formats
every CPU with AVX2 runs) and kquants.py (the K-quants, q4_0, q5_0, q5_1 and iq4_nl: integer activations only);
layer_types.py gathers them. A new format is a row in formats/block_formats.py's table (its blocks as a file stores
them), a row in its family's table (its layer, kernel and packing) and its kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lmserve.formats.block_formats import BLOCK_TYPES
from lmserve.worker.weights.block_packing import StoredBlocks


@dataclass(frozen=True)
class LayerFormat:
    """A format a linear layer's weights take here. name: the kernel format's (and --quantization's) name;
    layer_type: the layer that holds it, built from a weight (float, or a file's blocks) and a bias; kernel: what
    multiplies it; packing: how its weights go into that kernel's layout; activations: what the kernel takes;
    group_rows: output rows the kernel's layout groups (a layer's rows a multiple of it)."""

    name: str
    layer_type: type[nn.Module]
    kernel: str
    packing: str
    activations: tuple[str, ...] = ("int16", "int8")
    group_rows: int = 1

    @property
    def block_width(self) -> int:
        """Weights a block (1: float weights, any width)."""
        block = BLOCK_TYPES.get(self.name)
        return block.block_width if block else 1

    @property
    def bytes_per_weight(self) -> float:
        """What a weight costs in memory (its blocks', or float16's 2)."""
        block = BLOCK_TYPES.get(self.name)
        return block.bytes_per_weight if block else 2.0

    def fits(self, out_features: int, in_features: int) -> bool:
        """Whether a layer of this format can hold an [out_features, in_features] weight: whole blocks a row, whole
        groups of rows."""
        return in_features % self.block_width == 0 and out_features % self.group_rows == 0


class PendingLayer(nn.Module):
    """A layer whose weights are still being loaded: load_rows(start, weight) takes the checkpoint's rows, finish()
    gives the layer they make (pending.finish_block_linears)."""

    def load_rows(self, start: int, weight: torch.Tensor | StoredBlocks) -> None:
        raise NotImplementedError

    def finish(self) -> nn.Module:
        raise NotImplementedError
