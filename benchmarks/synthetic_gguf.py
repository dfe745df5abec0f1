"""A float16 GGUF at a bigger model's shapes, with random weights and a real file's tokenizer: for speed and memory
measurements only, where no real file of that size is at hand (the registry packages hold 0.5B and 270M models).

    .venv/bin/python benchmarks/synthetic_gguf.py --like ~/.cache/lmserve/real-models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf \\
        --shape qwen2.5-1.5b /tmp/qwen-1.5b-shapes-f16.gguf
    ~/.cache/lmserve-peers/llama.cpp/bin/llama-quantize /tmp/qwen-1.5b-shapes-f16.gguf OUT-q4_k_m.gguf Q4_K_M 2

The result is then quantized by llama.cpp's own llama-quantize, so its tensor types are the ones a real file of
those shapes gets (Q4_K_M: Q4_K and Q6_K, the tied embedding as Q6_K). Every metadata key of --like is kept (the
tokenizer, its chat template, the RoPE base) except the sizes, which come from --shape. The weights are normal with
a standard deviation of 0.02 (norms: 1, biases: 0), so activations stay finite; the text it writes means nothing,
and only timings and memory are worth taking from it (`benchmarks/gguf_peers.py` ignores EOS).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np

# Hugging Face configs of the models whose shapes can be made (Qwen/Qwen2.5-1.5B-Instruct, -3B-Instruct, -7B-Instruct).
SHAPES = {
    "qwen2.5-1.5b": {"hidden": 1536, "layers": 28, "ffn": 8960, "heads": 12, "kv_heads": 2, "tied": True},
    "qwen2.5-3b": {"hidden": 2048, "layers": 36, "ffn": 11008, "heads": 16, "kv_heads": 2, "tied": True},
    "qwen2.5-7b": {"hidden": 3584, "layers": 28, "ffn": 18944, "heads": 28, "kv_heads": 4, "tied": False},
}
SIZE_KEYS = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count",
             "attention.head_count_kv")


def copied_fields(reader: gguf.GGUFReader, arch: str) -> list[tuple[str, object, gguf.GGUFValueType, object]]:
    """(key, value, type, sub-type) of every metadata field but the file's own bookkeeping and its sizes."""
    skipped = {f"{arch}.{key}" for key in SIZE_KEYS} | {"general.architecture", "general.file_type", "general.name",
                                                          "general.size_label"}
    fields = []
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in skipped:
            continue
        vtype = field.types[0]
        sub_type = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        fields.append((key, field.contents(), vtype, sub_type))
    return fields


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--like", type=Path, required=True, help="a qwen2 GGUF whose tokenizer and settings to keep")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-1.5b")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    shape = SHAPES[args.shape]
    reader = gguf.GGUFReader(args.like)
    arch = reader.fields["general.architecture"].contents()
    if arch != "qwen2":
        raise SystemExit(f"--like must be a qwen2 file (its tensors' names and biases), not {arch}")
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)

    writer = gguf.GGUFWriter(args.out, arch)
    for key, value, vtype, sub_type in copied_fields(reader, arch):
        writer.add_key_value(key, value, vtype, sub_type)
    hidden, ffn, heads, kv_heads = shape["hidden"], shape["ffn"], shape["heads"], shape["kv_heads"]
    writer.add_name(f"synthetic {args.shape} shapes (random weights)")
    writer.add_block_count(shape["layers"])
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)

    rng = np.random.default_rng(args.seed)
    kv_dim = hidden // heads * kv_heads

    def matrix(rows: int, columns: int) -> Callable[[], np.ndarray]:
        return lambda: (rng.standard_normal((rows, columns), dtype=np.float32) * 0.02).astype(np.float16)

    def vector(rows: int, value: float) -> Callable[[], np.ndarray]:
        return lambda: np.full(rows, value, dtype=np.float32)

    tensors = [("token_embd.weight", (vocab, hidden), matrix(vocab, hidden))]
    if not shape["tied"]:
        tensors.append(("output.weight", (vocab, hidden), matrix(vocab, hidden)))
    tensors.append(("output_norm.weight", (hidden,), vector(hidden, 1.0)))
    for layer in range(shape["layers"]):
        prefix = f"blk.{layer}."
        for name, rows, columns in (("attn_q", hidden, hidden), ("attn_k", kv_dim, hidden), ("attn_v", kv_dim, hidden)):
            tensors.append((prefix + name + ".weight", (rows, columns), matrix(rows, columns)))
            tensors.append((prefix + name + ".bias", (rows,), vector(rows, 0.0)))
        tensors.append((prefix + "attn_output.weight", (hidden, hidden), matrix(hidden, hidden)))
        tensors.append((prefix + "ffn_gate.weight", (ffn, hidden), matrix(ffn, hidden)))
        tensors.append((prefix + "ffn_up.weight", (ffn, hidden), matrix(ffn, hidden)))
        tensors.append((prefix + "ffn_down.weight", (hidden, ffn), matrix(hidden, ffn)))
        tensors.append((prefix + "attn_norm.weight", (hidden,), vector(hidden, 1.0)))
        tensors.append((prefix + "ffn_norm.weight", (hidden,), vector(hidden, 1.0)))
    # Declared first and written one at a time: a 7B model's float16 weights (15 GB) are never in memory at once.
    for name, dims, _ in tensors:
        dtype = np.float16 if len(dims) == 2 else np.float32
        writer.add_tensor_info(name, dims, dtype, int(np.prod(dims)) * np.dtype(dtype).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, _, make in tensors:
        writer.write_tensor_data(make())
    writer.close()
    print(f"wrote {args.out} ({args.out.stat().st_size / 2**30:.2f} GiB)")


if __name__ == "__main__":
    main()
