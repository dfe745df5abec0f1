"""llama.cpp's block types in one table (BLOCK_TYPES): each one's block layout as a file stores it, what it costs a
weight, which of the kernels' formats hold it, and whether it runs as a kernel format of its own. The worker
(worker/weights/stored_formats.py converts the blocks; each family's layers under worker/weights/) and the planner
(what a file's weights take in memory) read it. See worker/weights/stored_formats.py for the conversions and why each
holds the file's values."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class BlockType:
    """One of llama.cpp's block types as a GGUF file stores it, and what the kernels make of it. block_bytes,
    block_width: a block's bytes and weights. exact_into: the kernel formats that hold its blocks exactly, fewest bytes
    first (worker/weights/stored_formats.py converts them); scale_rounded_into: those that hold them with each
    block's scale rounded once to float16. kernel: how it runs as a kernel format of its own (None: it does not):
    "float32" for the formats every CPU with AVX2 runs, with float32 activations or integer ones
    (kernels/quantized_linear.cpp), "integer" for those that run only where the int16-activation kernels do (AVX-512
    VNNI or AVX2, with integer activations: kernels/int16_activations.cpp, kernels/kquant_int16.cpp)."""

    block_bytes: int
    block_width: int = 32
    exact_into: tuple[str, ...] = ()
    scale_rounded_into: tuple[str, ...] = ()
    kernel: str | None = None

    @property
    def bytes_per_weight(self) -> float:
        return self.block_bytes / self.block_width


# The table: every block type a GGUF's matrix may be stored in, the kernel formats fewest bytes a weight first (the
# order in which a layer takes the first that holds its blocks). A new format is a row here (and its kernel, and its
# layer in its family's table under worker/weights/).
BLOCK_TYPES: dict[str, BlockType] = {
    "q2_k": BlockType(84, 256, ("q2_k",), kernel="integer"),
    # 3-bit codes - 4 under int8 sub-block scales: q6_k's codes - 32 hold them too
    "q3_k": BlockType(110, 256, ("q3_k", "q6_k"), kernel="integer"),
    "iq4_nl": BlockType(18, 32, ("iq4_nl", "q8_0"), kernel="integer"),
    # gpt-oss's experts: an E8M0 scale and 32 E2M1 values (w = 2^(e - 128) x doubled E2M1), exact in q8_0 where no
    # mxfp4 kernel runs (its d a float16 power of two: worker/weights/stored_formats.py)
    "mxfp4": BlockType(17, 32, ("mxfp4", "q8_0"), kernel="integer"),
    "q4_0": BlockType(18, 32, ("q4_0", "q4_1", "q8_0"), kernel="integer"),
    "q4_k": BlockType(144, 256, ("q4_k",), kernel="integer"),
    "q4_1": BlockType(20, 32, ("q4_1",), kernel="float32"),
    "q5_0": BlockType(22, 32, ("q5_0", "q8_0"), kernel="integer"),
    "q5_k": BlockType(176, 256, ("q5_k",), kernel="integer"),
    "q5_1": BlockType(24, 32, ("q5_1",), kernel="integer"),
    "q6_k": BlockType(210, 256, ("q6_k",), kernel="integer"),
    "q8_0": BlockType(34, 32, ("q8_0",), kernel="float32"),
    "iq4_xs": BlockType(136, 256, scale_rounded_into=("iq4_nl", "q8_0")),
}

# Views of the table, by what each reader asks.
KERNEL_FORMATS = tuple(name for name, t in BLOCK_TYPES.items() if t.kernel)  # fewest bytes a weight first
BLOCK_FORMATS = tuple(name for name, t in BLOCK_TYPES.items() if t.kernel == "float32")  # every AVX2 CPU runs these
INTEGER_ONLY_FORMATS = tuple(name for name, t in BLOCK_TYPES.items() if t.kernel == "integer")
# Stored type -> the kernel formats that hold its blocks exactly, fewest bytes first.
EXACT_INTO: dict[str, tuple[str, ...]] = {name: t.exact_into for name, t in BLOCK_TYPES.items() if t.exact_into}
# Stored type -> the kernel formats that hold its blocks with each block's scale rounded once to float16.
SCALE_ROUNDED_INTO: dict[str, tuple[str, ...]] = {
    name: t.scale_rounded_into for name, t in BLOCK_TYPES.items() if t.scale_rounded_into}
HELD_INTO = {**EXACT_INTO, **SCALE_ROUNDED_INTO}  # what each type's layers may take
STORED_BLOCK_TYPES = tuple(HELD_INTO)  # what the loader hands over as the file's blocks (worker/weights/loader.py)
STORED_BLOCK_BYTES = {name: t.block_bytes for name, t in BLOCK_TYPES.items()}
# Weights a block; 32 for the others.
BLOCK_WIDTH = {name: t.block_width for name, t in BLOCK_TYPES.items() if t.block_width != 32}


def block_width(stored_type: str) -> int:
    return BLOCK_WIDTH.get(stored_type, 32)


def held_bytes_per_weight(stored_type: str) -> float:
    """Bytes a weight of a matrix stored as `stored_type` takes as the engine holds it where every kernel runs: the
    first (fewest bytes) kernel format that holds its blocks, else float16 (2)."""
    into = HELD_INTO.get(stored_type)
    if not into:
        return 2.0
    return BLOCK_TYPES[into[0]].bytes_per_weight


def exact_kernel_format(stored_types: Iterable[str], formats: Iterable[str] = KERNEL_FORMATS) -> str | None:
    """The kernel format of `formats` (those that run here; fewest bytes first) that holds blocks of every one of
    `stored_types` (exactly, or with scales rounded: SCALE_ROUNDED_INTO), or None."""
    types = set(stored_types)
    if not types:
        return None
    for kernel_format in (f for f in KERNEL_FORMATS if f in set(formats)):
        if all(kernel_format in HELD_INTO.get(t, ()) for t in types):
            return kernel_format
    return None
