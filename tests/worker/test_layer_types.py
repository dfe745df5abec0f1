"""The weight formats' tables (worker/weights/): every kernel format of formats/block_formats.py's table has exactly
one layer format, each family's rows agree with the file formats' table, and the layer types are there without any
other module imported first (no registration as an import's side effect)."""

from __future__ import annotations

import subprocess
import sys

from lmserve.formats.block_formats import BLOCK_TYPES, KERNEL_FORMATS
from lmserve.worker.weights.layer_types import LAYER_FORMATS, LAYER_TYPES, layer_fits


def test_every_kernel_format_has_one_layer_format() -> None:
    assert set(LAYER_FORMATS) == {*KERNEL_FORMATS, "fp16"}
    for name, row in LAYER_FORMATS.items():
        assert row.name == name and LAYER_TYPES[name] is row.layer_type
        if name == "fp16":
            assert row.bytes_per_weight == 2.0 and row.block_width == 1
            continue
        assert row.layer_type.method == name
        assert row.bytes_per_weight == BLOCK_TYPES[name].block_bytes / BLOCK_TYPES[name].block_width
        assert row.activations[-2:] == ("int16", "int8")


def test_a_layer_fits_whole_blocks_and_whole_groups_of_rows() -> None:
    assert layer_fits("q4_1", 8, 64) and not layer_fits("q4_1", 8, 48)  # the float32 kernels: any rows
    assert layer_fits("q5_0", 16, 32) and not layer_fits("q5_0", 8, 32)  # integer-only: 16 rows a group
    assert layer_fits("q4_k", 32, 512) and not layer_fits("q4_k", 32, 288)  # 256 weights a block


def test_the_layer_types_load_with_the_pending_layers_alone() -> None:
    """What a pending layer finishes into is known to the module that finishes it, in a fresh process that imports
    nothing else (the K-quants' types once existed only after worker/kquant_formats.py had been imported)."""
    code = ("from lmserve.worker.weights import pending; "
            "print(' '.join(sorted(pending.LAYER_TYPES)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert set(out) == {*KERNEL_FORMATS, "fp16"}
