"""Prefill/decode disaggregation over torch.distributed (PyNcclConnector): one link per rank between a producer
instance and a consumer instance. Each link is a two-member process group of its own, made without the default group
that an instance's own ranks may be using (as vLLM's stateless process groups): gloo on CPU; on CUDA, gloo for the
control messages and NCCL for the blocks' bytes (an idle NCCL receive would trip its watchdog).

The producer's rank r hosts the rendezvous, a TCPStore on kv_ip:kv_port + r; the consumer's rank r joins it. Either
may start first, and either may go away and come back: every joining is a new generation of the group, announced in
the store. Until a link is up the producer sends nothing and the consumer computes what it cannot load: the tokens
stay right, only the transfer is missed.

Only an instance that holds the deployment's secret links (distributed/signed_frames.node_secret: the operator's
LMSERVE_NODE_SECRET, or on the loopback this user's key file): before either joins the group, each side writes a
fresh nonce to the store and answers the other's with an HMAC under the secret, so a process that reached the
producer's port without it receives no prompt's KV, and no process without it can hand a consumer blocks.

One message per batch of blocks: a header (block count, bytes), the blocks' names (their 32-byte hashes), their
bytes, then the consumer's acknowledgement once the blocks are in its buffer. The producer's step waits for it, so a
prefill response leaves after its blocks can be found on the decode side (the order `lmserve router` relies on).
"""

from __future__ import annotations

import hmac
import json
import logging
import secrets
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lmserve.distributed.signed_frames import NODE_SECRET_ENV, node_secret
from lmserve.kv_transfer_config import KVTransferConfig

logger = logging.getLogger(__name__)

HASH_BYTES = 32  # SHA-256, engine/kv_cache.py's block hashes
MAX_BLOCKS_PER_MESSAGE = 64
CONSUMER_JOIN_TIMEOUT = timedelta(seconds=10)
# Longer than the consumer's: a consumer that read a generation while the producer was waiting for it is not left
# to time out against a producer that moved on to the next one.
PRODUCER_JOIN_TIMEOUT = timedelta(seconds=30)
ACK_TIMEOUT = timedelta(seconds=30)  # the longest a producer's step waits for a consumer that stopped answering
IDLE = timedelta(days=3650)
REFUSED_RETRY_S = 30.0
UNLINKED_WARNING_AFTER_S = 60.0
UNLINKED_WARNING_EVERY_S = 300.0  # a consumer waits for the producer's next blocks as long as the link lives

OnBlocks = Callable[[list[str], torch.Tensor], None]


class LinkRefused(Exception):
    """The two instances cannot exchange blocks (another model or KV layout): no retry helps."""


class LinkUnauthenticated(RuntimeError):
    """The process at the other end did not prove that it holds the deployment's secret (it is let go, and the next
    joining tried)."""


def link_proof(key: bytes, generation_prefix: str, rank: int, their_nonce: str, our_nonce: str) -> str:
    """What side `rank` writes to prove it holds `key`: an HMAC over the other side's fresh nonce (and its own, the
    link's generation and its role, so no answer serves twice)."""
    message = f"{generation_prefix}|{rank}|{their_nonce}|{our_nonce}".encode()
    return hmac.digest(key, message, "sha256").hex()


