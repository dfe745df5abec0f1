"""Servers that several test files share: one start (~3 CPU-s, 15-20 s of a pytest-xdist worker's one CPU on this
machine's AVX2 kind) serves every file that asks for the same configuration.

A session fixture starts at most once per pytest-xdist worker, so the files that share a server are one unit of
`--dist loadfile` (tests/conftest.py: DEFAULT_HERMES_SERVER_FILES), which one worker runs.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest
from server_process import Server, start_server


@pytest.fixture(scope="session")
def default_hermes_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The default model with auto tool choice and the hermes parser, 1,024 positions a request: the configuration
    test_anthropic_real.py, test_auto_tool_choice.py and test_fim.py (a model without FIM tokens) each started a
    server of. Tests may not change it (no engine kill, no server flags of their own)."""
    server = start_server(tmp_path_factory.mktemp("default-hermes"), "--enable-auto-tool-choice", "--tool-call-parser",
                          "hermes", "--kv-cache-memory", "64MiB", "--max-model-len", "1024")
    yield server
    server.stop(signal.SIGKILL)
