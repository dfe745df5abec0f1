"""Weights stored in fewer bytes than the activations, applied after loading: `--quantization fp16|q8_0|q4_1`.

Decoding a small model on a CPU is bound by the bytes of weights read per step. fp16 keeps every weight in float16
(half of float32's bytes) and computes in float32: fbgemm, PyTorch's x86 GEMM library, widens the weights inside its
kernel, which on this project's AVX2 machines also beats float32 OpenBLAS at the few-row products of decoding.
Against the float32 model the output distribution is unchanged to within rounding (benchmarks/quantization.py:
perplexity 63.080 vs 63.075, 99.6% same top token), so `auto` picks fp16 on CPU with float32 for models whose file
holds no block format below. That includes llama.cpp's K-quants (Q4_K_M, Q6_K... files): the loader dequantizes them
and no kernel here reads their 256-wide super-blocks, so they run as float16 weights (2 bytes per weight rather than
the file's ~0.6), with the file's values to within float16 rounding.

q4_1 and q8_0 are llama.cpp's block formats (0.625 and 1.0625 bytes per weight). The C++ kernels in
kernels/quantized_linear.cpp widen them in registers and multiply in float32, so only the weights are rounded, never
the activations. Where a GGUF file stores its linear layers in one of them, `auto` picks that format and the layers
take the file's own blocks, rearranged into the kernels' panels byte for byte (StoredBlocks, PendingBlockLinear; no
float copy on the way): the model computes with exactly the weights it shipped with, in fewer bytes per decode step. Up to BLOCK_KERNEL_MAX_ROWS rows (decodes, and the prefill chunks that run beside them)
the kernels beat fbgemm's float16 GEMM; larger batches, bound by arithmetic, go through a float16 copy of the same
weights and fbgemm, which is faster there (benchmarks/quantization.py, docs/benchmarks.md), or with
`--batched-weights bf16` a bfloat16 copy through oneDNN (AMX, AVX-512 BF16), faster still but batch-dependent.
Where the CPU has AMX, `auto` (`prompt-bf16`) sends the prompt tokens of the decoder layers through lmserve's own AMX
kernel on a bfloat16 copy (kernels/amx_linear.cpp), 2-10x faster prefill, and keeps every generated token on the
block kernel: each row's result depends only on the row (prompt or generated), never on the batch or the chunking.
On AVX-512 VNNI without AMX, `auto` (`none`) makes no copy: the int16 block kernels below beat fbgemm's float16 GEMM
at prompt sizes there. Elsewhere `auto` (`prompt-fp16`) does the same with fbgemm's float16 copy for the prompt tokens.
Where the kernels build (AVX-512 VNNI or AVX2), `--block-activations auto` (int16) runs the block kernels with the
activations as 16-bit integers per block of 32 inputs (kernels/int16_activations.cpp): exact integer dot products, so a row's result
still does not depend on the batch, 1.2-2.7x faster at 1-64 rows, and a next-token KL below 1e-5 from the float32
model (bfloat16 activations: 1e-4).

Measured and left out (docs/benchmarks.md): int8 with dynamically quantized activations (fbgemm W8A8) is faster still
but ruins this model (perplexity 195; its MLP inputs carry outliers ~1,000× their median), and int8 weight-only
(`_weight_int8pack_mm`) is no faster than fp16 here.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from torch import nn

from lmserve.gguf_file import dequantize_gguf_blocks
from lmserve.worker.kernels import cpu_flags, cpu_kernels, cpu_kernels_load, disabled_features
from lmserve.worker.prompt_rows import PromptRows, current_prompt_rows
from lmserve.worker.stored_formats import (
    BLOCK_FORMATS,
    EXACT_INTO,
    STORED_BLOCK_BYTES,
    block_width,
    convert_blocks,
)

logger = logging.getLogger(__name__)

QUANTIZATION_METHODS = ("auto", "none", "fp16", "q8_0", "q4_1")
BLOCK_METHODS = ("q8_0", "q4_1")
# Chosen per layer under auto, for a file that stores them (worker/kquant_formats.py): int16 activations only.
KQUANT_METHODS = ("q4_k", "q5_k", "q6_k", "q5_0", "q5_1")
LAYER_METHODS = BLOCK_METHODS + KQUANT_METHODS
BATCHED_WEIGHTS = ("auto", "bf16", "fp16", "prompt-bf16", "prompt-fp16", "prompt-int8", "none")
BLOCK_ACTIVATIONS = ("auto", "float32", "int16")
BLOCK_SIZE = 32
# Up to this many rows the block kernels beat fbgemm's fp16 GEMM or match it (1.26x at 16 rows, 1.48x at 20, even at
# 32 and 64); above it the layer uses its fp16 copy, which fbgemm multiplies 5-14% faster (benchmarks/block_gemm.py).
BLOCK_KERNEL_MAX_ROWS = 64
FBGEMM_AVX2_ROWS = 6  # fbgemm's float16 GEMM kernels on AVX2: rows a tile (fbgemm_row_tile)
# With AMX, oneDNN's bfloat16 GEMM overtakes the block kernel at a few rows (benchmarks/block_gemm.py --batched bf16).
AMX_BLOCK_KERNEL_MAX_ROWS = 8


@dataclass(frozen=True)
class BatchedPath:
    """How a block layer multiplies batches above `block_kernel_max_rows` rows: a copy of its weights in `weights`
    (bf16: oneDNN's bfloat16 GEMM, activations rounded to bfloat16; fp16: fbgemm, activations kept in float32).
    prompt_copies: the decoder layers send prompt rows to a copy in `prompt_weights` instead (use_prompt_copies: bf16
    on the AMX kernel, or fp16 through fbgemm; int8: no copy, the int16 layout's blocks with 8-bit activations) and
    every generated row to the block kernel, at any batch size."""

    weights: str
    block_kernel_max_rows: int
    prompt_copies: bool = False
    prompt_weights: str = "bf16"


def batched_path(setting: str | None = "auto", activations: str = "int16") -> BatchedPath:
    """Each row's path fixed by what the row is, never by the batch: prompt-bf16 (auto where the CPU has AMX): prompt
    rows through the AMX kernel on a bfloat16 copy, 2-10x faster prefill; none (auto where the block kernels take
    int16 activations on AVX-512 VNNI: `activations`, the layers' resolved --block-activations): every row on the
    block kernels, no copy, the file's size in memory; prompt-fp16 (auto elsewhere): prompt rows through fbgemm on a
    float16 copy, float32 activations. Generated rows go through the block kernel in all three, at any batch size. A
    row's result then depends only on the row (fbgemm's, like the AMX kernel's, does not depend on the other rows of
    its call). On VNNI the int16 kernels multiply a 512-row prompt 1.2-1.4x faster than fbgemm's float16 GEMM (q4_1,
    q8_0, q5_0, q4_k; q6_k 0.75x), so the copy (2 bytes a weight beside the file's ~0.6) bought no speed there
    (docs/benchmarks.md, "Prompt rows on the stored blocks"); the AVX2 build's kernels are ~2x slower than fbgemm
    at prompt sizes and keep it.
    prompt-int8 (asked for): prompt rows through the same int16-layout blocks with 8-bit activations per block of 32
    (x_hi alone: llama.cpp's q8 activations, half the integer products: 1.5-2.1x the int16 kernels' prompt speed on
    VNNI), generated rows with 16-bit ones; no copy. Layers in the float32 kernels' layout run every row there.
    fp16: the block kernel up to BLOCK_KERNEL_MAX_ROWS rows, the float16 copy above, for prompt and generated rows
    alike: a row's result then depends on its batch's size, by the float16 rounding of the blocks' weights (on an AVX2
    build a seeded request drew another first token in a batch of 16 than alone; logprobs moved by 3e-4). bf16: the bfloat16 copy through oneDNN above a few
    rows, fast, but oneDNN's rounding and choice of kernel make greedy tokens depend on the batch a request ran in, so
    it is asked for, not chosen (docs/benchmarks.md). bf16 on a CPU without AVX-512 BF16 runs, slowly."""
    setting = setting or "auto"
    if setting not in BATCHED_WEIGHTS:
        raise ValueError(f"unknown batched weights {setting!r}: use one of {', '.join(BATCHED_WEIGHTS)}")
    if setting == "auto":
        if amx_kernel_loads():
            setting = "prompt-bf16"
        elif activations == "int16" and int16_vnni_kernel_runs():
            setting = "none"
        else:
            setting = "prompt-fp16"
    if setting == "prompt-bf16":
        if not amx_kernel_loads():
            raise ValueError("--batched-weights prompt-bf16 needs a CPU with AMX (amx_tile, amx_bf16, avx512_bf16)")
        return BatchedPath("fp16", BLOCK_KERNEL_MAX_ROWS, prompt_copies=True)
    if setting == "prompt-fp16":
        return BatchedPath("fp16", BLOCK_KERNEL_MAX_ROWS, prompt_copies=True, prompt_weights="fp16")
    if setting == "prompt-int8":
        if not int16_kernel_loads():
            raise ValueError("--batched-weights prompt-int8 needs the int16 block kernels (AVX2 with FMA and F16C, or "
                             "AVX-512 VNNI)")
        return BatchedPath("none", sys.maxsize, prompt_copies=True, prompt_weights="int8")
    if setting == "none":  # every row on the block kernels: no copy of any weight, the file's size in memory
        return BatchedPath("none", sys.maxsize)
    if setting == "bf16" and torch.cpu._is_avx512_bf16_supported() and torch.cpu._is_amx_tile_supported() and (
        "amx" not in disabled_features()
    ):
        return BatchedPath("bf16", AMX_BLOCK_KERNEL_MAX_ROWS)
    return BatchedPath(setting, BLOCK_KERNEL_MAX_ROWS)


def block_activations(setting: str | None = "auto") -> str:
    """How the q4_1 and q8_0 block kernels take their activations: float32 (kernels/quantized_linear.cpp) or int16,
    16-bit integers per block of 32 inputs through exact integer dot products (kernels/int16_activations.cpp: with
    AVX-512 VNNI 1.2-2.7x faster at 1-64 rows, next-token KL below 1e-5 from the float32 model). auto: int16 wherever
    the int16 kernels run, the AVX2 build included: a row's result is then its own whatever its batch, where the float32
    kernel sums a row in an order set by the batch's size (1-2, 3-8, 9+ rows; on the AVX2 build a seeded request drew
    another token in a batch of 16 than alone). The price on AVX2 (benchmarks/int16_activations.py): 0.92x the float32
    kernel's speed at 1 row, 0.65-0.8x at 16-64; `float32` stays there to be asked for."""
    setting = setting or "auto"
    if setting not in BLOCK_ACTIVATIONS:
        raise ValueError(f"unknown block activations {setting!r}: use one of {', '.join(BLOCK_ACTIVATIONS)}")
    if setting == "float32":
        return setting
    runs = int16_kernel_loads()
    if setting == "int16" and not runs:
        raise ValueError("--block-activations int16 needs a CPU with AVX2, FMA and F16C, or AVX-512 VNNI, where the "
                         "kernels build (LMSERVE_DISABLE_CPU_FEATURES=vnni turns the VNNI build's off)")
    return "int16" if runs else "float32"


