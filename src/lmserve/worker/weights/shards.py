"""A tensor rank's share of a checkpoint weight, whatever form the loader hands it in (float, or a file's blocks:
block_packing.StoredBlocks): rows selected block row for block row, input columns cut at block boundaries (or, where a
rank's share is not whole blocks of the stored type, in a narrower format that holds it), and the warning for layers
whose share fits no block of their format. The model (worker/models/llama.py) says which rows and columns are a
rank's; this module knows what that means for each format.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lmserve.worker.weights.block_packing import StoredBlocks
from lmserve.worker.weights.stored_formats import HELD_INTO, block_width, convert_blocks


def unfit_layers_message(unfit: list[tuple[str, str, int, int]], tp: int) -> str:
    """The warning for layers that have a block format but whose shape on this rank does not fit it (a K-quant's
    slice of columns under -tp is no multiple of 256): by kind of layer, the layers' indices, the format and shape."""
    kinds: dict[tuple[str, str, int, int], list[str]] = {}
    for name, method, rows, columns in unfit:
        index, _, kind = name.partition(".")
        kinds.setdefault((kind, method, rows, columns), []).append(index)
    named = "; ".join(f"{kind} of layer(s) {', '.join(indices)} ({method}, [{rows}, {columns}] on this rank)"
                      for (kind, method, rows, columns), indices in kinds.items())
    where = f" under tensor parallel ({tp} ranks: each holds a slice of the matrix)" if tp > 1 else ""
    return (f"{len(unfit)} layer(s) do not split into whole blocks of their format{where} and run as float16 weights "
            f"(2 bytes a weight, not their stored size): {named}. A -tp that leaves every slice whole blocks (a "
            "K-quant: columns a multiple of 256) keeps them at their stored size")


def select_rows(tensor: torch.Tensor | StoredBlocks,
                select: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor | StoredBlocks:
    """`select` (a function of a tensor's rows) applied to a float tensor or to a file's blocks, row for row."""
    return tensor.with_data(select(tensor.data)) if isinstance(tensor, StoredBlocks) else select(tensor)


def column_shard(tensor: torch.Tensor | StoredBlocks, tp: int, tp_rank: int) -> torch.Tensor | StoredBlocks:
    """This tensor rank's input columns of a row-parallel weight. Blocks split at block boundaries when each rank's
    share is whole blocks; a type of 256-weight blocks whose share is not (IQ4_XS down projections of 4,864 columns
    over 4 ranks) splits as the 32-weight format its layer takes anyway (q8_0); otherwise in float."""
    if isinstance(tensor, StoredBlocks):
        columns = tensor.shape[1]
        width = columns // tensor.data.shape[1]
        if columns % (tp * width) == 0:  # whole blocks (32 or 256 weights) a rank
            return tensor.with_data(tensor.data.chunk(tp, dim=1)[tp_rank])
        narrower = next((f for f in HELD_INTO.get(tensor.method, ()) if block_width(f) < width), None)
        if narrower is not None and columns % (tp * block_width(narrower)) == 0:
            blocks = torch.from_numpy(convert_blocks(tensor.method, tensor.data.numpy(), narrower))
            return StoredBlocks(narrower, blocks.chunk(tp, dim=1)[tp_rank])
        tensor = tensor.dequantize()
    return tensor.chunk(tp, dim=1)[tp_rank]


def num_rows(tensor: torch.Tensor | StoredBlocks) -> int:
    return (tensor.data if isinstance(tensor, StoredBlocks) else tensor).shape[0]


def as_floats(tensor: torch.Tensor | StoredBlocks) -> torch.Tensor:
    return tensor.dequantize() if isinstance(tensor, StoredBlocks) else tensor
