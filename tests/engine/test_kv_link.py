"""Prefill/decode disaggregation over torch.distributed (--kv-transfer-config PyNcclConnector, gloo on this CPU) on the
default model, in-process: a consumer started before its producer links to it and loads the blocks the producer
sends, giving one instance's greedy tokens; a consumer that goes away leaves the producer serving, and one started
again links again; a consumer of another KV layout is refused and computes its prompts itself; a taken port fails the
producer's start; a consumer that cannot reach its producer says so; the consumer's buffer is removed when it
stops; a consumer's rank on another machine than its engine is refused."""

from __future__ import annotations

import dataclasses
import json
import logging
import socket
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from network_addresses import free_port_block
from test_engine_e2e import assert_idle
from test_kv_transfer import GREEDY, ONE_TOKEN, PROMPTS

from lmserve import LLM
from lmserve.distributed import kv_link
from lmserve.distributed.kv_link import KVLink, wait_linked
from lmserve.kv_transfer_config import DEFAULT_KV_BUFFER_BYTES, KVTransferConfig, parse_kv_transfer_config
from lmserve.worker.kv_transfer import PyNcclWorker

LINK_WAIT_S = 60


def transfer(role: str, port: int, **extra: object) -> str:
    return json.dumps({"kv_connector": "PyNcclConnector", "kv_role": role, "kv_port": port, **extra})


def link(llm: LLM) -> KVLink:
    connector = llm.engine.executor.runner.kv_connector
    assert isinstance(connector, PyNcclWorker)
    return connector.link


def loaded_blocks(llm: LLM) -> int:
    return llm.engine.scheduler.kv_transfer.num_loaded_blocks


def full_blocks(prompt_token_ids: list[int]) -> int:
    return (len(prompt_token_ids) - 1) // 16  # the last prompt token is always computed: its logits are needed


@pytest.fixture(scope="module")
def ports() -> int:
    """The first of three free ports: a link per test (a producer's listening port outlives it a little)."""
    return free_port_block("127.0.0.1", 3)


@pytest.fixture(scope="module")
def producer(ports: int) -> Iterator[LLM]:
    llm = LLM(num_blocks=200, kv_transfer_config=transfer("kv_producer", ports + 1))
    yield llm
    assert_idle(llm)
    llm.shutdown()


def test_the_config_is_vllms_and_checked() -> None:
    producer = parse_kv_transfer_config(transfer("kv_producer", 20001, kv_ip="10.0.0.2", kv_rank=0,
                                                 kv_parallel_size=2, kv_buffer_size=1e8))
    assert (producer.kv_connector, producer.kv_role, producer.kv_ip, producer.kv_port) == (
        "PyNcclConnector", "kv_producer", "10.0.0.2", 20001)
    assert producer.over_network and producer.saves and not producer.loads and producer.max_storage_bytes == 10**8
    consumer = parse_kv_transfer_config(transfer("kv_consumer", 20001))
    assert consumer.loads and consumer.kv_ip == "127.0.0.1" and consumer.max_storage_bytes == DEFAULT_KV_BUFFER_BYTES
    assert "lmserve-kv-link-20001-" in consumer.shared_storage_path  # a buffer of its own, named once
    for bad, message in [({"kv_role": "kv_both"}, "kv_both needs SharedStorageConnector"),
                         ({"kv_role": "kv_consumer", "kv_rank": 0}, "kv_rank 1"),
                         ({"kv_role": "kv_producer", "kv_parallel_size": 3}, "kv_parallel_size is 2"),
                         ({"kv_role": "kv_producer", "kv_port": 70000}, "kv_port"),
                         ({"kv_role": "kv_producer", "kv_port": "80"}, "kv_port"),
                         ({"kv_role": "kv_producer", "kv_ip": ""}, "kv_ip"),
                         ({"kv_role": "kv_producer", "kv_buffer_size": "inf"}, "kv_buffer_size"),
                         ({"kv_role": "kv_producer", "kv_buffer_size": 0}, "kv_buffer_size")]:
        with pytest.raises(ValueError, match=message):
            KVTransferConfig.from_json({"kv_connector": "PyNcclConnector", **bad})