def int16_kernel_loads() -> bool:
    """Whether the int16-activation kernels (kernels/int16_activations.cpp, kernels/kquant_int16.cpp) were built here
    (for AVX-512 VNNI or for AVX2) and can run: the VNNI build not turned off (LMSERVE_DISABLE_CPU_FEATURES=vnni, as
    a CPU without VNNI would run before these kernels had an AVX2 build; the AVX2 build is LMSERVE_KERNEL_MARCH=haswell)."""
    try:
        ops = cpu_kernels()
    except RuntimeError:
        return False
    if not hasattr(ops, "q4_1_int16_linear"):
        return False
    return not (ops.int16_uses_vnni() and "vnni" in disabled_features())


def int16_vnni_kernel_runs() -> bool:
    """Whether the int16-activation kernels run here in their AVX-512 VNNI build (not the AVX2 one)."""
    return int16_kernel_loads() and cpu_kernels().int16_uses_vnni()


def amx_kernel_loads() -> bool:
    """Whether kernels/amx_linear.cpp runs here: built (the compiler saw AMX in -march=native) and the tile state
    granted by the OS, and not turned off (LMSERVE_DISABLE_CPU_FEATURES=amx)."""
    if "amx" in disabled_features():
        return False
    try:
        ops = cpu_kernels()
    except RuntimeError:
        return False
    return hasattr(ops, "amx_linear") and bool(ops.amx_available())


