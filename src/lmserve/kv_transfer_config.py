"""vLLM's --kv-transfer-config: what a prefill/decode pair of instances hands over, and how (engine/kv_transfer.py,
worker/kv_transfer.py, distributed/kv_link.py)."""

from __future__ import annotations

import importlib
import json
import os
import re
import socket
import tempfile
import uuid
from dataclasses import dataclass, field
from typing import Any

from lmserve.config_values import parse_json_config, parse_memory

KV_CONNECTORS = ("SharedStorageConnector", "PyNcclConnector")
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
DEFAULT_KV_STORAGE_BYTES = 4 * 2**30
DEFAULT_KV_BUFFER_BYTES = 10**9  # vLLM's kv_buffer_size
# A PyNcclConnector consumer's own buffer: this prefix + "<port>-<host>-p<pid>-<id>", host and pid those of the
# process that named it.
KV_LINK_BUFFER_PREFIX = "lmserve-kv-link-"
DEFAULT_KV_PORT = 14579  # vLLM's kv_port
KV_BUFFER_DEVICES = ("cuda", "cpu")  # vLLM's kv_buffer_device values; the buffer itself is host memory here
MODULE_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
MAX_EXTRA_CONFIG_BYTES = 64 * 1024  # a plugged connector's kv_connector_extra_config, as JSON


