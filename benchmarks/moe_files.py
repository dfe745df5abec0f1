"""Mixture-of-experts GGUF files of real shapes with random weights, typed by llama.cpp's own tools: no MoE file is in
the registry packages, so the speed and memory of MoE models are measured on these (their text means nothing).

    benchmarks/setup_peers.sh llama                       # once: llama.cpp's converter source, llama-quantize
    .venv/bin/python benchmarks/moe_files.py olmoe-1b-7b --layers 4 /tmp/moe       # -> /tmp/moe/olmoe-1b-7b-4l-q4_k_m.gguf
    .venv/bin/python benchmarks/gguf_peers.py /tmp/moe/olmoe-1b-7b-4l-q4_k_m.gguf --prefill

A random Hugging Face checkpoint of the shape (transformers builds the config; weights normal with a standard deviation
of 0.02, so random routers spread tokens roughly evenly over the experts), the default model's tokenizer (llama.cpp's
converter knows its pre-tokenizer; the vocabulary is padded to the shape's size, so the embedding and output layer
have their real size), then llama.cpp's convert_hf_to_gguf.py (bfloat16) and llama-quantize (Q4_K_M: Q4_K experts,
Q6_K for half the layers' down experts, as a real file of the shape gets them). --layers keeps fewer decoder layers
than the real model (every layer is alike), so that a file fits this machine's memory and minutes.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import torch
import transformers

from lmserve.model_tokenizer import load_tokenizer
from lmserve.models import DEFAULT_MODEL, resolve_model

PEERS_DIR = Path(os.environ.get("PEERS_DIR", Path.home() / ".cache" / "lmserve-peers"))
LLAMA_CPP_SOURCE = PEERS_DIR / "llama-cpp-python-0.3.36" / "vendor" / "llama.cpp"
LLAMA_QUANTIZE = PEERS_DIR / "llama.cpp" / "bin" / "llama-quantize"

# The released models' configs (allenai/OLMoE-1B-7B-0924, Qwen/Qwen3-30B-A3B, mistralai/Mixtral-8x7B-v0.1).
SHAPES = {
    "olmoe-1b-7b": (transformers.OlmoeConfig, {
        "hidden_size": 2048, "intermediate_size": 1024, "num_hidden_layers": 16, "num_attention_heads": 16,
        "num_key_value_heads": 16, "num_experts": 64, "num_experts_per_tok": 8, "vocab_size": 50304,
        "max_position_embeddings": 4096, "rope_theta": 10000.0, "norm_topk_prob": False}),
    "qwen3-30b-a3b": (transformers.Qwen3MoeConfig, {
        "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
        "num_experts_per_tok": 8, "vocab_size": 151936, "max_position_embeddings": 40960, "rope_theta": 1000000.0,
        "norm_topk_prob": True, "tie_word_embeddings": False}),
    "mixtral-8x7b": (transformers.MixtralConfig, {
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000,
        "max_position_embeddings": 32768, "rope_theta": 1000000.0}),
}


def make_checkpoint(shape: str, layers: int, directory: Path) -> None:
    config_class, sizes = SHAPES[shape]
    tokenizer = load_tokenizer(resolve_model(DEFAULT_MODEL))
    config = config_class(**{**sizes, "num_hidden_layers": layers}, initializer_range=0.02,
                          bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("out", type=Path, help="a folder for the checkpoint and the files")
    parser.add_argument("--layers", type=int, help="decoder layers (default: the real model's)")
    parser.add_argument("--type", default="Q4_K_M", help="llama-quantize's type")
    args = parser.parse_args()
    layers = args.layers or SHAPES[args.shape][1]["num_hidden_layers"]
    name = f"{args.shape}-{layers}l"
    hf_dir, bf16 = args.out / f"{name}-hf", args.out / f"{name}-bf16.gguf"
    quantized = args.out / f"{name}-{args.type.lower()}.gguf"
    if not (hf_dir / "config.json").exists():
        make_checkpoint(args.shape, layers, hf_dir)
    if not bf16.exists():
        env = {**os.environ, "PYTHONPATH": str(LLAMA_CPP_SOURCE / "gguf-py")}
        subprocess.run([sys.executable, str(LLAMA_CPP_SOURCE / "convert_hf_to_gguf.py"), str(hf_dir), "--outtype",
                        "bf16", "--outfile", str(bf16)], check=True, env=env)
    subprocess.run([str(LLAMA_QUANTIZE), str(bf16), str(quantized), args.type, str(os.cpu_count())], check=True)
    print(quantized)


if __name__ == "__main__":
    main()
