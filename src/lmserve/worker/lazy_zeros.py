"""Zero tensors whose memory becomes resident only as it is written (the KV cache's pool, RoPE tables)."""

from __future__ import annotations

import math
import mmap

import numpy as np
import torch


def zeroed_lazily(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor whose pages become resident only when first written, on CPU: an anonymous mapping of fresh zero
    pages, so a 2 GiB KV cache costs start-up no time and the process no memory until its blocks are used. torch.zeros
    writes every byte (about a second, and all of it resident at once), and so may calloc: below glibc's mmap
    threshold (which rises to 32 MiB once the process has freed large blocks) it zeroes reused heap memory."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    # Private: Python's anonymous mmap is shared by default, which a forked child would write through.
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    pages = np.frombuffer(mapping, dtype=np.uint8)  # the array holds the mapping
    return torch.from_numpy(pages).view(dtype).view(shape)
