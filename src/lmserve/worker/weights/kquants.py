"""Layers that run only with int16 activations, at the file's stored size: llama.cpp's K-quants (q2_k, q3_k, q4_k,
q5_k, q6_k; their super-blocks rearranged into the layout of kernels/kquant_int16.cpp) and q4_0, q5_0, q5_1 and iq4_nl
(kernels/int16_activations.cpp), both built for AVX-512 VNNI or AVX2. IQ4_XS files' blocks run as iq4_nl ones
(stored_formats.convert_blocks: each sub-block's scale rounded once to float16).

The rearrangement is exact: every code and every scale the file holds goes into the kernel's layout as it is
(tests/worker/test_kquant_formats.py checks the kernel's dequantization against gguf's, value for value). Done in
NumPy, on one thread, for the reason block_packing.pack_blocks gives.
"""

from __future__ import annotations

import numpy as np
import torch

from lmserve.formats.block_formats import BLOCK_TYPES, INTEGER_ONLY_FORMATS
from lmserve.worker.kernels import cpu_kernels
from lmserve.worker.weights.block_linear import BlockQuantizedLinear
from lmserve.worker.weights.block_packing import PackedBlocks, StoredBlocks, StoredRows
from lmserve.worker.weights.kernel_choice import (
    INTEGER_ACTIVATIONS,
    BatchedPath,
    block_kernels_load,
    int16_kernel_loads,
)
from lmserve.worker.weights.layer_format import LayerFormat
from lmserve.worker.weights.stored_formats import (
    BLOCK_FORMATS,
    HELD_INTO,
    KERNEL_FORMATS,
    convert_blocks,
    q3_k_fields,
)

SUPER_BLOCK = 256
GROUP_ROWS = 16  # output rows per group of the kernel's layout
# llama.cpp's block_q2_K, block_q3_K, block_q4_K, block_q5_K, block_q6_K (formats/block_formats.py's table)
KQUANT_BLOCK_BYTES = {name: BLOCK_TYPES[name].block_bytes for name in INTEGER_ONLY_FORMATS
                      if BLOCK_TYPES[name].block_width == SUPER_BLOCK}
# kernels/int16_activations.cpp's, blocks of 32
INT16_BLOCK_METHODS = tuple(name for name in INTEGER_ONLY_FORMATS if BLOCK_TYPES[name].block_width == 32)


def kernel_formats(activations_setting: str | None = "auto") -> tuple[str, ...]:
    """The kernel formats a layer can take here: q4_1 and q8_0 where the block kernels build, and the K-quants, q4_0,
    q5_0, q5_1 and iq4_nl where the int16-activation kernels run, unless the block kernels are told to keep float32
    activations (those kernels take int16 ones only)."""
    if not block_kernels_load("q8_0", explicit=False):
        return ()
    formats = set(BLOCK_FORMATS)
    if (activations_setting or "auto") != "float32" and int16_kernel_loads():
        formats |= {*KQUANT_BLOCK_BYTES, *INT16_BLOCK_METHODS}
    return tuple(f for f in KERNEL_FORMATS if f in formats)


def _float16_bytes(blocks: np.ndarray, at: int) -> np.ndarray:
    return np.ascontiguousarray(blocks[..., at : at + 2])


