"""gpt-oss's Hugging Face checkpoints as the weights the mixture-of-experts block loads: each expert's own gate, up and
down weights and biases (the names a GGUF's stacked experts are read under too, loader._gguf_experts), the router as
the block's gate.

A checkpoint stacks every expert of a layer in one tensor each, transposed against nn.Linear's layout, with gate and
up interleaved by column (transformers' GptOssExperts: gate = gate_up[..., ::2], up = gate_up[..., 1::2]):
  mlp.experts.gate_up_proj [experts, hidden, 2 x intermediate], gate_up_proj_bias [experts, 2 x intermediate],
  mlp.experts.down_proj [experts, intermediate, hidden], down_proj_bias [experts, hidden].
OpenAI's released checkpoints store the two weight tensors as MXFP4 instead (transformers' integrations/mxfp4.py):
  *_blocks uint8 [experts, rows, columns / 32, 16] (per byte: value 2i in the low nibble, 2i + 1 in the high one) and
  *_scales uint8 [experts, rows, columns / 32] (E8M0: 2^(e - 127)), rows in nn.Linear's order (no transpose).
Those become llama.cpp's MXFP4 blocks ([rows, columns / 32, 17]: the scale byte, then value k in the low nibble of
byte k and value k + 16 in its high one), the layout convert_hf_to_gguf.py writes: bytes moved, no value changed.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator
from typing import Any

import numpy as np
import torch

from lmserve.worker.weights.block_packing import StoredBlocks
from lmserve.worker.weights.stored_formats import MXFP4_VALUES

_EXPERTS = ".mlp.experts."
# The packed MXFP4 pairs' names: weight -> (its blocks, its scales).
_PACKED = {"gate_up_proj": ("gate_up_proj_blocks", "gate_up_proj_scales"),
           "down_proj": ("down_proj_blocks", "down_proj_scales")}


def gpt_oss_hf_weights(
    weights: Iterable[tuple[str, torch.Tensor]], blocks: Collection[str] = ()
) -> Iterator[tuple[str, torch.Tensor | StoredBlocks]]:
    """A gpt-oss checkpoint's tensors under the names and layout of one expert's weights each. MXFP4 experts come as
    their blocks (StoredBlocks "mxfp4") where `blocks` names mxfp4 (the layers take them at their stored size), else
    dequantized (exactly: every MXFP4 value is a float32)."""
    halves: dict[str, torch.Tensor] = {}  # a packed pair's first tensor until its other one arrives
    for name, tensor in weights:
        name = name.replace(".mlp.router.", ".mlp.gate.")
        prefix, found, kind = name.partition(_EXPERTS)
        if not found:
            yield name, tensor
            continue
        if kind in ("gate_up_proj", "down_proj"):
            # [experts, columns, rows]: each expert's [rows, columns] weight.
            yield from _split(prefix, kind, "weight", tensor.transpose(1, 2))
        elif kind in ("gate_up_proj_bias", "down_proj_bias"):
            yield from _split(prefix, kind.removesuffix("_bias"), "bias", tensor)
        else:
            weight = next((w for w, pair in _PACKED.items() if kind in pair), None)
            if weight is None:
                raise ValueError(f"unexpected weight {name!r} in a gpt-oss checkpoint")
            key = f"{prefix}.{weight}"
            other = halves.pop(key, None)
            if other is None:
                halves[key] = tensor
                continue
            packed, scales = (tensor, other) if kind.endswith("_blocks") else (other, tensor)
            stacked = mxfp4_blocks_from_hf(packed, scales)
            if "mxfp4" in blocks:
                yield from _split(prefix, weight, "weight", stacked, as_blocks=True)
            else:
                yield from _split(prefix, weight, "weight", torch.from_numpy(dequantize_mxfp4(stacked.numpy())))
    if halves:
        raise ValueError(f"gpt-oss checkpoint has MXFP4 blocks without their scales (or scales without blocks): "
                         f"{sorted(halves)[:3]}")


def gpt_oss_mxfp4_types(config: Any) -> dict[str, str] | None:
    """Each expert's gate, up and down weight's stored type (mxfp4) where the checkpoint's config says its experts are
    MXFP4 (quantization_config's quant_method, as OpenAI's releases), by the names gpt_oss_hf_weights gives them;
    None for any other checkpoint."""
    quantization = getattr(config, "quantization_config", None) or {}
    method = quantization.get("quant_method") if isinstance(quantization, dict) else getattr(
        quantization, "quant_method", None)
    if getattr(config, "model_type", None) != "gpt_oss" or str(method).lower() != "mxfp4":
        return None
    return {f"model.layers.{layer}{_EXPERTS}{expert}.{part}.weight": "mxfp4"
            for layer in range(config.num_hidden_layers) for expert in range(config.num_local_experts)
            for part in ("gate_proj", "up_proj", "down_proj")}


def _split(prefix: str, weight: str, kind: str, stacked: torch.Tensor, as_blocks: bool = False
           ) -> Iterator[tuple[str, torch.Tensor | StoredBlocks]]:
    """Each expert's rows of a stacked [experts, rows, ...] tensor; gate_up's interleaved rows as gate and up."""
    for expert in range(stacked.shape[0]):
        base = f"{prefix}{_EXPERTS}{expert}"
        rows = stacked[expert]
        parts = ([("gate_proj", rows[0::2]), ("up_proj", rows[1::2])] if weight == "gate_up_proj"
                 else [("down_proj", rows)])
        for part, data in parts:
            data = data.contiguous()
            yield f"{base}.{part}.{kind}", StoredBlocks("mxfp4", data) if as_blocks else data


def mxfp4_blocks_from_hf(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """A checkpoint's MXFP4 pair (*_blocks uint8 [..., groups, 16], *_scales uint8 [..., groups]) as llama.cpp's
    blocks, uint8 [..., groups, 17] (convert_hf_to_gguf.py's GptOssModel.repack_mxfp4)."""
    if packed.dtype != torch.uint8 or scales.dtype != torch.uint8 or packed.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(packed.shape)} {packed.dtype} and scales {tuple(scales.shape)} "
                         f"{scales.dtype} do not match")
    data = packed.numpy()
    values = np.stack([data & 0x0F, data >> 4], axis=-1).reshape(*data.shape[:-1], 32)  # value 2i, 2i + 1
    out = np.empty((*data.shape[:-1], 17), dtype=np.uint8)
    out[..., 0] = scales.numpy()
    out[..., 1:] = values[..., :16] | (values[..., 16:] << 4)
    return torch.from_numpy(out)


def dequantize_mxfp4(blocks: np.ndarray) -> np.ndarray:
    """llama.cpp's MXFP4 blocks uint8 [..., groups, 17] as float32 [..., groups x 32]: w = 2^(e - 128) v[q] with v
    the doubled E2M1 values (ggml's dequantize_row_mxfp4), each exact in float32 (2^-128 is a subnormal one)."""
    scale = np.ldexp(np.float32(1.0), blocks[..., 0].astype(np.int32) - 128).astype(np.float32)
    nibbles = blocks[..., 1:]
    codes = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)  # value k, then k + 16
    values = MXFP4_VALUES[codes].astype(np.float32) * scale[..., None]
    return values.reshape(*blocks.shape[:-2], blocks.shape[-2] * 32)
