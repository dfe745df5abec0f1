"""Building the model's modules without a second copy of its weights.

Built the plain way (`LlamaForCausalLM(...).to(bfloat16)`), every parameter is first allocated in float32 and randomly
initialised, then converted: twice the weights' bytes at the peak, and time spent drawing numbers that the checkpoint
overwrites. Here the modules are built on the meta device (shapes only), cast to the target dtype there (free), and
materialised once on the target device as uninitialised memory, which `load_weights` fills: it raises when the
checkpoint lacks any parameter, so no uninitialised value can survive into a forward pass.
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from lmserve.distributed.parallel_state import ParallelGroups
from lmserve.worker.models.llama import LlamaForCausalLM


def build_model(
    config: PretrainedConfig, max_position: int, device: torch.device, dtype: torch.dtype,
    parallel: ParallelGroups | None = None,
) -> LlamaForCausalLM:
    """The model's modules on `device` in `dtype`, parameters uninitialised (load its weights next). The RoPE
    tables are real float32 values on `device`: they are plain attributes, computed from the config, not loaded."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config, max_position, parallel, rope_device=device)
    return model.to(dtype).to_empty(device=device)
