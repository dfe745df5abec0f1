"""exit_closed ends a process at once with its code, and what it printed or logged is not lost."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_exit_closed_keeps_the_code_and_flushes_streams_and_logs(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    program = f"""
import atexit, logging, sys
from lmserve.process_exit import exit_closed
logging.basicConfig(filename={str(log)!r}, level=logging.INFO)
logging.getLogger("engine").info("stopped cleanly")
atexit.register(lambda: print("atexit ran"))  # the interpreter's teardown, which exit_closed skips
sys.stdout.write("no newline, still buffered")
sys.stderr.write("the reason, unflushed")
exit_closed(3)
"""
    done = subprocess.run([sys.executable, "-c", program], check=False, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 3
    assert done.stdout == "no newline, still buffered"
    assert done.stderr == "the reason, unflushed"
    assert "stopped cleanly" in log.read_text()
