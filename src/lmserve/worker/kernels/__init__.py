"""CPU kernels compiled on first use with torch's C++ extension builder (cached, so later starts only load them).

`python -m lmserve.worker.kernels` builds them ahead of time; the Makefile does that at install.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import platform
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent
# -fopenmp: at::parallel_for is a header template whose parallel region compiles only with OpenMP on (without it the
# kernel ran on one thread). The link names libgomp.so.1, the same soname as the runtime torch already loaded, so the
# kernel joins torch's thread pool rather than starting a second one. Infinities are real values in the softmax.
BUILD_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-fopenmp"]


def cpu_signature() -> str:
    """A short hash of the CPU's instruction-set flags: `-march=native` code must never load on a CPU without them."""
    flags = ""
    with contextlib.suppress(OSError):
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    return hashlib.sha1(f"{platform.machine()} {flags}".encode()).hexdigest()[:10]


def build_directory() -> Path:
    """One folder per torch version and CPU, under lmserve's cache, so that a kernel built against another torch or
    for another CPU (a shared home directory) is never loaded."""
    xdg = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    cache = Path(os.environ.get("LMSERVE_CACHE") or xdg / "lmserve")
    path = cache / "kernels" / f"torch-{torch.__version__}" / f"cpu-{cpu_signature()}"
    path.mkdir(parents=True, exist_ok=True)
    return path


@functools.cache
def paged_attention_op():
    """`torch.ops.lmserve.paged_attention`, building it if needed; raises RuntimeError when it cannot be built."""
    from torch.utils import cpp_extension

    started = time.perf_counter()
    try:
        cpp_extension.load(
            name="lmserve_paged_attention",
            sources=[str(SOURCE_DIR / "paged_attention.cpp")],
            extra_cflags=BUILD_FLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_directory()),
            is_python_module=False,
            verbose=False,
        )
    except Exception as exc:  # a missing compiler or ninja shows up as one of several exception types
        raise RuntimeError(f"could not build the CPU paged-attention kernel: {exc}") from exc
    logger.debug("paged-attention kernel ready in %.1fs", time.perf_counter() - started)
    return torch.ops.lmserve.paged_attention

