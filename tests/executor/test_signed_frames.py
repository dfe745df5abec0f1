"""Messages between an engine and its ranks are pickles, so none is unpickled before its signature under the
engine's key is checked (lmserve.distributed.signed_frames); over TCP a peer without the key cannot even connect
(CurveZMQ); a layout of several machines needs the operator's secret, and on the loopback a per-user key file stands
in for it."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import zmq
from network_addresses import free_port_block

from lmserve.distributed import signed_frames
from lmserve.distributed.signed_frames import (
    NODE_SECRET_ENV,
    ForgedFrame,
    SignedFrames,
    curve_client,
    curve_server,
    node_secret,
)


def code_running_pickle(marker: Path) -> bytes:
    """A pickle (protocol 0) whose loading runs `touch marker`."""
    return f"cos\nsystem\n(S'touch {marker}'\ntR.".encode()


@pytest.fixture
def pair():
    context = zmq.Context()
    port = free_port_block("127.0.0.1", 1)
    receiver, sender = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    receiver.bind(f"tcp://127.0.0.1:{port}")
    sender.connect(f"tcp://127.0.0.1:{port}")
    yield receiver, sender
    context.destroy(linger=0)


def test_an_unsigned_or_forged_pickle_is_dropped_unread(pair, tmp_path: Path) -> None:
    receiver, sender = pair
    frames = SignedFrames(b"k" * 32)
    marker = tmp_path / "code-ran"
    payload = code_running_pickle(marker)
    forged = [[payload], [b"\0" * 32, payload], [SignedFrames(b"x" * 32).seal(("step", 1))[0], payload],
              [frames.seal(("step", 1))[0], payload]]  # another message's valid signature on this payload
    for message in forged:
        sender.send_multipart(message)
        assert receiver.poll(10_000)
        assert frames.recv(receiver) is None
    assert frames.num_forged == len(forged) and not marker.exists()
    frames.send(sender, ("execute", {"rows": [1, 2]}))
    assert receiver.poll(10_000) and frames.recv(receiver) == ("execute", {"rows": [1, 2]})
    with pytest.raises(ForgedFrame):
        frames.open([b"a", b"b", b"c"])


def test_over_tcp_a_peer_without_the_key_cannot_connect() -> None:
    """CurveZMQ with a server key derived from the secret: a plain ZMQ peer and one with a guessed key never get a
    message through (nor receive one from a PUSH socket); a peer with the key does."""
    context = zmq.Context()
    key = b"the engine's key, 32 bytes long!"
    port = free_port_block("127.0.0.1", 1)
    try:
        server = context.socket(zmq.PULL)
        curve_server(server, key)
        server.bind(f"tcp://127.0.0.1:{port}")
        for guess in (None, b"a guessed key, 32 bytes long....", key):
            client = context.socket(zmq.PUSH)
            client.setsockopt(zmq.LINGER, 0)
            if guess is not None:
                curve_client(client, guess)
            client.connect(f"tcp://127.0.0.1:{port}")
            try:
                client.send(b"hello", zmq.NOBLOCK)  # queued until a connection completes its handshake
            except zmq.Again:
                pass
            arrived = server.poll(2000 if guess != key else 20_000)
            assert arrived == (guess == key), guess
            if arrived:
                assert server.recv() == b"hello"
            client.close(linger=0)
    finally:
        context.destroy(linger=0)


def test_several_machines_need_the_operators_secret(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(NODE_SECRET_ENV, raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    with pytest.raises(ValueError, match=f"opens ports on 192.0.2.7, which other machines reach: set {NODE_SECRET_ENV}"):
        node_secret(["192.0.2.7"], "--nnodes 2 --master-addr 192.0.2.7")
    # The loopback: this user's key file, made once with mode 0600 in a 0700 directory, the same key every time.
    first = node_secret(["127.0.0.1", "localhost"], "test")
    key_file = tmp_path / "lmserve" / "node-secret"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600 and stat.S_IMODE(key_file.parent.stat().st_mode) == 0o700
    assert node_secret(["127.0.0.1"], "test") == first
    key_file.chmod(0o644)
    with pytest.raises(ValueError, match="readable by other users"):
        node_secret(["127.0.0.1"], "test")
    monkeypatch.setenv(NODE_SECRET_ENV, "0123456789abcdef")
    assert node_secret(["192.0.2.7"], "test") != first
    monkeypatch.setenv(NODE_SECRET_ENV, "too short")
    with pytest.raises(ValueError, match="at least 16 characters"):
        node_secret(["192.0.2.7"], "test")


def test_an_engine_over_several_machines_refuses_to_start_without_the_secret(monkeypatch: pytest.MonkeyPatch,
                                                                            tiny_llama_dir: Path) -> None:
    from lmserve.config import make_engine_config
    from lmserve.executor.multiproc import engine_key

    monkeypatch.delenv(NODE_SECRET_ENV, raising=False)
    config = make_engine_config(str(tiny_llama_dir), tensor_parallel_size=2, nnodes=2, master_addr="192.0.2.7")
    with pytest.raises(ValueError, match=NODE_SECRET_ENV):
        engine_key(config.parallel)
    monkeypatch.setenv(NODE_SECRET_ENV, "0123456789abcdef0123")
    assert engine_key(config.parallel) == node_secret(["192.0.2.7"], "x")
    one_machine = make_engine_config(str(tiny_llama_dir), tensor_parallel_size=2)
    assert engine_key(one_machine.parallel) != engine_key(one_machine.parallel)  # a fresh key per engine


def test_a_rank_takes_its_key_from_its_environment_and_hides_it() -> None:
    """The key is not in a rank's argv (`ps` shows argv to every user) and not passed on to what the rank starts."""
    script = ("import os\n"
              "from lmserve.distributed.signed_frames import key_from_environment, RANK_KEY_ENV\n"
              "print(key_from_environment().hex(), RANK_KEY_ENV in os.environ)\n")
    env = {**os.environ, signed_frames.RANK_KEY_ENV: "ab" * 32,
           "PYTHONPATH": str(Path(signed_frames.__file__).parents[2])}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True,
                            timeout=60)
    assert result.stdout.split() == ["ab" * 32, "False"]
