"""A kernel build killed midway leaves torch's lock file behind; the next start must not wait on it forever. A library
built from the current sources loads without torch's builder."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils import cpp_extension

from lmserve.worker import kernels


def test_a_stale_torch_build_lock_is_removed_under_lmserves_own_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LMSERVE_CACHE", str(tmp_path))
    directory = kernels.build_directory()
    (directory / kernels.TORCH_BUILD_LOCK).touch()  # as a killed build leaves it
    seen: dict[str, bool] = {}

    def fake_load(**kwargs: object) -> None:
        assert kwargs["build_directory"] == str(directory)
        seen["stale_lock_left"] = (directory / kernels.TORCH_BUILD_LOCK).exists()
        with open(directory / "lmserve-build.lock") as other:
            try:
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
                seen["exclusive"] = False
            except BlockingIOError:
                seen["exclusive"] = True

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    kernels.cpu_kernels.__wrapped__()
    assert seen == {"stale_lock_left": False, "exclusive": True}


def test_a_library_built_from_these_sources_loads_without_torchs_builder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stamped with build_key(): loaded as it is. Any other stamp (a source or a flag changed, another torch):
    torch's builder, which rebuilds, and the stamp is rewritten."""
    monkeypatch.setenv("LMSERVE_CACHE", str(tmp_path))
    directory = kernels.build_directory()
    library, stamp = directory / f"{kernels.LIBRARY}.so", directory / kernels.BUILD_STAMP
    library.write_bytes(b"a built library")
    calls: list[str] = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: calls.append("builder"))
    monkeypatch.setattr(torch.ops, "load_library", lambda path: calls.append(path))

    stamp.write_text("the key of other sources")
    kernels.cpu_kernels.__wrapped__()
    assert calls == ["builder"] and stamp.read_text() == kernels.build_key()
    kernels.cpu_kernels.__wrapped__()
    assert calls == ["builder", str(library)]


def test_a_warm_start_never_imports_torchs_builder() -> None:
    kernels.cpu_kernels()  # built and stamped for this interpreter
    code = ("import sys; from lmserve.worker.kernels import cpu_kernels; ops = cpu_kernels(); ops.q4_1_linear;"
            " assert 'torch.utils.cpp_extension' not in sys.modules and 'setuptools' not in sys.modules")
    env = {**os.environ, "PYTHONPATH": str(Path(kernels.__file__).parents[3])}
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, env=env)


def test_another_march_builds_apart_and_a_bad_one_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """LMSERVE_KERNEL_MARCH builds for that -march into a folder of its own, under a key of its own, so that the
    native library and the other one never replace each other; a value that is not one word never reaches g++."""
    monkeypatch.setenv("LMSERVE_CACHE", str(tmp_path))
    monkeypatch.delenv(kernels.KERNEL_MARCH_VARIABLE, raising=False)
    native_directory, native_key = kernels.build_directory(), kernels.build_key()
    assert "-march=native" in kernels.build_flags()
    monkeypatch.setenv(kernels.KERNEL_MARCH_VARIABLE, "haswell")
    assert "-march=haswell" in kernels.build_flags() and "-march=native" not in kernels.build_flags()
    assert kernels.build_directory() != native_directory and kernels.build_key() != native_key
    seen: dict[str, object] = {}
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: seen.update(kwargs))
    kernels.cpu_kernels.__wrapped__()
    assert "-march=haswell" in seen["extra_cflags"] and seen["build_directory"] == str(kernels.build_directory())
    monkeypatch.setenv(kernels.KERNEL_MARCH_VARIABLE, "haswell -fplugin=evil.so")
    with pytest.raises(ValueError, match="not a -march name"):
        kernels.build_flags()
