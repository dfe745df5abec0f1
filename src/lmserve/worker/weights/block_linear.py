"""Linear layers whose weights are stored in fewer bytes than the activations (BlockQuantizedLinear, the base of
every block format's layer), the q4_1 and q8_0 family's layers and table (BLOCK_LAYER_FORMATS), and the model-wide
settings of their kernels' paths (`--block-activations`, `--batched-weights`).

Decoding on a CPU is bound by the bytes of weights read per step, so a layer keeps its weights as small as its file
holds them. A block layer (BlockQuantizedLinear) holds one of llama.cpp's block formats (q4_1 and q8_0 here; the
K-quants q2_k to q6_k, q4_0, q5_0, q5_1 and iq4_nl in worker/weights/kquants.py) and multiplies through C++ kernels
that widen the blocks in registers (worker/kernels). Under `auto` each matrix of a GGUF file keeps the format it is
stored in (weights/stored_formats.py: the kernel format that holds its stored rows exactly), taken byte for byte
from the file (StoredBlocks, pending.PendingBlockLinear: no float copy on the way); a matrix no kernel format holds,
and a Hugging Face directory's, runs as float16 weights through fbgemm (weights/batched_copies.py, float16.py), within
rounding of float32 (benchmarks/quantization.py: perplexity 63.080 against 63.075).

Which kernel a row takes is weights/kernel_choice.py's: with `--block-activations auto` (int16 wherever those kernels
build) the block kernels split each block of 32 inputs into 16-bit integers, exact integer dot products, so that a
row's result does not depend on its batch, at a next-token KL below 1e-5 from the float32 model; prompt rows take the
path `--batched-weights` names (the same kernels, 8-bit activations on the same blocks, or a float16 or bfloat16
copy of the weights: worker/weights/batched_copies.py). The blocks' byte layouts are worker/weights/block_packing.py's.

Measured and left out (docs/benchmarks.md): int8 with dynamically quantized activations (fbgemm W8A8) is faster still
but ruins the default model (perplexity 195; its MLP inputs carry outliers ~1,000x their median), and int8 weight-only
(`_weight_int8pack_mm`) is no faster than fp16 here.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ClassVar

import numpy as np
import torch
from torch import nn

from lmserve.worker.kernels import cpu_kernels
from lmserve.worker.layer_program import KernelCall, LinearPlan
from lmserve.worker.prompt_rows import PromptRows, current_prompt_rows
from lmserve.worker.weights.batched_copies import (
    BATCHED_LAYER_TYPES,
    PROMPT_LAYER_TYPES,
    AmxBfloat16Linear,
)
from lmserve.worker.weights.block_packing import (
    BLOCK_BYTES,
    PANEL_ROWS,
    PackedBlocks,
    StoredBlocks,
    StoredRows,
    as_blocks,
    pack_blocks,
    unpack_blocks,
)
from lmserve.worker.weights.kernel_choice import (
    BLOCK_SIZE,
    INTEGER_ACTIVATIONS,
    BatchedPath,
    batched_path,
)
from lmserve.worker.weights.layer_format import LayerFormat


class BlockQuantizedLinear(nn.Module):
    """y = x @ W.T + b with W in one of llama.cpp's block formats, computed in float32. Batches of up to
    `batched.block_kernel_max_rows` rows run the block kernel; larger ones a float16 or bfloat16 copy of the same
    weights (batched_path)."""

    method: ClassVar[str]

    def __init__(
        self, weight: torch.Tensor | StoredBlocks | StoredRows | PackedBlocks, bias: torch.Tensor | None,
        batched: BatchedPath | None = None,
        activations: str = "float32",
    ) -> None:
        """weight: float [out_features, in_features], rounded to the format; or a file's blocks (StoredBlocks), taken
        as they are when they are in this format. batched: how batches above the kernel's rows run (batched_path).
        activations: int16 or int8 packs the blocks for the integer-activation kernels at once
        (use_integer_activations' layout, without packing them for the float kernel first) where they can tile the
        layer."""
        super().__init__()
        self.activations = activations
        if isinstance(weight, PackedBlocks):  # packed by an earlier start (packed_cache): nothing to pack
            self.activations = weight.activations
            self.blocks, self.out_features, self.in_features = weight.blocks, weight.out_features, weight.in_features
        else:
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
        # Every row on the block kernel, and no copy ever made: an expert's layers (worker/models/moe.py), whose
        # copies would cost every expert's bytes again.
        self.kernel_only = False
        self.copy_lock = threading.Lock()  # one builder of this layer's copies at a time

    def _pack(self, weight: torch.Tensor | StoredBlocks | StoredRows) -> tuple[torch.Tensor, int, int]:
        """The weights in the kernel's layout, out_features, in_features."""
        blocks = as_blocks(self.method, weight)
        rows, columns = blocks.shape[0], blocks.shape[1] * BLOCK_SIZE
        if self.activations in INTEGER_ACTIVATIONS and rows % 16 == 0:
            return getattr(cpu_kernels(), f"{self.method}_int16_pack")([blocks]), rows, columns
        self.activations = "float32"
        return pack_blocks(self.method, blocks), rows, columns

    def _use_ops(self) -> None:
        ops = cpu_kernels()
        if self.activations not in INTEGER_ACTIVATIONS:
            self.linear_op = getattr(ops, f"{self.method}_linear")
            self.dequantize_op = getattr(ops, f"{self.method}_dequantize")
            self.int8_linear_op = None
            return
        self.dequantize_op = getattr(ops, f"{self.method}_int16_dequantize")
        self.int8_linear_op = getattr(ops, f"{self.method}_int8_linear")
        # Both take the int16 layout's blocks; int8 runs every row on the 8-bit kernel.
        self.linear_op = self.int8_linear_op if self.activations == "int8" else getattr(ops, f"{self.method}_int16_linear")

    def use_integer_activations(self, activations: str = "int16") -> bool:
        """Moves the layer to the integer-activation kernels (block_activations: int16 or int8), its blocks repacked
        for them; False where they cannot tile it (out_features not a multiple of 16)."""
        if self.activations not in INTEGER_ACTIVATIONS:
            if self.out_features % 16:
                return False
            pack = getattr(cpu_kernels(), f"{self.method}_int16_pack")
            self.blocks = pack([unpack_blocks(self.method, self.blocks, self.out_features)])
        self.activations = activations
        self._use_ops()
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
        # None as well while a builder is setting it: nn.Module.__setattr__ takes a module out of __dict__ before it
        # puts it in _modules, and the builder holds the lock throughout.
        copy = getattr(self, attribute, None)
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
        if self.activations in INTEGER_ACTIVATIONS:  # per 16 rows and block: 16 d's, then q[n][4j + e] + 128 at 64j + 4n + e
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
        if self.kernel_only:
            return self.linear_op(x, self.blocks, self.out_features, self.bias)
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

    def program_plan(self) -> LinearPlan:
        """What forward() is for the batches it sends to the block kernel alone (worker/layer_program.py)."""
        call = KernelCall(self.linear_op._qualified_op_name, self.blocks, self.out_features, self.bias)
        if self.kernel_only:  # every row on the kernel
            return LinearPlan([call], sys.maxsize, prompt_rows_apart=False)
        if self.prompt_copies:  # generated rows take the kernel at any batch size; prompt rows go elsewhere
            return LinearPlan([call], sys.maxsize, prompt_rows_apart=True)
        return LinearPlan([call], self.batched_path.block_kernel_max_rows, prompt_rows_apart=False)

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


# The family's table: the block formats every CPU with AVX2 runs, with float32 activations or integer ones.
BLOCK_LAYER_FORMATS = (
    LayerFormat("q4_1", Q4_1Linear, "kernels/quantized_linear.cpp; integer activations kernels/int16_activations.cpp",
                "block_packing.pack_blocks: panels of 8 rows; q4_1_int16_pack for integer activations",
                ("float32", "int16", "int8")),
    LayerFormat("q8_0", Q8_0Linear, "kernels/quantized_linear.cpp; integer activations kernels/int16_activations.cpp",
                "block_packing.pack_blocks: panels of 8 rows; q8_0_int16_pack for integer activations",
                ("float32", "int16", "int8")),
)


def prepare_batched_copies(module: nn.Module, threads: int = 1) -> None:
    """Builds every block layer's float16 copy for large batches under `module` (run on a background thread after
    start-up, over the decoder layers: the output layer sees large batches only when scoring prompts, and builds
    its copy then), `threads` layers at a time in layer order: fbgemm packs a matrix on one core (~6 s for Qwen2.5
    0.5B's layers), and the first prompt after start-up waits for the copies it needs."""
    def build(child: BlockQuantizedLinear) -> None:
        if child.kernel_only:
            return
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
        if not isinstance(child, BlockQuantizedLinear) or child.kernel_only:
            continue
        prompt_weights = child.batched_path.prompt_weights
        if prompt_weights == "int8":
            takes = child.activations in INTEGER_ACTIVATIONS  # the float32 kernels' layout has no 8-bit kernel
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
    them as built); returns how many layers run integer (int16 or int8) activations."""
    if setting not in INTEGER_ACTIVATIONS:
        return 0
    return sum(child.use_integer_activations(setting) for child in module.modules()
               if isinstance(child, BlockQuantizedLinear))
