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
the activations. Where a GGUF file stores its linear layers in one of them, re-packing the loaded weights gives back
the file's own blocks, so `auto` picks that format: the model computes with exactly the weights it shipped with, in
fewer bytes per decode step. Up to BLOCK_KERNEL_MAX_ROWS rows (decodes, and the prefill chunks that run beside them)
the kernels beat fbgemm's float16 GEMM; larger batches, bound by arithmetic, go through a float16 copy of the same
weights and fbgemm, which is faster there (benchmarks/quantization.py, docs/benchmarks.md).

Measured and left out (docs/benchmarks.md): int8 with dynamically quantized activations (fbgemm W8A8) is faster still
but ruins this model (perplexity 195; its MLP inputs carry outliers ~1,000× their median), and int8 weight-only
(`_weight_int8pack_mm`) is no faster than fp16 here.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from lmserve.worker.kernels import cpu_kernels, cpu_kernels_load

logger = logging.getLogger(__name__)

QUANTIZATION_METHODS = ("auto", "none", "fp16", "q8_0", "q4_1")
BLOCK_METHODS = ("q8_0", "q4_1")
BATCHED_WEIGHTS = ("auto", "bf16", "fp16")
BLOCK_SIZE = 32
# Up to this many rows the block kernels beat fbgemm's fp16 GEMM or match it (1.26x at 16 rows, 1.48x at 20, even at
# 32 and 64); above it the layer uses its fp16 copy, which fbgemm multiplies 5-14% faster (benchmarks/block_gemm.py).
BLOCK_KERNEL_MAX_ROWS = 64
# With AMX, oneDNN's bfloat16 GEMM overtakes the block kernel at a few rows (benchmarks/block_gemm.py --batched bf16).
AMX_BLOCK_KERNEL_MAX_ROWS = 8


@dataclass(frozen=True)
class BatchedPath:
    """How a block layer multiplies batches above `block_kernel_max_rows` rows: a copy of its weights in `weights`
    (bf16: oneDNN's bfloat16 GEMM, activations rounded to bfloat16; fp16: fbgemm, activations kept in float32)."""

    weights: str
    block_kernel_max_rows: int


def batched_path(setting: str | None = "auto") -> BatchedPath:
    """auto: bf16 where the CPU multiplies bfloat16 natively (AVX-512 BF16; with AMX also from a few rows up, where
    its tiles beat the block kernel), fp16 elsewhere. bf16 on a CPU without AVX-512 BF16 runs, slowly (tests)."""
    setting = setting or "auto"
    if setting not in BATCHED_WEIGHTS:
        raise ValueError(f"unknown batched weights {setting!r}: use one of {', '.join(BATCHED_WEIGHTS)}")
    native_bf16 = torch.cpu._is_avx512_bf16_supported()
    weights = ("bf16" if native_bf16 else "fp16") if setting == "auto" else setting
    if weights == "bf16" and native_bf16 and torch.cpu._is_amx_tile_supported():
        return BatchedPath(weights, AMX_BLOCK_KERNEL_MAX_ROWS)
    return BatchedPath(weights, BLOCK_KERNEL_MAX_ROWS)


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


class Float16WeightLinear(nn.Module):
    """y = x @ W.T + b with W stored in float16 and the arithmetic in float32, through fbgemm at every batch size: it
    also beats a float32 GEMM of the weights widened per call at 256 and 1,024 rows (benchmarks/quantization.py)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]
        self.bias = None if bias is None else bias.detach().float()
        self.packed = torch.ops.quantized.linear_prepack_fp16(weight.detach().float(), self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic_fp16(x.contiguous(), self.packed)

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


BATCHED_LAYER_TYPES: dict[str, type[nn.Module]] = {"fp16": Float16WeightLinear, "bf16": Bfloat16WeightLinear}


def _blocks(weight: torch.Tensor) -> torch.Tensor:
    out_features, in_features = weight.shape
    if in_features % BLOCK_SIZE:
        raise ValueError(
            f"block quantization needs in_features that are a multiple of {BLOCK_SIZE}; a layer has {in_features}"
        )
    return weight.detach().float().reshape(out_features, in_features // BLOCK_SIZE, BLOCK_SIZE)


PANEL_ROWS = 8  # output rows whose blocks the kernels read together (kernels/quantized_linear.cpp)


def _panels(values: torch.Tensor) -> torch.Tensor:
    """[N, blocks, ...] per-row block values as [panels, blocks, 8 rows, ...], N padded to whole panels with zeros."""
    rows = values.shape[0]
    padded = -(-rows // PANEL_ROWS) * PANEL_ROWS
    if padded != rows:
        values = torch.cat([values, values.new_zeros(padded - rows, *values.shape[1:])])
    return values.reshape(padded // PANEL_ROWS, PANEL_ROWS, *values.shape[1:]).transpose(1, 2)


def _bytes(values: torch.Tensor) -> torch.Tensor:
    """[panels, blocks, ...] as [panels, blocks, bytes]."""
    return values.contiguous().view(torch.uint8).reshape(*values.shape[:2], -1)


def _packed(panels: list[torch.Tensor]) -> torch.Tensor:
    """Each panel's blocks one after another, as [N rounded up to whole panels, bytes per row]."""
    packed = torch.cat(panels, -1)
    return packed.reshape(packed.shape[0] * PANEL_ROWS, -1)


