"""The token embedding kept in the file's blocks: each step dequantizes only the rows its tokens look up.

A vocabulary of 151,936 rows by 896 (Qwen2.5 0.5B) is 545 MB as a float32 table and 93 MB as the file's Q5_0 blocks;
a step looks up as many rows as it has tokens. The rows come out as lmserve.models' reader gives them (the float32
table would hold exactly these values), so nothing downstream changes.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import os
import sys

import numpy as np
import torch
from torch import nn

from lmserve.distributed.parallel_state import ParallelGroups
from lmserve.worker.weights.block_linear import BlockQuantizedLinear
from lmserve.worker.weights.block_packing import StoredBlocks
from lmserve.worker.weights.stored_formats import STORED_BLOCK_BYTES, block_width

logger = logging.getLogger(__name__)


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


class BlockEmbedding(nn.Module):
    """VocabParallelEmbedding's rows (this rank's share, padded alike) as `stored_type` blocks."""

    def __init__(self, vocab_size: int, hidden_size: int, parallel: ParallelGroups, stored_type: str) -> None:
        super().__init__()
        width = block_width(stored_type)
        if hidden_size % width:
            raise ValueError(f"{stored_type} rows of {hidden_size} are not whole blocks of {width}")
        self.parallel = parallel
        self.stored_type = stored_type
        self.hidden_size = hidden_size
        self.rows_per_rank = -(-vocab_size // parallel.tp_size)
        self.first_row = parallel.tp_rank * self.rows_per_rank
        shape = (self.rows_per_rank, hidden_size // width, STORED_BLOCK_BYTES[stored_type])
        self.register_buffer("blocks", torch.zeros(shape, dtype=torch.uint8), persistent=False)
        # The tied output layer whose blocks hold the same rows, once share_rows_of() let this copy go.
        self.rows_source: BlockQuantizedLinear | None = None
        self.file_mapped = False  # blocks is the loader's mapping of the file (StoredBlocks.file_mapped)

    def share_rows_of(self, layer: nn.Module) -> bool:
        """Looks rows up in a tied output layer holding the same blocks (its kernel layout read back) and frees this
        copy: a 262,144-token Q8_0 embedding (Gemma 3) is 178 MB held once instead of twice. Only where the layer
        holds this format's blocks exactly, all of this rank's rows, and reads them back; False otherwise."""
        if not (isinstance(layer, BlockQuantizedLinear) and layer.method == self.stored_type
                and self.parallel.tp_size == 1 and layer.out_features >= self.rows_per_rank):
            return False
        probe = np.array([0, self.rows_per_rank - 1])
        stored = layer.stored_rows(probe)
        if stored is None or not np.array_equal(stored, self.blocks.numpy()[probe]):
            return False
        self.rows_source = layer
        self.blocks = torch.empty((0, *self.blocks.shape[1:]), dtype=torch.uint8)
        return True

    def release_file_pages(self) -> None:
        """Drops this process's resident pages of a table still mapped from the file. A tied output layer in another
        layout than this table's (share_rows_of) read every row of it while it was packed: 183 MB of a 1.5B Qwen
        file's Q6_K table stayed resident, though a step looks up a few rows. They are read from the file again as
        tokens look them up. madvise(MADV_DONTNEED) on a copy-on-write mapping that nothing wrote to (Linux): the next
        read sees the file's bytes, as before."""
        if not self.file_mapped or sys.platform != "linux" or self.blocks.numel() == 0:
            return
        start = self.blocks.data_ptr()
        first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE  # the pages wholly inside the table only
        last = (start + self.blocks.numel()) // mmap.PAGESIZE * mmap.PAGESIZE
        if last > first and _libc().madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first),
                                            mmap.MADV_DONTNEED) != 0:  # memory, not results: the model runs on
            logger.warning("the embedding's file pages stay resident: madvise failed (%s)",
                           os.strerror(ctypes.get_errno()))

    def load_rows(self, start: int, weight: torch.Tensor | StoredBlocks) -> None:
        """The checkpoint's rows for this rank (the loader's StoredBlocks of this type)."""
        if not isinstance(weight, StoredBlocks) or weight.method != self.stored_type:
            raise ValueError(f"the embedding takes the file's {self.stored_type} blocks")
        rows = weight.data
        if rows.shape[1:] != self.blocks.shape[1:] or start + rows.shape[0] > self.rows_per_rank:
            raise ValueError(f"embedding rows of shape {tuple(rows.shape)} do not fit at row {start}")
        if start == 0 and rows.shape == self.blocks.shape and self.blocks.device.type == "cpu":
            # The whole table: keep the loader's (copy-on-write) mapping of the file, as llama.cpp does. A step reads
            # a few rows, so only the pages of tokens seen become resident (Qwen2.5 0.5B: 89 MB it would copy).
            self.blocks = rows
            self.file_mapped = weight.file_mapped
            return
        self.blocks.numpy()[start : start + rows.shape[0]] = rows.numpy()

    def rows(self, local_ids: torch.Tensor) -> torch.Tensor:
        """float32 [len(local_ids), hidden] of this rank's rows."""
        ids = local_ids.reshape(-1).numpy()
        picked = self.rows_source.stored_rows(ids) if self.rows_source is not None else self.blocks.numpy()[ids]
        return StoredBlocks(self.stored_type, torch.from_numpy(np.ascontiguousarray(picked))).dequantize()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.cpu()
        if self.parallel.tp_size == 1:
            return self.rows(ids).view(*input_ids.shape, self.hidden_size).to(input_ids.device)
        local = ids - self.first_row
        outside = (local < 0) | (local >= self.rows_per_rank)
        x = self.rows(local.masked_fill(outside, 0)).view(*input_ids.shape, self.hidden_size)
        x.masked_fill_(outside.unsqueeze(-1), 0)
        return self.parallel.all_reduce(x.to(input_ids.device))

    def extra_repr(self) -> str:
        return f"{self.rows_per_rank} rows of {self.hidden_size}, {self.stored_type} blocks"
