"""nomic-bert from GGUF (llama.cpp's names) against a small reference written here from the published architecture
(nomic-embed-text: BERT with rotary positions, SwiGLU, fused q/k/v without biases, post-norm), on a tiny random file;
the WordPiece vocabulary llama.cpp stores (its "phantom space" spelling) read back as BERT's. The real file's check
against llama.cpp's own embeddings is a by-hand check in docs/embeddings.md (it is 274 MB)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from lmserve.config import CacheConfig, ModelConfig
from lmserve.model_tokenizer import load_tokenizer
from lmserve.models import resolve_model
from lmserve.pooling_config import load_pooling_config
from lmserve.worker.pooling_runner import PoolingModelRunner

HIDDEN, HEADS, INTER, LAYERS, EPS, BASE = 64, 4, 96, 2, 1e-12, 1000.0
WORDS = ["hello", "world", "the", "cat", "sat", "on", "mat", "search", "query", "document"]
# As llama.cpp's converter writes a WordPiece vocabulary: specials as they are, first pieces with U+2581, "##x" as x.
TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *(f"\u2581{w}" for w in WORDS), "s", "ing", "\u2581:", ":"]


def write_tiny_nomic(path: Path, pooling_type: int = 1, quantized: str | None = None) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    vocab = len(TOKENS)
    weights = {"token_embd.weight": rng.normal(0, 0.5, (vocab, HIDDEN)),
               "token_types.weight": rng.normal(0, 0.1, (2, HIDDEN)),
               "token_embd_norm.weight": 1 + rng.normal(0, 0.1, HIDDEN), "token_embd_norm.bias": rng.normal(0, 0.1, HIDDEN)}
    for i in range(LAYERS):
        weights |= {f"blk.{i}.attn_qkv.weight": rng.normal(0, 0.2, (3 * HIDDEN, HIDDEN)),
                    f"blk.{i}.attn_output.weight": rng.normal(0, 0.2, (HIDDEN, HIDDEN)),
                    f"blk.{i}.attn_output_norm.weight": 1 + rng.normal(0, 0.1, HIDDEN),
                    f"blk.{i}.attn_output_norm.bias": rng.normal(0, 0.1, HIDDEN),
                    f"blk.{i}.ffn_up.weight": rng.normal(0, 0.2, (INTER, HIDDEN)),
                    f"blk.{i}.ffn_gate.weight": rng.normal(0, 0.2, (INTER, HIDDEN)),
                    f"blk.{i}.ffn_down.weight": rng.normal(0, 0.2, (HIDDEN, INTER)),
                    f"blk.{i}.layer_output_norm.weight": 1 + rng.normal(0, 0.1, HIDDEN),
                    f"blk.{i}.layer_output_norm.bias": rng.normal(0, 0.1, HIDDEN)}
    writer = gguf.GGUFWriter(str(path), "nomic-bert")
    for key, value in (("context_length", 128), ("embedding_length", HIDDEN), ("feed_forward_length", INTER),
                       ("block_count", LAYERS), ("attention.head_count", HEADS), ("pooling_type", pooling_type)):
        writer.add_uint32(f"nomic-bert.{key}", value)
    writer.add_float32("nomic-bert.attention.layer_norm_epsilon", EPS)
    writer.add_float32("nomic-bert.rope.freq_base", BASE)
    writer.add_bool("nomic-bert.attention.causal", False)
    writer.add_tokenizer_model("bert")
    writer.add_token_list(TOKENS)
    writer.add_token_types([3 if t.startswith("[") else 1 for t in TOKENS])
    for key, token in (("bos_token_id", "[CLS]"), ("eos_token_id", "[SEP]"), ("unknown_token_id", "[UNK]"),
                       ("seperator_token_id", "[SEP]"), ("padding_token_id", "[PAD]")):
        writer.add_uint32(f"tokenizer.ggml.{key}", TOKENS.index(token))
    stored = {}
    for name, value in weights.items():
        # Matrices in F16 as the real file stores them, vectors in F32.
        stored[name] = value.astype(np.float16 if value.ndim == 2 else np.float32)
        if name == quantized:
            qtype = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(name, gguf.quants.quantize(value.astype(np.float32), qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, stored[name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {name: value.astype(np.float64) for name, value in stored.items()}


def reference(w: dict[str, np.ndarray], ids: list[int]) -> np.ndarray:
    """nomic-embed-text's encoder in float64 NumPy, mean-pooled and normalised."""

    def layer_norm(x: np.ndarray, prefix: str) -> np.ndarray:
        mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
        return (x - mean) / np.sqrt(var + EPS) * w[f"{prefix}.weight"] + w[f"{prefix}.bias"]

    n, d = len(ids), HIDDEN // HEADS
    x = layer_norm(w["token_embd.weight"][ids] + w["token_types.weight"][0], "token_embd_norm")
    angles = np.arange(n)[:, None] * BASE ** (-np.arange(0, d, 2) / d)[None, :]  # [n, d/2]
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]

    def rope(t: np.ndarray) -> np.ndarray:  # [n, heads, d], rotate-half (GPT-NeoX) layout
        a, b = t[..., : d // 2], t[..., d // 2 :]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)

    for i in range(LAYERS):
        q, k, v = np.split(x @ w[f"blk.{i}.attn_qkv.weight"].T, 3, axis=-1)
        q, k, v = (t.reshape(n, HEADS, d) for t in (q, k, v))
        q, k = rope(q), rope(k)
        scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(d)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        attended = np.einsum("hqk,khd->qhd", probs, v).reshape(n, HIDDEN)
        x = layer_norm(attended @ w[f"blk.{i}.attn_output.weight"].T + x, f"blk.{i}.attn_output_norm")
        gate, up = x @ w[f"blk.{i}.ffn_gate.weight"].T, x @ w[f"blk.{i}.ffn_up.weight"].T
        mlp = (gate / (1 + np.exp(-gate)) * up) @ w[f"blk.{i}.ffn_down.weight"].T
        x = layer_norm(mlp + x, f"blk.{i}.layer_output_norm")
    pooled = x.mean(0)
    return pooled / np.linalg.norm(pooled)


@pytest.fixture(scope="module")
def tiny_nomic(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    path = tmp_path_factory.mktemp("nomic") / "tiny-nomic.gguf"
    return path, write_tiny_nomic(path)


def test_the_gguf_vocabulary_tokenizes_as_bert(tiny_nomic: tuple[Path, dict[str, np.ndarray]]) -> None:
    path, _ = tiny_nomic
    tokenizer = load_tokenizer(resolve_model(str(path)))
    ids = tokenizer.encode("Hello cats: search")
    assert tokenizer.convert_ids_to_tokens(ids) == ["[CLS]", "hello", "cat", "##s", ":", "search", "[SEP]"]


def test_embeddings_match_the_reference_alone_and_batched(tiny_nomic: tuple[Path, dict[str, np.ndarray]]) -> None:
    path, weights = tiny_nomic
    source = resolve_model(str(path))
    assert load_pooling_config(source).pooling == "mean"
    runner = PoolingModelRunner(ModelConfig(model=str(path), dtype="float32"), CacheConfig())
    prompts = [[2, 5, 6, 3], [2, 7, 8, 9, 10, 11, 12, 16, 13, 14, 3], [2, 1, 3], list(range(5, 15)) * 6]
    expected = np.stack([reference(weights, p) for p in prompts])
    batched = torch.stack(runner.embed(prompts)).numpy()
    alone = np.stack([runner.embed([p])[0].numpy() for p in prompts])
    cosine = (batched * expected).sum(1) / np.linalg.norm(batched, axis=1)
    assert cosine.min() >= 0.9999, cosine
    np.testing.assert_allclose(batched, expected, atol=1e-5)
    np.testing.assert_allclose(batched, alone, atol=1e-6)


def test_a_pooling_type_lmserve_does_not_run_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "rank.gguf"
    write_tiny_nomic(path, pooling_type=4)  # llama.cpp's rank: a reranker's classification head
    with pytest.raises(ValueError, match="pooling_type 4"):
        load_pooling_config(resolve_model(str(path)))


def test_a_block_format_weight_is_refused_not_copied_into_floats(tmp_path: Path) -> None:
    path = tmp_path / "q8.gguf"
    write_tiny_nomic(path, quantized="blk.1.ffn_down.weight")
    with pytest.raises(ValueError, match=r"blk\.1\.ffn_down\.weight is stored as Q8_0"):
        PoolingModelRunner(ModelConfig(model=str(path), dtype="float32"), CacheConfig())
