"""Writes the default model (or any model lmserve loads) as a Hugging Face directory, for peers that need one (vLLM).

    python benchmarks/export_hf.py OUT_DIR [--model NAME_OR_PATH] [--dtype bfloat16]

The weights are the ones lmserve serves (the Q4_1 GGUF dequantized, Q/K un-permuted), so every server in a
comparison computes the same model.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from lmserve.config import DEFAULT_MODEL
from lmserve.model_tokenizer import load_tokenizer
from lmserve.models import load_hf_config, resolve_model
from lmserve.worker.weights.loader import load_weights

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def export(model: str, out: Path, dtype: str) -> None:
    source = resolve_model(model)
    config = load_hf_config(source)
    weights = {name: tensor.contiguous() for name, tensor in load_weights(source, DTYPES[dtype])}
    if getattr(config, "tie_word_embeddings", False):
        weights.pop("lm_head.weight", None)
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.dtype = dtype
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    config.save_pretrained(out)
    # Peers may read the pre-5.0 transformers layout: keep rope_theta and torch_dtype at the top level too.
    saved = json.loads((out / "config.json").read_text())
    rope = saved.get("rope_parameters") or {}
    saved.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
    saved.setdefault("torch_dtype", dtype)
    (out / "config.json").write_text(json.dumps(saved, indent=2) + "\n")
    load_tokenizer(source).save_pretrained(out)
    print(f"wrote {len(weights)} tensors ({dtype}) and the tokenizer to {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    args = parser.parse_args()
    export(args.model, args.out, args.dtype)


if __name__ == "__main__":
    main()
