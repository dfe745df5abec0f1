"""Tiny random gpt-oss models (transformers' GptOssForCausalLM) saved as real Hugging Face directories: float32
experts as transformers stores them (stacked, gate and up interleaved), or MXFP4 experts as OpenAI's checkpoints store
them (`*_blocks` and `*_scales`), with a float32 twin directory that holds exactly the values those blocks encode (the
reference transformers runs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file

# Small, with GQA, alternating sliding-window (8 positions: the parity sequences pass it) and full layers, more experts
# than are chosen, and inner sizes of whole 32-wide blocks (MXFP4's).
GPT_OSS_SIZES = {
    "hidden_size": 64,
    "intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "sliding_window": 8,
    "max_position_embeddings": 512,
    # A limit the clamped SwiGLU reaches on these weights (gpt-oss's is 7.0): the clamp is exercised, not idle.
    "swiglu_limit": 3.0,
}


def save_tiny_gpt_oss(directory: Path, tokenizer, **changes) -> Path:
    """transformers' default gpt-oss RoPE (YaRN, factor 32 over 4,096 positions), random sinks, biases and norms."""
    config = transformers.GptOssConfig(**{**GPT_OSS_SIZES, **changes}, vocab_size=len(tokenizer),
                                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                       pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(torch.randn_like(param) * 0.1)
            elif name.endswith(("_bias", ".bias")):
                param.normal_(0.0, 0.1)
            elif name.endswith(".sinks"):  # logits of the scores' size: they take a real share of each softmax
                param.normal_(0.0, 1.0)
            elif name.endswith("router.weight"):  # choices far from ties, so that routing is decisive
                param.normal_(0.0, 0.5)
            elif name.endswith("experts.gate_up_proj"):  # activations that reach the SwiGLU's clamp
                param.normal_(0.0, 0.3)
            elif name.endswith(("q_proj.weight", "k_proj.weight")):  # peaked attention, where positions matter
                param.normal_(0.0, 0.25)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


# E2M1's 16 values (transformers' FP4_VALUES).
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      dtype=np.float32)


def random_mxfp4(shape: tuple[int, ...], rng: np.random.Generator, exponents: tuple[int, int] = (120, 126)
                 ) -> tuple[np.ndarray, np.ndarray]:
    """A checkpoint's MXFP4 pair for float weights of `shape` [..., rows, columns]: blocks uint8 [..., rows,
    columns / 32, 16] (value 2i in byte i's low nibble, 2i + 1 in its high one) and E8M0 scales [..., rows,
    columns / 32] (2^(e - 127))."""
    *lead, columns = shape
    blocks = rng.integers(0, 256, size=(*lead, columns // 32, 16), dtype=np.uint8)
    scales = rng.integers(exponents[0], exponents[1] + 1, size=(*lead, columns // 32), dtype=np.uint8)
    return blocks, scales


def hf_mxfp4_values(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """transformers' reading of an MXFP4 pair (convert_moe_packed_tensors, before its transpose): float32 [...,
    rows, columns]."""
    values = np.stack([FP4_VALUES[blocks & 0x0F], FP4_VALUES[blocks >> 4]], axis=-1).reshape(*blocks.shape[:-1], 32)
    values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
    return values.reshape(*blocks.shape[:-2], blocks.shape[-2] * 32).astype(np.float32)


def save_mxfp4_twin(float_dir: Path, mxfp4_dir: Path, rng: np.random.Generator,
                    exponents: tuple[int, int] = (117, 123)) -> Path:
    """Replaces the float directory's expert weights with the values of random MXFP4 blocks, and writes the same
    model with its experts as those blocks (OpenAI's layout: `*_blocks`, `*_scales`, quantization_config mxfp4) to
    mxfp4_dir. float_dir then holds exactly what mxfp4_dir encodes. Scales 2^(e - 127) for e in `exponents`: weights
    up to 6 x 2^-4 (the float model's tests exercise the SwiGLU's clamp; these the blocks)."""
    path = float_dir / "model.safetensors"
    with safe_open(path, "pt") as f:
        state = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (not a dict)
    packed_state = {}
    for name in sorted(state):
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            packed_state[name] = state[name]
            continue
        # transformers' float layout is [experts, columns, rows]; the blocks are by rows (nn.Linear's weight).
        experts, columns, rows = state[name].shape
        blocks, scales = random_mxfp4((experts, rows, columns), rng, exponents)
        state[name] = torch.from_numpy(hf_mxfp4_values(blocks, scales)).transpose(1, 2).contiguous()
        packed_state[f"{name}_blocks"] = torch.from_numpy(blocks)
        packed_state[f"{name}_scales"] = torch.from_numpy(scales)
    save_file(state, path, metadata={"format": "pt"})
    mxfp4_dir.mkdir(parents=True, exist_ok=True)
    save_file(packed_state, mxfp4_dir / "model.safetensors", metadata={"format": "pt"})
    for file in float_dir.iterdir():
        if file.name == "config.json":
            config = json.loads(file.read_text())
            config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
                "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
            (mxfp4_dir / file.name).write_text(json.dumps(config, indent=2))
        elif file.name != "model.safetensors" and file.is_file():
            (mxfp4_dir / file.name).write_bytes(file.read_bytes())
    return mxfp4_dir


# llama.cpp's source as benchmarks/setup_peers.sh leaves it (its convert_hf_to_gguf.py and gguf-py).
LLAMA_CPP_SOURCE = (Path(os.environ.get("PEERS_DIR", Path.home() / ".cache" / "lmserve-peers"))
                    / "llama-cpp-python-0.3.36" / "vendor" / "llama.cpp")


def convert_with_llama_cpp(hf_dir: Path, path: Path) -> Path:
    """The directory as llama.cpp's own convert_hf_to_gguf.py writes it (gpt-oss: MXFP4 experts repacked as the
    checkpoint stores them, the rest kept float32 so that the file holds the directory's model exactly)."""
    env = {**os.environ, "PYTHONPATH": str(LLAMA_CPP_SOURCE / "gguf-py")}
    subprocess.run([sys.executable, str(LLAMA_CPP_SOURCE / "convert_hf_to_gguf.py"), str(hf_dir), "--outtype", "f32",
                    "--outfile", str(path)], check=True, env=env, capture_output=True)
    return path
