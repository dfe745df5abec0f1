"""Reading a model's weights: whatever the source, they come out under Hugging Face parameter names in Hugging Face
layout, so the model code only knows one format. Finding the model and its config is lmserve.models' (torch-free).
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch

from lmserve.config import GEMMA_MODEL_TYPES
from lmserve.formats.gguf_file import (
    GGUFTensorInfo,
    ggml_type_name,
    read_gguf_blocks,
    read_gguf_header,
    read_gguf_tensor,
)
from lmserve.models import GGUFConfig, ModelSource, load_model_config
from lmserve.worker.weights.block_packing import StoredBlocks
from lmserve.worker.weights.gpt_oss import gpt_oss_hf_weights, gpt_oss_mxfp4_types

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------------- weights


def load_weights(
    source: ModelSource, dtype: torch.dtype | None, blocks: Collection[str] = (),
    wanted: Callable[[str], bool] | None = None,
    part: Callable[[str, tuple[int, ...]], TensorPart | FusedRowsPart | None] | None = None,
) -> Iterator[tuple[str, torch.Tensor | StoredBlocks]]:
    """Every weight as (Hugging Face name, tensor in `dtype`; None: in the dtype the checkpoint stores it, for
    targets that convert as they copy). `blocks`: block formats (weights/block_linear.py's names, q4_1, q8_0) whose
    GGUF matrices come as the file stores them (StoredBlocks), not dequantized: the block layers take those bytes as
    they are (LlamaForCausalLM.load_weights). `wanted` (a Hugging Face name -> bool, a pipeline stage's
    LlamaForCausalLM.wants): the others are skipped before they are read or converted. `part` (a Hugging Face name and
    the tensor's shape -> the rows or columns this rank keeps, LlamaForCausalLM.checkpoint_part): a safetensors
    tensor is read and converted only there (a tensor-parallel rank reads its share, not every rank everything);
    a GGUF's are memory-mapped, so a rank's cut of them reads only its pages anyway."""
    config = load_model_config(source)  # rejects unsupported architectures before any weight is read
    start, count, nbytes = time.perf_counter(), 0, 0
    weights = (_hf_weights(source.path, wanted, part) if source.kind == "hf"
               else _gguf_weights(source.path, config, blocks, wanted))
    # Gemma's RMSNorm scales by (1 + weight): the model's norm scales by its weight, so the 1 is added here, in
    # float32 as transformers adds it. llama.cpp's converter stored it added already.
    norms_plus_one = source.kind == "hf" and config.model_type in GEMMA_MODEL_TYPES
    weights = (part for name, tensor in weights for part in split_fused(name, tensor, config))
    if source.kind == "hf" and config.model_type == "gpt_oss":  # stacked (or MXFP4) experts as each one's own
        weights = gpt_oss_hf_weights(weights, blocks)
    for name, tensor in weights:
        if norms_plus_one and name.endswith("norm.weight"):
            tensor = tensor.float() + 1.0
        if isinstance(tensor, StoredBlocks):
            size = tensor.data.nbytes
        else:
            tensor = tensor if dtype is None else tensor.to(dtype)
            size = tensor.nbytes
        count, nbytes = count + 1, nbytes + size
        yield name, tensor
    elapsed = time.perf_counter() - start
    logger.info(
        "loaded %d tensors (%.1f MB, %s) from %s in %.2f s", count, nbytes / 1e6, dtype or "as stored", source.path,
        elapsed,
    )


def hf_tensor_dtype(source: ModelSource, name: str) -> torch.dtype | None:
    """The dtype a Hugging Face directory's safetensors store `name` in (None: not such a source, or no such
    tensor). Read from the files' headers, which is what the weights really are, whatever the config says."""
    if source.kind != "hf":
        return None
    from safetensors import safe_open  # HF directories only

    for file in _safetensors_files(source.path):
        with safe_open(file, framework="pt") as f:
            if name in f.keys():  # noqa: SIM118 - safe_open handles support no `in`
                return _SAFETENSORS_DTYPES.get(f.get_slice(name).get_dtype())
    return None


_SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def _safetensors_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        # Some repos also ship consolidated.safetensors in another naming scheme; the index says which to use.
        files = sorted({directory / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {directory}")
    return files


@dataclass(frozen=True)
class TensorPart:
    """The slice [start, stop) of a tensor's dimension `dim` (0: rows, 1: columns) that this rank keeps."""

    dim: int
    start: int
    stop: int


@dataclass(frozen=True)
class FusedRowsPart:
    """A fused checkpoint tensor (Phi-3's qkv_proj, gate_up_proj) read as the separate weights it holds, each as this
    rank's rows of it: (the separate weight's name, first row, end row) in the fused tensor's rows."""

    pieces: tuple[tuple[str, int, int], ...]


def _hf_weights(
    directory: Path, wanted: Callable[[str], bool] | None,
    part: Callable[[str, tuple[int, ...]], TensorPart | FusedRowsPart | None] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open  # HF directories only

    for file in _safetensors_files(directory):
        with safe_open(file, framework="pt") as f:
            names = f.keys()  # safe_open handles are not iterable
            for name in names:
                # Old checkpoints saved this buffer; it is derived from the config.
                if name.endswith("rotary_emb.inv_freq") or (wanted is not None and not wanted(name)):
                    continue
                cut = part(name, tuple(f.get_slice(name).get_shape())) if part is not None else None
                if cut is None:
                    yield name, f.get_tensor(name)
                elif isinstance(cut, FusedRowsPart):
                    whole = f.get_slice(name)
                    for piece, start, stop in cut.pieces:
                        yield piece, whole[start:stop]
                elif cut.dim == 0:
                    yield name, f.get_slice(name)[cut.start : cut.stop]
                else:
                    yield name, f.get_slice(name)[:, cut.start : cut.stop]


GGMLType = gguf.GGMLQuantizationType
# The types a GGUF may hold. Under `--quantization auto` a matrix whose type a kernel format holds (Q4_0, Q4_1, Q5_0,
# Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL and MXFP4 exactly, IQ4_XS with its scales rounded:
# weights/stored_formats.py) stays in its stored blocks or goes into that format's; the others (floats, and any type
# where this CPU's kernels do not build) are dequantized tensor by tensor into float16 layers
# (worker/weights/float16.py), and the runner's log names them. A type not listed is refused by name.
SUPPORTED_GGML_TYPES = (
    GGMLType.F32,
    GGMLType.F16,
    GGMLType.BF16,
    GGMLType.Q8_0,
    GGMLType.Q4_0,
    GGMLType.Q4_1,
    GGMLType.Q5_0,
    GGMLType.Q5_1,
    GGMLType.Q2_K,
    GGMLType.Q3_K,
    GGMLType.Q4_K,
    GGMLType.Q5_K,
    GGMLType.Q6_K,
    GGMLType.IQ4_NL,
    GGMLType.IQ4_XS,
    GGMLType.MXFP4,
)

_GGUF_TOP_LEVEL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_GGUF_PER_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # Mixtures of experts: the router, the shared expert and its gate (Qwen2-MoE). The routed experts are stacked in
    # one tensor each (_GGUF_EXPERTS).
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# Every expert's gate, up or down weight in one [experts, rows, columns] tensor: read as each expert's own weight.
_GGUF_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_GGUF_NAME = re.compile(r"(?:blk\.(\d+)\.)?(\w+)\.(weight|bias)")


# Gemma 2/3 name their four norms a layer as llama.cpp does; ffn_norm is the MLP's input norm in both.
_GGUF_GEMMA_PER_LAYER = {
    **_GGUF_PER_LAYER,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


# gpt-oss: a norm after attention that is the MLP's input norm (llama.cpp's post_attention_norm), the sinks, and the
# router (ffn_gate_inp) and the stacked experts with biases.
_GGUF_GPT_OSS_PER_LAYER = {**_GGUF_PER_LAYER, "post_attention_norm": "post_attention_layernorm"}
# A per-layer vector that the model holds as a parameter of its own (no ".weight").
_GGUF_PARAMETERS = {"attn_sinks": "self_attn.sinks"}


# Phi-3 stores q, k and v as one matrix, and gate and up as one (llama.cpp names it ffn_up), as its HF checkpoints do.
_GGUF_PHI3_PER_LAYER = {**_GGUF_PER_LAYER, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
# Tensors a GGUF holds for the config, not the model: lmserve.models reads them into the RoPE parameters; and a
# reranker's classifier rows (llama.cpp's cls.output: Qwen3-Reranker's "yes" and "no"), which the pooling runner reads.
_GGUF_ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight",
                      "cls.output.weight")


def hf_name_from_gguf(name: str, arch: str = "llama") -> str:
    """A GGUF tensor's Hugging Face name; for stacked experts, with `*` where the expert's index goes."""
    match = _GGUF_NAME.fullmatch(name)
    if match and match[1] is not None and match[2] in _GGUF_EXPERTS:
        return f"model.layers.{match[1]}.mlp.experts.*.{_GGUF_EXPERTS[match[2]]}.{match[3]}"
    if match and match[1] is not None and match[2] in _GGUF_PARAMETERS and match[3] == "weight":
        return f"model.layers.{match[1]}.{_GGUF_PARAMETERS[match[2]]}"
    per_layer = {"phi3": _GGUF_PHI3_PER_LAYER, "gpt_oss": _GGUF_GPT_OSS_PER_LAYER, "gpt-oss": _GGUF_GPT_OSS_PER_LAYER
                 }.get(arch, _GGUF_GEMMA_PER_LAYER if arch in GEMMA_MODEL_TYPES else _GGUF_PER_LAYER)
    table = per_layer if match and match[1] is not None else _GGUF_TOP_LEVEL
    if not match or match[2] not in table:
        raise ValueError(f"unexpected GGUF tensor '{name}' for a {arch} model")
    layer, module, kind = match.groups()
    prefix = f"model.layers.{layer}." if layer is not None else ""
    return f"{prefix}{table[module]}.{kind}"


def _gguf_weights(
    path: Path, config: GGUFConfig, blocks: Collection[str], wanted: Callable[[str], bool] | None = None,
) -> Iterator[tuple[str, torch.Tensor | StoredBlocks]]:
    tensors = read_gguf_header(path).tensors
    unsupported = {t.ggml_type for t in tensors} - set(SUPPORTED_GGML_TYPES)
    if unsupported:
        found = ", ".join(sorted(map(ggml_type_name, unsupported)))
        supported = ", ".join(t.name for t in SUPPORTED_GGML_TYPES)
        raise ValueError(f"{path} holds tensors of GGUF type {found}; lmserve dequantizes {supported}")
    # llama.cpp interleaves the two rotary halves of each Q/K head for its llama arch only (not qwen2).
    permuted = config.model_type in ("llama", "mistral", "mixtral")
    for info in tensors:
        if info.name in _GGUF_ROPE_TENSORS:
            continue  # read into the config by lmserve.models; the rotary embedding applies them
        name = hf_name_from_gguf(info.name, config.model_type)
        if "*" in name:
            yield from _gguf_experts(path, info, name, blocks, wanted)
            continue
        if wanted is not None and not wanted(name):
            continue
        method = ggml_type_name(info.ggml_type).lower()
        as_blocks = method in blocks and len(info.shape) == 2
        array = read_gguf_blocks(path, info) if as_blocks else read_gguf_tensor(path, info)
        file_mapped = as_blocks
        # A permutation of rows: the same for a file's blocks (each row's blocks move with it) as for floats.
        if permuted and ".self_attn.q_proj." in name:
            array, file_mapped = _unpermute_rotary(array, config.num_attention_heads), False
        elif permuted and ".self_attn.k_proj." in name:
            array, file_mapped = _unpermute_rotary(array, config.num_key_value_heads), False
        tensor = torch.from_numpy(array if array.flags.writeable else array.copy())
        yield name, StoredBlocks(method, tensor, file_mapped) if as_blocks else tensor


def _gguf_experts(
    path: Path, info: GGUFTensorInfo, pattern: str, blocks: Collection[str], wanted: Callable[[str], bool] | None,
) -> Iterator[tuple[str, torch.Tensor | StoredBlocks]]:
    """A stacked [experts, rows, columns] tensor as each expert's weight (`pattern` with its index for the `*`): a
    file's blocks as views of the mapping, one expert's rows each, so that no expert is copied before its layer
    packs it."""
    num_experts = info.shape[0]
    method = ggml_type_name(info.ggml_type).lower()
    as_blocks = method in blocks and len(info.shape) == 3
    array = read_gguf_blocks(path, info) if as_blocks else read_gguf_tensor(path, info)
    array = array.reshape(num_experts, -1, *array.shape[1:] if as_blocks else array.shape[2:])
    for expert in range(num_experts):
        name = pattern.replace("*", str(expert))
        if wanted is not None and not wanted(name):
            continue
        tensor = torch.from_numpy(array[expert] if array.flags.writeable else array[expert].copy())
        yield name, StoredBlocks(method, tensor, True) if as_blocks else tensor


def stored_matrix_types(source: ModelSource) -> dict[str, str] | None:
    """For a GGUF file, each matrix's stored type by Hugging Face name (lower case: q5_0, q4_k, f32...), which decides
    the kernel format each layer takes (worker/weights/stored_formats.py); for a gpt-oss checkpoint with MXFP4
    experts, those experts' (mxfp4; the other matrices are float); None for any other source."""
    if source.kind == "hf":
        return gpt_oss_mxfp4_types(load_model_config(source))
    if source.kind != "gguf":
        return None
    header = read_gguf_header(source.path)
    arch = header.metadata.get("general.architecture", "llama")
    types = {}
    for info in header.tensors:
        if len(info.shape) not in (2, 3) or info.name in _GGUF_ROPE_TENSORS:
            continue
        name = hf_name_from_gguf(info.name, arch)
        stored = ggml_type_name(info.ggml_type).lower()
        if "*" in name:  # stacked experts: each expert's weight is stored in the stack's type
            types.update({name.replace("*", str(e)): stored for e in range(info.shape[0])})
        elif len(info.shape) == 2:
            types[name] = stored
    return {part: stored for name, stored in types.items() for part in fused_parts(name)}


# Checkpoints that store q/k/v or gate/up as one matrix (Phi-3): the parts, in their order of rows.
_FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def fused_parts(name: str) -> list[str]:
    """The separate weights a checkpoint's fused weight holds (itself if it is not fused)."""
    module, _, kind = name.rpartition(".")
    prefix, _, last = module.rpartition(".")
    return [f"{prefix}.{part}.{kind}" for part in _FUSED_PARTS[last]] if last in _FUSED_PARTS else [name]


def fused_sizes(num_parts: int, rows: int, config: GGUFConfig) -> list[int]:
    """The rows of each weight a fused one of `rows` rows holds: q, k, v by the config's heads, gate and up halves."""
    if num_parts == 3:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_rows = (getattr(config, "num_key_value_heads", None) or config.num_attention_heads) * head_dim
        return [config.num_attention_heads * head_dim, kv_rows, kv_rows]
    return [rows // 2] * 2


def split_fused(
    name: str, tensor: torch.Tensor | StoredBlocks, config: GGUFConfig
) -> Iterator[tuple[str, torch.Tensor | StoredBlocks]]:
    """A fused q/k/v or gate/up weight as its separate weights, each as a checkpoint of separate ones stores it: the
    model fuses them again its own way, splitting each across tensor-parallel ranks first (each rank takes its
    heads of q, of k and of v, which a split of the fused rows would not give it). Rows only, so a file's blocks
    split as floats do."""
    parts = fused_parts(name)
    if len(parts) == 1:
        yield name, tensor
        return
    data = tensor.data if isinstance(tensor, StoredBlocks) else tensor
    sizes = fused_sizes(len(parts), data.shape[0], config)
    if sum(sizes) != data.shape[0]:
        raise ValueError(f"{name!r} has {data.shape[0]} rows; the config's {' + '.join(map(str, sizes))} expected")
    for part, rows in zip(parts, data.split(sizes), strict=True):
        yield part, tensor.with_data(rows) if isinstance(tensor, StoredBlocks) else rows


def _unpermute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's `permute`: per head, rows [i, half] back to [half, i] (HF's rotate_half layout). Only rows
    move, so `w` may be [rows, columns] floats or [rows, blocks, bytes] of a file's blocks. In NumPy, like every byte
    moved while loading (block_packing.pack_blocks says why)."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
