"""Which of the kernels' block formats holds a GGUF file's stored blocks exactly, and the conversion into it.

A llama.cpp file mixes block types: a Q4_K_M file of a model whose rows are 896 wide (not a multiple of the K-quants'
256) stores most matrices as Q5_0 and some as Q8_0, Q4_K and Q6_K. The kernels (kernels/quantized_linear.cpp,
kernels/int16_activations.cpp, kernels/kquant_int16.cpp) read their own formats (block_formats.KERNEL_FORMATS). Some
stored types convert into one of them without changing any weight's value, block for block, with the same scales:
  q5_0: float16 d, 32 five-bit codes q (w = d (q - 16)) -> q8_0 with the int8 codes q - 16 (where no q5_0 kernel
        runs: kernels/int16_activations.cpp reads q5_0 at its stored size with int16 activations);
  q4_0: float16 d, 32 four-bit codes q (w = d (q - 8))  -> q4_1 with m = -8 d (exact in float16: a power of two),
        or q8_0 with q - 8 (where no q4_0 kernel runs: kernels/int16_activations.cpp reads it at its stored size);
  iq4_nl: float16 d, 32 four-bit indices q into llama.cpp's table of 16 int8 values (w = d kvalues[q]) -> q8_0 with
        the codes kvalues[q] (where no iq4_nl kernel runs: kernels/int16_activations.cpp reads it at its stored size);
  mxfp4: an E8M0 byte e, 32 four-bit indices q into E2M1's values doubled (w = 2^(e - 128) v[q], v in -12..12) ->
        q8_0 with the codes v[q] and d = 2^(e - 128) in float16 (exact for e in 104..143, every trained model's
        scale; a block outside refuses: where no mxfp4 kernel runs, kernels/int16_activations.cpp reads it at its
        stored size);
  q3_k: float16 d, 16 six-bit sub-block scales ls, 256 three-bit integers q in -4..3 (w = d (ls - 32) q) -> q6_k
        with sc = ls - 32 and codes q + 32 (for a layer that fuses it with Q6_K rows: 6.56 bits a weight);
  q4_1 and q8_0 are kernel formats already, and so are q5_1, q3_k, q4_k, q5_k and q6_k where the int16-activation
  kernels run (worker/weights/kquants.py; q3_k at 3.56 bits a weight for the file's 3.44).
A layer whose rows all come in types that share such a format takes its file's values into that format, bit for bit
(tests/worker/test_stored_formats.py checks every value against gguf's own dequantization). A layer whose rows
include a type that converts into none of the formats that run here (the K-quants, q5_0 and q5_1 under
--block-activations float32 or without the int16 kernels) gets no block format: it keeps float weights (float16
under --quantization auto).
One type converts with its scales rounded (SCALE_ROUNDED_INTO): iq4_xs, whose 32-weight sub-blocks are scaled by
d x a 6-bit integer, into iq4_nl blocks (or, where no iq4_nl kernel runs, q8_0 ones) whose float16 scale is that
product, rounded once: the error of float16 weights (half a unit in their 11th bit) at 0.5625 bytes a weight (the
file's 0.53), on the integer kernels.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from lmserve.formats.block_formats import (
    BLOCK_FORMATS,
    EXACT_INTO,
    HELD_INTO,
    KERNEL_FORMATS,
    SCALE_ROUNDED_INTO,
    STORED_BLOCK_BYTES,
    STORED_BLOCK_TYPES,
    block_width,
    exact_kernel_format,
)

__all__ = ["BLOCK_FORMATS", "EXACT_INTO", "HELD_INTO", "KERNEL_FORMATS", "SCALE_ROUNDED_INTO", "STORED_BLOCK_BYTES",
           "STORED_BLOCK_TYPES", "block_width", "convert_blocks", "exact_kernel_format", "float_fallbacks",
           "preferred_kernel_format", "q3_k_fields", "runnable_types"]
# llama.cpp's kvalues_iq4nl: the 16 weights (in units of the block's scale) an IQ4_NL or IQ4_XS index picks.
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)


def preferred_kernel_format(stored_types: Iterable[str], formats: Iterable[str] = KERNEL_FORMATS) -> str | None:
    """The kernel format of `formats` most of a file's matrices convert into exactly (each one's first choice), or
    None when no matrix converts: what `--quantization auto` takes a GGUF's layers to."""
    counts: dict[str, int] = {}
    runs = set(formats)
    for stored_type in stored_types:
        choices = [f for f in HELD_INTO.get(stored_type, ()) if f in runs]
        if choices:
            counts[choices[0]] = counts.get(choices[0], 0) + 1
    return max(counts, key=lambda f: (counts[f], -KERNEL_FORMATS.index(f))) if counts else None


