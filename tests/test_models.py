"""Hub ids (Org/Name) resolve from the local Hugging Face cache only, laid out here as huggingface_hub lays it out."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import huggingface_hub
import pytest

from lmserve.model_tokenizer import load_tokenizer
from lmserve.models import ModelSource, load_hf_config, resolve_model

REVISION = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty HF cache that huggingface_hub uses (it reads HF_HUB_CACHE once, at import), with the hub offline."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    return cache


def cache_snapshot(cache: Path, repo_id: str, files: dict[str, Path]) -> Path:
    """models--org--name/snapshots/<revision>/ holding `files` (name -> source), and refs/main naming it."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / REVISION
    snapshot.mkdir(parents=True)
    for name, source in files.items():
        shutil.copyfile(source, snapshot / name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    return snapshot


def test_cached_hf_repo_resolves_to_its_snapshot(hf_cache: Path, tiny_qwen2_dir: Path) -> None:
    snapshot = cache_snapshot(hf_cache, "TinyOrg/tiny-qwen2", {p.name: p for p in tiny_qwen2_dir.iterdir()})
    source = resolve_model("TinyOrg/tiny-qwen2")
    assert source == ModelSource("hf", snapshot, "TinyOrg/tiny-qwen2")  # the repo id is the served name
    assert load_hf_config(source).model_type == "qwen2"
    assert len(load_tokenizer(source)) == 49152


def test_cached_gguf_repo_resolves_to_its_gguf(hf_cache: Path, tiny_llama_gguf: Path) -> None:
    snapshot = cache_snapshot(
        hf_cache,
        "TinyOrg/tiny-llama-GGUF",
        {"tiny-llama-Q4_K_M.gguf": tiny_llama_gguf, "mmproj-tiny-llama-f16.gguf": tiny_llama_gguf},
    )
    # One GGUF besides the vision projector: that one.
    assert resolve_model("TinyOrg/tiny-llama-GGUF") == ModelSource(
        "gguf", snapshot / "tiny-llama-Q4_K_M.gguf", "TinyOrg/tiny-llama-GGUF"
    )
    shutil.copyfile(tiny_llama_gguf, snapshot / "tiny-llama-IQ4_K_M.gguf")
    with pytest.raises(ValueError, match=r"2 GGUF files .*IQ4_K_M.*Q4_K_M.*TinyOrg/tiny-llama-GGUF:TAG"):
        resolve_model("TinyOrg/tiny-llama-GGUF")
    # A tag picks by a whole word of the name, as llama.cpp's and Ollama's repo:quant.
    source = resolve_model("TinyOrg/tiny-llama-GGUF:q4_k_m")
    assert source == ModelSource("gguf", snapshot / "tiny-llama-Q4_K_M.gguf", "TinyOrg/tiny-llama-GGUF:q4_k_m")
    assert load_hf_config(source).model_type == "llama"
    with pytest.raises(ValueError, match="0 GGUF files .* have 'Q8_0'"):
        resolve_model("TinyOrg/tiny-llama-GGUF:Q8_0")


def test_unknown_hub_id_says_where_it_looked_and_how_to_fetch(hf_cache: Path) -> None:
    start = time.perf_counter()
    with pytest.raises(FileNotFoundError) as err:
        resolve_model("NoSuchOrg/no-such-model")
    assert time.perf_counter() - start < 2  # never waits on a network
    message = str(err.value)
    assert "neither a local path" in message
    assert str(hf_cache) in message
    assert "hf download NoSuchOrg/no-such-model" in message


def test_local_path_wins_over_hub_id(
    hf_cache: Path, tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache_snapshot(hf_cache, "models/tiny", {"config.json": tiny_llama_dir / "config.json"})
    shutil.copytree(tiny_llama_dir, tmp_path / "models" / "tiny")
    monkeypatch.chdir(tmp_path)
    assert resolve_model("models/tiny").path == Path("models/tiny")


def test_the_fast_block_dequantization_is_gguf_s_own_bit_for_bit(default_source) -> None:
    """The default file's q4_1 and q8_0 tensors read by lmserve's vectorized dequantization equal gguf's."""
    import gguf
    import numpy as np

    from lmserve.formats.gguf_file import _FAST_DEQUANTIZE, read_gguf_header, read_gguf_tensor

    seen = set()
    for info in read_gguf_header(default_source.path).tensors:
        qtype = gguf.GGMLQuantizationType(info.ggml_type)
        if qtype not in _FAST_DEQUANTIZE or (qtype in seen and not info.name.startswith("blk.0.")):
            continue
        seen.add(qtype)
        block_size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        rows = int(np.prod(info.shape[:-1]))
        raw = np.memmap(default_source.path, mode="r", dtype=np.uint8, offset=info.offset,
                        shape=(rows, info.shape[-1] // block_size * block_bytes))
        expected = gguf.quants.dequantize(raw, qtype).reshape(info.shape)
        got = read_gguf_tensor(default_source.path, info)
        assert got.dtype == expected.dtype and np.array_equal(got, expected), info.name
    assert seen == set(_FAST_DEQUANTIZE)
