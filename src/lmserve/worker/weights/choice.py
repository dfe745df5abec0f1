"""What a model's weights load into, decided from the file and the settings before any weight is read, and the
kernel paths its block layers settle on once loaded: the `--quantization`, `--block-activations` and
`--batched-weights` choices a model load makes (docs/architecture.md, "Part 2: one model load").

Under `--quantization auto` each matrix of a GGUF file takes the kernel format that holds its stored blocks exactly
(stored_formats.py), among those that run on this CPU (kquants.kernel_formats); a matrix no format holds runs as
float16 weights (float16.py), and the user hears which.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from lmserve.config import ModelConfig
from lmserve.models import ModelSource
from lmserve.worker.weights.block_linear import use_batched_path, use_block_activations, use_prompt_copies
from lmserve.worker.weights.kernel_choice import (
    LAYER_METHODS,
    BatchedPath,
    batched_path,
    block_activations,
    check_quantization,
)
from lmserve.worker.weights.kquants import kernel_formats
from lmserve.worker.weights.loader import hf_tensor_dtype, stored_matrix_types
from lmserve.worker.weights.stored_formats import (
    STORED_BLOCK_TYPES,
    float_fallbacks,
    preferred_kernel_format,
    runnable_types,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WeightFormats:
    """The formats a model's layers are built in. quantization: `--quantization` resolved (check_quantization);
    per_layer: a GGUF's kernel format per matrix (Hugging Face name; "float" where none runs here) under auto, else
    None; formats: the kernel formats that run here."""

    quantization: str
    per_layer: dict[str, str] | None
    formats: tuple[str, ...]

    @property
    def block_method(self) -> str | None:
        """The block format the linear layers are built in (per layer where per_layer is given), None for floats."""
        return self.quantization if self.quantization in LAYER_METHODS else None

    @property
    def float16_layers(self) -> bool:
        """Whether float linear layers load straight into float16 weights: under fp16, and a GGUF's layers that no
        block format holds under auto (no float32 copy of them is made)."""
        return self.quantization == "fp16" or (self.block_method is not None and self.per_layer is not None)

    @property
    def loaded_blocks(self) -> tuple[str, ...]:
        """The stored types whose GGUF matrices the loader hands over as their blocks (StoredBlocks), not
        dequantized: every one a kernel format holds, where the layers are block layers."""
        return STORED_BLOCK_TYPES if self.block_method else ()

    def layer_activations(self, model_config: ModelConfig, decoder_weights: int) -> str:
        """The activations the block layers are packed for as they are built (block_activations; float32 without
        block layers)."""
        if self.block_method is None:
            return "float32"
        return block_activations(model_config.block_activations, decoder_weights)

    def embedding_dtype(self, source: ModelSource) -> torch.dtype | None:
        """The token embedding's dtype where it keeps a 16-bit checkpoint's own (fp16), else None (the model's)."""
        stored = hf_tensor_dtype(source, "model.embed_tokens.weight") if self.quantization == "fp16" else None
        return stored if stored in (torch.bfloat16, torch.float16) else None


def choose_weight_formats(model_config: ModelConfig, source: ModelSource, device: torch.device,
                          dtype: torch.dtype) -> WeightFormats:
    """Each layer's format under the settings: under auto each takes the format that holds its file's values
    exactly (stored_formats.py), the rest float16."""
    stored_types = stored_matrix_types(source)
    on_cpu = device.type == "cpu" and dtype == torch.float32
    formats = kernel_formats(model_config.block_activations) if stored_types and on_cpu else ()
    stored_as = preferred_kernel_format(stored_types.values(), formats) if stored_types else None
    quantization = check_quantization(model_config.quantization, device, dtype, stored_as)
    per_layer = None
    if stored_types and (model_config.quantization or "auto") == "auto":
        per_layer = runnable_types(stored_types, formats)
        if fallbacks := float_fallbacks(stored_types, per_layer):
            logger.warning("no kernel here holds these matrices at their stored size: %s; they run as float16 "
                           "weights (2 bytes a weight)", fallbacks)
    return WeightFormats(quantization, per_layer, formats)


@dataclass(frozen=True)
class BlockKernels:
    """How a loaded model's block layers run: their activations (block_activations; float32 where none takes
    integer ones), the path of large batches and prompt rows (batched_path), and whether some decoder layer sends
    prompt rows apart (BatchedPath.prompt_copies). None of it for a model without block layers."""

    activations: str = "float32"
    batched_path: BatchedPath | None = None
    prompt_copies: bool = False

    def describe(self) -> str:
        """What the block layers run batches on, for the load's log line ("" without block layers)."""
        if self.batched_path is None:
            return ""
        return (f", {self.batched_path.describe(self.prompt_copies)}, {self.activations} activations in the block "
                "kernel")


def settle_block_kernels(model: nn.Module, decoder_layers: nn.Module, formats: WeightFormats,
                         model_config: ModelConfig, decoder_weights: int) -> BlockKernels:
    """Puts every block layer under `model` on the kernels the settings choose (decoder_weights: the model's,
    models.llama.decoder_linear_weights, for block_activations' auto); the prompt-row copies go to the
    `decoder_layers` only (their rows are the batch's tokens)."""
    if formats.quantization not in LAYER_METHODS:
        return BlockKernels()
    activations = block_activations(model_config.block_activations, decoder_weights)
    path = batched_path(model_config.batched_weights, activations)
    use_batched_path(model, path)
    if use_block_activations(model, activations) == 0:
        activations = "float32"
    prompt_copies = False
    if path.prompt_copies:  # after the activations: prompt-int8 takes the int16 layout's layers
        prompt_copies = use_prompt_copies(decoder_layers) > 0
    return BlockKernels(activations, path, prompt_copies)
