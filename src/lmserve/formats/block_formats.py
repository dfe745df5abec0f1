"""The kernels' block formats and what a GGUF's stored block types become in them: constants that the worker
(worker/weights/stored_formats.py converts the blocks) and the planner (what a file's weights take in memory) share.
See worker/weights/stored_formats.py for the conversions and why each holds the file's values."""

from __future__ import annotations

from collections.abc import Iterable

# Fewest bytes a weight first. All but q4_1 and q8_0 run only where the int16-activation kernels do (AVX-512 VNNI or
# AVX2, with integer activations).
KERNEL_FORMATS = ("q2_k", "q3_k", "iq4_nl", "q4_0", "q4_k", "q4_1", "q5_0", "q5_k", "q5_1", "q6_k", "q8_0")
BLOCK_FORMATS = ("q4_1", "q8_0")  # the formats every CPU with AVX2 runs (kernels/quantized_linear.cpp)
# Stored type -> the kernel formats that hold its blocks exactly, fewest bytes first.
EXACT_INTO: dict[str, tuple[str, ...]] = {
    "q4_1": ("q4_1",),
    "q8_0": ("q8_0",),
    "q4_0": ("q4_0", "q4_1", "q8_0"),
    "q5_0": ("q5_0", "q8_0"),
    "q5_1": ("q5_1",),
    "q4_k": ("q4_k",),
    "q5_k": ("q5_k",),
    "q6_k": ("q6_k",),
    "iq4_nl": ("iq4_nl", "q8_0"),
    "q2_k": ("q2_k",),
    "q3_k": ("q3_k", "q6_k"),  # 3-bit codes - 4 under int8 sub-block scales: q6_k's codes - 32 hold them too
}
# Stored type -> the kernel formats that hold its blocks with each block's scale rounded once to float16.
SCALE_ROUNDED_INTO: dict[str, tuple[str, ...]] = {"iq4_xs": ("iq4_nl", "q8_0")}
HELD_INTO = {**EXACT_INTO, **SCALE_ROUNDED_INTO}  # what each type's layers may take
STORED_BLOCK_TYPES = tuple(HELD_INTO)  # what the loader hands over as the file's blocks (worker/weights/loader.py)
STORED_BLOCK_BYTES = {"q4_0": 18, "q4_1": 20, "q5_0": 22, "q5_1": 24, "q8_0": 34, "q4_k": 144, "q5_k": 176, "q6_k": 210,
                      "iq4_nl": 18, "iq4_xs": 136, "q3_k": 110, "q2_k": 84}
# Weights a block; 32 for the others.
BLOCK_WIDTH = {"q4_k": 256, "q5_k": 256, "q6_k": 256, "iq4_xs": 256, "q3_k": 256, "q2_k": 256}


def block_width(stored_type: str) -> int:
    return BLOCK_WIDTH.get(stored_type, 32)


def held_bytes_per_weight(stored_type: str) -> float:
    """Bytes a weight of a matrix stored as `stored_type` takes as the engine holds it where every kernel runs: the
    first (fewest bytes) kernel format that holds its blocks, else float16 (2)."""
    into = HELD_INTO.get(stored_type)
    if not into:
        return 2.0
    return STORED_BLOCK_BYTES[into[0]] / block_width(into[0])


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