def q4_k_fields(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """[N, S, 144] block_q4_K -> d and dmin (float16 bytes [N, S, 2]), sc and mn (uint8 [N, S, 8], 6-bit), codes
    (uint8 [N, S * 256], 0..15): gguf's Q4_K.dequantize_blocks reading, without the arithmetic."""
    rows, supers, _ = blocks.shape
    scales = blocks[..., 4:16].reshape(rows, supers, 3, 4)
    d_bits, m_bits, both = scales[..., 0, :], scales[..., 1, :], scales[..., 2, :]
    sc = np.concatenate([d_bits & 0x3F, (both & 0x0F) | ((d_bits >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m_bits & 0x3F, (both >> 4) | ((m_bits >> 2) & 0x30)], axis=-1)
    qs = blocks[..., 16:144].reshape(rows, supers, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)
    codes = (qs & 0x0F).reshape(rows, supers * SUPER_BLOCK)
    return _float16_bytes(blocks, 0), _float16_bytes(blocks, 2), sc, mn, codes


def q5_k_fields(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """[N, S, 176] block_q5_K -> q4_k_fields' d, dmin, sc, mn and codes (0..31): gguf's Q5_K.dequantize_blocks
    reading (scales as q4_k's, then 32 bytes whose bit j holds the fifth bit of sub-block j's code, then nibbles)."""
    rows, supers, _ = blocks.shape
    as_q4_k = np.concatenate([blocks[..., 0:16], blocks[..., 48:176]], axis=-1)
    d, dmin, sc, mn, low = q4_k_fields(as_q4_k)
    fifth = (blocks[..., 16:48].reshape(rows, supers, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1
    return d, dmin, sc, mn, low | (fifth.reshape(rows, supers * SUPER_BLOCK) << 4)


def q6_k_fields(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[N, S, 210] block_q6_K -> d (float16 bytes [N, S, 2]), sc (uint8 bytes of int8 [N, S, 16]), codes (uint8
    [N, S * 256], 0..63): gguf's Q6_K.dequantize_blocks reading."""
    rows, supers, _ = blocks.shape
    ql = blocks[..., 0:128].reshape(rows, supers, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)
    qh = blocks[..., 128:192].reshape(rows, supers, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(
        1, 1, 1, 4, 1)
    low = (ql & 0x0F).reshape(rows, supers, 8, 32)
    high = (qh & 0x03).reshape(rows, supers, 8, 32)
    codes = (low | (high << 4)).reshape(rows, supers * SUPER_BLOCK)
    return _float16_bytes(blocks, 208), np.ascontiguousarray(blocks[..., 192:208]), codes


def q2_k_fields(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """[N, S, 84] block_q2_K -> d and dmin (float16 bytes [N, S, 2]), the 16 sub-blocks' sc and mn (uint8 [N, S, 16],
    4-bit) and codes (uint8 [N, S * 256], 0..3): gguf's Q2_K.dequantize_blocks reading (w = d sc q - dmin mn; weight
    128 h + 32 j + p in bits 2j of code byte 32 h + p)."""
    rows, supers, _ = blocks.shape
    packed = blocks[..., 0:16]
    qs = blocks[..., 16:80].reshape(rows, supers, 2, 1, 32) >> (2 * np.arange(4, dtype=np.uint8).reshape(1, 1, 1, 4, 1))
    codes = (qs & 3).reshape(rows, supers * SUPER_BLOCK)
    return _float16_bytes(blocks, 80), _float16_bytes(blocks, 82), packed & 0x0F, packed >> 4, codes


def _rows_of_four(codes: np.ndarray) -> np.ndarray:
    """uint8 [N, K] codes -> [G, K / 32, 8, 64]: per group of 16 outputs and block of 32 inputs, row j holds
    q[n][4j..4j+3] for n = 0..15 (the VNNI order)."""
    rows, cols = codes.shape
    grouped = codes.reshape(rows // GROUP_ROWS, GROUP_ROWS, cols // 32, 8, 4)  # g, n, b, j, e
    return grouped.transpose(0, 2, 3, 1, 4).reshape(rows // GROUP_ROWS, cols // 32, 8, 64)


def _per_group(values: np.ndarray) -> np.ndarray:
    """[N, X, W] -> [G, X, 16 * W]: the group's 16 rows' fields one after another (W bytes each)."""
    rows, x, width = values.shape
    return values.reshape(rows // GROUP_ROWS, GROUP_ROWS, x, width).transpose(0, 2, 1, 3).reshape(
        rows // GROUP_ROWS, x, GROUP_ROWS * width)


def _two_bits(quant_rows: np.ndarray) -> np.ndarray:
    """[G, B, 8, 64] 2-bit values -> [G, B, 128]: chunk h holds row 4h + r in bits 2r, 2r + 1."""
    groups = quant_rows.shape[0]
    two = quant_rows.reshape(groups, -1, 2, 4, 64)
    return (two[:, :, :, 0] | (two[:, :, :, 1] << 2) | (two[:, :, :, 2] << 4) | (two[:, :, :, 3] << 6)).reshape(
        groups, -1, 128)


def pack_kquant(method: str, blocks: np.ndarray) -> torch.Tensor:
    """[N, K / 256, bytes] of the file's blocks in kernels/kquant_int16.cpp's layout: uint8 [N / 16, bytes per group]."""
    rows, supers, block_bytes = blocks.shape
    if block_bytes != KQUANT_BLOCK_BYTES[method]:
        raise ValueError(f"{method} blocks have {KQUANT_BLOCK_BYTES[method]} bytes, got {block_bytes}")
    if rows % GROUP_ROWS:
        raise ValueError(f"{method} layers need out_features that are a multiple of {GROUP_ROWS}, got {rows}")
    groups, blocks_per_super = rows // GROUP_ROWS, SUPER_BLOCK // 32
    if method == "q2_k":
        d, dmin, sc, mn, codes = q2_k_fields(blocks)
        header = np.concatenate([_per_group(d), _per_group(dmin)], axis=-1)
        sc_pairs, mn_pairs = sc.reshape(rows, -1, 2), mn.reshape(rows, -1, 2)  # per block of 32: its two halves'
        parts = [_per_group(sc_pairs[..., 0:1]), _per_group(sc_pairs[..., 1:2]), _per_group(mn_pairs[..., 0:1]),
                 _per_group(mn_pairs[..., 1:2]), _two_bits(_rows_of_four(codes))]
    elif method in ("q4_k", "q5_k"):
        d, dmin, sc, mn, codes = (q4_k_fields if method == "q4_k" else q5_k_fields)(blocks)
        header = np.concatenate([_per_group(d), _per_group(dmin)], axis=-1)
        scales = np.concatenate([_per_group(sc.reshape(rows, -1, 1)), _per_group(mn.reshape(rows, -1, 1))], axis=-1)
        quant_rows = _rows_of_four(codes)
        low = quant_rows & 0x0F
        quants = low[:, :, 0::2] | (low[:, :, 1::2] << 4)  # chunk c: rows 2c (low), 2c + 1 (high)
        parts = [scales, quants.reshape(groups, -1, 256)]
        if method == "q5_k":  # byte 4n + e: in bit j the fifth bit of row j's
            fifth = ((quant_rows >> 4) & 1) << np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
            parts.append(np.bitwise_or.reduce(fifth, axis=2))
    else:
        if method == "q6_k":
            d, sc, codes = q6_k_fields(blocks)
        else:  # q3_k: its integers -4..3 as codes 0..7 under the offset 4
            d, scales, values = q3_k_fields(blocks)
            sc, codes = scales.view(np.uint8), (values + np.int8(4)).view(np.uint8).reshape(rows, -1)
        header = _per_group(d)
        pairs = sc.reshape(rows, -1, 2)  # per block of 32 inputs: the scales of its two halves of 16
        quant_rows = _rows_of_four(codes)
        parts = [_per_group(pairs[..., 0:1]), _per_group(pairs[..., 1:2])]
        if method == "q6_k":
            low = quant_rows & 0x0F
            parts.append((low[:, :, 0::2] | (low[:, :, 1::2] << 4)).reshape(groups, -1, 256))
            parts.append(_two_bits(quant_rows >> 4))
        else:  # the low 2 bits as q6_k's top ones, the third as q5_k's fifth
            parts.append(_two_bits(quant_rows & 0x03))
            third = ((quant_rows >> 2) & 1) << np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
            parts.append(np.bitwise_or.reduce(third, axis=2))
    per_block = np.concatenate(parts, axis=-1).reshape(groups, supers, blocks_per_super, -1)
    packed = np.concatenate([header, per_block.reshape(groups, supers, -1)], axis=-1)
    return torch.from_numpy(np.ascontiguousarray(packed.reshape(groups, -1)))


class KQuantLinear(BlockQuantizedLinear):
    """A layer whose weights stay in the file's K-quant blocks (q2_k, q3_k, q4_k, q5_k, q6_k), run by
    kernels/kquant_int16.cpp with int16 (or, asked for, int8) activations at every batch size of generated rows;
    prompt rows and large batches take the same copies as the other block layers (BlockQuantizedLinear), built from
    these blocks."""

    def __init__(self, weight: StoredBlocks | StoredRows | PackedBlocks, bias: torch.Tensor | None,
                 batched: BatchedPath | None = None, activations: str = "int16") -> None:
        # A registered layer type knows its format (iq4_nl's takes IQ4_XS blocks too); KQuantLinear itself takes the
        # blocks' own.
        self.method = getattr(type(self), "method", None) or weight.method
        # Integer activations only: 16-bit ones unless int8 is asked for.
        super().__init__(weight, bias, batched, activations if activations in INTEGER_ACTIVATIONS else "int16")

    def _pack(self, weight: torch.Tensor | StoredBlocks | StoredRows) -> tuple[torch.Tensor, int, int]:
        parts = ([StoredBlocks(weight.method, part) for part in weight.parts] if isinstance(weight, StoredRows)
                 else [weight])
        parts = [self._own_blocks(part) for part in parts]
        rows, columns = sum(part.shape[0] for part in parts), parts[0].shape[1]
        if rows % GROUP_ROWS:
            raise ValueError(f"{self.method} layers need out_features that are a multiple of {GROUP_ROWS}, got {rows}")
        # The kernel's own packer (every thread, no temporaries, a fused layer's parts read where they lie);
        # pack_kquant is its NumPy statement, tests hold them equal.
        return getattr(cpu_kernels(), f"{self.method}_int16_pack")([part.data for part in parts]), rows, columns

    def _own_blocks(self, weight: torch.Tensor | StoredBlocks) -> StoredBlocks:
        """A file's blocks in this layer's format: its own, or another stored type this format holds (iq4_xs as
        iq4_nl, q3_k as q6_k)."""
        if isinstance(weight, StoredBlocks) and self.method in HELD_INTO.get(weight.method, ()):
            weight = StoredBlocks(self.method, torch.from_numpy(convert_blocks(weight.method, weight.data.numpy(),
                                                                              self.method)))
        if not isinstance(weight, StoredBlocks) or weight.method != self.method:
            raise ValueError(f"a {self.method} layer takes a file's {self.method} blocks")
        return weight

    def use_integer_activations(self, activations: str = "int16") -> bool:
        self.activations = activations
        self._use_ops()
        return True


class Int16BlockLinear(KQuantLinear):
    """Q4_0, Q5_0, Q5_1 or IQ4_NL blocks at their stored size (0.5625, 0.6875, 0.75, 0.5625 bytes a weight) through
    kernels/int16_activations.cpp: Q5_0 is what a Q4_K_M file of a model whose rows are not a multiple of 256 wide
    holds in most layers. Where no int16 kernel runs, Q5_0 and IQ4_NL blocks are q8_0 ones and Q4_0 blocks q4_1
    ones (stored_formats.convert_blocks), with the same values."""


def _layer_type(method: str, base: type[KQuantLinear]) -> type[KQuantLinear]:
    """The layer class of one format: its family's class with the format named (Q4_KLinear, Q5_0Linear...)."""
    return type(f"{method.upper()}Linear", (base,), {"method": method, "__module__": __name__})


_KQUANT_KERNEL = "kernels/kquant_int16.cpp"
_KQUANT_PACKING = "<format>_int16_pack (pack_kquant its NumPy statement): super-blocks regrouped 16 rows a group"
_INT16_KERNEL = "kernels/int16_activations.cpp"
_INT16_PACKING = "<format>_int16_pack: blocks of 32 regrouped 16 rows a group"
# The family's table: integer activations only, the file's blocks at their stored size, 16 output rows a group.
KQUANT_LAYER_FORMATS = (
    LayerFormat("q2_k", _layer_type("q2_k", KQuantLinear), _KQUANT_KERNEL, _KQUANT_PACKING, group_rows=GROUP_ROWS),
    LayerFormat("q3_k", _layer_type("q3_k", KQuantLinear), _KQUANT_KERNEL, _KQUANT_PACKING, group_rows=GROUP_ROWS),
    LayerFormat("q4_k", _layer_type("q4_k", KQuantLinear), _KQUANT_KERNEL, _KQUANT_PACKING, group_rows=GROUP_ROWS),
    LayerFormat("q5_k", _layer_type("q5_k", KQuantLinear), _KQUANT_KERNEL, _KQUANT_PACKING, group_rows=GROUP_ROWS),
    LayerFormat("q6_k", _layer_type("q6_k", KQuantLinear), _KQUANT_KERNEL, _KQUANT_PACKING, group_rows=GROUP_ROWS),
    LayerFormat("q4_0", _layer_type("q4_0", Int16BlockLinear), _INT16_KERNEL, _INT16_PACKING, group_rows=GROUP_ROWS),
    LayerFormat("q5_0", _layer_type("q5_0", Int16BlockLinear), _INT16_KERNEL, _INT16_PACKING, group_rows=GROUP_ROWS),
    LayerFormat("q5_1", _layer_type("q5_1", Int16BlockLinear), _INT16_KERNEL, _INT16_PACKING, group_rows=GROUP_ROWS),
    # IQ4_XS files' blocks run here too, each sub-block's scale rounded once (stored_formats.convert_blocks).
    LayerFormat("iq4_nl", _layer_type("iq4_nl", Int16BlockLinear), _INT16_KERNEL, _INT16_PACKING,
                group_rows=GROUP_ROWS),
    # gpt-oss's experts: each block's E8M0 scale as a float16 d (the packer refuses a scale outside its range).
    LayerFormat("mxfp4", _layer_type("mxfp4", Int16BlockLinear), _INT16_KERNEL, _INT16_PACKING,
                group_rows=GROUP_ROWS),
)