def test_a_consumer_started_first_loads_what_the_producer_sends(ports: int) -> None:
    port = ports
    consumer = LLM(num_blocks=200, kv_transfer_config=transfer("kv_consumer", port))
    producer = LLM(num_blocks=200, kv_transfer_config=transfer("kv_producer", port))
    try:
        assert wait_linked(link(consumer), LINK_WAIT_S) and wait_linked(link(producer), LINK_WAIT_S)
        prefilled = producer.generate(PROMPTS, ONE_TOKEN)  # what the router asks the prefill instance for
        blocks = [full_blocks(o.prompt_token_ids) for o in prefilled]
        decoded = consumer.generate(PROMPTS, GREEDY)
        expected = [o.outputs[0].token_ids for o in producer.generate(PROMPTS, GREEDY)]
        assert [o.outputs[0].token_ids for o in decoded] == expected
        assert [o.num_cached_tokens for o in decoded] == [16 * n for n in blocks] and min(blocks) >= 1
        assert loaded_blocks(consumer) == sum(blocks)
        buffer = Path(consumer.engine.config.cache.kv_transfer_config.shared_storage_path)
        assert len(list(buffer.glob("model-*/*-r0.kv"))) == sum(blocks)  # each block crossed once, though asked for twice
        assert_idle(consumer)
        assert not any(consumer.engine.scheduler.kv_transfer.storage.pins.iterdir())
    finally:
        consumer.shutdown()
        producer.shutdown()
    assert not buffer.exists()  # the consumer's buffer went with it; the producer never had one
    assert not Path(producer.engine.config.cache.kv_transfer_config.shared_storage_path).exists()


def test_a_consumer_that_goes_away_leaves_the_producer_serving_and_one_started_again_links(
        producer: LLM, ports: int) -> None:
    port = ports + 1
    first = LLM(num_blocks=200, kv_transfer_config=transfer("kv_consumer", port))
    assert wait_linked(link(producer), LINK_WAIT_S) and wait_linked(link(first), LINK_WAIT_S)
    generation = link(producer).generation
    first.shutdown()
    # The producer's next send finds the consumer gone: its request is answered all the same.
    alone = producer.generate(PROMPTS[0], GREEDY)[0]
    assert len(alone.outputs[0].token_ids) == 24
    second = LLM(num_blocks=200, kv_transfer_config=transfer("kv_consumer", port))
    try:
        assert wait_linked(link(second), LINK_WAIT_S) and wait_linked(link(producer), LINK_WAIT_S)
        assert link(producer).generation > generation
        # The producer sent PROMPTS[0]'s blocks to the consumer that went away; the new one gets them again.
        producer.generate(PROMPTS[0], ONE_TOKEN)
        again = second.generate(PROMPTS[0], GREEDY)[0]
        assert again.outputs[0].token_ids == alone.outputs[0].token_ids
        assert again.num_cached_tokens == 16 * full_blocks(alone.prompt_token_ids) == 16 * loaded_blocks(second)
        assert_idle(second)
    finally:
        second.shutdown()


def test_a_consumer_of_another_kv_layout_is_refused_and_computes_its_prompts(ports: int) -> None:
    port = ports + 2
    producer = LLM(num_blocks=200, kv_transfer_config=transfer("kv_producer", port))
    consumer = LLM(num_blocks=200, kv_cache_dtype="float32", kv_transfer_config=transfer("kv_consumer", port))
    try:
        deadline = time.monotonic() + LINK_WAIT_S
        while link(consumer).refusal is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "another KV layout" in (link(consumer).refusal or "") and "float32" in link(consumer).refusal
        assert not link(consumer).up and not link(producer).up
        producer.generate(PROMPTS[0], ONE_TOKEN)
        out = consumer.generate(PROMPTS[0], GREEDY)[0]
        assert out.num_cached_tokens == 0 and loaded_blocks(consumer) == 0
        assert out.outputs[0].token_ids == producer.generate(PROMPTS[0], GREEDY)[0].outputs[0].token_ids
    finally:
        consumer.shutdown()
        producer.shutdown()


