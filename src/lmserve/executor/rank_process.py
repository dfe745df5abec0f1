"""The main loop of one rank process (`python -m lmserve.executor.rank_process INPUT RESULTS RANK INIT_METHOD
WORLD_SIZE/NNODES [PLACEMENT_JSON]`), started by the multiproc executor or, on another node, by `lmserve serve
--headless`: take the configuration from the engine, build the rank's Worker, then run every step the engine sends
until told to stop."""

from __future__ import annotations

import ctypes
import dataclasses
import json
import logging
import os
import signal
import sys

import zmq

from lmserve.config import EngineConfig, PlacementConfig
from lmserve.distributed.signed_frames import SignedFrames, curve_client, key_from_environment
from lmserve.process_exit import exit_closed, process_alive

logger = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
PARENT_CHECK_MS = 1000


def name_process(rank: int) -> None:
    """`lmserve-rank0`, ... in ps -o comm and top: a forked rank's command line is the fork server's."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_NAME, f"lmserve-rank{rank}".encode()[:15])
    except OSError:
        pass


def die_with_parent() -> None:
    """The kernel kills this rank when the engine process dies, however it dies (Linux; elsewhere the loop's parent
    check does it within a second)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def next_message(inputs: zmq.Socket, frames: SignedFrames, parent: int,
                 engine_pid: int | None = None) -> tuple[str, object] | None:
    """The engine's next message (one that is not signed with the engine's key is dropped unread); None once the
    process that started this rank, or the engine, is gone."""
    while True:
        while not inputs.poll(PARENT_CHECK_MS):
            if os.getppid() != parent or (engine_pid is not None and not process_alive(engine_pid)):
                return None
        message = frames.recv(inputs)
        if message is not None:
            return message  # type: ignore[return-value]


def grammar_masks(inputs: zmq.Socket, frames: SignedFrames, parent: int, engine_pid: int | None) -> object:
    """A constrained step's masks (lmserve.step.GrammarMasks), which the engine sends right after the step: the next
    message on this rank's socket when the step samples."""
    message = next_message(inputs, frames, parent, engine_pid)
    if message is None or message[0] != "grammar":
        raise RuntimeError("the engine sent no grammar masks for this step (it sent "
                           f"{repr(message[0]) if message else 'nothing: it is gone'})")
    return message[1]


def layout_mismatch(config: EngineConfig, layout: str) -> str | None:
    """Why this rank cannot join the engine that configured it: its node was started with another layout
    (`layout`: "WORLD_SIZE/NNODES" as the starter saw it)."""
    parallel = config.parallel
    if layout == f"{parallel.world_size}/{parallel.nnodes}":
        return None
    world_size, nnodes = layout.split("/")
    return (f"this node was started for {world_size} ranks over {nnodes} node(s), the engine runs "
            f"{parallel.world_size} over {parallel.nnodes}: give every node the same -tp, -pp and --nnodes")


def on_this_machine(config: EngineConfig, placement: str | None) -> EngineConfig:
    """The engine's configuration with this machine's CPUs and threads where its starter gave them (a --headless
    node's own --engine-cpus / --engine-threads: the engine's machine may have other CPUs)."""
    if placement is None:
        return config
    return dataclasses.replace(config, placement=PlacementConfig(**json.loads(placement)))


def forked_main(engine_pid: int, environment: dict[str, str], log_level: str, *arguments: str) -> None:
    """A rank forked by the engine's fork server (lmserve.executor.rank_starter): main() as the command line runs it.
    The server lives while any process holds its "alive" pipe, which each forked child inherits: the rank lets go of
    it, so that the server goes with the engine and the kernel's parent-death signal then takes the rank."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    alive = getattr(server, "_forkserver_alive_fd", None)
    if isinstance(alive, int):
        os.close(alive)
        server._forkserver_alive_fd = None
    os.environ.clear()
    os.environ.update(environment)
    os.environ.setdefault("LMSERVE_LOG_LEVEL", log_level)
    input_address, results_address, rank, init_method, layout, *placement = arguments
    exit_closed(main(input_address, results_address, int(rank), init_method, layout, *placement,
                     engine_pid=engine_pid))


def main(input_address: str, results_address: str, rank: int, init_method: str, layout: str,
         placement: str | None = None, engine_pid: int | None = None) -> int:
    """`engine_pid`: the engine's, where it is not this rank's parent (a forked rank's parent is the fork server)."""
    parent = os.getppid()
    die_with_parent()
    name_process(rank)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the API process's to handle
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    logging.basicConfig(level=os.environ.get("LMSERVE_LOG_LEVEL", "INFO"),
                        format=f"%(asctime)s %(levelname)s rank {rank}: %(message)s")
    key = key_from_environment()
    frames = SignedFrames(key)
    ctx = zmq.Context()
    inputs = ctx.socket(zmq.PULL)
    results = ctx.socket(zmq.PUSH)
    results.setsockopt(zmq.SNDHWM, 0)
    for sock, address in ((inputs, input_address), (results, results_address)):
        if address.startswith("tcp://"):  # another machine's engine: CurveZMQ, as it binds
            curve_client(sock, key)
        sock.connect(address)

    def send(kind: str, payload: object) -> None:
        frames.send(results, (kind, rank, payload))

    from lmserve.executor.step_messages import StepDecoder
    from lmserve.step import GrammarMasks
    from lmserve.worker.worker import Worker  # after the sockets: a failed import is still reported

    first = next_message(inputs, frames, parent, engine_pid)
    if first is None or first[0] != "config":  # the engine stopped before this rank started
        ctx.destroy(linger=0)
        return 0
    mismatch = layout_mismatch(first[1], layout)
    try:
        if mismatch:
            raise ValueError(mismatch)
        worker = Worker(on_this_machine(first[1], placement), rank, init_method)
    except Exception as exc:
        logger.exception("rank failed to start")
        send("failed", f"{type(exc).__name__}: {exc}")
        results.close(linger=1000)
        ctx.destroy(linger=0)
        return 1
    send("ready", worker.info)
    steps = StepDecoder()
    code = 0
    while (message := next_message(inputs, frames, parent, engine_pid)) is not None:
        kind, payload = message
        if kind == "execute":
            try:
                step = steps.decode(payload)
                if isinstance(step.grammar, GrammarMasks) and step.grammar.mask is None:
                    step.grammar.receive = lambda: grammar_masks(inputs, frames, parent, engine_pid)
                output = worker.execute_model(step)
            except Exception as exc:
                logger.exception("step failed")
                send("failed", f"step failed: {type(exc).__name__}: {exc}")
                code = 1
                break
            if output is not None:
                send("output", output)
        elif kind == "stats":
            send("stats", worker.communication_stats())
        elif kind == "grammar":
            pass  # the masks of a step that sampled none of its constrained rows (it read none)
        elif kind == "shutdown":
            break
    if code == 0:
        worker.shutdown()  # not after a failure: leaving the process group waits on peers that may be gone
    results.close(linger=1000)
    inputs.close(linger=0)
    ctx.term()
    return code


if __name__ == "__main__":
    exit_closed(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5], *sys.argv[6:7]))