def check_quantization(
    method: str | None, device: torch.device, dtype: torch.dtype, stored_as: str | None = None
) -> str:
    """The method to apply; a method that cannot run raises. auto, on CPU with float32: the block format the model file
    stores its linear layers in (`stored_as`, e.g. q4_1 for the default GGUF) when the kernels load, else fp16;
    elsewhere none."""
    method = method or "auto"
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"unknown quantization {method!r}: use one of {', '.join(QUANTIZATION_METHODS)}")
    supported = device.type == "cpu" and dtype == torch.float32
    if method == "auto":
        if not supported:
            return "none"
        if stored_as in BLOCK_METHODS and block_kernels_load(stored_as, explicit=False):
            return stored_as
        if stored_as in KQUANT_METHODS:  # the caller found the kernel that runs it (kquant_formats.kernel_formats)
            return stored_as
        return "fp16"
    if method != "none" and not supported:
        raise ValueError(
            f"--quantization {method} runs on CPU with float32 activations only (--device cpu --dtype float32)"
        )
    if method in BLOCK_METHODS:
        block_kernels_load(method, explicit=True)
    return method


def block_kernels_load(method: str, explicit: bool) -> bool:
    """Whether the C++ kernel for a block format loads (it needs a compiler and, being AVX2 code, an x86 CPU with
    AVX2, FMA and F16C). An explicit request that cannot be met raises; auto logs and falls back to fp16."""
    fallback = "the linear layers keep float16 weights"
    if not cpu_kernels_load(explicit, fallback):
        return False
    if not hasattr(cpu_kernels(), f"{method}_linear"):
        message = f"--quantization {method} needs a CPU with AVX2, FMA and F16C"
        if explicit:
            raise ValueError(message)
        logger.warning("%s; %s", message, fallback)
        return False
    return True


