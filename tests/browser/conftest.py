"""The browser tests start a real server with the API tests' helper (tests/api/server_process.py)."""

from __future__ import annotations

import sys
from pathlib import Path

API_TESTS = str(Path(__file__).resolve().parents[1] / "api")
if API_TESTS not in sys.path:
    sys.path.insert(0, API_TESTS)
