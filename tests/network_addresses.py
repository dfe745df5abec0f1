"""Addresses for tests of deployments that span machines, run here as processes that meet on this machine's network
address (as other machines would), not on the loopback."""

from __future__ import annotations

import random
import socket
from pathlib import Path


def non_loopback_address() -> str:
    """This machine's address on its network, as another machine would reach it (the loopback where it has none)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 1))  # UDP: picks the route, sends nothing
            return probe.getsockname()[0]
        except OSError:
            return "127.0.0.1"


_PORTS = random.SystemRandom()  # not the random module's state, which a test may seed (then every worker picks alike)


def free_port_block(host: str, count: int) -> int:
    """A port such that it and the count - 1 after it are free on host (a rendezvous port and the sockets after it).
    Below the kernel's ephemeral range: a port from it (what binding port 0 gives) may become the local port of any
    outgoing connection between this check and the server's bind seconds later (a flake seen once: EADDRINUSE)."""
    low = _ephemeral_range()[0]
    for _ in range(50):
        base = _PORTS.randrange(10_000, low - count) if low - count > 10_000 else _any_free_port(host)
        held = []
        try:
            for port in range(base, base + count):
                held.append(socket.socket())
                held[-1].bind((host, port))
            return base
        except OSError:
            continue
        finally:
            for sock in held:
                sock.close()
    raise RuntimeError(f"no {count} consecutive free ports on {host}")


def _any_free_port(host: str) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def _ephemeral_range() -> tuple[int, int]:
    """The ports the kernel gives outgoing connections (Linux's default where it does not say)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999