def fbgemm_row_tile() -> int:
    """Rows that fbgemm's float16 GEMM computes alike in every call when it is given a multiple of them: its AVX2
    kernels take 6 rows at a time and a remainder of 1 or 2 rows with another kernel, whose sums differ in their last
    bits (a row's result then depends on the batch's size); its AVX-512 ones give each row the same bits at any size.
    fbgemm picks by the CPU (avx512f, bw, dq and vl), not by how lmserve's kernels were built."""
    return 1 if {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= cpu_flags() else FBGEMM_AVX2_ROWS


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

    @property
    def shape(self) -> tuple[int, int]:
        return self.data.shape[0], self.data.shape[1] * block_width(self.method)

    def with_data(self, data: torch.Tensor) -> StoredBlocks:
        """The same format over other rows or blocks of it (a shard, a permutation)."""
        return StoredBlocks(self.method, data)

    def dequantize(self) -> torch.Tensor:
        """The float32 weights, [rows, in_features]: lmserve.models' reader's values (a stored type without a fast
        reader goes through the kernel format that holds it exactly, stored_formats)."""
        method, data = self.method, self.data.numpy()
        if method not in BLOCK_FORMATS and EXACT_INTO.get(method, ("",))[-1] in BLOCK_FORMATS:
            kernel_format = EXACT_INTO[method][-1]
            method, data = kernel_format, convert_blocks(self.method, data, kernel_format)
        return torch.from_numpy(dequantize_gguf_blocks(method, data))


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


def as_blocks(method: str, weight: torch.Tensor | StoredBlocks) -> torch.Tensor:
    """`weight` as rows of `method`'s blocks: a file's blocks of that format as they are, or converted into it where
    that keeps every value (stored_formats: q5_0 and q4_0 into q8_0, q4_0 into q4_1); anything else rounded."""
    if isinstance(weight, StoredBlocks):
        if weight.method == method:
            return weight.data
        if method in EXACT_INTO.get(weight.method, ()):
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


class BlockQuantizedLinear(nn.Module):
    """y = x @ W.T + b with W in one of llama.cpp's block formats, computed in float32. Batches of up to
    `batched.block_kernel_max_rows` rows run the block kernel; larger ones a float16 or bfloat16 copy of the same
    weights (batched_path)."""

    method: ClassVar[str]

    def __init__(
        self, weight: torch.Tensor | StoredBlocks, bias: torch.Tensor | None, batched: BatchedPath | None = None,
        activations: str = "float32",
    ) -> None:
        """weight: float [out_features, in_features], rounded to the format; or a file's blocks (StoredBlocks), taken
        as they are when they are in this format. batched: how batches above the kernel's rows run (batched_path).
        activations: int16 packs the blocks for the int16-activation kernel at once (use_int16_activations' layout,
        without packing them for the float kernel first) where it can tile the layer."""
        super().__init__()
        self.activations = activations
        self.blocks, self.out_features, self.in_features = self._pack(weight)
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.batched_path = batched or batched_path()
        self._use_ops()
        # The copy for large batches (fbgemm's packed float16 one takes ~2 s for the default model's layers) is built
        # off the start-up path (prepare_batched_copies on a background thread), or by the first batch that needs it.
        self.batched: nn.Module | None = None
        # The decoder layers' copy for prompt rows (use_prompt_copies), built the same way.
        self.prompt_copies = False
        self.prompt_copy: nn.Module | None = None
        self.copy_lock = threading.Lock()  # one builder of this layer's copies at a time

    def _pack(self, weight: torch.Tensor | StoredBlocks) -> tuple[torch.Tensor, int, int]:
        """The weights in the kernel's layout, out_features, in_features."""
        blocks = as_blocks(self.method, weight)
        rows, columns = blocks.shape[0], blocks.shape[1] * BLOCK_SIZE
        if self.activations == "int16" and rows % 16 == 0:
            return getattr(cpu_kernels(), f"{self.method}_int16_pack")(blocks.contiguous()), rows, columns
        self.activations = "float32"
        return pack_blocks(self.method, blocks), rows, columns

    def _use_ops(self) -> None:
        ops = cpu_kernels()
        kernel = f"{self.method}_int16" if self.activations == "int16" else self.method
        self.linear_op = getattr(ops, f"{kernel}_linear")
        self.dequantize_op = getattr(ops, f"{kernel}_dequantize")
        self.int8_linear_op = getattr(ops, f"{self.method}_int8_linear") if self.activations == "int16" else None

    def use_int16_activations(self) -> bool:
        """Moves the layer to the int16-activation kernel (block_activations), its blocks repacked for it; False
        where the kernel cannot tile it (out_features not a multiple of 16)."""
        if self.out_features % 16 or self.activations == "int16":
            return self.activations == "int16"
        ops = cpu_kernels()
        pack = getattr(ops, f"{self.method}_int16_pack")
        self.blocks = pack(unpack_blocks(self.method, self.blocks, self.out_features))
        self.linear_op = getattr(ops, f"{self.method}_int16_linear")
        self.dequantize_op = getattr(ops, f"{self.method}_int16_dequantize")
        self.int8_linear_op = getattr(ops, f"{self.method}_int8_linear")
        self.activations = "int16"
        return True

    def prepare_batched(self) -> nn.Module:
        return self._copy("batched", lambda: BATCHED_LAYER_TYPES[self.batched_path.weights])

    def prepare_prompt_copy(self) -> nn.Module:
        return self._copy("prompt_copy", lambda: PROMPT_LAYER_TYPES[self.batched_path.prompt_weights])

    def prompt_product(self, x: torch.Tensor) -> torch.Tensor:
        """Prompt rows' y: the copy in the path's prompt_weights, or (int8) the blocks with 8-bit activations."""
        if self.batched_path.prompt_weights == "int8":
            return self.int8_linear_op(x, self.blocks, self.out_features, self.bias)
        return self.prepare_prompt_copy()(x)

    def _copy(self, attribute: str, layer_type: Callable[[], type[nn.Module]]) -> nn.Module:
        copy = getattr(self, attribute)
        if copy is None:
            # One builder a layer: a forward pass that needs a copy waits for the background threads' build of it
            # instead of making a second one (twice the memory, and freed memory a process rarely gives back).
            with self.copy_lock:
                copy = getattr(self, attribute)
                if copy is None:
                    copy = layer_type()(self.dequantized(), self.bias)
                    setattr(self, attribute, copy)
        return copy

    def stored_rows(self, rows: np.ndarray) -> np.ndarray | None:
        """The file's blocks of some output rows, [len(rows), in_features / 32, bytes] in llama.cpp's layout, read
        back out of the kernel's layout (a tied embedding looks its rows up here instead of keeping its own copy);
        None where the layout is not one this reads (q8_0's panels of 8 rows and its int16 groups of 16 are)."""
        if self.method != "q8_0":
            return None
        num_blocks, rows = self.in_features // BLOCK_SIZE, np.asarray(rows, dtype=np.int64)
        out = np.empty((len(rows), num_blocks, BLOCK_BYTES["q8_0"]), np.uint8)
        if self.activations == "int16":  # per 16 rows and block: 16 d's, then q[n][4j + e] + 128 at 64j + 4n + e
            source = self.blocks.numpy().reshape(-1, num_blocks, 32 + 512)
            group, n = rows // 16, rows % 16
            k = np.arange(32)
            quants = source[group[:, None, None], np.arange(num_blocks)[None, :, None],
                            (32 + 64 * (k // 4) + k % 4)[None, None, :] + 4 * n[:, None, None]]
            out[:, :, 2:] = quants ^ 0x80  # q + 128 back to int8's bytes
        else:  # pack_blocks: per 8 rows and block, 8 d's, then q[r][c] at 8c + r
            source = self.blocks.numpy().reshape(-1, num_blocks, PANEL_ROWS * BLOCK_BYTES["q8_0"])
            group, n = rows // PANEL_ROWS, rows % PANEL_ROWS
            quants = source[group[:, None, None], np.arange(num_blocks)[None, :, None],
                            (2 * PANEL_ROWS + PANEL_ROWS * np.arange(32))[None, None, :] + n[:, None, None]]
            out[:, :, 2:] = quants
        scales = source[group[:, None, None], np.arange(num_blocks)[None, :, None], 2 * n[:, None, None] + np.arange(2)]
        out[:, :, :2] = scales
        return out

    def dequantized(self) -> torch.Tensor:
        """The float32 weights these blocks hold."""
        out = torch.empty(self.out_features, self.in_features)
        self.dequantize_op(self.blocks, out)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.prompt_copies:
            rows = current_prompt_rows()
            if rows is not None and rows.prompt is not None and x.dim() == 2 and x.shape[0] == rows.num_rows:
                return self._split(x, rows)
            # Generated rows, or a caller that did not say which rows are prompts: the block kernel at every size.
            return self.linear_op(x, self.blocks, self.out_features, self.bias)
        if x.numel() <= self.batched_path.block_kernel_max_rows * self.in_features:
            return self.linear_op(x, self.blocks, self.out_features, self.bias)
        # The same path for a large batch whether or not the background thread got here first: same numbers.
        return self.prepare_batched()(x)

    def _split(self, x: torch.Tensor, rows: PromptRows) -> torch.Tensor:
        if rows.generated is None:
            return self.prompt_product(x)
        y = x.new_empty(x.shape[0], self.out_features)
        y[rows.generated] = self.linear_op(x[rows.generated], self.blocks, self.out_features, self.bias)
        y[rows.prompt] = self.prompt_product(x[rows.prompt])
        return y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, {self.method} weights, "
                f"{self.activations} activations")


class Q4_1Linear(BlockQuantizedLinear):
    method = "q4_1"


class Q8_0Linear(BlockQuantizedLinear):
    method = "q8_0"


LAYER_TYPES: dict[str, type[nn.Module]] = {"fp16": Float16WeightLinear, "q8_0": Q8_0Linear, "q4_1": Q4_1Linear}


def layer_fits(method: str, out_features: int, in_features: int) -> bool:
    """Whether a `method` layer can hold an [out_features, in_features] weight: whole blocks a row, and for the
    K-quants' kernel whole groups of 16 rows."""
    if method in KQUANT_METHODS:
        return in_features % block_width(method) == 0 and out_features % 16 == 0
    return in_features % BLOCK_SIZE == 0


def register_layer_type(method: str, layer_type: type[nn.Module]) -> None:
    """A layer for another kernel format (worker/kquant_formats.py registers the K-quants' when it is imported)."""
    LAYER_TYPES[method] = layer_type
# The output layer is the most sensitive to rounding; llama.cpp's q4 files keep it (or the tied embedding) in q8_0.
OUTPUT_LAYER_METHOD = {"q4_1": "q8_0"}


def prepare_batched_copies(module: nn.Module, threads: int = 1) -> None:
    """Builds every block layer's float16 copy for large batches under `module` (run on a background thread after
    start-up, over the decoder layers: the output layer sees large batches only when scoring prompts, and builds
    its copy then), `threads` layers at a time in layer order: fbgemm packs a matrix on one core (~6 s for Qwen2.5
    0.5B's layers), and the first prompt after start-up waits for the copies it needs."""
    def build(child: BlockQuantizedLinear) -> None:
        if child.prompt_copies:
            if child.batched_path.prompt_weights != "int8":
                child.prepare_prompt_copy()
        elif child.batched_path.weights != "none":
            child.prepare_batched()

    layers = [child for child in module.modules() if isinstance(child, BlockQuantizedLinear)]
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="batched-copies") as pool:
        for _ in pool.map(build, layers):
            pass


def use_prompt_copies(module: nn.Module) -> int:
    """Makes every block layer under `module` (the decoder layers: their rows are the batch's tokens) send prompt rows
    to a copy in its path's prompt_weights and generated rows to the block kernel (BatchedPath.prompt_copies); returns
    how many layers take it (a layer whose shape the AMX kernel cannot tile keeps its batched path)."""
    count = 0
    for child in module.modules():
        if not isinstance(child, BlockQuantizedLinear):
            continue
        prompt_weights = child.batched_path.prompt_weights
        if prompt_weights == "int8":
            takes = child.activations == "int16"  # the float32 kernels' layout has no 8-bit kernel: every row there
        else:
            takes = prompt_weights == "fp16" or AmxBfloat16Linear.fits(child.out_features, child.in_features)
        if takes:
            child.prompt_copies = True
            count += 1
    return count


def use_batched_path(module: nn.Module, path: BatchedPath) -> None:
    """Makes every block layer under `module` multiply large batches the way `path` says (a copy of the other kind
    is dropped and rebuilt on demand)."""
    for child in module.modules():
        if isinstance(child, BlockQuantizedLinear) and child.batched_path != path:
            with child.copy_lock:
                if child.batched_path.weights != path.weights:
                    child.batched = None
                child.batched_path = path


def use_block_activations(module: nn.Module, setting: str) -> int:
    """Moves every block layer under `module` to the kernel for `setting` (block_activations' answer; float32 leaves
    them as built); returns how many layers run int16 activations."""
    if setting != "int16":
        return 0
    return sum(child.use_int16_activations() for child in module.modules() if isinstance(child, BlockQuantizedLinear))


def quantize_linears(module: nn.Module, method: str) -> int:
    """Replaces every nn.Linear under module with its `method` version, in place; returns how many were replaced."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, LAYER_TYPES[method](child.weight, child.bias))
            count += 1
        else:
            count += quantize_linears(child, method)
    return count


class PendingLayer(nn.Module):
    """A layer whose weights are still being loaded: load_rows(start, weight) takes the checkpoint's rows, finish()
    gives the layer they make (finish_block_linears)."""

    def load_rows(self, start: int, weight: torch.Tensor | StoredBlocks) -> None:
        raise NotImplementedError

    def finish(self) -> nn.Module:
        raise NotImplementedError


class PendingBlockLinear(PendingLayer):
    """A block layer whose weights are still being loaded: the checkpoint's rows arrive one tensor (or shard) at a time
    into `staged`, rows of llama.cpp blocks; a file's blocks of the same format are copied as they are, anything else
    is rounded to the format (as_blocks). finish() then packs them into the layer. Built on the meta device with the
    rest of the model (worker/model_builder.py), it never holds the weights in float."""

    def __init__(self, method: str, in_features: int, out_features: int, bias: bool, activations: str = "float32"
                 ) -> None:
        super().__init__()
        self.activations = activations  # the finished layer's (BlockQuantizedLinear)
        width = block_width(method)
        if in_features % width:
            raise ValueError(f"{method} layers need in_features that are a multiple of {width}; a layer has "
                             f"{in_features}")
        self.method, self.in_features, self.out_features = method, in_features, out_features
        staged = torch.empty(out_features, in_features // width, STORED_BLOCK_BYTES[method], dtype=torch.uint8)
        self.register_buffer("staged", staged, persistent=False)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def load_rows(self, start: int, weight: torch.Tensor | StoredBlocks) -> None:
        """Rows start, start + 1, ... of the weight (a fused layer's q, k and v arrive one after another)."""
        blocks = as_blocks(self.method, weight)
        if blocks.shape[1:] != self.staged.shape[1:] or start + blocks.shape[0] > self.out_features:
            raise ValueError(
                f"rows of shape {tuple(weight.shape)} do not fit at row {start} of a "
                f"[{self.out_features}, {self.in_features}] layer"
            )
        self.staged.numpy()[start : start + blocks.shape[0]] = blocks.numpy()  # one thread (see pack_blocks)

    def finish(self) -> BlockQuantizedLinear:
        return LAYER_TYPES[self.method](StoredBlocks(self.method, self.staged), self.bias,
                                        activations=self.activations)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.method} weights, loading"


def pend_block_linears(
    module: nn.Module, method: str | Callable[[str], str | None], prefix: str = "", activations: str = "float32"
) -> int:
    """Replaces every nn.Linear under module (on the meta device: shapes only) with a PendingBlockLinear of
    `method`, in place; returns how many were replaced. `method` may be a function of the layer's name under module
    (e.g. "0.mlp.down_proj"), whose None leaves that layer a float one. activations: the finished layers' kernel."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            layer_method = method(prefix + name) if callable(method) else method
            if layer_method is None or not layer_fits(layer_method, child.out_features, child.in_features):
                continue
            bias = child.bias is not None
            setattr(module, name, PendingBlockLinear(layer_method, child.in_features, child.out_features, bias,
                                                     activations))
            count += 1
        else:
            count += pend_block_linears(child, method, f"{prefix}{name}.", activations)
    return count


def finish_block_linears(module: nn.Module) -> None:
    """Replaces every PendingLayer under module (PendingBlockLinear, worker/row_segments.PendingSegmentsLinear) with
    the layer its loaded rows make."""
    for name, child in list(module.named_children()):
        if isinstance(child, PendingLayer):
            setattr(module, name, child.finish())
        else:
            finish_block_linears(child)
