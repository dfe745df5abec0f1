"""Start a real `lmserve serve` on 127.0.0.1 for end-to-end tests, and find its engine process."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

LMSERVE = Path(sys.executable).parent / "lmserve"
# One client for the helpers that poll a server: `httpx.get` builds a TLS context each call (~20 ms of CPU), taken
# from the one CPU that a pytest worker shares with the servers it starts.
HTTP = httpx.Client(timeout=10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        text = (task / "children").read_text() if (task / "children").exists() else ""
        found += [int(c) for c in text.split()]
    return found


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def wait_for(predicate: Callable[[], Any], timeout: float = 20.0, interval: float = 0.05) -> Any:
    """The predicate's first truthy value within the timeout, else its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(interval)
    return predicate()


@dataclass
class Server:
    process: subprocess.Popen
    base_url: str
    log_path: Path

    @property
    def engine_pid(self) -> int:
        for pid in children(self.process.pid):
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"lmserve.engine.core_proc" in cmdline:
                return pid
        raise RuntimeError("engine process not found")

    @property
    def socket_directory(self) -> Path:
        """Where the engine's ipc sockets are (and its temporary files): its command line names them (ipc://DIR/input)."""
        arguments = Path(f"/proc/{self.engine_pid}/cmdline").read_bytes().decode().split("\0")
        directory = Path(next(a for a in arguments if a.startswith("ipc://")).removeprefix("ipc://")).parent
        assert directory.is_dir(), directory
        return directory

    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()


def launch_server(tmp: Path, *args: str, command: list[str] | None = None,
                  env: dict[str, str] | None = None) -> Server:
    """`lmserve serve ARGS` (or `command serve ARGS`) on a free port, started: wait_healthy() waits for it. env:
    variables set for it on top of this process's."""
    port = free_port()
    log_path = tmp / f"server-{port}.log"
    cmd = [*(command or [str(LMSERVE)]), "serve", "--port", str(port), *args]
    with open(log_path, "w") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                   env={**os.environ, **(env or {})})
    return Server(process, f"http://127.0.0.1:{port}", log_path)


def wait_healthy(server: Server, timeout: float = 180) -> Server:
    """The server once /health answers 200; raises with its log if it exits or takes longer than `timeout`."""
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=2) as client:  # a client of its own: HTTP may be polled from other threads
        while time.monotonic() < deadline:
            if server.process.poll() is not None:
                raise RuntimeError(f"server exited with {server.process.returncode}:\n{server.log()}")
            try:
                if client.get(f"{server.base_url}/health").status_code == 200:
                    return server
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
    server.stop(signal.SIGKILL)
    raise RuntimeError(f"server not healthy after {timeout}s:\n{server.log()}")


def start_server(tmp: Path, *args: str, timeout: float = 180, command: list[str] | None = None,
                 env: dict[str, str] | None = None) -> Server:
    """launch_server(), then wait_healthy()."""
    return wait_healthy(launch_server(tmp, *args, command=command, env=env), timeout)


def start_servers(tmp: Path, *arguments: tuple[str, ...], timeout: float = 180) -> list[Server]:
    """Several servers started side by side (a start is mostly one core's imports): each once healthy. If one fails,
    the others are stopped too."""
    servers = [launch_server(tmp, *args) for args in arguments]
    try:
        return [wait_healthy(server, timeout) for server in servers]
    except BaseException:
        for server in servers:
            server.stop(signal.SIGKILL)
        raise


def debug_engine(server: Server, *request_ids: str) -> dict:
    """/debug/engine, with the positions and status of the given requests."""
    params = [("request_id", r) for r in request_ids]
    return HTTP.get(f"{server.base_url}/debug/engine", params=params).json()
