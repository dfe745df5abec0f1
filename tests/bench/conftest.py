"""tests/api/server_process.py starts real servers; the bench tests use it too."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "api"))
