"""CPU kernels compiled on first use with torch's C++ extension builder (cached, so later starts only load them).

`python -m lmserve.worker.kernels` builds them ahead of time; the Makefile does that at install.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import platform
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from lmserve.config import cache_directory

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent
SOURCES = (
    "paged_attention.cpp", "paged_attention_avx2.cpp", "fused_ops.cpp", "quantized_linear.cpp", "top_p.cpp",
    "amx_linear.cpp", "int16_activations.cpp", "kquant_int16.cpp", "layer_program.cpp",
)
HEADERS = ("paged_attention.h", "int16_activations.h", "int16_simd.h", "linear_segments.h", "moe_block.h")  # included by SOURCES: part of what a build is made of
# -fopenmp: at::parallel_for is a header template whose parallel region compiles only with OpenMP on (without it the
# kernel ran on one thread). The link names libgomp.so.1, the same soname as the runtime torch already loaded, so the
# kernel joins torch's thread pool rather than starting a second one. -ffast-math lets loops of exp() use glibc's
# vector versions; the kernels never compute with infinities (a softmax's running max starts at the lowest float).
BUILD_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]
LINK_FLAGS = ["-fopenmp"]
# Another -march than native for the kernels (e.g. haswell: the AVX2 build, tested and measured on an AVX-512 machine).
KERNEL_MARCH_VARIABLE = "LMSERVE_KERNEL_MARCH"
# CPU features the kernels' dispatch treats as absent (comma-separated; e.g. amx,vnni): how one machine runs the choices
# another CPU kind would make (batched_path's auto, block_activations' auto) without another build.
DISABLED_FEATURES_VARIABLE = "LMSERVE_DISABLE_CPU_FEATURES"
# avx2-split: the AVX2 build's activation split in vectors (kernels/int16_activations.h), so that the element-by-element
# one before it stays runnable and measurable. q8k: the 8-bit K-quant products' one activation scale per 256 inputs
# (kernels/kquant_int16.cpp, llama.cpp's q8_K); disabled, one per 32 as before.
DISABLEABLE_FEATURES = ("amx", "vnni", "avx2-split", "q8k")
TORCH_BUILD_LOCK = "lock"  # torch.utils.cpp_extension's FileBaton in the build directory
LIBRARY = "lmserve_cpu_kernels"
BUILD_STAMP = f"{LIBRARY}.stamp"  # build_key() of the library beside it


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's instruction-set flags from /proc/cpuinfo (empty where there is none): what `-march=native` builds for."""
    line = ""
    with contextlib.suppress(OSError):
        line = next((row for row in Path("/proc/cpuinfo").read_text().splitlines() if row.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def cpu_signature() -> str:
    """A short hash of the CPU's instruction-set flags: `-march=native` code must never load on a CPU without them."""
    return hashlib.sha1(f"{platform.machine()} {' '.join(sorted(cpu_flags()))}".encode()).hexdigest()[:10]


def kernel_march() -> str:
    """The -march the kernels are built for: native, or what LMSERVE_KERNEL_MARCH names (checked to be one word, as it
    goes onto the compiler's command line), optionally with `+`-joined -m options: `haswell` (the AVX2 build),
    `native+no-amx-tile` (no AMX kernel built), `znver3+avx512f+avx512vnni+...` (what GCC 12.2 makes of a Zen 4)."""
    march = os.environ.get(KERNEL_MARCH_VARIABLE, "").strip() or "native"
    if not re.fullmatch(r"[a-z0-9][a-z0-9_.-]*(\+[a-z0-9][a-z0-9_.-]*)*", march):
        raise ValueError(f"{KERNEL_MARCH_VARIABLE}={march!r} is not a -march name (e.g. native, haswell, x86-64-v3)")
    return march


def disabled_features() -> frozenset[str]:
    """What LMSERVE_DISABLE_CPU_FEATURES names (amx: no AMX kernel, prompt rows as a CPU without AMX runs them; vnni:
    no int16-activation kernel; avx2-split: the AVX2 build's int16 kernels split activations element by element; q8k:
    the 8-bit q4_k, q5_k and q6_k products take one activation scale per 32 inputs instead of per 256); an unknown
    name raises."""
    names = frozenset(n.strip() for n in os.environ.get(DISABLED_FEATURES_VARIABLE, "").split(",") if n.strip())
    unknown = sorted(names - set(DISABLEABLE_FEATURES))
    if unknown:
        raise ValueError(f"{DISABLED_FEATURES_VARIABLE}: unknown feature {', '.join(unknown)}: use any of "
                         f"{', '.join(DISABLEABLE_FEATURES)}")
    return names


def build_flags() -> list[str]:
    """BUILD_FLAGS for kernel_march(): -march=NAME, then -mOPTION for each `+OPTION`."""
    march, *extensions = kernel_march().split("+")
    flags = [f"-march={march}" if flag == "-march=native" else flag for flag in BUILD_FLAGS]
    return flags + [f"-m{extension}" for extension in extensions]


def build_directory() -> Path:
    """One folder per torch version, CPU and -march, under lmserve's cache, so that a kernel built against another
    torch or for another CPU (a shared home directory) is never loaded."""
    march = kernel_march()
    cpu = f"cpu-{cpu_signature()}" + ("" if march == "native" else f"-march-{march}")
    path = cache_directory() / "kernels" / f"torch-{torch.__version__}" / cpu
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def _only_builder(directory: Path) -> Iterator[None]:
    """Holds an exclusive lock on the build directory while building or loading.

    torch's own lock is a file whose existence means "a build is running": a build that was killed (a server stopped
    while it compiled) leaves it behind, and every later start would wait on it forever. The kernel's lock is released
    by the kernel when its holder dies, so whoever holds it knows that any torch lock file left is stale.
    """
    with open(directory / "lmserve-build.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = directory / TORCH_BUILD_LOCK
            if stale.exists():
                logger.warning("removing %s, left by a kernel build that did not finish", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build_key() -> str:
    """What the built library is made of: the sources' text, the flags, torch (its version and its files' real place)
    and Python. Written beside the library once it loaded (BUILD_STAMP). The real place, so that one virtualenv
    reached through two paths (a symlink) shares one build instead of rebuilding whenever the other path starts."""
    digest = hashlib.sha256()
    for name in SOURCES + HEADERS:
        digest.update(name.encode() + b"\0" + (SOURCE_DIR / name).read_bytes() + b"\0")
    torch_files = str(Path(torch.__file__).resolve().parent)
    digest.update(" ".join([*build_flags(), "|", *LINK_FLAGS, torch.__version__, torch_files, sys.version]).encode())
    return digest.hexdigest()


@functools.cache
def cpu_kernels():
    """The `torch.ops.lmserve` namespace with every CPU kernel (SOURCES), building them if needed; raises
    RuntimeError when they cannot be built.

    A library whose stamp says it was built from exactly these sources and flags is loaded as it is; anything else
    goes through torch's extension builder (which rebuilds what changed). That builder costs ~0.2 s of start-up even
    when nothing changed (it imports setuptools and runs ninja)."""
    started = time.perf_counter()
    directory = build_directory()
    library, stamp, key = directory / f"{LIBRARY}.so", directory / BUILD_STAMP, build_key()
    try:
        with _only_builder(directory):
            if library.is_file() and stamp.is_file() and stamp.read_text() == key:
                torch.ops.load_library(str(library))
            else:
                from torch.utils import cpp_extension

                stamp.unlink(missing_ok=True)
                cpp_extension.load(
                    name=LIBRARY,
                    sources=[str(SOURCE_DIR / name) for name in SOURCES],
                    extra_cflags=build_flags(),
                    extra_ldflags=LINK_FLAGS,
                    build_directory=str(directory),
                    is_python_module=False,
                    verbose=False,
                )
                stamp.write_text(key)
    except Exception as exc:  # a missing compiler or ninja shows up as one of several exception types
        raise RuntimeError(f"could not build lmserve's CPU kernels: {exc}") from exc
    if hasattr(torch.ops.lmserve, "set_avx2_split"):  # built where the int16 kernels build
        torch.ops.lmserve.set_avx2_split("avx2-split" not in disabled_features())
        torch.ops.lmserve.set_kquant_super_scale("q8k" not in disabled_features())
    logger.debug("CPU kernels ready in %.1fs", time.perf_counter() - started)
    return torch.ops.lmserve


def paged_attention_op():
    """`torch.ops.lmserve.paged_attention` (worker/kernels/paged_attention.cpp)."""
    return cpu_kernels().paged_attention


@functools.cache
def paged_keys_transposed() -> bool:
    """Whether the built paged attention kernel reads K blocks transposed, [block, kv head, head dim, key] (a build
    for AVX-512), or laid out as V's, [block, kv head, key, head dim] (any other): kernels/paged_attention.h."""
    return bool(cpu_kernels().paged_keys_transposed())


@functools.cache
def top_p_mask_op():
    """`torch.ops.lmserve.top_p_mask` (worker/kernels/top_p.cpp), or None where the kernels do not build."""
    try:
        return cpu_kernels().top_p_mask
    except RuntimeError:
        return None


@functools.cache
def moe_combine_op():
    """`torch.ops.lmserve.moe_combine` (kernels/moe_block.h's combine_slots, the C++ MoE block's weighted sum), or
    None where the kernels do not build."""
    try:
        return cpu_kernels().moe_combine
    except RuntimeError:
        return None


def write_kv_cache_op():
    """`torch.ops.lmserve.write_kv_cache` (worker/kernels/paged_attention.cpp)."""
    return cpu_kernels().write_kv_cache


FUSED_OPS = ("auto", "none", "cpu")


def check_fused_ops(name: str | None, device: torch.device, dtype: torch.dtype) -> str:
    """`cpu` (fused_ops.cpp for RMSNorm + residual, SiLU-and-multiply and RoPE) or `none` (PyTorch ops). auto picks
    cpu on CPU with float32 when the kernels build; an explicit cpu that cannot run raises."""
    name = name or "auto"
    if name not in FUSED_OPS:
        raise ValueError(f"unknown fused ops {name!r}: use one of {', '.join(FUSED_OPS)}")
    if name == "none":
        return name
    if device.type != "cpu" or dtype != torch.float32:
        if name == "auto":
            return "none"
        raise ValueError(f"--fused-ops cpu runs on CPU with float32 (here: {device.type}, {dtype})")
    return "cpu" if cpu_kernels_load(name != "auto", "the model runs PyTorch's ops instead of the fused ones") else "none"


def cpu_kernels_load(explicit: bool, fallback: str) -> bool:
    """Whether the kernels build and load. When the user asked for them (`explicit`) a failure raises; under auto it is
    logged with what happens instead (`fallback`)."""
    try:
        cpu_kernels()
    except RuntimeError as exc:
        if explicit:
            raise
        logger.warning("%s; %s", exc, fallback)
        return False
    return True
