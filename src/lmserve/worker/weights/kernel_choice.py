"""Which kernels a layer runs on this CPU: the settings' choices (`--quantization`, `--batched-weights`,
`--block-activations`) and what `auto` resolves each to, by what the CPU has (AMX, AVX-512 VNNI, AVX2) and what the
kernel library built (worker/kernels). Every path stays forceable (`LMSERVE_DISABLE_CPU_FEATURES`,
`LMSERVE_KERNEL_MARCH`) so that one machine can test another kind's."""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass

import torch

from lmserve.config import INT8_ACTIVATIONS_FROM_WEIGHTS
from lmserve.formats.block_formats import BLOCK_FORMATS, INTEGER_ONLY_FORMATS
from lmserve.worker.kernels import cpu_flags, cpu_kernels, cpu_kernels_load, disabled_features

logger = logging.getLogger(__name__)


QUANTIZATION_METHODS = ("auto", "none", "fp16", "q8_0", "q4_1")
# Named in formats/block_formats.py's table: the formats every CPU with AVX2 runs (kernels/quantized_linear.cpp), and
# those chosen per layer under auto, for a file that stores them (worker/weights/kquants.py): kernels with int16 (or
# int8) activations only.
BLOCK_METHODS = BLOCK_FORMATS
INT16_ONLY_METHODS = INTEGER_ONLY_FORMATS
LAYER_METHODS = BLOCK_METHODS + INT16_ONLY_METHODS
BATCHED_WEIGHTS = ("auto", "bf16", "fp16", "prompt-bf16", "prompt-fp16", "prompt-int8", "none")
BLOCK_ACTIVATIONS = ("auto", "float32", "int16", "int8")
INTEGER_ACTIVATIONS = ("int16", "int8")  # the kernels of kernels/int16_activations.cpp and kquant_int16.cpp
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

    def describe(self, copies_taken: bool) -> str:
        """What batches run on, for the load's log line; `copies_taken`: some layer took the prompt copy asked for."""
        if self.prompt_copies and copies_taken:
            return "prompt tokens on " + {"bf16": "AMX tiles (bf16 weights)", "fp16": "fbgemm (fp16 weights)",
                                          "int8": "the stored blocks (8-bit activations)"}[self.prompt_weights]
        if self.weights == "none":
            return "every row on the stored blocks"
        return f"{self.weights} weights above {self.block_kernel_max_rows} rows"


def batched_path(setting: str | None = "auto", activations: str = "int16") -> BatchedPath:
    """Each row's path fixed by what the row is, never by the batch: prompt-bf16 (auto where the CPU has AMX and the
    layers take int16 activations): prompt rows through the AMX kernel on a bfloat16 copy, 2-10x faster prefill; none
    (auto where the block kernels take int16 activations on AVX-512 VNNI, or int8 ones on any kind, AMX included:
    `activations`, the layers' resolved --block-activations): every row on the block kernels, no copy, the file's size in memory; prompt-fp16 (auto
    elsewhere): prompt rows through fbgemm on a float16 copy, float32 activations. Generated rows go through the
    block kernel in all three, at any batch size. A row's result then depends only on the row (fbgemm's, like the
    AMX kernel's, does not depend on the other rows of its call). On VNNI the int16 kernels multiply a 512-row
    prompt 1.2-1.4x faster than fbgemm's float16 GEMM (q4_1, q8_0, q5_0, q4_k; q6_k 0.75x), so the copy (2 bytes a
    weight beside the file's ~0.6) bought no speed there (docs/benchmarks.md, "Prompt rows on the stored blocks");
    the AVX2 build's kernels are ~2x slower than fbgemm at prompt sizes with int16 activations and keep it for them.
    With int8 ones (auto from INT8_ACTIVATIONS_FROM_WEIGHTS) they prefill Qwen2.5 0.5B about as fast as fbgemm's
    AVX-512 code does from the copy, on an AVX-512 CPU made to run the AVX2 build, and the copy, built after
    start-up, had more than doubled the engine's memory (687 against 1,569 MiB). On AMX the bfloat16 copy costs
    as much memory (RSS at ready 1.66x llama.cpp's on Qwen2.5 0.5B, before the copies were done), while int8
    activations on the blocks already serve 8 concurrent streams at 1.9-2.7x llama.cpp's rate on VNNI (not
    measured on an AMX machine): for the models that take int8 the copy is asked for, not chosen.
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
        if activations == "int8":  # a large model: a copy would take 2 bytes a weight beside the file's ~0.6
            setting = "none"
        elif amx_kernel_loads():
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


def block_activations(setting: str | None = "auto", decoder_weights: int = 0) -> str:
    """How the block kernels take their activations: float32 (kernels/quantized_linear.cpp, q4_1 and q8_0 only),
    int16 (16-bit integers per block of 32 inputs through exact integer dot products, kernels/int16_activations.cpp:
    with AVX-512 VNNI 1.2-2.7x faster than float32 at 1-64 rows, next-token KL below 1e-5 from the float32 model) or
    int8 (the same kernels and layout with 8-bit activations per block of 32, the high halves alone, as llama.cpp's q8
    activations: half the integer products, so each row a batch, a prompt or a speculative verify step adds costs
    about half; perplexity +0.06% on Qwen2.5 0.5B Q4_K_M, +1.9% on the default model, whose activations carry
    outliers, int16's < 0.01%; q4_k, q5_k and q6_k layers take one scale per 256 inputs, llama.cpp's q8_K, with
    one float step per 256 instead of per 32: kernels/kquant_int16.cpp). A row's result is its own whatever its batch under both integer settings, where the
    float32 kernel sums a row in an order set by the batch's size (on the AVX2 build a seeded request drew another
    token in a batch of 16 than alone).
    auto, wherever the integer kernels run (the AVX2 build included): int8 for a model of at least
    INT8_ACTIVATIONS_FROM_WEIGHTS decoder weights (`decoder_weights`, models.llama.decoder_linear_weights), int16 below
    it; float32 where they do not run. The price of int16 on AVX2 (benchmarks/int16_activations.py): 0.92x the float32
    kernel's speed at 1 row, 0.65-0.8x at 16-64; `float32` stays there to be asked for."""
    setting = setting or "auto"
    if setting not in BLOCK_ACTIVATIONS:
        raise ValueError(f"unknown block activations {setting!r}: use one of {', '.join(BLOCK_ACTIVATIONS)}")
    if setting == "float32":
        return setting
    runs = int16_kernel_loads()
    if setting in INTEGER_ACTIVATIONS and not runs:
        raise ValueError(f"--block-activations {setting} needs a CPU with AVX2, FMA and F16C, or AVX-512 VNNI, where "
                         "the kernels build (LMSERVE_DISABLE_CPU_FEATURES=vnni turns the VNNI build's off)")
    if setting in INTEGER_ACTIVATIONS:
        return setting
    if not runs:
        return "float32"
    return "int8" if decoder_weights >= INT8_ACTIVATIONS_FROM_WEIGHTS else "int16"


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
        if stored_as in INT16_ONLY_METHODS:  # the caller found the kernel that runs it (kquants.kernel_formats)
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
