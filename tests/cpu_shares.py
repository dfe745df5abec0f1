"""The CPUs of the machine the suite runs on, as against the share of them a pytest-xdist worker runs on.

Under `pytest -n N` each worker pins itself to a share of the CPUs (tests/conftest.py), and the servers and engines it
starts size their threads from that share. Tests that must run on every CPU (multi-threaded kernels) ask for these.
"""

from __future__ import annotations

import os

MACHINE_CPUS_VARIABLE = "LMSERVE_TEST_MACHINE_CPUS"


def remember_machine_cpus() -> list[int]:
    """Called before a worker pins itself: its CPUs now are the machine's (for the tests, and their subprocesses)."""
    cpus = sorted(os.sched_getaffinity(0))
    os.environ[MACHINE_CPUS_VARIABLE] = ",".join(map(str, cpus))
    return cpus


def machine_cpus() -> list[int]:
    listed = os.environ.get(MACHINE_CPUS_VARIABLE)
    return [int(cpu) for cpu in listed.split(",")] if listed else sorted(os.sched_getaffinity(0))
