"""`lmserve serve`: the API-server process (FastAPI + uvicorn + AsyncLLM) and, through AsyncLLM, the engine process."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Sequence

from lmserve.api.tool_parsers import ToolConfig
from lmserve.config import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_LIMIT_CONCURRENCY,
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    EngineConfig,
)
from lmserve.frontend.async_llm import AsyncLLM

logger = logging.getLogger(__name__)

# After the engine dies, keep answering 503 this long (so clients and probes see why), then exit non-zero.
ENGINE_DEATH_GRACE_VARIABLE = "LMSERVE_ENGINE_DEATH_GRACE_S"
DEFAULT_ENGINE_DEATH_GRACE_S = 3.0
MAX_ENGINE_DEATH_GRACE_S = 600.0


def engine_death_grace_s() -> float:
    """LMSERVE_ENGINE_DEATH_GRACE_S: seconds of 503 answers between the engine's death and the server's exit (vLLM
    exits at once; a probe or a client polling /health learns why first). ValueError names a bad value."""
    text = os.environ.get(ENGINE_DEATH_GRACE_VARIABLE)
    if text is None:
        return DEFAULT_ENGINE_DEATH_GRACE_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds <= MAX_ENGINE_DEATH_GRACE_S:  # also refuses nan
        raise ValueError(f"{ENGINE_DEATH_GRACE_VARIABLE}={text!r}: give seconds from 0 to "
                         f"{MAX_ENGINE_DEATH_GRACE_S:.0f}")
    return seconds


class ShutdownRequested(Exception):
    """SIGINT or SIGTERM arrived: stop serving and shut the engine down."""


class PortUnavailable(Exception):
    """The address to serve on cannot be bound (in use, not ours, not resolvable)."""


def bind_listening_socket(host: str, port: int) -> socket.socket:
    """Binds HOST:PORT before the engine starts.

    The engine's ranks open ephemeral ports of their own (gloo, zmq): binding after them could find the port taken,
    and a busy port is better reported before a model loads than after.
    """
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise PortUnavailable(f"cannot serve on {host}:{port}: {exc}") from exc
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise PortUnavailable(f"cannot serve on {host}:{port}: {exc.strerror or exc}") from exc
    return sock


async def serve(
    config: EngineConfig,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    served_model_name: str | list[str] | None = None,
    log_level: str = "info",
    request_log: str | None = None,
    api_cpus: list[int] | None = None,
    max_queued_requests: int | None = None,
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
    tools: ToolConfig | None = None,
    allowed_origins: list[str] | None = None,
    engine_death_grace: float = DEFAULT_ENGINE_DEATH_GRACE_S,
    header_timeout: float = DEFAULT_HEADER_TIMEOUT_S,
    body_timeout: float = DEFAULT_BODY_TIMEOUT_S,
    limit_concurrency: int = DEFAULT_LIMIT_CONCURRENCY,
    more_models: Sequence[tuple[EngineConfig, str | None]] = (),
) -> int:
    """Runs until SIGINT/SIGTERM (exit code 0) or until the engine dies (exit code 1, `engine_death_grace` seconds
    later) or the address cannot be bound (exit code 1).

    `more_models`: other models to serve beside `config`'s (--embedding-model, --rerank-model), each in an engine
    process of its own, named by its served name (None: its model argument). Then one dead engine fails its own model's requests (503) and
    /health, and the others go on serving; the server exits once every engine is dead."""
    try:
        listening = bind_listening_socket(host, port)
    except PortUnavailable as exc:
        logger.error("%s", exc)
        return 1
    first_name = served_model_name[0] if isinstance(served_model_name, list) else served_model_name
    llm = AsyncLLM(config, served_model_name=first_name, log_level=log_level.upper(),
                   max_queued_requests=max_queued_requests)
    others: list[AsyncLLM] = []
    try:
        # Each model's engine process loads its weights while the next one starts.
        for other, name in more_models:
            others.append(AsyncLLM(other, served_model_name=name, log_level=log_level.upper(),
                                   max_queued_requests=max_queued_requests))
    except BaseException:
        for started in (llm, *others):
            await started.shutdown()
        raise
    if api_cpus:
        # After the engine processes have started: they keep their own placement (config.placement).
        os.sched_setaffinity(0, api_cpus)
    for started in (llm, *others):
        started.start()
    # The web stack only now, with the engine process already loading the model: its imports (FastAPI, uvicorn, the
    # API's schemas, ~1 s) overlap the engine's start-up instead of delaying it.
    import uvicorn

    from lmserve.api.connections import uvicorn_config
    from lmserve.api.server import build_app

    app = build_app(llm, api_key=api_key, served_model_name=served_model_name, request_log=request_log,
                    max_request_body_bytes=max_request_body_bytes, tools=tools, allowed_origins=allowed_origins,
                    body_timeout=body_timeout, more_models=others)
    server = uvicorn.Server(
        uvicorn_config(app, header_timeout=header_timeout, limit_concurrency=limit_concurrency, host=host, port=port,
                       log_level=log_level, timeout_graceful_shutdown=3)
    )
    app.state.is_shutting_down = lambda: server.should_exit  # long-lived streams (the dashboard) end on it
    exit_code = 0

    engines = [llm, *others]

    def on_engine_dead() -> None:
        nonlocal exit_code
        if server.should_exit:
            return  # already stopping: a SIGTERM to the process group reached the engine too
        if not all(engine.errored for engine in engines):
            dead = [engine.model_name for engine in engines if engine.errored]
            logger.error("the engine of %s died: its requests and /health answer 503; the other models go on "
                         "serving", ", ".join(map(repr, dead)))
            return
        exit_code = 1
        asyncio.get_running_loop().call_later(engine_death_grace, setattr, server, "should_exit", True)

    for engine in engines:
        engine.on_engine_dead = on_engine_dead
    try:
        await server.serve(sockets=[listening])
    except ShutdownRequested:
        pass
    finally:
        await asyncio.gather(*(engine.shutdown() for engine in engines))
        app.state.recorder.close()
        listening.close()
    if exit_code:
        logger.error("exiting because the engine died: %s", "; ".join(engine.dead_reason for engine in engines))
    return exit_code
