"""Messages between an engine and its ranks (executor/multiproc.py, rank_process.py, headless.py) carry Python objects
(the configuration, each step's plan, the driver rank's output), pickled. pickle.loads runs whatever a message asks,
so no message is unpickled before it proves that it comes from a process that holds the engine's key: every message
is two ZMQ frames, an HMAC-SHA256 of the payload under the key, then the payload. A message that fails the check is
dropped unread (ForgedFrame).

The key: one engine on one machine makes a random one and hands it to the ranks it starts in their environment
(RANK_KEY_ENV: not in argv, which `ps` shows to every user). Ranks on other machines (--nnodes, started by
`lmserve serve --headless`) get theirs from the operator's secret, the same on every node (NODE_SECRET_ENV). Over TCP
the sockets also run CurveZMQ with a server key derived from the same secret: a peer that does not hold it cannot
complete the handshake, so it can neither read the messages nor take a rank's place on a PUSH socket, and the bytes
on the wire are encrypted. Where every address is this machine's loopback and no secret is given, a per-user key file
(0600) stands in for it, so that other users of the machine cannot join either. docs/security.md has the whole
picture: which ports each layout opens and who may reach them.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import pickle
import secrets
import socket
import time
from collections.abc import Iterable
from pathlib import Path

import zmq
from zmq.utils import z85

logger = logging.getLogger(__name__)

NODE_SECRET_ENV = "LMSERVE_NODE_SECRET"  # the operator's secret, the same on every node of a deployment
RANK_KEY_ENV = "LMSERVE_RANK_KEY"  # an engine's key (hex), handed to the ranks it starts itself
MIN_SECRET_CHARS = 16
TAG_BYTES = 32  # HMAC-SHA256
FORGED_WARNING_EVERY_S = 60.0


class ForgedFrame(Exception):
    """A message that does not carry a valid HMAC under the engine's key (or is not two frames)."""


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host.strip("[]"))).is_loopback
    except (OSError, ValueError):
        return False


def user_key_file() -> Path:
    """This user's key for layouts whose every address is loopback (0600, made on first use)."""
    base = Path(os.environ.get("XDG_RUNTIME_DIR") or Path.home() / ".cache") / "lmserve"
    base.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = base / "node-secret"
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass
    else:
        with os.fdopen(descriptor, "w") as file:
            file.write(secrets.token_hex(32))
    if path.stat().st_mode & 0o077:
        raise ValueError(f"{path} is readable by other users: `chmod 600 {path}`, or set {NODE_SECRET_ENV}")
    return path


def node_secret(hosts: Iterable[str], what: str) -> bytes:
    """The deployment's key for a channel on `hosts` (what: the flags that open it, for the message): the
    operator's NODE_SECRET_ENV; where every host is loopback and none is set, this user's key file; else an error
    that says how to set one."""
    value = os.environ.get(NODE_SECRET_ENV)
    if value is not None:
        if len(value) < MIN_SECRET_CHARS:
            raise ValueError(f"{NODE_SECRET_ENV} must hold at least {MIN_SECRET_CHARS} characters (a random one: "
                             "`python -c 'import secrets; print(secrets.token_hex(32))'`)")
    else:
        hosts = list(hosts)
        outside = [host for host in hosts if not _is_loopback(host)]
        if outside:
            raise ValueError(f"{what} opens ports on {', '.join(outside)}, which other machines reach: set "
                             f"{NODE_SECRET_ENV} to the same secret (at least {MIN_SECRET_CHARS} characters) in the "
                             "environment of every node, so that only they can join (docs/security.md)")
        value = user_key_file().read_text().strip()
    return hashlib.sha256(b"lmserve node secret\0" + value.encode()).digest()


def _curve_server_secret(key: bytes) -> bytes:
    return z85.encode(hashlib.sha256(b"lmserve curve server\0" + key).digest())


def curve_server(sock: zmq.Socket, key: bytes) -> None:
    """Makes a bound TCP socket a CurveZMQ server whose key only holders of `key` can derive (the server's public
    key never crosses the wire: a client must know it to start the handshake)."""
    sock.curve_secretkey = _curve_server_secret(key)
    sock.curve_server = True


def curve_client(sock: zmq.Socket, key: bytes) -> None:
    """Makes a connecting TCP socket a CurveZMQ client of curve_server's socket (its own key pair is fresh)."""
    sock.curve_serverkey = zmq.curve_public(_curve_server_secret(key))
    sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()


class SignedFrames:
    """pickle over ZMQ, each message signed with `key` and checked before it is unpickled."""

    def __init__(self, key: bytes) -> None:
        if len(key) < 16:
            raise ValueError("a frame key has at least 16 bytes")
        self._key = key
        self.num_forged = 0
        self._warned_at = -FORGED_WARNING_EVERY_S

    def seal(self, message: object) -> list[bytes]:
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        return [hmac.digest(self._key, payload, "sha256"), payload]

    def open(self, frames: list[bytes]) -> object:
        if len(frames) != 2 or not hmac.compare_digest(frames[0], hmac.digest(self._key, frames[1], "sha256")):
            raise ForgedFrame(f"a message of {len(frames)} frame(s) without a valid signature")
        return pickle.loads(frames[1])

    def send(self, sock: zmq.Socket, message: object, flags: int = 0) -> None:
        sock.send_multipart(self.seal(message), flags)

    def send_sealed(self, sock: zmq.Socket, frames: list[bytes], flags: int = 0) -> None:
        """One sealed message to several sockets (a broadcast) signs it once."""
        sock.send_multipart(frames, flags, copy=False)

    def recv(self, sock: zmq.Socket) -> object | None:
        """The next message, or None where it was forged (dropped and counted, a warning now and then)."""
        frames = sock.recv_multipart()
        try:
            return self.open(frames)
        except ForgedFrame as forged:
            self.num_forged += 1
            now = time.monotonic()
            if now - self._warned_at >= FORGED_WARNING_EVERY_S:
                self._warned_at = now
                logger.warning("dropped %d unsigned or forged message(s) on an engine socket (%s): is a process "
                               "without the engine's key connected? (docs/security.md)", self.num_forged, forged)
            return None


def new_engine_key() -> bytes:
    return secrets.token_bytes(32)


def key_from_environment() -> bytes:
    """A rank's key as its starter handed it (RANK_KEY_ENV), removed from the environment so that nothing this rank
    starts inherits it."""
    value = os.environ.pop(RANK_KEY_ENV, None)
    if not value:
        raise RuntimeError(f"a rank process needs its engine's key in {RANK_KEY_ENV} (it is started by the engine "
                           "or by `lmserve serve --headless`, not by hand)")
    return bytes.fromhex(value)
