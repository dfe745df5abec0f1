"""Every format a linear layer's weights can take, by name: the families' tables gathered in one place, explicitly
(float16.py, block_linear.py, kquants.py; layer_format.py says what a row holds). Nothing registers a layer type as
a side effect of being imported: a format runs because its family's table names it here.
"""

from __future__ import annotations

from torch import nn

from lmserve.worker.weights.block_linear import BLOCK_LAYER_FORMATS
from lmserve.worker.weights.float16 import FLOAT16_LAYER_FORMATS
from lmserve.worker.weights.kquants import KQUANT_LAYER_FORMATS
from lmserve.worker.weights.layer_format import LayerFormat

LAYER_FORMATS: dict[str, LayerFormat] = {
    row.name: row for row in (*FLOAT16_LAYER_FORMATS, *BLOCK_LAYER_FORMATS, *KQUANT_LAYER_FORMATS)
}
# The layer each format's weights are held in (a measurement may add one of its own: benchmarks/quantization.py).
LAYER_TYPES: dict[str, type[nn.Module]] = {name: row.layer_type for name, row in LAYER_FORMATS.items()}
# The output layer is the most sensitive to rounding; llama.cpp's q4 files keep it (or the tied embedding) in q8_0.
OUTPUT_LAYER_METHOD = {"q4_1": "q8_0"}


def layer_fits(method: str, out_features: int, in_features: int) -> bool:
    """Whether a `method` layer can hold an [out_features, in_features] weight: whole blocks a row, and for the
    integer-only kernels' layout whole groups of 16 rows."""
    return LAYER_FORMATS[method].fits(out_features, in_features)
