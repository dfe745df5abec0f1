"""Building the model's modules without a second copy of its weights.

Built the plain way (`LlamaForCausalLM(...).to(bfloat16)`), every parameter is first allocated in float32 and randomly
initialised, then converted: twice the weights' bytes at the peak, and time spent drawing numbers that the checkpoint
overwrites. Here the modules are built on the meta device (shapes only), cast to the target dtype there (free), and
materialised once on the target device as uninitialised memory, which `load_weights` fills: it raises when the
checkpoint lacks any parameter, so no uninitialised value can survive into a forward pass.

With a block format (`block_method`, --quantization q4_1 or q8_0) the linear layers are block layers from the start:
they are built as PendingBlockLinear (uint8 rows of blocks), which load_weights fills with the file's own blocks and
packs, so the float32 weights of those layers never exist. With float16 weights (--quantization fp16, and a GGUF's
layers that no block format holds) the float layers are built as PendingFloat16Linear, likewise.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from lmserve.config import HYBRID_MODEL_TYPES
from lmserve.distributed.parallel_state import ParallelGroups
from lmserve.worker.models.hybrid import HybridForCausalLM
from lmserve.worker.models.llama import LlamaForCausalLM
from lmserve.worker.weights.stored_formats import KERNEL_FORMATS

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def build_model(
    config: PretrainedConfig, max_position: int, device: torch.device, dtype: torch.dtype,
    parallel: ParallelGroups | None = None, block_method: str | None = None,
    stored_types: Mapping[str, str] | None = None, formats: Sequence[str] = KERNEL_FORMATS,
    activations: str = "float32", float16_layers: bool = False, embedding_dtype: torch.dtype | None = None,
    expert_parallel: bool = False,
) -> LlamaForCausalLM:
    """The model's modules on `device` in `dtype`, parameters uninitialised (load its weights next). The RoPE
    tables are real float32 values on `device`: they are plain attributes, computed from the config, not loaded.
    block_method: the linear layers' block format (LlamaForCausalLM.pend_block_layers), or None for float ones;
    stored_types: a GGUF's matrix types, for a format per layer among `formats` (those that run here); activations:
    the block layers' kernel (block_activations), their blocks packed for it at once. float16_layers: the float
    linear layers that remain load straight into float16 weights (LlamaForCausalLM.pend_float16_layers; the table
    in embedding_dtype where given)."""
    with torch.device("meta"):
        model_class = HybridForCausalLM if config.model_type in HYBRID_MODEL_TYPES else LlamaForCausalLM
        model = model_class(config, max_position, parallel, rope_device=device, expert_parallel=expert_parallel)
        if block_method is not None:
            model.pend_block_layers(block_method, stored_types, formats, activations)
        model = model.to(dtype)  # before the float16 layers: it would widen their staged rows
        if float16_layers:
            model.pend_float16_layers(embedding_dtype)
    return _to_empty(model, device)


def _to_empty(model: nn.Module, device: torch.device) -> nn.Module:
    """model.to_empty(device=device): every parameter and buffer as uninitialised memory on `device`. Without
    to_empty's torch.empty_like of meta tensors, which runs torch's reference implementations and, the first time,
    imports sympy (half a second of start-up) to reason about their strides."""
    made: dict[int, torch.Tensor] = {}  # a tensor two modules share stays shared
    for module in model.modules():
        for group in (module._parameters, module._buffers):
            for name, tensor in group.items():
                if tensor is None:
                    continue
                if id(tensor) not in made:
                    empty = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
                    if isinstance(tensor, nn.Parameter):
                        empty = nn.Parameter(empty, requires_grad=tensor.requires_grad)
                    made[id(tensor)] = empty
                group[name] = made[id(tensor)]
    return model