def runnable_types(stored_types: Mapping[str, str], formats: Iterable[str]) -> dict[str, str]:
    """stored_types with every type that no format of `formats` holds exactly named "float" (a layer of it stays a
    float layer)."""
    runs = set(formats)
    return {name: t if runs & set(HELD_INTO.get(t, ())) else "float" for name, t in stored_types.items()}


def float_fallbacks(stored_types: Mapping[str, str], runnable: Mapping[str, str]) -> str | None:
    """What a user should hear about a file's quantized matrices that run as float16 weights (runnable_types named
    them "float"): "3 q3_k, 1 q2_k", most first; None when every quantized matrix keeps its blocks."""
    counts: dict[str, int] = {}
    for name, stored in stored_types.items():
        if runnable.get(name) == "float" and stored not in ("f32", "f16", "bf16"):
            counts[stored] = counts.get(stored, 0) + 1
    if not counts:
        return None
    return ", ".join(f"{n} {t}" for t, n in sorted(counts.items(), key=lambda item: (-item[1], item[0])))


def convert_blocks(stored_type: str, blocks: np.ndarray, kernel_format: str) -> np.ndarray:
    """uint8 [rows, blocks, bytes] of `stored_type` as the same weights in `kernel_format`'s blocks (llama.cpp's
    layout of that format); raises where the conversion is not exact."""
    if stored_type == kernel_format:
        return blocks
    if kernel_format not in HELD_INTO.get(stored_type, ()):
        raise ValueError(f"{stored_type} blocks do not convert exactly into {kernel_format}")
    if blocks.shape[-1] != STORED_BLOCK_BYTES[stored_type]:
        raise ValueError(f"{stored_type} blocks have {STORED_BLOCK_BYTES[stored_type]} bytes, got {blocks.shape[-1]}")
    scale = blocks[..., 0:2]
    if kernel_format == "iq4_nl":  # from iq4_xs: the only other type it holds
        return _iq4_xs_as_iq4_nl(blocks)
    if kernel_format == "q6_k":  # from q3_k
        return _q3_k_as_q6_k(blocks)
    if kernel_format == "q8_0":
        if stored_type == "mxfp4":
            return _mxfp4_as_q8_0(blocks)
        if stored_type == "iq4_nl":
            return _iq4_nl_as_q8_0(blocks)
        if stored_type == "iq4_xs":
            return _iq4_nl_as_q8_0(_iq4_xs_as_iq4_nl(blocks))
        codes = _codes(stored_type, blocks)
        offset = 16 if stored_type == "q5_0" else 8
        return np.concatenate([scale, (codes.astype(np.int16) - offset).astype(np.int8).view(np.uint8)], axis=-1)
    # q4_0 -> q4_1: the same nibbles, m = -8 d.
    minimum = (scale.copy().view(np.float16) * np.float16(-8)).astype(np.float16)
    if not np.isfinite(minimum).all():
        raise ValueError("q4_0 block scale too large to give its minimum in float16")
    return np.concatenate([scale, minimum.view(np.uint8), blocks[..., 2:18]], axis=-1)


