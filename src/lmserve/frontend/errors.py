"""Errors the front-end raises to its callers (the API server, scripts) about the engine's state and the client's."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine core process died; every in-flight request fails and no new one can run."""


class EngineNotReadyError(RuntimeError):
    """The engine core is still starting (loading weights, allocating the KV cache)."""


class QueueFullError(RuntimeError):
    """--max-queued-requests requests already wait for the engine: the caller should retry later (HTTP 429)."""


class ClientDisconnected(Exception):
    """The client that asked went away before its answer was done: its engine requests were aborted."""
