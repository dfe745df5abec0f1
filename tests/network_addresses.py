"""Addresses for tests of deployments that span machines, run here as processes that meet on this machine's network
address (as other machines would), not on the loopback."""

from __future__ import annotations

import socket


def non_loopback_address() -> str:
    """This machine's address on its network, as another machine would reach it (the loopback where it has none)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 1))  # UDP: picks the route, sends nothing
            return probe.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def free_port_block(host: str, count: int) -> int:
    """A port such that it and the count - 1 after it are free on host (a rendezvous port and the sockets after it)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind((host, 0))
            base = probe.getsockname()[1]
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