# Each byte of IQ4_NL indices -> the int8 values of its low and its high nibble, as two little-endian bytes.
_IQ4_PAIRS = (IQ4_VALUES[np.arange(256) & 15].view(np.uint8).astype("<u2")
              | IQ4_VALUES[np.arange(256) >> 4].view(np.uint8).astype("<u2") << 8)


def _iq4_nl_as_q8_0(blocks: np.ndarray) -> np.ndarray:
    """One table lookup a byte, then the pairs apart (low nibbles are weights 0-15, high ones 16-31): 7x faster than
    indexing each code (0.94 s of a Qwen2.5 0.5B file's 1.8 s load)."""
    out = np.empty((*blocks.shape[:-1], 34), dtype=np.uint8)
    out[..., 0:2] = blocks[..., 0:2]
    pairs = _IQ4_PAIRS[blocks[..., 2:18]].view(np.uint8).reshape(*blocks.shape[:-1], 16, 2)
    out[..., 2:34].reshape(*blocks.shape[:-1], 2, 16)[...] = pairs.swapaxes(-1, -2)
    return out


# llama.cpp's kvalues_mxfp4: E2M1's 16 values doubled (an MXFP4 block's d is half its E8M0 scale).
MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int8)


def mxfp4_scales_as_float16(exponents: np.ndarray) -> np.ndarray:
    """E8M0 bytes e as float16 d = 2^(e - 128) (exact: a power of two float16 holds); raises where one is not."""
    powers = exponents.astype(np.int32) - 128
    if powers.size and (powers.min() < -24 or powers.max() > 15):
        raise ValueError(f"mxfp4 block scale 2^{powers.min() if powers.min() < -24 else powers.max()} is outside "
                         "float16's range (2^-24 .. 2^15)")
    return np.ldexp(np.float32(1.0), powers).astype(np.float16)


def _mxfp4_as_q8_0(blocks: np.ndarray) -> np.ndarray:
    out = np.empty((*blocks.shape[:-1], 34), dtype=np.uint8)
    out[..., 0:2] = mxfp4_scales_as_float16(blocks[..., 0])[..., None].view(np.uint8)
    nibbles = blocks[..., 1:17]
    out[..., 2:18] = MXFP4_VALUES[nibbles & 0x0F].view(np.uint8)
    out[..., 18:34] = MXFP4_VALUES[nibbles >> 4].view(np.uint8)
    return out


def _iq4_xs_as_iq4_nl(blocks: np.ndarray) -> np.ndarray:
    """Each super-block of 256 as 8 IQ4_NL blocks: scale d (ls - 32) rounded to float16 (llama.cpp's and gguf's
    dl, computed in float32), the sub-block's 16 bytes of indices as they are (IQ4_NL's order)."""
    lead = blocks.shape[:-1]
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)  # [..., 1]
    high = blocks[..., 2:4].copy().view("<u2").astype(np.int32)  # [..., 1]: 2 bits a sub-block
    low = blocks[..., 4:8]  # [..., 4]: a nibble a sub-block
    low = np.stack([low & 0x0F, low >> 4], axis=-1).reshape(*lead, 8).astype(np.int32)
    ls = low | (((high >> (2 * np.arange(8))) & 3) << 4)
    with np.errstate(over="ignore"):
        scales = (d * (ls - 32).astype(np.float32)).astype(np.float16)  # [..., 8]
    if not np.isfinite(scales).all():
        raise ValueError("iq4_xs block scale too large for a float16 block scale")
    sub_blocks = np.empty((*lead, 8, 18), dtype=np.uint8)  # as IQ4_NL blocks
    sub_blocks[..., 0:2] = scales[..., None].view(np.uint8)
    sub_blocks[..., 2:18] = blocks[..., 8:136].reshape(*lead, 8, 16)
    return sub_blocks.reshape(*lead[:-1], lead[-1] * 8, 18)