def _reciprocal(scale: torch.Tensor) -> torch.Tensor:
    return torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))


def pack_q4_1(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] weights as llama.cpp's block_q4_1 values: per 32 weights of a row a float16 scale d and minimum m and
    integers q in 0..15 with w ≈ d * q + m, 20 bytes. The bytes are grouped in panels of 8 rows: per block, the 8 d's,
    the 8 m's, then for each column j < 16 one byte per row holding q[j] (low nibble) and q[j + 16]; N is padded to a
    multiple of 8. Rounding uses the float16 d and m, so weights that came out of q4_1 blocks pack back to the same
    values."""
    blocks = _blocks(weight)
    low, high = blocks.amin(-1), blocks.amax(-1)
    scale, minimum = ((high - low) / 15).half(), low.half()
    q = ((blocks - minimum.float()[..., None]) * _reciprocal(scale.float())[..., None]).round().clamp(0, 15)
    q = q.to(torch.uint8)
    nibbles = q[..., :16] | (q[..., 16:] << 4)  # [N, blocks, 16 columns]
    return _packed([_bytes(_panels(scale)), _bytes(_panels(minimum)), _bytes(_panels(nibbles).transpose(2, 3))])


def pack_q8_0(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] weights as llama.cpp's block_q8_0 values: per 32 weights of a row a float16 scale d and 32 int8 q with
    w ≈ d * q, 34 bytes, grouped in panels of 8 rows like pack_q4_1's: per block the 8 d's, then column by column
    one byte per row."""
    blocks = _blocks(weight)
    scale = (blocks.abs().amax(-1) / 127).half()
    q = (blocks * _reciprocal(scale.float())[..., None]).round().clamp(-128, 127).to(torch.int8)
    return _packed([_bytes(_panels(scale)), _bytes(_panels(q).transpose(2, 3))])


_BATCHED_COPIES_LOCK = threading.Lock()


class BlockQuantizedLinear(nn.Module):
    """y = x @ W.T + b with W in one of llama.cpp's block formats, computed in float32. Batches of up to
    `batched.block_kernel_max_rows` rows run the block kernel; larger ones a float16 or bfloat16 copy of the same
    weights (batched_path)."""

    method: ClassVar[str]
    PACKERS: ClassVar = {"q4_1": pack_q4_1, "q8_0": pack_q8_0}

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, batched: BatchedPath | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.blocks = self.PACKERS[self.method](weight).contiguous()
        self.batched_path = batched or batched_path()
        ops = cpu_kernels()
        self.linear_op = getattr(ops, f"{self.method}_linear")
        self.dequantize_op = getattr(ops, f"{self.method}_dequantize")
        # The copy for large batches (fbgemm's packed float16 one takes ~2 s for the default model's layers) is built
        # off the start-up path (prepare_batched_copies on a background thread), or by the first batch that needs it.
        self.batched: nn.Module | None = None

    def prepare_batched(self) -> nn.Module:
        batched = self.batched
        if batched is None:
            # One builder at a time: a forward pass that needs a copy waits for the background thread's build of
            # it instead of making a second one (twice the memory, and freed memory a process rarely gives back).
            with _BATCHED_COPIES_LOCK:
                batched = self.batched
                if batched is None:
                    layer_type = BATCHED_LAYER_TYPES[self.batched_path.weights]
                    batched = self.batched = layer_type(self.dequantized(), self.bias)
        return batched

    def dequantized(self) -> torch.Tensor:
        """The float32 weights these blocks hold."""
        out = torch.empty(self.out_features, self.in_features)
        self.dequantize_op(self.blocks, out)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() <= self.batched_path.block_kernel_max_rows * self.in_features:
            return self.linear_op(x, self.blocks, self.out_features, self.bias)
        # The same path for a large batch whether or not the background thread got here first: same numbers.
        return self.prepare_batched()(x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.method} weights"


class Q4_1Linear(BlockQuantizedLinear):
    method = "q4_1"


class Q8_0Linear(BlockQuantizedLinear):
    method = "q8_0"


LAYER_TYPES: dict[str, type[nn.Module]] = {"fp16": Float16WeightLinear, "q8_0": Q8_0Linear, "q4_1": Q4_1Linear}
# The output layer is the most sensitive to rounding; llama.cpp's q4 files keep it (or the tied embedding) in q8_0.
OUTPUT_LAYER_METHOD = {"q4_1": "q8_0"}


def prepare_batched_copies(module: nn.Module) -> None:
    """Builds every block layer's float16 copy for large batches under `module` (run on a background thread after
    start-up, over the decoder layers: the output layer sees large batches only when scoring prompts, and builds
    its copy then)."""
    for child in module.modules():
        if isinstance(child, BlockQuantizedLinear):
            child.prepare_batched()


def use_batched_path(module: nn.Module, path: BatchedPath) -> None:
    """Makes every block layer under `module` multiply large batches the way `path` says (a copy of the other kind
    is dropped and rebuilt on demand)."""
    for child in module.modules():
        if isinstance(child, BlockQuantizedLinear) and child.batched_path != path:
            with _BATCHED_COPIES_LOCK:
                if child.batched_path.weights != path.weights:
                    child.batched = None
                child.batched_path = path


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