class KVLink:
    """This rank's end of the link. The producer calls `send` from its step; the consumer's thread hands what it
    receives to `on_blocks` (which must keep the blocks before it returns)."""

    def __init__(self, config: KVTransferConfig, rank: int, layout: dict[str, Any], device: torch.device,
                 block_bytes: int, on_blocks: OnBlocks | None = None) -> None:
        self.producer = config.saves
        self.rank = rank
        self.address, self.port = config.kv_ip, config.kv_port + rank
        self.layout = json.dumps(layout, sort_keys=True)
        self.device = device
        self.block_bytes = block_bytes
        self.on_blocks = on_blocks
        self.generation = 0  # of the link now up; 0 while none is
        self.refusal: str | None = None
        self._groups: tuple[Any, Any] | None = None  # (control, data) while the link is up
        self._lock = threading.Lock()
        self._lost = threading.Event()
        self._closed = threading.Event()
        self._store: dist.TCPStore | None = None
        self._key = node_secret([self.address], f"kv transfer's link (kv_ip {self.address})")
        if self.port > 65535:
            raise ValueError(f"kv transfer: rank {rank}'s link would use port {self.port} (kv_port + rank), past "
                             "65535: choose a lower kv_port")
        if self.producer:
            try:  # the one step that can fail at once, so a taken port fails the start with its reason
                self._store = dist.TCPStore(self.address, self.port, 2, is_master=True, timeout=CONSUMER_JOIN_TIMEOUT,
                                            wait_for_workers=False)
            except (RuntimeError, OSError) as exc:
                raise ValueError(f"kv transfer: rank {rank} cannot listen on {self.address}:{self.port} for its link "
                                 f"to the kv_consumer ({exc}); choose another kv_port or kv_ip") from None
        self._thread = threading.Thread(target=self._run, name=f"kv-link-r{rank}", daemon=True)
        self._thread.start()

    @property
    def up(self) -> bool:
        return self._groups is not None

    def send(self, names: list[str], data: torch.Tensor) -> bool:
        """Sends blocks (at most MAX_BLOCKS_PER_MESSAGE) and waits until the consumer holds them; False when no link
        is up or it broke (the consumer then computes these blocks itself)."""
        groups = self._groups
        if groups is None:
            return False
        control, data_group = groups
        try:
            _wait(control.send([torch.tensor([len(names), data.numel()], dtype=torch.int64)], 1, 0), ACK_TIMEOUT)
            _wait(control.send([_pack_names(names)], 1, 1), ACK_TIMEOUT)
            _wait(data_group.send([data.to(self.device)], 1, 2), ACK_TIMEOUT)
            _wait(control.recv([torch.zeros(1, dtype=torch.int64)], 1, 3), ACK_TIMEOUT)
        except RuntimeError as exc:
            self._drop(groups, f"lost the kv_consumer ({_first_line(exc)}); its prompts are computed there until it "
                               "joins again")
            return False
        return True

    def close(self) -> None:
        self._closed.set()
        groups, self._groups = self._groups, None
        if groups is not None:
            _shutdown(groups)
        self._store = None  # a producer's listening port is let go with it
        self._lost.set()

    @property
    def _peer(self) -> str:
        return "kv_consumer" if self.producer else "kv_producer"

    def _run(self) -> None:
        unlinked_since, next_warning_s = time.monotonic(), UNLINKED_WARNING_AFTER_S
        while not self._closed.is_set():
            try:
                groups, generation = self._join()
            except LinkRefused as refused:  # said loudly, and tried again: the other side may be restarted right
                self.refusal = str(refused)
                logger.error("kv transfer: rank %d's link refused: %s", self.rank, refused)
                self._closed.wait(REFUSED_RETRY_S)
                continue
            except LinkUnauthenticated as impostor:
                logger.warning("kv transfer: rank %d refused a %s: %s", self.rank, self._peer, impostor)
                self._closed.wait(1.0)
                continue
            except (RuntimeError, OSError, ValueError) as exc:  # nobody there yet, or the other side went away
                unlinked_s = time.monotonic() - unlinked_since
                if unlinked_s >= next_warning_s:  # a wrong kv_ip or a firewall must not stay silent
                    logger.warning("kv transfer: rank %d not linked to the %s at %s:%d for %.0f s (the last try: %s)",
                                   self.rank, self._peer, self.address, self.port, unlinked_s, _first_line(exc))
                    next_warning_s = unlinked_s + UNLINKED_WARNING_EVERY_S
                else:
                    logger.debug("kv transfer: rank %d not linked yet: %s", self.rank, _first_line(exc))
                self._closed.wait(1.0)
                continue
            logger.info("kv transfer: rank %d linked to the %s (%s:%d, generation %d)", self.rank, self._peer,
                        self.address, self.port, generation)
            with self._lock:
                self.refusal = None
                self.generation = generation
                self._groups = groups
            if self.producer:
                self._lost.wait()
                self._lost.clear()
            else:
                self._receive(groups)
            unlinked_since, next_warning_s = time.monotonic(), UNLINKED_WARNING_AFTER_S

    def _join(self) -> tuple[tuple[Any, Any], int]:
        if self.producer:
            if self._store is None:
                raise RuntimeError("closed")
            store, rank, timeout = self._store, 0, PRODUCER_JOIN_TIMEOUT
            generation = store.add("generation", 1)
        else:
            store = dist.TCPStore(self.address, self.port, 2, is_master=False, timeout=CONSUMER_JOIN_TIMEOUT)
            rank, timeout = 1, CONSUMER_JOIN_TIMEOUT
            generation = int(store.get("generation"))
        prefix = f"link{generation}"
        self._authenticate(store, prefix, rank)
        store.set(f"{prefix}/layout{rank}", self.layout)
        local = self.address if self.producer else _address_towards(self.address, self.port)
        control = _gloo(dist.PrefixStore(f"{prefix}/control", store), rank, local, timeout)
        data = control
        if self.device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = ACK_TIMEOUT
            data = dist.ProcessGroupNCCL(dist.PrefixStore(f"{prefix}/data", store), rank, 2, options)
        theirs = store.get(f"{prefix}/layout{1 - rank}").decode()
        if theirs != self.layout:
            _shutdown((control, data))
            raise LinkRefused(f"the other instance runs another KV layout ({_differences(theirs, self.layout)}): "
                              "give both the same model, --kv-cache-dtype, -tp/-pp and CPU kind")
        return (control, data), generation

    def _authenticate(self, store: dist.Store, prefix: str, rank: int) -> None:
        """Both sides prove that they hold the secret before either joins the group (challenge and answer over
        the store); raises LinkUnauthenticated when the other side's answer is wrong."""
        ours = secrets.token_hex(16)
        store.set(f"{prefix}/nonce{rank}", ours)
        theirs = store.get(f"{prefix}/nonce{1 - rank}").decode()
        store.set(f"{prefix}/proof{rank}", link_proof(self._key, prefix, rank, theirs, ours))
        answer = store.get(f"{prefix}/proof{1 - rank}").decode()
        if not hmac.compare_digest(answer, link_proof(self._key, prefix, 1 - rank, ours, theirs)):
            raise LinkUnauthenticated(f"the process at the other end of {self.address}:{self.port} does not hold "
                                      f"this deployment's secret: give both instances the same {NODE_SECRET_ENV}")

    def _receive(self, groups: tuple[Any, Any]) -> None:
        control, data_group = groups
        limit = MAX_BLOCKS_PER_MESSAGE * self.block_bytes
        try:
            while not self._closed.is_set():
                header = torch.zeros(2, dtype=torch.int64)
                _wait(control.recv([header], 0, 0), IDLE)
                if self._closed.is_set():  # gloo's abort leaves the pair open: the last reference closes it
                    return
                count, size = header.tolist()
                if not 0 < count <= MAX_BLOCKS_PER_MESSAGE or size != count * self.block_bytes or size > limit:
                    raise RuntimeError(f"a message of {count} blocks in {size} bytes (a block is {self.block_bytes})")
                names = torch.zeros(count * HASH_BYTES, dtype=torch.uint8)
                _wait(control.recv([names], 0, 1), ACK_TIMEOUT)
                data = torch.empty(size, dtype=torch.uint8, device=self.device)
                _wait(data_group.recv([data], 0, 2), ACK_TIMEOUT)
                assert self.on_blocks is not None
                try:
                    self.on_blocks(_unpack_names(names), data.cpu())
                except OSError as exc:  # a full /dev/shm: these blocks are computed here instead; the link holds
                    logger.warning("kv transfer: rank %d cannot keep %d received blocks (%s)", self.rank, count, exc)
                _wait(control.send([torch.ones(1, dtype=torch.int64)], 0, 3), ACK_TIMEOUT)
        except (RuntimeError, OSError) as exc:
            if not self._closed.is_set():
                self._drop(groups, f"lost the kv_producer ({_first_line(exc)}); waiting for it to link again")

    def _drop(self, groups: tuple[Any, Any], why: str) -> None:
        with self._lock:
            if self._groups is not groups:
                return
            self._groups = None
            self.generation = 0
        logger.warning("kv transfer: rank %d %s", self.rank, why)
        _shutdown(groups)
        self._lost.set()


