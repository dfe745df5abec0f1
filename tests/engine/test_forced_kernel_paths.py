"""The engine's batch-invariance and seeded-sampling tests under every kernel path this machine can execute.

Each CPU kind takes its own path through the kernels (AMX: prompt rows on the AMX kernel; AVX-512 VNNI without AMX:
every row on the int16 block kernels (VPDPBUSD), no float16 copy; AVX2 only: the AVX2 builds of the int16 and
attention kernels for every block format, prompt rows on fbgemm's float16 copy). A mixture of experts' K-quant
experts (every row on the block kernels) must match transformers and keep a token's result its own on each. Speculative decoding's verify steps (several generated rows
of one request in a batch) must give plain decoding's greedy tokens on each path too. `--block-activations float32` (the VNNI build with LMSERVE_DISABLE_CPU_FEATURES=vnni) is one
more path. Issue 32 was a seeded request whose first token changed with its batch on the second kind
only, which no machine we tested on ran. Here the same tests run in a fresh interpreter with the dispatch told to act
as each other kind would (LMSERVE_DISABLE_CPU_FEATURES, LMSERVE_KERNEL_MARCH); a path that cannot run here is skipped
with the reason.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from cpu_shares import machine_cpus

from lmserve.worker import kernels

ROOT = Path(__file__).resolve().parents[2]
INVARIANCE_TESTS = "matches_alone or bit_for_bit or seeded"


def _needs(*flags: str) -> str | None:
    missing = [flag for flag in flags if flag not in kernels.cpu_flags()]
    return f"this CPU lacks {', '.join(missing)}" if missing else None


# Under pytest-xdist each worker runs on a share of the CPUs (tests/conftest.py), and so do the engines it builds: one
# thread each on 2 cores. These suites run on all of the machine's CPUs, so that every path's work is split between
# threads as a user's engine splits it; waiting passively at OpenMP barriers, so as not to take the neighbouring
# worker's core while they wait (docs/benchmarks.md, "pytest-xdist").
MACHINE_CPUS = machine_cpus()
FEWER_CPUS_THAN_THE_MACHINE = len(os.sched_getaffinity(0)) < len(MACHINE_CPUS)

# (id, environment, reason it cannot run here or None)
# On an AVX2-only CPU the native build is an AVX2 build: it takes the paths avx2-build forces elsewhere, without a
# second build of the kernels (~1.5 minutes of a fresh machine's 2 cores).
AVX2_ONLY = bool(_needs("avx512f")) and not _needs("avx2", "fma", "f16c")

FORCED_PATHS = [
    ("native-all-cpus", {},
     "the suite's own engines already take every CPU here" if not FEWER_CPUS_THAN_THE_MACHINE else None),
    ("no-amx", {kernels.DISABLED_FEATURES_VARIABLE: "amx"},
     _needs("amx_tile") and "no AMX here: the native run already takes the path of a CPU without it"),
    ("no-amx-no-vnni", {kernels.DISABLED_FEATURES_VARIABLE: "amx,vnni"},
     _needs("avx512_vnni") and "no AVX-512 VNNI here: the kernels' AVX2 build has no VNNI to turn off"),
    ("avx2-build", {kernels.KERNEL_MARCH_VARIABLE: "haswell", kernels.DISABLED_FEATURES_VARIABLE: "amx,vnni"},
     _needs("avx2", "fma", "f16c")
     or (AVX2_ONLY and FEWER_CPUS_THAN_THE_MACHINE
         and "AVX2 only here: native-all-cpus runs the AVX2 build's paths, built once")),
]


@pytest.mark.slow
@pytest.mark.parametrize(("env", "unavailable"), [p[1:] for p in FORCED_PATHS], ids=[p[0] for p in FORCED_PATHS])
def test_engine_invariance_under_forced_kernel_path(env: dict[str, str], unavailable: str | None) -> None:
    if unavailable:
        pytest.skip(unavailable)
    # The stored formats' tests too: which format a layer takes depends on what runs (no q5_0 kernel without VNNI),
    # and the K-quant kernel's AVX2 build is another source path (kernels/kquant_int16.cpp).
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", "-o", "log_cli=true",
               "--log-cli-level=INFO",
               str(ROOT / "tests/engine/test_engine_e2e.py"), str(ROOT / "tests/worker/test_kquant_formats.py"),
               str(ROOT / "tests/worker/test_stored_formats.py"), str(ROOT / "tests/engine/test_speculative_e2e.py"),
               str(ROOT / "tests/worker/test_layer_program.py"), str(ROOT / "tests/worker/test_moe.py"),
               str(ROOT / "tests/worker/test_gpt_oss.py"), str(ROOT / "tests/worker/test_mxfp4.py"),
               "-k", (f"{INVARIANCE_TESTS} or kquant or stored_formats or greedy_tokens_equal_plain"
                      " or (python_loops_bits and (default_source or q4_k_m))"
                      " or k_quant_experts or other_tokens_of_its_step or gpt_oss_matches or mxfp4")]
    if FEWER_CPUS_THAN_THE_MACHINE:
        env = {**env, "OMP_WAIT_POLICY": "passive"}
    # Not an xdist worker itself (tests/conftest.py would give it its share of the CPUs again).
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST_")}
    result = subprocess.run(command, check=False, cwd=ROOT, env={**inherited, **env}, capture_output=True, text=True,
                            timeout=900, preexec_fn=lambda: os.sched_setaffinity(0, MACHINE_CPUS))
    tail = result.stdout[-6000:] + result.stderr[-2000:]
    assert result.returncode == 0, f"under {env}:\n{tail}"
    assert " passed" in result.stdout and " failed" not in result.stdout, tail
    # Every engine split its work between as many threads as the machine has CPUs.
    threads = re.findall(r"engine compute: (\d+) thread", result.stdout)
    assert threads and set(threads) == {str(len(MACHINE_CPUS))}, f"under {env}: engines of {set(threads)} threads"
    if kernels.KERNEL_MARCH_VARIABLE in env or AVX2_ONLY:  # the K-quant kernel's AVX2 build ran
        assert "kquant_int16" not in result.stdout, f"the K-quant kernel did not run under {env}:\n{tail}"


def test_forced_features_reach_the_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """What LMSERVE_DISABLE_CPU_FEATURES names is off for every auto choice; an unknown name is refused."""
    from lmserve.worker.weights import kernel_choice

    monkeypatch.setenv(kernels.DISABLED_FEATURES_VARIABLE, "amx,vnni")
    assert not kernel_choice.amx_kernel_loads()
    path = kernel_choice.batched_path("auto")
    assert path.prompt_copies and path.prompt_weights == "fp16"
    with pytest.raises(ValueError, match="prompt-bf16 needs a CPU with AMX"):
        kernel_choice.batched_path("prompt-bf16")
    if kernels.cpu_kernels().int16_uses_vnni():  # the VNNI build's int16 kernels are off; an AVX2 build's stay on
        assert not kernel_choice.int16_kernel_loads() and kernel_choice.block_activations("auto") == "float32"
        with pytest.raises(ValueError, match="int16 needs a CPU with AVX2, FMA and F16C, or AVX-512 VNNI"):
            kernel_choice.block_activations("int16")
        with pytest.raises(ValueError, match="int8 needs a CPU with AVX2, FMA and F16C, or AVX-512 VNNI"):
            kernel_choice.block_activations("int8")
    else:  # the AVX2 build: int16 for every block format (float32 only when asked: it is not batch-invariant)
        assert kernel_choice.int16_kernel_loads() and kernel_choice.block_activations("int16") == "int16"
        assert kernel_choice.block_activations("auto") == "int16" and kernel_choice.block_activations("int8") == "int8"
    monkeypatch.setenv(kernels.DISABLED_FEATURES_VARIABLE, "amx,sse9")
    with pytest.raises(ValueError, match="unknown feature sse9"):
        kernels.disabled_features()
