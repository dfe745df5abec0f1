"""llama.cpp's q4_1 and q8_0 blocks: a file's blocks as the loader hands them over (StoredBlocks), float weights
quantized into them, and both rearranged byte for byte into the panels the block kernels read
(kernels/quantized_linear.cpp). The K-quant formats' layouts are worker/weights/stored_formats.py's and kquants.py's."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from lmserve.formats.gguf_file import dequantize_gguf_blocks
from lmserve.worker.weights.kernel_choice import BLOCK_SIZE
from lmserve.worker.weights.stored_formats import (
    BLOCK_FORMATS,
    EXACT_INTO,
    HELD_INTO,
    block_width,
    convert_blocks,
)

# llama.cpp's block formats as a GGUF file stores them, per 32 weights of a row: block_q4_1 is float16 d, float16 m,
# then 16 bytes whose byte j holds q[j] in its low nibble and q[j + 16] in its high one (w = d q + m); block_q8_0 is
# float16 d, then 32 int8 q (w = d q).
BLOCK_BYTES = {"q4_1": 20, "q8_0": 34}
_SCALE_BYTES = {"q4_1": 4, "q8_0": 2}  # the float16 fields before the quants


@dataclass(frozen=True)
class StoredBlocks:
    """A weight in one of the block formats, as its file stores it: `data` is uint8 [rows, in_features / 32, bytes per
    block] in llama.cpp's layout (BLOCK_BYTES). The loader hands GGUF tensors over in this form so that a block layer
    takes the file's own blocks, with no float copy of the weights on the way."""

    method: str
    data: torch.Tensor
    # data is the loader's copy-on-write mapping of the file, which nothing writes to: this process's resident pages
    # of it can be dropped and are read from the file again when used (BlockEmbedding.release_file_pages).
    file_mapped: bool = False

    @property
    def shape(self) -> tuple[int, int]:
        return self.data.shape[0], self.data.shape[1] * block_width(self.method)

    def with_data(self, data: torch.Tensor) -> StoredBlocks:
        """The same format over other rows or blocks of it (a shard, a permutation). Still the file's mapping where
        `data` is a view of this one's memory (a shard), not where it is a copy (a permutation)."""
        same_memory = data.untyped_storage().data_ptr() == self.data.untyped_storage().data_ptr()
        return StoredBlocks(self.method, data, self.file_mapped and same_memory)

    def dequantize(self) -> torch.Tensor:
        """The float32 weights, [rows, in_features]: lmserve.models' reader's values (a stored type without a fast
        reader goes through the kernel format that holds it exactly, stored_formats)."""
        method, data = self.method, self.data.numpy()
        into = EXACT_INTO.get(method, ())
        if method not in BLOCK_FORMATS and into and into[-1] in BLOCK_FORMATS:
            method, data = into[-1], convert_blocks(self.method, data, into[-1])
        return torch.from_numpy(dequantize_gguf_blocks(method, data))


@dataclass(frozen=True)
class StoredRows:
    """A layer's rows in one block format that arrive as several tensors, one after another (a fused layer's q, k and
    v, or gate and up), each StoredBlocks.data-shaped and where the loader has it (the file's mapping): the int16
    packers read them in place, with no copy of the whole layer first."""

    method: str
    parts: tuple[torch.Tensor, ...]

    @property
    def shape(self) -> tuple[int, int]:
        return sum(part.shape[0] for part in self.parts), self.parts[0].shape[1] * block_width(self.method)

    def joined(self) -> StoredBlocks:
        return StoredBlocks(self.method, torch.cat(self.parts))


@dataclass(frozen=True)
class PackedBlocks:
    """A layer's weights already in its kernel's layout (the `blocks` a BlockQuantizedLinear holds, packed for
    `activations`), as an earlier start packed them: worker/weights/packed_cache.py maps them from disk, so the
    layer takes them as they are instead of packing the file's blocks again."""

    method: str
    blocks: torch.Tensor
    out_features: int
    in_features: int
    activations: str


def check_block_width(in_features: int) -> None:
    if in_features % BLOCK_SIZE:
        raise ValueError(
            f"block quantization needs in_features that are a multiple of {BLOCK_SIZE}; a layer has {in_features}"
        )


def _blocks(weight: torch.Tensor) -> torch.Tensor:
    out_features, in_features = weight.shape
    check_block_width(in_features)
    return weight.detach().float().reshape(out_features, in_features // BLOCK_SIZE, BLOCK_SIZE)


def _reciprocal(scale: torch.Tensor) -> torch.Tensor:
    return torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))


def _fp16_bytes(values: torch.Tensor) -> torch.Tensor:
    """[N, blocks] float16 as [N, blocks, 2] bytes."""
    return values.unsqueeze(-1).contiguous().view(torch.uint8)


def quantize_blocks(method: str, weight: torch.Tensor) -> torch.Tensor:
    """[N, K] float weights as rows of `method`'s blocks, uint8 [N, K / 32, bytes] (StoredBlocks.data), rounded as
    llama.cpp rounds. q4_1: d = (max - min) / 15 and m = min, both float16, q = round((w - m) / d) in 0..15; q8_0:
    d = max |w| / 127 in float16, q = round(w / d). Rounding uses the float16 d and m, so weights that came out of
    blocks give back the same blocks."""
    blocks = _blocks(weight)
    if method == "q4_1":
        low, high = blocks.amin(-1), blocks.amax(-1)
        scale, minimum = ((high - low) / 15).half(), low.half()
        q = ((blocks - minimum.float()[..., None]) * _reciprocal(scale.float())[..., None]).round().clamp(0, 15)
        q = q.to(torch.uint8)
        nibbles = q[..., :16] | (q[..., 16:] << 4)
        return torch.cat([_fp16_bytes(scale), _fp16_bytes(minimum), nibbles], dim=-1)
    if method == "q8_0":
        scale = (blocks.abs().amax(-1) / 127).half()
        q = (blocks * _reciprocal(scale.float())[..., None]).round().clamp(-128, 127).to(torch.int8)
        return torch.cat([_fp16_bytes(scale), q.view(torch.uint8)], dim=-1)
    raise ValueError(f"unknown block format {method!r}")