def _gloo(store: dist.Store, rank: int, address: str, timeout: timedelta) -> dist.ProcessGroupGloo:
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
    return dist.ProcessGroupGloo(store, rank, 2, options)


def _wait(work: Any, timeout: timedelta) -> None:
    if not work.wait(timeout):
        raise RuntimeError(f"timed out after {timeout.total_seconds():.0f} s")


def _shutdown(groups: tuple[Any, Any]) -> None:
    """Aborts what is in flight (NCCL); gloo's sockets close only with the group's last reference."""
    for group in dict.fromkeys(groups):  # control and data may be one group
        try:
            group.abort()
        except RuntimeError:
            pass


def _address_towards(host: str, port: int) -> str:
    """This machine's address on the route to `host` (the one the producer can reach this rank at)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((socket.gethostbyname(host), port))
        return probe.getsockname()[0]


def _pack_names(names: list[str]) -> torch.Tensor:
    packed = b"".join(bytes.fromhex(name) for name in names)
    if len(packed) != HASH_BYTES * len(names):
        raise ValueError(f"kv transfer: block names are {HASH_BYTES}-byte hashes")
    return torch.frombuffer(bytearray(packed), dtype=torch.uint8)


def _unpack_names(packed: torch.Tensor) -> list[str]:
    raw = packed.numpy().tobytes()
    return [raw[i : i + HASH_BYTES].hex() for i in range(0, len(raw), HASH_BYTES)]


def _differences(theirs: str, ours: str) -> str:
    there, here = json.loads(theirs), json.loads(ours)
    return "; ".join(f"{key} {there.get(key)!r} there, {here.get(key)!r} here" if key != "block_shapes" else
                     "the cache's block shapes differ (another CPU kind's K layout, or another split of the layers)"
                     for key in sorted(set(there) | set(here)) if there.get(key) != here.get(key))


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]


def wait_linked(link: KVLink, timeout: float) -> bool:
    """Whether the link came up within `timeout` seconds (tests and start-up checks)."""
    deadline = time.monotonic() + timeout
    while not link.up and time.monotonic() < deadline:
        time.sleep(0.05)
    return link.up
