"""The packed weights cache (worker/weights/packed_cache.py): a GGUF's second start maps the block layers' packed
bytes from disk instead of packing them, and computes the same bits; a changed model file, a damaged entry, the off
switch, an unwritable directory and the size limit each leave the weights packed in memory, never wrong.

Real ModelRunners on the tests' K-quant files: a dense one, one whose fused q/k/v layer runs as row segments of two
formats, and a mixture of experts with Q4_K/Q6_K experts."""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_model_parity import scheduled

from lmserve.config import CacheConfig, ModelConfig, cache_directory
from lmserve.formats.gguf_file import read_gguf_blocks, read_gguf_header
from lmserve.worker.kernels import cpu_kernels
from lmserve.worker.model_runner import ModelRunner
from lmserve.worker.weights.block_linear import BlockQuantizedLinear
from lmserve.worker.weights.packed_cache import DIRECTORY_VARIABLE, ENTRY_SUFFIX, packed_cache_settings

MODELS = ["tiny_kquant_gguf", "mixed_gguf", "moe_kquant"]


@pytest.fixture
def model_copy(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    """A copy of the fixture's file that a test may touch, grow or replace."""
    value = request.getfixturevalue(request.param)
    source = value[1] if isinstance(value, tuple) else value
    (tmp_path / "model").mkdir()
    return Path(shutil.copy2(source, tmp_path / "model" / source.name))


def start(path: Path, cache: Path | str, **settings) -> ModelRunner:
    """A runner on `path` with the cache at `cache` (tiny models cached too), its entry written before it returns."""
    config = ModelConfig(model=str(path), packed_weights_cache=str(cache), packed_weights_cache_min_bytes=0,
                         **settings)
    runner = ModelRunner(config, CacheConfig(num_blocks=8))
    if runner.packed_weights_saving is not None:
        runner.packed_weights_saving.join()
    return runner


def entries(cache: Path) -> list[Path]:
    return sorted(cache.glob(f"*{ENTRY_SUFFIX}")) if cache.is_dir() else []


def block_layers(runner: ModelRunner) -> dict[str, BlockQuantizedLinear]:
    return {name: m for name, m in runner.model.named_modules() if isinstance(m, BlockQuantizedLinear)}


def prompt_logits(runner: ModelRunner) -> torch.Tensor:
    """Every position's logits of one 12-token prompt."""
    tokens = [(7 * i + 3) % runner.vocab_size for i in range(12)]
    inputs = runner.prepare_inputs([scheduled("a", tokens, 0, len(tokens), [1])])
    return runner.forward(replace(inputs, logits_indices=torch.arange(len(tokens))))


def mapped_from(tensor: torch.Tensor) -> str | None:
    """The file whose mapping holds the tensor's first byte (/proc/self/maps), or None."""
    address = tensor.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        low, high = (int(bound, 16) for bound in fields[0].split("-"))
        if low <= address < high:
            return fields[5] if len(fields) == 6 else None
    return None


@pytest.mark.parametrize("model_copy", MODELS, indirect=True)
def test_a_second_start_maps_the_packed_weights_and_computes_the_same_bits(model_copy: Path, tmp_path: Path) -> None:
    cache = tmp_path / "packed"
    first = start(model_copy, cache)
    assert not first.packed_weights_mapped
    (entry,) = entries(cache)
    second = start(model_copy, cache)
    assert second.packed_weights_mapped
    assert entries(cache) == [entry]
    packed, mapped = block_layers(first), block_layers(second)
    assert packed.keys() == mapped.keys() and packed
    for name, layer in mapped.items():
        assert torch.equal(layer.blocks, packed[name].blocks), name
        assert layer.activations == packed[name].activations, name
        assert mapped_from(layer.blocks) == str(entry), name  # the entry's pages, not a copy
        assert mapped_from(packed[name].blocks) != str(entry), name
    assert torch.equal(prompt_logits(second), prompt_logits(first))


@pytest.mark.parametrize("model_copy", ["tiny_kquant_gguf"], indirect=True)
@pytest.mark.parametrize("change", ["mtime", "size"])
def test_a_changed_model_file_is_packed_again(model_copy: Path, tmp_path: Path, change: str) -> None:
    cache = tmp_path / "packed"
    start(model_copy, cache)
    (old,) = entries(cache)
    if change == "mtime":
        stat = model_copy.stat()
        os.utime(model_copy, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    else:  # bytes after the last tensor: the same weights, another file
        with model_copy.open("ab") as f:
            f.write(b"\0" * 64)
    again = start(model_copy, cache)
    assert not again.packed_weights_mapped
    (new,) = entries(cache)  # the old file's entry, which no start would read again, is gone
    assert new != old
    assert start(model_copy, cache).packed_weights_mapped


@pytest.mark.parametrize("model_copy", ["mixed_gguf"], indirect=True)
@pytest.mark.parametrize("damage", ["truncated", "tensor bytes", "table", "emptied"])
def test_a_damaged_entry_is_never_used_and_is_written_again(model_copy: Path, tmp_path: Path, damage: str,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    cache = tmp_path / "packed"
    fresh = prompt_logits(start(model_copy, cache))
    (entry,) = entries(cache)
    data = bytearray(entry.read_bytes())
    if damage == "truncated":
        data = data[: len(data) - 5000]
    elif damage == "tensor bytes":  # one bit of one tensor
        (length,) = struct.unpack_from("<Q", data, 8)
        tensors = json.loads(bytes(data[16 : 16 + length]))["tensors"]
        data[tensors[len(tensors) // 2]["offset"] + 17] ^= 0x01
    elif damage == "table":
        at = data.index(b'"activations"')
        data[at + 1] ^= 0x20
    else:
        data = bytearray()
    entry.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="lmserve.worker.weights.packed_cache"):
        runner = start(model_copy, cache)
    assert not runner.packed_weights_mapped
    assert torch.equal(prompt_logits(runner), fresh)
    if damage != "emptied":  # an empty file is no entry at all: simply written anew
        assert "damaged" in caplog.text
    again = start(model_copy, cache)
    assert again.packed_weights_mapped
    assert torch.equal(prompt_logits(again), fresh)


@pytest.mark.parametrize("model_copy", ["tiny_kquant_gguf"], indirect=True)
def test_off_packs_in_memory_and_writes_nothing(model_copy: Path, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "packed"
    monkeypatch.setenv(DIRECTORY_VARIABLE, str(cache))
    reference = prompt_logits(start(model_copy, "off"))
    assert not cache.exists()
    monkeypatch.setenv(DIRECTORY_VARIABLE, "off")
    runner = start(model_copy, "auto")
    assert not runner.packed_weights_mapped and not cache.exists()
    assert torch.equal(prompt_logits(runner), reference)
    monkeypatch.setenv(DIRECTORY_VARIABLE, str(cache))  # auto: the variable's directory
    start(model_copy, "auto")
    assert len(entries(cache)) == 1
    assert start(model_copy, "auto").packed_weights_mapped


def test_auto_is_under_lmserves_cache_unless_the_variable_says_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DIRECTORY_VARIABLE, raising=False)
    assert packed_cache_settings("auto").directory == cache_directory() / "packed"
    assert packed_cache_settings("off").directory is None
    assert packed_cache_settings("/somewhere/else").directory == Path("/somewhere/else")


@pytest.mark.parametrize("model_copy", ["tiny_kquant_gguf"], indirect=True)
def test_an_unwritable_cache_directory_leaves_the_weights_packed_in_memory(
        model_copy: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")  # (tests may run as root, whom permissions do not stop)
    with caplog.at_level(logging.WARNING, logger="lmserve.worker.weights.packed_cache"):
        runner = start(model_copy, blocker / "packed")
    assert not runner.packed_weights_mapped
    assert "could not write" in caplog.text
    assert torch.equal(prompt_logits(runner), prompt_logits(start(model_copy, "off")))


@pytest.mark.parametrize("model_copy", ["tiny_kquant_gguf"], indirect=True)
def test_the_cache_stays_under_its_size(model_copy: Path, mixed_gguf: Path, tmp_path: Path) -> None:
    cache = tmp_path / "packed"
    start(model_copy, cache)
    (first,) = entries(cache)
    other = Path(shutil.copy2(mixed_gguf, model_copy.parent / mixed_gguf.name))
    start(other, tmp_path / "measure")
    (measured,) = entries(tmp_path / "measure")
    sizes = first.stat().st_size, measured.stat().st_size
    # Room for either entry, not both: the one read least recently goes.
    start(other, cache, packed_weights_cache_size=max(sizes) + 1)
    assert [e.name for e in entries(cache)] == [measured.name]
    # An entry larger than the whole cache is not written.
    start(model_copy, tmp_path / "small", packed_weights_cache_size=min(sizes) - 1)
    assert entries(tmp_path / "small") == []


def test_a_stacked_expert_tensor_is_packed_in_one_call_into_each_experts_own_bytes(moe_kquant, tmp_path: Path
                                                                                   ) -> None:
    """Every expert's gate_up (and down) blocks are views of one pack call's result, and hold what packing that
    expert alone gives."""
    _, path = moe_kquant
    runner = start(path, "off")
    tensors = {t.name: t for t in read_gguf_header(path).tensors}
    ops = cpu_kernels()
    for index, layer in enumerate(runner.model.layers):
        experts = layer.mlp.experts
        stacks = {name: read_gguf_blocks(path, tensors[f"blk.{index}.{name}.weight"])
                  for name in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")}
        stacks = {name: torch.from_numpy(blocks.reshape(len(experts), -1, *blocks.shape[1:]).copy())
                  for name, blocks in stacks.items()}
        for slot, method, parts in (("gate_up_proj", "q4_k", ("ffn_gate_exps", "ffn_up_exps")),
                                    ("down_proj", "q6_k", ("ffn_down_exps",))):
            linears = [getattr(expert, slot) for expert in experts]
            assert len({linear.blocks.untyped_storage().data_ptr() for linear in linears}) == 1, slot
            for e, linear in enumerate(linears):
                alone = getattr(ops, f"{method}_int16_pack")([stacks[part][e] for part in parts])
                assert linear.method == method and torch.equal(linear.blocks, alone), (index, slot, e)


@pytest.mark.parametrize("model_copy", ["tiny_kquant_gguf"], indirect=True)
def test_a_writers_temporary_file_is_never_read_and_an_abandoned_one_is_removed(model_copy: Path, tmp_path: Path
                                                                                ) -> None:
    """Another server's write in progress is a hidden temporary file until it is renamed into place: a start neither
    reads it nor removes it; one whose writer died long ago (a server stopped mid-write) goes at the next save."""
    cache = tmp_path / "packed"
    cache.mkdir()
    writing, abandoned = cache / ".entry.packed.123.aaaa.tmp", cache / ".entry.packed.456.bbbb.tmp"
    for leftover in (writing, abandoned):
        leftover.write_bytes(b"LMSPACK1 half a file")
    two_hours_ago = abandoned.stat().st_mtime - 7200
    os.utime(abandoned, (two_hours_ago, two_hours_ago))
    assert not start(model_copy, cache).packed_weights_mapped
    assert writing.exists() and not abandoned.exists()
    assert len(entries(cache)) == 1
    assert start(model_copy, cache).packed_weights_mapped
