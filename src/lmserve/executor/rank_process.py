"""The main loop of one rank process (`python -m lmserve.executor.rank_process DIR RANK INIT_METHOD`), started by
the multiproc executor: build the rank's Worker, then run every step the engine sends until told to stop."""

from __future__ import annotations

import ctypes
import logging
import os
import pickle
import signal
import sys
from pathlib import Path

import zmq

logger = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
PARENT_CHECK_MS = 1000


def die_with_parent() -> None:
    """The kernel kills this rank when the engine process dies, however it dies (Linux; elsewhere the loop's parent
    check does it within a second)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def main(ipc_dir: str, rank: int, init_method: str) -> int:
    parent = os.getppid()
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the API process's to handle
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    logging.basicConfig(level=os.environ.get("LMSERVE_LOG_LEVEL", "INFO"),
                        format=f"%(asctime)s %(levelname)s rank {rank}: %(message)s")
    ctx = zmq.Context()
    inputs = ctx.socket(zmq.PULL)
    inputs.connect(f"ipc://{ipc_dir}/rank{rank}")
    results = ctx.socket(zmq.PUSH)
    results.setsockopt(zmq.SNDHWM, 0)
    results.connect(f"ipc://{ipc_dir}/results")

    def send(kind: str, payload: object) -> None:
        results.send(pickle.dumps((kind, rank, payload), protocol=pickle.HIGHEST_PROTOCOL))

    from lmserve.executor.step_messages import StepDecoder
    from lmserve.worker.worker import Worker  # after the sockets: a failed import is still reported

    try:
        config = pickle.loads((Path(ipc_dir) / "config.pkl").read_bytes())
        worker = Worker(config, rank, init_method)
    except Exception as exc:
        logger.exception("rank failed to start")
        send("failed", f"{type(exc).__name__}: {exc}")
        return 1
    send("ready", worker.info)
    steps = StepDecoder()
    code = 0
    while True:
        if not inputs.poll(PARENT_CHECK_MS):
            if os.getppid() != parent:
                break
            continue
        kind, payload = pickle.loads(inputs.recv())
        if kind == "execute":
            try:
                output = worker.execute_model(steps.decode(payload))
            except Exception as exc:
                logger.exception("step failed")
                send("failed", f"step failed: {type(exc).__name__}: {exc}")
                code = 1
                break
            if output is not None:
                send("output", output)
        elif kind == "stats":
            send("stats", worker.communication_stats())
        elif kind == "shutdown":
            break
    if code == 0:
        worker.shutdown()  # not after a failure: leaving the process group waits on peers that may be gone
    results.close(linger=1000)
    inputs.close(linger=0)
    ctx.term()
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), sys.argv[3]))