def q3_k_fields(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[..., 110] block_q3_K -> d (float16 bytes [..., 2]), the 16 sub-blocks' scales ls - 32 (int8 [..., 16]) and the
    256 weights' integers (int8 [..., 256], -4..3): llama.cpp's dequantize_row_q3_K reading (w = d (ls - 32) q).
    Layout: 32 bytes hmask (weight 16 s + l's high bit in bit 4 h + j of byte l, for half h, shift j, sub-block
    s = 0..1 of 16), 64 bytes of 2-bit codes (byte 32 h + 16 s + l, bits 2 j), 12 bytes of 6-bit scales, d."""
    lead = blocks.shape[:-1]
    hmask, qs, packed = blocks[..., 0:32], blocks[..., 32:96], blocks[..., 96:108]
    # Scale j: its low 4 bits in byte j % 8 (the low nibble for j < 8), its top 2 in byte 8 + j % 4 at bit 2 (j // 4).
    low = np.concatenate([packed[..., 0:8] & 0x0F, packed[..., 0:8] >> 4], axis=-1)
    top = ((packed[..., 8:12].reshape(*lead, 1, 4) >> (2 * np.arange(4, dtype=np.uint8).reshape(4, 1))) & 3)
    scales = ((low | (top.reshape(*lead, 16) << 4)) - np.uint8(32)).view(np.int8)
    # Weight 128 h + 32 j + p (p = 16 s + l) as [..., h, j, p]: shifts broadcast over the bytes (a gather of the same
    # bytes by index took 0.28 s a 896 x 4,864 matrix).
    shift = np.arange(4, dtype=np.uint8).reshape(4, 1)
    codes = (qs.reshape(*lead, 2, 1, 32) >> (2 * shift)) & 3
    high = (hmask.reshape(*lead, 1, 1, 32) >> (4 * np.arange(2, dtype=np.uint8).reshape(2, 1, 1) + shift)) & 1
    values = codes.view(np.int8) - 4 + 4 * high.view(np.int8)
    return np.ascontiguousarray(blocks[..., 108:110]), scales, values.reshape(*lead, 256)


def _q3_k_as_q6_k(blocks: np.ndarray) -> np.ndarray:
    """The same weights as block_q6_K (w = d sc (q - 32), q in 0..63, sc int8 a 16-weight sub-block): d as it is,
    sc = ls - 32, q = the 3-bit integer + 32; every value exact (6.56 bits a weight for the file's 3.44, on the
    q6_k kernel, where the float16 weights it had before take 16)."""
    d, scales, values = q3_k_fields(blocks)
    lead = blocks.shape[:-1]
    codes = (values + np.int8(32)).view(np.uint8).reshape(*lead, 2, 4, 32)  # half, quarter, l
    low, high = codes & 0x0F, codes >> 4
    ql = np.concatenate([low[..., 0, :] | (low[..., 2, :] << 4), low[..., 1, :] | (low[..., 3, :] << 4)], axis=-1)
    qh = high[..., 0, :] | (high[..., 1, :] << 2) | (high[..., 2, :] << 4) | (high[..., 3, :] << 6)
    return np.concatenate([ql.reshape(*lead, 128), qh.reshape(*lead, 64), scales.view(np.uint8), d], axis=-1)


def _codes(stored_type: str, blocks: np.ndarray) -> np.ndarray:
    """The 32 unsigned codes q of each block, uint8 [..., 32], weights in order."""
    if stored_type == "q4_0":
        nibbles = blocks[..., 2:18]
        return np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)
    # q5_0: d, then 4 bytes of fifth bits (bit j for weight j, little-endian), then 16 bytes of nibbles as q4_0's.
    nibbles = blocks[..., 6:22]
    high = np.unpackbits(np.ascontiguousarray(blocks[..., 2:6]), axis=-1, bitorder="little")
    return np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1) | (high << 4)
