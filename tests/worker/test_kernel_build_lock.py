"""A kernel build killed midway leaves torch's lock file behind; the next start must not wait on it forever."""

from __future__ import annotations

import fcntl
from pathlib import Path

import pytest
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