@dataclass(frozen=True)
class KVTransferConfig:
    """vLLM's --kv-transfer-config, for prefill/decode disaggregation. A producer (the prefill instance) hands over the
    KV of every full prompt block it computes, named by the block's prefix-cache hash (SHA-256 of the tokens before and
    in it); a consumer (the decode instance) loads the longest run of a new prompt's blocks it finds instead of
    computing them.
    - SharedStorageConnector: through shared_storage_path, one file per block and rank; kv_both does both. The
      producer keeps at most max_storage_bytes of its own files (oldest removed first).
    - PyNcclConnector (vLLM V0's names): over torch.distributed between the two instances (gloo on CPU, NCCL on CUDA),
      a link per rank; the producer (kv_rank 0, kv_parallel_size 2) listens on kv_ip:kv_port + rank, the consumer
      (kv_rank 1) connects. The consumer keeps what it received in a buffer of its own (shared_storage_path, a new
      directory; at most kv_buffer_size bytes, oldest removed first) on buffer_host, the machine of its engine.
    - any other name, from kv_connector_module_path (vLLM's key): a module every process of the instance imports,
      whose attribute of that name has a `scheduler` and a `worker` class (lmserve.engine.kv_transfer's
      KVConnectorScheduler, lmserve.worker.kv_transfer's KVConnectorWorker); kv_connector_extra_config reaches both
      as extra_config."""

    kv_connector: str
    kv_role: str
    shared_storage_path: str
    max_storage_bytes: int = DEFAULT_KV_STORAGE_BYTES
    kv_ip: str = "127.0.0.1"
    kv_port: int = DEFAULT_KV_PORT
    buffer_host: str = ""
    module_path: str = ""
    extra_config: dict[str, Any] = field(default_factory=dict, hash=False)
    # A fingerprint of the model's files (distributed/kv_storage.model_fingerprint), set by the engine before its
    # ranks start: blocks are filed under it, so two models never read each other's blocks.
    model_key: str = ""

    @property
    def storage_directory(self) -> str:
        """Where this model's blocks lie: a directory of shared_storage_path named by the model's fingerprint."""
        return os.path.join(self.shared_storage_path, f"model-{self.model_key}") if self.model_key \
            else self.shared_storage_path

    @property
    def saves(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def loads(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def over_network(self) -> bool:
        return self.kv_connector == "PyNcclConnector"

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> KVTransferConfig:
        known = {"kv_connector", "kv_role", "kv_connector_extra_config", "kv_rank", "kv_parallel_size",
                 "kv_buffer_device", "engine_id", "kv_ip", "kv_port", "kv_buffer_size", "kv_connector_module_path"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"kv_transfer_config: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        connector, role = value.get("kv_connector"), value.get("kv_role")
        if "kv_connector_module_path" in value:
            return cls._plugged(value, connector, role)
        if connector not in KV_CONNECTORS:
            raise ValueError(f"kv_transfer_config: kv_connector {connector!r} is not supported; use "
                             f"{' or '.join(KV_CONNECTORS)}")
        if role not in KV_ROLES:
            raise ValueError(f"kv_transfer_config: kv_role must be one of {', '.join(KV_ROLES)}, got {role!r}")
        device = value.get("kv_buffer_device", "cuda")
        if device not in KV_BUFFER_DEVICES:
            # vLLM's default is "cuda"; lmserve's consumer buffers what it receives in host memory either way.
            raise ValueError(f"kv_transfer_config: kv_buffer_device must be one of {', '.join(KV_BUFFER_DEVICES)}, "
                             f"got {device!r}")
        extra = value.get("kv_connector_extra_config")
        extra = {} if extra is None else extra
        if not isinstance(extra, dict):
            raise ValueError("kv_transfer_config: kv_connector_extra_config must be an object")  # noqa: TRY004 - a bad flag value
        if connector == "PyNcclConnector":
            return cls._network(value, role)
        path = extra.get("shared_storage_path")
        if not isinstance(path, str) or not path or len(path) > 4096:
            raise ValueError("kv_transfer_config: SharedStorageConnector needs kv_connector_extra_config."
                             "shared_storage_path, a directory both instances reach")
        return cls(connector, role, path, byte_count("max_storage_bytes", extra.get("max_storage_bytes",
                                                                                     DEFAULT_KV_STORAGE_BYTES)))

    @classmethod
    def _plugged(cls, value: dict[str, Any], connector: Any, role: Any) -> KVTransferConfig:
        """A connector of the user's (vLLM's kv_connector_module_path); it is imported where it runs."""
        module_path = value["kv_connector_module_path"]
        if not isinstance(module_path, str) or len(module_path) > 200 or not MODULE_PATH.fullmatch(module_path):
            raise ValueError(f"kv_transfer_config: kv_connector_module_path must be a dotted module name, got "
                             f"{str(module_path)[:200]!r}")
        if not isinstance(connector, str) or len(connector) > 100 or not connector.isidentifier():
            raise ValueError(f"kv_transfer_config: kv_connector must name a class of {module_path}, got "
                             f"{str(connector)[:100]!r}")
        if role not in KV_ROLES:
            raise ValueError(f"kv_transfer_config: kv_role must be one of {', '.join(KV_ROLES)}, got {role!r}")
        extra = value.get("kv_connector_extra_config")
        extra = {} if extra is None else extra
        if not isinstance(extra, dict) or len(json.dumps(extra, default=str)) > MAX_EXTRA_CONFIG_BYTES:
            raise ValueError(f"kv_transfer_config: kv_connector_extra_config must be an object of at most "
                             f"{MAX_EXTRA_CONFIG_BYTES} bytes")
        path = extra.get("shared_storage_path", "")
        if not isinstance(path, str) or len(path) > 4096:
            raise ValueError("kv_transfer_config: shared_storage_path must be a path")
        capacity = byte_count("max_storage_bytes", extra.get("max_storage_bytes", DEFAULT_KV_STORAGE_BYTES))
        return cls(connector, role, path, capacity, module_path=module_path, extra_config=extra)

    @classmethod
    def _network(cls, value: dict[str, Any], role: str) -> KVTransferConfig:
        if role == "kv_both":
            raise ValueError("kv_transfer_config: PyNcclConnector links one kv_producer to one kv_consumer; kv_both "
                             "needs SharedStorageConnector")
        rank = value.get("kv_rank", 0 if role == "kv_producer" else 1)
        if rank != (0 if role == "kv_producer" else 1):
            raise ValueError(f"kv_transfer_config: PyNcclConnector's kv_producer is kv_rank 0 and its kv_consumer "
                             f"kv_rank 1; a {role} got kv_rank {rank!r}")
        if value.get("kv_parallel_size", 2) != 2:
            raise ValueError(f"kv_transfer_config: PyNcclConnector's kv_parallel_size is 2 (one producer, one "
                             f"consumer), got {value.get('kv_parallel_size')!r}")
        address, port = value.get("kv_ip", "127.0.0.1"), value.get("kv_port", DEFAULT_KV_PORT)
        if not isinstance(address, str) or not address or len(address) > 255:
            raise ValueError(f"kv_transfer_config: kv_ip must be the producer's address, got {address!r}")
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise ValueError(f"kv_transfer_config: kv_port must be a port number, got {port!r}")
        buffer = byte_count("kv_buffer_size", value.get("kv_buffer_size", DEFAULT_KV_BUFFER_BYTES))
        # The consumer's buffer: a directory of its own, named here so that its scheduler and its ranks agree.
        base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
        # The naming process's machine and pid in the name: a later consumer on this machine removes a buffer whose
        # owner was killed (distributed/kv_storage.remove_orphans).
        path = os.path.join(base, f"{KV_LINK_BUFFER_PREFIX}{port}-{socket.gethostname()}-p{os.getpid()}-"
                                  f"{uuid.uuid4().hex[:12]}")
        return cls("PyNcclConnector", role, path, buffer, address, port, socket.gethostname())


def byte_count(name: str, value: Any) -> int:
    if isinstance(value, str):
        try:
            value = parse_memory(value)
        except (ValueError, OverflowError):
            raise ValueError(f"kv_transfer_config: {name} must be a positive size, got {value!r}") from None
    if isinstance(value, float) and value.is_integer():  # vLLM writes kv_buffer_size as 1e9
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"kv_transfer_config: {name} must be a positive size, got {value!r}")
    return value


def plugged_connector(config: KVTransferConfig) -> Any:
    """The object kv_connector names in kv_connector_module_path's module (its `scheduler` and `worker` classes are
    checked by the side that takes them)."""
    try:
        module = importlib.import_module(config.module_path)
    except Exception as exc:  # noqa: BLE001 - whatever the user's module raises, said as a configuration error
        raise ValueError(f"kv_transfer_config: cannot import kv_connector_module_path {config.module_path!r}: "
                         f"{type(exc).__name__}: {exc}") from None
    connector = getattr(module, config.kv_connector, None)
    if connector is None:
        raise ValueError(f"kv_transfer_config: {config.module_path} has no {config.kv_connector}")
    return connector


def parse_kv_transfer_config(value: Any) -> KVTransferConfig | None:
    return parse_json_config(value, KVTransferConfig)
