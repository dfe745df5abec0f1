"""A GGUF file's header (metadata and tensor list) and its tensors' blocks, read without gguf.GGUFReader; no torch."""

from __future__ import annotations

import functools
import hashlib
import mmap
import struct
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from lmserve.formats.block_formats import (
    HELD_INTO,
    STORED_BLOCK_BYTES,
    STORED_BLOCK_TYPES,
    block_width,
    exact_kernel_format,
    held_bytes_per_weight,
)

GGUF_MAGIC = b"GGUF"



def is_gguf_file(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(4) == GGUF_MAGIC


# Org/Name, or Org/Name:TAG to pick one GGUF of a repo that holds several (as llama.cpp's and Ollama's repo:quant).


# gguf.GGUFReader needs ~7 s for this 135M model (a numpy view per vocabulary string), so we walk the header
# with struct ourselves (~0.2 s) and keep gguf for its constants and dequantization.
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
# Longer arrays are given as their length: a 262k vocabulary's scores as a list cost every process ~12 MiB.
_GGUF_ARRAY_KEPT = 4096


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order: rows first, the reverse of GGUF's
    ggml_type: int
    offset: int  # absolute, in the file


@dataclass
class GGUFHeader:
    metadata: dict[str, Any]  # arrays of strings, and arrays of > 4,096 numbers, are given as their length
    tensors: list[GGUFTensorInfo]


def read_gguf_header(path: Path) -> GGUFHeader:
    """The file's metadata and tensor list. Read once per file (its path, size and modification time) and process:
    the engine asks for it several times while it starts (~0.1 s each for the default model's vocabulary). Callers
    must not change what it returns."""
    stat = path.stat()
    return _read_gguf_header(Path(path).resolve(), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _read_gguf_header(path: Path, _size: int, _mtime_ns: int) -> GGUFHeader:
    blob = np.memmap(path, mode="r", dtype=np.uint8)
    magic, version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", blob, 0)
    if magic != GGUF_MAGIC or version not in (2, 3):
        raise ValueError(f"{path} is not a GGUF v2/v3 file")
    pos, metadata = 24, {}
    for _ in range(n_kv):
        key, pos = _gguf_value(blob, pos, _GGUF_STRING)
        (value_type,) = struct.unpack_from("<I", blob, pos)
        metadata[key], pos = _gguf_value(blob, pos + 4, value_type)

    entries = []
    for _ in range(n_tensors):
        name, pos = _gguf_value(blob, pos, _GGUF_STRING)
        (n_dims,) = struct.unpack_from("<I", blob, pos)
        dims = struct.unpack_from(f"<{n_dims}Q", blob, pos + 4)
        ggml_type, offset = struct.unpack_from("<IQ", blob, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        entries.append((name, tuple(reversed(dims)), ggml_type, offset))
    alignment = metadata.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT)
    data_start = -(-pos // alignment) * alignment  # tensor data starts at the next aligned offset
    tensors = [GGUFTensorInfo(name, shape, t, data_start + offset) for name, shape, t, offset in entries]
    return GGUFHeader(metadata, tensors)


def gguf_header_digest(path: Path) -> str:
    """A SHA-256 of the file's header (its metadata and tensor list, up to where the tensors' data starts): what
    changes when the file holds other tensors or other settings, read in ~ms where a hash of the whole file's GBs
    would cost seconds. With the file's size and modification time, it keys what is derived from the file
    (worker/weights/packed_cache.py)."""
    tensors = read_gguf_header(path).tensors
    end = min((t.offset for t in tensors), default=path.stat().st_size)
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while end > 0 and (chunk := f.read(min(end, 1 << 20))):
            digest.update(chunk)
            end -= len(chunk)
    return digest.hexdigest()


def _gguf_rows(path: Path, info: GGUFTensorInfo, mode: str = "r") -> tuple[np.memmap, int]:
    """The tensor's bytes as [rows, bytes per row] (mapped, not read), and the bytes of one of its blocks."""
    qtype = gguf.GGMLQuantizationType(info.ggml_type)
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    row_bytes = info.shape[-1] // block_size * block_bytes
    rows = int(np.prod(info.shape[:-1]))
    return np.memmap(path, mode=mode, dtype=np.uint8, offset=info.offset, shape=(rows, row_bytes)), block_bytes


def read_gguf_blocks(path: Path, info: GGUFTensorInfo) -> np.ndarray:
    """One tensor's bytes as the file stores them, uint8 [rows, blocks per row, bytes per block] (for a quantized
    type, llama.cpp's blocks; for F32, F16 and BF16 one element per block), mapped copy-on-write: read from the file
    as they are used, and a write (none is made) would change this process's copy only. No copy of the whole
    tensor is made here: the layer that takes the blocks copies them once into its own layout (~0.6 s of a 0.5B
    model's start-up was a read of every tensor into memory first)."""
    raw, block_bytes = _gguf_rows(path, info, mode="c")
    return raw.reshape(raw.shape[0], -1, block_bytes)


def read_gguf_tensor(path: Path, info: GGUFTensorInfo) -> np.ndarray:
    """One tensor, dequantized to float32, in torch order (rows first)."""
    qtype = gguf.GGMLQuantizationType(info.ggml_type)
    raw, block_bytes = _gguf_rows(path, info)
    fast = _FAST_DEQUANTIZE.get(qtype)
    if fast is not None:
        return fast(np.asarray(raw).reshape(-1, block_bytes)).reshape(info.shape)
    return gguf.quants.dequantize(raw, qtype).reshape(info.shape)


def dequantize_gguf_blocks(type_name: str, blocks: np.ndarray) -> np.ndarray:
    """[rows, blocks, bytes] of a quantized tensor (read_gguf_blocks, or rows or blocks of one) as float32
    [rows, columns]: read_gguf_tensor's values."""
    qtype = gguf.GGMLQuantizationType[type_name.upper()]
    fast = _FAST_DEQUANTIZE.get(qtype)
    if fast is None:  # the K-quants: gguf's own reader
        return gguf.quants.dequantize(blocks.reshape(blocks.shape[0], -1), qtype).reshape(blocks.shape[0], -1)
    return fast(blocks.reshape(-1, blocks.shape[-1])).reshape(blocks.shape[0], -1)


def _dequantize_q4_1(blocks: np.ndarray) -> np.ndarray:
    """block_q4_1: float16 d and m, then 16 bytes of 4-bit q (low nibbles: weights 0-15, high: 16-31); w = d q + m."""
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    qs = blocks[:, 4:20]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)
    return q * d + m


def _dequantize_q8_0(blocks: np.ndarray) -> np.ndarray:
    """block_q8_0: float16 d, then 32 int8 q; w = d q."""
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    return blocks[:, 2:34].copy().view(np.int8).astype(np.float32) * d


# The block formats of the default model's file, one vectorized pass each (gguf's own dequantize loops over groups of
# rows in Python: ~1.8 s of the default model's start-up). Bit-for-bit the same values (tests/test_models.py).
_FAST_DEQUANTIZE = {
    gguf.GGMLQuantizationType.Q4_1: _dequantize_q4_1,
    gguf.GGMLQuantizationType.Q8_0: _dequantize_q8_0,
}


def _gguf_value(blob: np.ndarray, pos: int, value_type: int) -> tuple[Any, int]:
    """One metadata value at `pos`, and the position after it."""
    if value_type in _GGUF_SCALARS:
        fmt = "<" + _GGUF_SCALARS[value_type]
        return struct.unpack_from(fmt, blob, pos)[0], pos + struct.calcsize(fmt)
    if value_type == _GGUF_STRING:
        (length,) = struct.unpack_from("<Q", blob, pos)
        return bytes(blob[pos + 8 : pos + 8 + length]).decode("utf-8", errors="replace"), pos + 8 + length
    if value_type == _GGUF_ARRAY:
        item_type, count = struct.unpack_from("<IQ", blob, pos)
        pos += 12
        if item_type in _GGUF_SCALARS:
            fmt = f"<{count}{_GGUF_SCALARS[item_type]}"
            if count > _GGUF_ARRAY_KEPT:  # the vocabulary's scores and types: only a tokenizer build reads them
                return count, pos + struct.calcsize(fmt)
            return list(struct.unpack_from(fmt, blob, pos)), pos + struct.calcsize(fmt)  # per-layer values
        # Vocabulary and merges: only transformers' tokenizer needs them, so step over them undecoded.
        for _ in range(count):
            if item_type == _GGUF_STRING:
                pos += 8 + struct.unpack_from("<Q", blob, pos)[0]
            else:
                _, pos = _gguf_value(blob, pos, item_type)
        return count, pos
    raise ValueError(f"unknown GGUF metadata value type {value_type}")


def read_gguf_arrays(path: Path, keys: Collection[str]) -> dict[str, list]:
    """The named metadata arrays in full (a vocabulary's tokens, scores and types, its merges), which
    read_gguf_header gives as their lengths: only a tokenizer's conversion reads them. Strings decoded strictly, as
    transformers' reader decodes them."""
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        unpack = struct.unpack_from
        magic, version, _, n_kv = unpack("<4sIQQ", data, 0)
        if magic != GGUF_MAGIC or version not in (2, 3):
            raise ValueError(f"{path} is not a GGUF v2/v3 file")
        pos, found = 24, {}
        for _ in range(n_kv):
            if len(found) == len(keys):
                break
            (length,) = unpack("<Q", data, pos)
            key = data[pos + 8 : pos + 8 + length].decode()
            (value_type,) = unpack("<I", data, pos + 8 + length)
            pos += 12 + length
            if key not in keys or value_type != _GGUF_ARRAY:
                _, pos = _gguf_value(data, pos, value_type)
                continue
            item_type, count = unpack("<IQ", data, pos)
            pos += 12
            if item_type in _GGUF_SCALARS:
                fmt = f"<{count}{_GGUF_SCALARS[item_type]}"
                found[key] = list(unpack(fmt, data, pos))
                pos += struct.calcsize(fmt)
            elif item_type == _GGUF_STRING:
                values = []
                for _ in range(count):
                    (length,) = unpack("<Q", data, pos)
                    values.append(data[pos + 8 : pos + 8 + length].decode())
                    pos += 8 + length
                found[key] = values
            else:
                raise ValueError(f"{path}: {key} is an array of GGUF type {item_type}")
        return found


# Matrices the engine runs as one layer (worker/models/llama.py fuses q/k/v and gate/up): in one kernel format when
# one holds all of them, else each in its own, else all in float16.
_FUSED_GROUPS = {"attn_q": "qkv", "attn_k": "qkv", "attn_v": "qkv", "ffn_gate": "gate_up", "ffn_up": "gate_up"}


def _fused_held_bytes(types: list[str]) -> list[float]:
    """Bytes a weight of each part of one fused layer, by the rule above (every kernel running)."""
    common = exact_kernel_format(types)
    if common is not None:
        return [STORED_BLOCK_BYTES[common] / block_width(common)] * len(types)
    if all(HELD_INTO.get(t) for t in types):
        return [held_bytes_per_weight(t) for t in types]
    return [2.0] * len(types)


# Row-parallel matrices: under tensor parallel each rank holds a slice of their columns (in_features / tp).
_ROW_PARALLEL = ("attn_output", "ffn_down")


def shard_fits_blocks(stored_type: str, in_features: int, tp: int) -> bool:
    """Whether a row-parallel matrix's slice of in_features / tp columns still splits into whole blocks of the
    kernel format its type is held in (a K-quant's 256): where not, the worker runs it as float16 weights."""
    into = HELD_INTO.get(stored_type)
    return not into or tp == 1 or (in_features % tp == 0 and in_features // tp % block_width(into[0]) == 0)


@functools.lru_cache(maxsize=32)
def gguf_held_bits(path: Path, tp: int = 1) -> float:
    """Bits a parameter the file's tensors take as the engine holds them where every kernel runs: a matrix in the
    kernel format its blocks convert into (IQ4_XS as iq4_nl, Q3_K beside Q6_K as q6_k; the parts of a fused q/k/v or
    gate/up as above), one that no format holds (floats) as float16; the token embedding in the file's
    blocks where they can be looked up, and when the output layer is the embedding (no output.weight), that layer in
    its kernel format besides unless the two share the blocks; vectors in float32. Under `tp` ranks, a row-parallel
    matrix whose slice of columns is no whole number of its format's blocks (Qwen2.5 0.5B's down_proj, 4864 / 2 =
    2432 columns, under Q4_K's 256) is float16, as the worker loads it."""
    tensors = read_gguf_header(path).tensors
    tied = all(info.name != "output.weight" for info in tensors)
    fused: dict[tuple[str, str], list[GGUFTensorInfo]] = {}
    held = elements = 0.0
    for info in tensors:
        count = int(np.prod(info.shape))
        elements += count
        stored = ggml_type_name(info.ggml_type).lower()
        parts = info.name.split(".")
        if len(info.shape) < 2:
            held += 4 * count
        elif info.name == "token_embd.weight":
            block_size, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(info.ggml_type)]
            held += count // block_size * block_bytes if stored in STORED_BLOCK_TYPES else 2 * count
            if tied and HELD_INTO.get(stored, ("",))[0] != stored:
                held += count * held_bytes_per_weight(stored)
        elif parts[0] == "blk" and len(parts) > 2 and parts[2] in _ROW_PARALLEL and \
                not shard_fits_blocks(stored, info.shape[-1], tp):
            held += 2 * count
        elif parts[0] == "blk" and len(parts) > 2 and parts[2] in _FUSED_GROUPS:
            fused.setdefault((parts[1], _FUSED_GROUPS[parts[2]]), []).append(info)
        else:
            held += count * held_bytes_per_weight(stored)
    for infos in fused.values():
        rates = _fused_held_bytes([ggml_type_name(info.ggml_type).lower() for info in infos])
        held += sum(int(np.prod(info.shape)) * rate for info, rate in zip(infos, rates, strict=True))
    return 8 * held / elements


def ggml_type_name(ggml_type: int) -> str:
    try:
        return gguf.GGMLQuantizationType(ggml_type).name
    except ValueError:  # a type newer than the installed gguf package
        return f"#{ggml_type}"