def as_blocks(method: str, weight: torch.Tensor | StoredBlocks | StoredRows) -> torch.Tensor:
    """`weight` as rows of `method`'s blocks: a file's blocks of that format as they are, or converted into it where
    that keeps every value (stored_formats: q5_0, q4_0 and iq4_nl into q8_0, q4_0 into q4_1) or only rounds the block
    scales (iq4_xs into q8_0); anything else rounded."""
    if isinstance(weight, StoredRows):
        weight = weight.joined()
    if isinstance(weight, StoredBlocks):
        if weight.method == method:
            return weight.data
        if method in HELD_INTO.get(weight.method, ()):
            return torch.from_numpy(convert_blocks(weight.method, weight.data.numpy(), method))
        weight = weight.dequantize()
    return quantize_blocks(method, weight)


PANEL_ROWS = 8  # output rows whose blocks the kernels read together (kernels/quantized_linear.cpp)


def pack_blocks(method: str, blocks: torch.Tensor) -> torch.Tensor:
    """Rows of `method`'s blocks ([N, K / 32, bytes], llama.cpp's layout) in the kernels' layout: panels of 8 rows,
    each panel's blocks one after another; per block the 8 rows' d's, (q4_1) the 8 m's, then the quants column by
    column, one byte per row (q4_1: 16 columns of nibble pairs, q8_0: 32 of int8). A pure rearrangement of bytes,
    returned as [N rounded up to whole panels, bytes per row]; the padding rows are zero.

    In NumPy, one thread: torch's copies of these small strided pieces run on every compute thread, and at start-up,
    on a busy 2-core machine, waiting for each other cost ~25x as much (4 s instead of 0.2 for the default model)."""
    rows, num_blocks, block_bytes = blocks.shape
    if block_bytes != BLOCK_BYTES[method]:
        raise ValueError(f"{method} blocks have {BLOCK_BYTES[method]} bytes, got {block_bytes}")
    panels = -(-rows // PANEL_ROWS)
    source = blocks.numpy()
    if panels * PANEL_ROWS != rows:
        source = np.concatenate([source, np.zeros((panels * PANEL_ROWS - rows, num_blocks, block_bytes), np.uint8)])
    by_block = source.reshape(panels, PANEL_ROWS, num_blocks, block_bytes).transpose(0, 2, 1, 3)  # panel, block, row
    packed = np.empty((panels, num_blocks, PANEL_ROWS * block_bytes), np.uint8)
    head = _SCALE_BYTES[method]
    for i in range(0, head, 2):  # each float16 field: the 8 rows' values one after another
        packed[:, :, i * PANEL_ROWS : (i + 2) * PANEL_ROWS].reshape(panels, num_blocks, PANEL_ROWS, 2)[...] = (
            by_block[..., i : i + 2]
        )
    quants = packed[:, :, head * PANEL_ROWS :].reshape(panels, num_blocks, block_bytes - head, PANEL_ROWS)
    quants[...] = by_block[..., head:].transpose(0, 1, 3, 2)  # column by column, one byte per row
    return torch.from_numpy(packed.reshape(panels * PANEL_ROWS, -1))


def unpack_blocks(method: str, packed: torch.Tensor, rows: int) -> torch.Tensor:
    """pack_blocks undone: the first `rows` rows of llama.cpp's blocks, uint8 [rows, K / 32, bytes]."""
    block_bytes = BLOCK_BYTES[method]
    panels = packed.shape[0] // PANEL_ROWS
    num_blocks = packed.shape[1] // block_bytes
    source = packed.numpy().reshape(panels, num_blocks, PANEL_ROWS * block_bytes)
    by_block = np.empty((panels, num_blocks, PANEL_ROWS, block_bytes), np.uint8)
    head = _SCALE_BYTES[method]
    for i in range(0, head, 2):
        by_block[..., i : i + 2] = source[:, :, i * PANEL_ROWS : (i + 2) * PANEL_ROWS].reshape(
            panels, num_blocks, PANEL_ROWS, 2
        )
    quants = source[:, :, head * PANEL_ROWS :].reshape(panels, num_blocks, block_bytes - head, PANEL_ROWS)
    by_block[..., head:] = quants.transpose(0, 1, 3, 2)
    blocks = by_block.transpose(0, 2, 1, 3).reshape(panels * PANEL_ROWS, num_blocks, block_bytes)
    return torch.from_numpy(np.ascontiguousarray(blocks[:rows]))


def pack_q4_1(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] weights as block_q4_1 values (quantize_blocks) in the kernels' panels (pack_blocks): 20 bytes per 32
    weights, N padded to a multiple of 8."""
    return pack_blocks("q4_1", quantize_blocks("q4_1", weight))


def pack_q8_0(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] weights as block_q8_0 values (quantize_blocks) in the kernels' panels (pack_blocks): 34 bytes per 32
    weights, N padded to a multiple of 8."""
    return pack_blocks("q8_0", quantize_blocks("q8_0", weight))
