"""Weights stored in fewer bytes than the activations, applied after loading: `--quantization fp16`.

Decoding a small model on a CPU is bound by the bytes of weights read per step. fp16 keeps every weight in float16
(half of float32's bytes) and computes in float32: fbgemm, PyTorch's x86 GEMM library, widens the weights inside its
kernel, which on this project's AVX2 machines also beats float32 OpenBLAS at the few-row products of decoding.
Against the float32 model the output distribution is unchanged to within rounding (benchmarks/quantization.py:
perplexity 63.080 vs 63.075, 99.6% same top token), so `auto` picks fp16 wherever it runs: CPU with float32.

Measured and left out (docs/benchmarks.md): int8 with dynamically quantized activations (fbgemm W8A8) is faster still
but ruins this model (perplexity 195; its MLP inputs carry outliers ~1,000× their median), and int8 weight-only
(`_weight_int8pack_mm`) is no faster than fp16 here.
"""

from __future__ import annotations

import torch
from torch import nn

QUANTIZATION_METHODS = ("auto", "none", "fp16")
# Above this many rows a float32 GEMM of the weights widened on the fly beats fbgemm's fp16 kernel (prefill chunks).
FP16_KERNEL_MAX_ROWS = 128


def check_quantization(method: str | None, device: torch.device, dtype: torch.dtype) -> str:
    """The method to apply: auto becomes fp16 on CPU with float32, none elsewhere; a method that cannot run raises."""
    method = method or "auto"
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"unknown quantization {method!r}: use one of {', '.join(QUANTIZATION_METHODS)}")
    supported = device.type == "cpu" and dtype == torch.float32
    if method == "auto":
        return "fp16" if supported else "none"
    if method != "none" and not supported:
        raise ValueError(
            f"--quantization {method} runs on CPU with float32 activations only (--device cpu --dtype float32)"
        )
    return method


class Float16WeightLinear(nn.Module):
    """y = x @ W.T + b with W stored in float16 and the arithmetic in float32."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]
        self.bias = None if bias is None else bias.detach().float()
        self.weight = weight.detach().to(torch.float16)
        self.packed = torch.ops.quantized.linear_prepack_fp16(self.weight.float(), self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= FP16_KERNEL_MAX_ROWS:
            return torch.ops.quantized.linear_dynamic_fp16(x.contiguous(), self.packed)
        return nn.functional.linear(x, self.weight.float(), self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, float16 weights"


LAYER_TYPES: dict[str, type[nn.Module]] = {"fp16": Float16WeightLinear}


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