def test_a_link_past_the_last_port_is_refused() -> None:
    config = parse_kv_transfer_config(transfer("kv_consumer", 65535))
    with pytest.raises(ValueError, match="port 65536 .kv_port \\+ rank., past 65535"):
        KVLink(config, 1, {}, torch.device("cpu"), block_bytes=16)


def test_a_producer_whose_port_is_taken_fails_its_start() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(Exception, match="cannot listen on 127.0.0.1"):
            LLM(num_blocks=64, kv_transfer_config=transfer("kv_producer", taken.getsockname()[1]))


def test_a_consumer_that_cannot_reach_its_producer_says_so(monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """A wrong kv_ip or a firewall: the consumer serves on, computing its prompts, and its log says why (after a
    minute unlinked; here at once)."""
    monkeypatch.setattr(kv_link, "UNLINKED_WARNING_AFTER_S", 0.0)
    monkeypatch.setattr(kv_link, "CONSUMER_JOIN_TIMEOUT", timedelta(seconds=1))
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = parse_kv_transfer_config(transfer("kv_consumer", port))
    caplog.set_level(logging.WARNING, logger=kv_link.__name__)
    consumer = KVLink(config, 0, {"model": "m"}, torch.device("cpu"), block_bytes=16, on_blocks=lambda *_: None)
    try:
        deadline = time.monotonic() + LINK_WAIT_S
        while "not linked to the kv_producer" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
        assert f"not linked to the kv_producer at 127.0.0.1:{port}" in caplog.text and not consumer.up
    finally:
        consumer.close()


def test_a_consumer_that_cannot_keep_what_it_received_keeps_the_link(ports: int) -> None:
    """Two bare links: a batch the consumer fails to store (a full /dev/shm) is acknowledged and dropped, and the
    next one arrives whole."""
    kept: list[tuple[list[str], bytes]] = []
    failures = [OSError(28, "No space left on device")]

    def keep(names: list[str], data: torch.Tensor) -> None:
        if failures:
            raise failures.pop()
        kept.append((names, data.numpy().tobytes()))

    port = ports + 2  # the layout test's producer is gone by now
    layout = {"model": "m", "block_bytes": 4}
    producer = KVLink(parse_kv_transfer_config(transfer("kv_producer", port)), 0, layout, torch.device("cpu"), 4)
    consumer = KVLink(parse_kv_transfer_config(transfer("kv_consumer", port)), 0, layout, torch.device("cpu"), 4, keep)
    try:
        assert wait_linked(producer, LINK_WAIT_S) and wait_linked(consumer, LINK_WAIT_S)
        names = ["ab" * 32, "cd" * 32]
        data = torch.arange(8, dtype=torch.uint8)
        assert producer.send(names, data) and kept == []
        assert producer.send(names[::-1], data + 1) and producer.up
        assert kept == [(names[::-1], bytes(range(1, 9)))]
    finally:
        consumer.close()
        producer.close()


def test_a_consumer_without_the_deployments_secret_is_not_linked(monkeypatch: pytest.MonkeyPatch,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """Whoever reaches the producer's port could join its TCPStore as the consumer and receive every prompt's KV:
    a consumer whose LMSERVE_NODE_SECRET differs is refused (both sides say why) and gets no block, and one with the
    producer's secret links and receives. The producer keeps serving throughout."""
    from lmserve.distributed.signed_frames import NODE_SECRET_ENV

    port = free_port_block("127.0.0.1", 1)
    layout = {"model": "m", "block_bytes": 4}
    kept: list[list[str]] = []
    monkeypatch.setenv(NODE_SECRET_ENV, "the deployment's secret, 32 chars")
    producer = KVLink(parse_kv_transfer_config(transfer("kv_producer", port)), 0, layout, torch.device("cpu"), 4)
    monkeypatch.setenv(NODE_SECRET_ENV, "an impostor's guess at the secret")
    impostor = KVLink(parse_kv_transfer_config(transfer("kv_consumer", port)), 0, layout, torch.device("cpu"), 4,
                      lambda names, data: kept.append(names))
    consumer = None
    try:
        with caplog.at_level(logging.WARNING, logger="lmserve.distributed.kv_link"):
            deadline = time.monotonic() + LINK_WAIT_S
            while caplog.text.count("does not hold this deployment's secret") < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
        assert "refused a kv_consumer" in caplog.text and "refused a kv_producer" in caplog.text, caplog.text
        assert not producer.up and not impostor.up
        assert not producer.send(["ab" * 32], torch.arange(4, dtype=torch.uint8)) and kept == []
        impostor.close()
        monkeypatch.setenv(NODE_SECRET_ENV, "the deployment's secret, 32 chars")
        consumer = KVLink(parse_kv_transfer_config(transfer("kv_consumer", port)), 0, layout, torch.device("cpu"), 4,
                          lambda names, data: kept.append(names))
        assert wait_linked(producer, LINK_WAIT_S) and wait_linked(consumer, LINK_WAIT_S)
        assert producer.send(["ab" * 32], torch.arange(4, dtype=torch.uint8)) and kept == [["ab" * 32]]
    finally:
        for link in (consumer, impostor, producer):
            if link is not None:
                link.close()


def test_a_link_over_the_network_needs_the_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the loopback the user's own key file stands in; a kv_ip that other machines reach needs the operator's
    secret, and the error says which variable."""
    from lmserve.distributed.signed_frames import NODE_SECRET_ENV

    monkeypatch.delenv(NODE_SECRET_ENV, raising=False)
    config = dataclasses.replace(parse_kv_transfer_config(transfer("kv_consumer", 65535)), kv_ip="192.0.2.1")
    with pytest.raises(ValueError, match=f"opens ports on 192.0.2.1, which other machines reach: set {NODE_SECRET_ENV}"):
        KVLink(config, 0, {}, torch.device("cpu"), 4)
    monkeypatch.setenv(NODE_SECRET_ENV, "short")
    with pytest.raises(ValueError, match="at least 16 characters"):
        KVLink(config, 0, {}, torch.device("cpu"), 4)


def test_a_killed_consumers_buffer_and_pins_are_removed_by_the_next_consumer(tmp_path: Path) -> None:
    """A consumer killed before its clean-up (SIGKILL, the OOM killer) leaves its buffer in /dev/shm (up to
    kv_buffer_size bytes) and pin directories whose hard links keep block files' bytes alive: the next consumer on
    the machine removes those of processes that are gone, and nothing of a live process or of another machine."""
    import os
    import signal
    import subprocess
    import sys

    from lmserve.distributed.kv_storage import SharedKVStorage
    from lmserve.engine.kv_transfer import scheduler_connector

    # The consumer's process names its buffer (as the front-end does) and fills it, then is killed.
    consumer = ("import json, os, time\n"
                "from lmserve.kv_transfer_config import parse_kv_transfer_config\n"
                "config = parse_kv_transfer_config(json.dumps({'kv_connector': 'PyNcclConnector',"
                " 'kv_role': 'kv_consumer'}))\n"
                "os.makedirs(config.shared_storage_path)\n"
                "open(os.path.join(config.shared_storage_path, 'block-r0.kv'), 'wb').write(b'x' * 4096)\n"
                "print(config.shared_storage_path, flush=True)\n"
                "time.sleep(120)\n")
    owner = subprocess.Popen([sys.executable, "-c", consumer], stdout=subprocess.PIPE, text=True)
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        killed_buffer = Path(owner.stdout.readline().strip())
        assert killed_buffer.is_dir() and f"-p{owner.pid}-" in killed_buffer.name
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        host = socket.gethostname()
        live_buffer = killed_buffer.with_name(f"lmserve-kv-link-1-{host}-p{alive.pid}-0123456789ab")
        foreign_buffer = killed_buffer.with_name(f"lmserve-kv-link-1-another-host-p{owner.pid}-0123456789ab")
        for kept in (live_buffer, foreign_buffer):
            kept.mkdir()
        config = KVTransferConfig("PyNcclConnector", "kv_consumer",
                                  str(killed_buffer.with_name(f"lmserve-kv-link-1-{host}-p{os.getpid()}-fedcba987654")))
        scheduling = scheduler_connector(config, 1, kv=None)  # the next consumer's start
        try:
            assert not killed_buffer.exists()
            assert live_buffer.is_dir() and foreign_buffer.is_dir()
        finally:
            scheduling.close()
            for kept in (live_buffer, foreign_buffer):
                kept.rmdir()
        assert not Path(config.shared_storage_path).exists()

        # Pins in a storage directory: a killed consumer's go (with the bytes their links held), the rest stay.
        (tmp_path / "block-r0.kv").write_bytes(b"x" * 4096)
        pins = {name: tmp_path / f".pins-{name}-0123abcd" for name in
                (f"{host}-p{owner.pid}", f"{host}-p{alive.pid}", f"another-host-p{owner.pid}")}
        for directory in pins.values():
            directory.mkdir()
            os.link(tmp_path / "block-r0.kv", directory / "pinned-r0.kv")
        storage = SharedKVStorage(str(tmp_path), 1)
        assert not pins[f"{host}-p{owner.pid}"].exists()
        assert pins[f"{host}-p{alive.pid}"].is_dir() and pins[f"another-host-p{owner.pid}"].is_dir()
        assert storage.pins.is_dir() and f"{host}-p{os.getpid()}-" in storage.pins.name
        storage.close()
    finally:
        for process in (owner, alive):
            process.kill()
            process.wait()


def test_orphans_are_matched_by_their_whole_name_not_a_piece_of_it(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Host node1 shares a storage directory with host gpu-node1: gpu-node1's pins (`.pins-gpu-node1-p<pid>-<id>`)
    end in "-node1-p<pid>", yet they are not node1's, whatever the pid: only a name that parses whole, with this
    machine's name exactly, is a candidate. Names that only look alike (another prefix, a trailing part) stay."""
    import subprocess
    import sys

    from lmserve.distributed import kv_storage

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    monkeypatch.setattr(kv_storage.socket, "gethostname", lambda: "node1")
    theirs = [f".pins-gpu-node1-p{gone.pid}-0123abcd", f".pins-node1-p{gone.pid}-0123abcd-x",
              f"lmserve-kv-link-1-gpu-node1-p{gone.pid}-0123456789ab", f"x.pins-node1-p{gone.pid}-0123abcd"]
    ours = [f".pins-node1-p{gone.pid}-0123abcd", f"lmserve-kv-link-14579-node1-p{gone.pid}-0123456789ab"]
    for name in theirs + ours:
        (tmp_path / name).mkdir()
    assert kv_storage.owner(f".pins-gpu-node1-p{gone.pid}-0123abcd") == ("gpu-node1", gone.pid)
    assert sorted(path.name for path in kv_storage.remove_orphans(tmp_path)) == sorted(ours)
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(theirs)


def test_a_consumers_rank_on_another_machine_than_its_engine_is_refused() -> None:
    """The consumer's engine pins blocks from the buffer of its own machine: a rank elsewhere (--nnodes, Ray) would
    fill a /dev/shm that engine never reads (every prompt computed again, the buffer left behind), so it refuses to
    start and says what works instead; on the engine's machine the same rank starts."""
    config = parse_kv_transfer_config(transfer("kv_consumer", 65535))
    assert config.buffer_host == socket.gethostname()
    elsewhere = dataclasses.replace(config, buffer_host="node-0.example")
    with pytest.raises(ValueError, match=r"on the machine of its engine \(node-0.example\); rank 1 runs on .*"
                                         r"SharedStorageConnector"):
        PyNcclWorker(elsewhere, [], 1, "m")
    assert not Path(config.shared_storage_path).exists()  # nothing made on the wrong machine
    producer = dataclasses.replace(parse_kv_transfer_config(transfer("kv_producer", 65535)), buffer_host="node-0.example")
    assert producer.buffer_host and not producer.loads  # a producer's ranks keep no buffer: any machine may send
