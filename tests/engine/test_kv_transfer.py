"""Prefill/decode disaggregation over shared storage (--kv-transfer-config SharedStorageConnector) on the default
model, in-process: a consumer that loads a producer's blocks gives one instance's greedy tokens, counts the loaded
tokens as cached, holds no block afterwards and leaves no pin behind; a block missing from the storage is computed;
a consumer of another KV layout refuses to start; the producer keeps to its byte cap."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_engine_e2e import assert_idle

from lmserve import LLM, SamplingParams
from lmserve.engine.kv_cache import hash_block_tokens
from lmserve.kv_transfer_config import KVTransferConfig, parse_kv_transfer_config

PROMPTS = [
    ("The history of Paris begins in the third century BC, when a Celtic people called the Parisii settled on an "
    "island in the Seine. The Romans conquered the area in 52 BC and built a town named Lutetia on the left bank."),
    "List the planets of the solar system in order from the Sun, with one fact about each of them:",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
ONE_TOKEN = SamplingParams(temperature=0.0, max_tokens=1)


def transfer(role: str, path: Path, **extra: object) -> str:
    return json.dumps({"kv_connector": "SharedStorageConnector", "kv_role": role,
                       "kv_connector_extra_config": {"shared_storage_path": str(path), **extra}})


def model_storage(path: Path) -> Path:
    """The directory of the one model whose blocks `path` holds (blocks are filed under the model's fingerprint)."""
    (directory,) = path.glob("model-*")
    return directory


def stored_blocks(path: Path) -> list[Path]:
    return sorted(path.glob("model-*/*.kv"))


@pytest.fixture(scope="module")
def storage(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kv")


@pytest.fixture(scope="module")
def plain() -> Iterator[LLM]:
    llm = LLM(num_blocks=200)
    yield llm
    assert_idle(llm)


@pytest.fixture(scope="module")
def producer(storage: Path) -> Iterator[LLM]:
    llm = LLM(num_blocks=200, kv_transfer_config=transfer("kv_producer", storage))
    yield llm
    assert_idle(llm)


@pytest.fixture(scope="module")
def consumer(storage: Path) -> Iterator[LLM]:
    llm = LLM(num_blocks=200, kv_transfer_config=transfer("kv_consumer", storage))
    yield llm
    assert_idle(llm)
    assert not any(llm.engine.scheduler.kv_transfer.storage.pins.iterdir())  # every pin was read and dropped


def test_the_config_is_vllms_and_checked() -> None:
    parsed = parse_kv_transfer_config(transfer("kv_both", Path("/tmp/x"), max_storage_bytes="1GiB"))
    assert parsed == KVTransferConfig("SharedStorageConnector", "kv_both", "/tmp/x", 2**30)
    assert parsed.saves and parsed.loads
    vllms = {"kv_connector": "PyNcclConnector", "kv_role": "kv_consumer", "kv_buffer_device": "cuda"}  # its default
    assert KVTransferConfig.from_json(vllms).loads
    for bad, message in [({"kv_connector": "NixlConnector", "kv_role": "kv_both"}, "not supported"),
                         ({"kv_connector": "SharedStorageConnector", "kv_role": "kv_leader"}, "kv_role"),
                         ({"kv_connector": "SharedStorageConnector", "kv_role": "kv_both"}, "shared_storage_path"),
                         ({"kv_connector": "SharedStorageConnector", "kv_role": "kv_both", "kv_connector_extra_config":
                           {"shared_storage_path": "/x", "max_storage_bytes": -1}}, "max_storage_bytes"),
                         ({"kv_connector": "SharedStorageConnector", "kv_role": "kv_both", "cache": 1}, "unknown"),
                         ({"kv_connector": "PyNcclConnector", "kv_role": "kv_producer", "kv_buffer_device": "tpu"},
                          "kv_buffer_device must be one of cuda, cpu")]:
        with pytest.raises(ValueError, match=message):
            KVTransferConfig.from_json(bad)


def test_a_consumer_loads_the_producers_blocks_and_gives_one_instances_tokens(
        plain: LLM, producer: LLM, consumer: LLM, storage: Path) -> None:
    expected = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, GREEDY)]
    prefilled = producer.generate(PROMPTS, ONE_TOKEN)  # what the router asks the prefill instance for
    full_blocks = [(len(o.prompt_token_ids) - 1) // 16 for o in prefilled]
    assert len(stored_blocks(storage)) == sum(full_blocks) > 0
    decoded = consumer.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in decoded] == expected
    # The consumer computed none of those blocks itself: they count as cached, as vLLM counts external hits.
    assert [o.num_cached_tokens for o in decoded] == [16 * n for n in full_blocks]
    assert consumer.engine.scheduler.kv_transfer.num_loaded_blocks == sum(full_blocks)


def test_a_block_missing_from_the_storage_is_computed(producer: LLM, consumer: LLM, storage: Path) -> None:
    prompt = "A different prompt, long enough for a few blocks of sixteen tokens each, about rivers and the sea. " * 4
    out = producer.generate(prompt, GREEDY)[0]  # it stores the prompt's blocks, then decodes on
    tokens = out.prompt_token_ids
    assert (len(tokens) - 1) // 16 >= 4
    chain = None
    for i in range(3):  # the third block's name: its prefix-cache hash, as every process computes it
        chain = hash_block_tokens(chain, tokens[16 * i : 16 * (i + 1)])
    (model_storage(storage) / f"{chain.hex()}-r0.kv").unlink()
    again = consumer.generate(prompt, GREEDY)[0]
    assert again.outputs[0].token_ids == out.outputs[0].token_ids
    assert again.num_cached_tokens == 32  # the run of stored blocks ends where one is missing


def test_the_consumers_own_prefix_cache_comes_first_then_the_stored_blocks(
        plain: LLM, producer: LLM, consumer: LLM) -> None:
    """A decode instance that already holds a prompt's first blocks (a shared system prompt) loads only the rest."""
    shared = "You are a patient chess teacher. Explain each rule with a short example and no jargon at all. " * 3
    first, second = shared + "How does the knight move?", shared + "What is castling, and when is it allowed?"
    producer.generate(first, ONE_TOKEN)
    consumer.generate(first, GREEDY)
    prefilled = producer.generate(second, ONE_TOKEN)[0]
    tokens, first_tokens = prefilled.prompt_token_ids, consumer.generate(first, ONE_TOKEN)[0].prompt_token_ids
    common = next(i for i, (a, b) in enumerate(zip(tokens, first_tokens, strict=False)) if a != b) // 16
    full = (len(tokens) - 1) // 16
    assert 2 <= common < full
    loaded_before = consumer.engine.scheduler.kv_transfer.num_loaded_blocks
    decoded = consumer.generate(second, GREEDY)[0]
    assert consumer.engine.scheduler.kv_transfer.num_loaded_blocks - loaded_before == full - common
    assert decoded.num_cached_tokens == 16 * full  # its own hit and the loaded blocks
    assert decoded.outputs[0].token_ids == plain.generate(second, GREEDY)[0].outputs[0].token_ids


def test_prompt_logprobs_compute_every_position(consumer: LLM) -> None:
    out = consumer.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=0))[0]
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
    assert out.num_cached_tokens == 0  # the stored blocks were not loaded (nor the consumer's own cache used)


def test_a_consumer_of_another_kv_layout_refuses_to_start(producer: LLM, storage: Path) -> None:
    with pytest.raises(Exception, match="another layout"):
        LLM(num_blocks=64, kv_cache_dtype="float32", kv_transfer_config=transfer("kv_consumer", storage))


def test_the_producer_keeps_to_its_byte_cap(tmp_path: Path) -> None:
    """Oldest files first: with room for two blocks, three written leave the last two."""
    llm = LLM(num_blocks=200, kv_transfer_config=transfer("kv_producer", tmp_path / "probe"))
    block_bytes = json.loads((model_storage(tmp_path / "probe") / "layout-r0.json").read_text())["block_bytes"]
    llm.shutdown()
    llm = LLM(num_blocks=200, kv_transfer_config=transfer("kv_producer", tmp_path / "kv",
                                                           max_storage_bytes=2 * block_bytes + 1))
    written = []
    for prompt in PROMPTS:  # 2 + 1 full blocks
        llm.generate(prompt, ONE_TOKEN)
        written += [f for f in stored_blocks(tmp_path / "kv") if f not in written]
    files = stored_blocks(tmp_path / "kv")
    assert len(written) == 3 and len(files) == 2 and written[0] not in files
    assert sum(f.stat().st_size for f in files) == 2 * block_bytes
    assert_idle(llm)
    llm.shutdown()


def test_a_producer_restarted_keeps_to_its_byte_cap_counting_what_is_on_disk(tmp_path: Path) -> None:
    """The cap bounds the directory, not one process's writes: a producer started again over its predecessor's
    files (two blocks, the cap) removes the oldest as it writes a third, where it used to let the store grow by a
    cap's worth each start. The directories are this user's only (0700): they hold every stored prompt's KV."""
    import stat

    probe = LLM(num_blocks=200, kv_transfer_config=transfer("kv_producer", tmp_path / "probe"))
    block_bytes = json.loads((model_storage(tmp_path / "probe") / "layout-r0.json").read_text())["block_bytes"]
    probe.shutdown()
    config = transfer("kv_producer", tmp_path / "kv", max_storage_bytes=2 * block_bytes + 1)
    first = LLM(num_blocks=200, kv_transfer_config=config)
    first.generate(PROMPTS[0], ONE_TOKEN)  # two full blocks
    before = stored_blocks(tmp_path / "kv")
    first.shutdown()
    assert len(before) == 2
    for directory in (tmp_path / "kv", model_storage(tmp_path / "kv")):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700, directory
    again = LLM(num_blocks=200, kv_transfer_config=config)
    again.generate(PROMPTS[1], ONE_TOKEN)  # one more
    after = stored_blocks(tmp_path / "kv")
    assert len(after) == 2 and not set(before) <= set(after)
    assert sum(f.stat().st_size for f in after) <= 2 * block_bytes
    again.shutdown()


def test_a_block_file_cut_short_or_gone_before_its_load_is_computed(plain: LLM, producer: LLM, consumer: LLM,
                                                                     storage: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A stored file truncated after the producer wrote it, or a pin removed before the load read it: the request
    computes those positions itself and answers as one instance would; nothing fails, the blocks are not left in the
    prefix cache, and the metric counts the failed loads."""
    import os

    from lmserve.distributed.kv_storage import SharedKVStorage

    transfer_side = consumer.engine.scheduler.kv_transfer
    failed_before, loaded_before = transfer_side.num_failed_loads, transfer_side.num_loaded_blocks
    short = "A prompt about lighthouses and the people who kept them, long enough to fill several blocks. " * 3
    gone = "A prompt about bridges of stone and iron, and the rivers they were built to cross, at length. " * 3
    expected = [o.outputs[0].token_ids for o in plain.generate([short, gone], GREEDY)]
    producer.generate(short, ONE_TOKEN)
    newest = max(stored_blocks(storage), key=lambda path: path.stat().st_mtime_ns)
    os.truncate(newest, 100)
    assert consumer.generate(short, GREEDY)[0].outputs[0].token_ids == expected[0]
    assert transfer_side.num_failed_loads == failed_before + 1

    producer.generate(gone, ONE_TOKEN)
    pin = SharedKVStorage.pin

    def pin_then_lose(self, block_hashes):
        names = pin(self, block_hashes)
        for name in names[-1:]:
            (self.pins / f"{name}-r0.kv").unlink()
        return names

    monkeypatch.setattr(SharedKVStorage, "pin", pin_then_lose)
    decoded = consumer.generate(gone, GREEDY)[0]
    monkeypatch.undo()
    assert decoded.outputs[0].token_ids == expected[1]
    assert transfer_side.num_failed_loads == failed_before + 2
    assert transfer_side.num_loaded_blocks == loaded_before  # what failed does not count as loaded
    assert consumer.engine.stats().kv_transfer_failed_loads == failed_before + 2
    # Served again, the prompts hit the consumer's own prefix cache, now computed right.
    assert [o.outputs[0].token_ids for o in consumer.generate([short, gone], GREEDY)] == expected
    assert_idle(consumer)
    assert not any(transfer_side.storage.pins.iterdir())  # a failed load's pins go too


def test_a_full_disk_skips_the_save_and_counts_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ENOSPC or EIO while a producer stores a block: the block is not stored (no half-written file left), the
    step's tokens come out as usual, and kv_transfer_failed_saves counts it; the next save that can write does."""
    import errno
    import os

    llm = LLM(num_blocks=200, kv_transfer_config=transfer("kv_producer", tmp_path))
    replace = os.replace
    failures = [OSError(errno.ENOSPC, "No space left on device"), OSError(errno.EIO, "Input/output error")]

    def failing_replace(source, target):  # the block's bytes are written under a temporary name, then renamed
        if failures and str(target).endswith(".kv"):
            raise failures.pop(0)
        return replace(source, target)

    monkeypatch.setattr(os, "replace", failing_replace)
    try:
        full_blocks = 0
        for prompt in PROMPTS:  # the first one's saves meet ENOSPC, the second one's EIO
            out = llm.generate(prompt, GREEDY)[0]
            assert len(out.outputs[0].token_ids) > 0
            full_blocks += len(out.prompt_token_ids) // 16  # every full prompt block is saved
        assert llm.engine.stats().kv_transfer_failed_saves == full_blocks > 0 and stored_blocks(tmp_path) == []
        llm.generate(PROMPTS, ONE_TOKEN)  # the disk has room again: the same blocks are stored now
        assert len(stored_blocks(tmp_path)) == full_blocks
        assert not [p for p in model_storage(tmp_path).iterdir() if p.name.startswith(".") and ".kv." in p.name]
        assert_idle(llm)
    finally:
        llm.shutdown()


def test_two_models_in_one_storage_never_read_each_others_blocks(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """Two Hugging Face directories of one name and size (a fine-tune of the same base): the second model's
    consumer must not load the first one's blocks (a directory's identity was its name and "size 0")."""
    import shutil

    from safetensors.torch import load_file, save_file

    copies = []
    for index, scale in enumerate((1.0, 1.01)):
        copy = tmp_path / f"m{index}" / "model"
        shutil.copytree(tiny_llama_dir, copy)
        for weights in copy.glob("*.safetensors"):
            tensors = {name: (t * scale).to(t.dtype) if t.is_floating_point() else t
                       for name, t in load_file(weights).items()}
            save_file(tensors, weights, metadata={"format": "pt"})
        copies.append(copy)
    assert [p.stat().st_size for p in copies[0].iterdir()] == [p.stat().st_size for p in copies[1].iterdir()]
    storage = tmp_path / "kv"
    options = {"dtype": "float32", "quantization": "none", "num_blocks": 64, "max_model_len": 256}
    prompt = list(range(200, 260))
    with LLM(str(copies[0]), **options, kv_transfer_config=transfer("kv_producer", storage)) as producer:
        producer.generate([prompt], ONE_TOKEN)
    with LLM(str(copies[1]), **options, kv_transfer_config=transfer("kv_consumer", storage)) as consumer:
        consumer.generate([prompt], ONE_TOKEN)
        assert consumer.engine.scheduler.kv_transfer.num_loaded_blocks == 0
    with LLM(str(copies[0]), **options, kv_transfer_config=transfer("kv_consumer", storage)) as same:
        same.generate([prompt], ONE_TOKEN)
        assert same.engine.scheduler.kv_transfer.num_loaded_blocks == (len(prompt) - 1) // 16


@pytest.fixture
def slow_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each request's load takes 0.3 s longer: the steps in between are what the loading thread runs beside."""
    from lmserve.worker.kv_transfer import KVConnectorWorker

    load = KVConnectorWorker._load_in_thread

    def slower(self, blocks):
        time.sleep(0.3)
        return load(self, blocks)

    monkeypatch.setattr(KVConnectorWorker, "_load_in_thread", slower)


def recorded_steps(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> list:
    steps = []
    schedule = llm.engine.scheduler.schedule

    def recording():
        steps.append(schedule())
        return steps[-1]

    monkeypatch.setattr(llm.engine.scheduler, "schedule", recording)
    return steps


def test_a_request_loads_its_blocks_while_a_running_one_decodes(
        plain: LLM, producer: LLM, consumer: LLM, slow_loads: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM V1's asynchronous load: the loading request waits (as in WAITING_FOR_REMOTE_KVS) and the running
    request's steps go on meanwhile; then it runs from its loaded blocks and gives one instance's tokens."""
    prompt = "Rivers of Europe, from the longest to the shortest, with the countries each one flows through: " * 2
    running = "Count from one to fifty: one, two, three,"
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), GREEDY]
    expected = [o.outputs[0].token_ids for o in plain.generate([running, prompt], params)]
    loaded = 16 * ((len(producer.generate(prompt, ONE_TOKEN)[0].prompt_token_ids) - 1) // 16)
    steps = recorded_steps(consumer, monkeypatch)
    decoded = consumer.generate([running, prompt], params)
    assert [o.outputs[0].token_ids for o in decoded] == expected
    assert decoded[1].num_cached_tokens == loaded > 0
    (issued,) = [i for i, step in enumerate(steps) if step.kv_loads]
    loading_id = steps[issued].kv_loads[0][0]
    first_run = next(i for i, step in enumerate(steps) if any(s.request_id == loading_id for s in step.scheduled))
    assert first_run > issued
    assert next(s for s in steps[first_run].scheduled if s.request_id == loading_id).start_position == loaded
    beside = [step for step in steps[issued:first_run] if step.scheduled]
    assert len(beside) >= 2, "the running request did not step while the other one loaded"
    assert all(loading_id not in {s.request_id for s in step.scheduled} for step in beside)


def test_a_request_aborted_while_loading_holds_nothing(
        producer: LLM, consumer: LLM, slow_loads: None, monkeypatch: pytest.MonkeyPatch) -> None:
    prompt = "Mountains of Asia, from the highest, with the first people known to have climbed each of them: " * 2
    expected = consumer.engine.scheduler.kv_transfer.num_loaded_blocks
    producer.generate(prompt, ONE_TOKEN)
    steps = recorded_steps(consumer, monkeypatch)
    consumer._add(prompt, GREEDY, 0)
    while not any(step.kv_loads for step in steps):
        consumer._step()
    (request_id,) = consumer.engine.scheduler.requests
    assert consumer.engine.scheduler.requests[request_id].kv_loading
    consumer.output_processor.process_outputs(consumer.engine.abort_requests([request_id]))
    consumer.output_processor.remove(request_id)
    while consumer.engine.has_unfinished_requests():
        consumer._step()
    consumer.engine.step()  # the next step waits for the aborted load before its blocks can be reused
    assert_idle(consumer)
    assert not any(consumer.engine.scheduler.kv_transfer.storage.pins.iterdir())
    assert consumer.engine.scheduler.kv_transfer.num_loaded_blocks > expected
    # The same prompt again loads again and answers as the producer would.
    again = consumer.generate(prompt, GREEDY)[0]
    assert again.outputs[0].token_ids == producer.generate(prompt, GREEDY)[0].outputs[0].token_ids


def test_int8_blocks_travel_with_their_scales_and_a_float16_consumer_refuses_them(tmp_path: Path) -> None:
    """An int8 cache's rows hold their scales (worker/kv_int8.py), so a stored block is its values and scales: a
    consumer that loads them gives an int8 instance's own tokens and logprobs, bit for bit; a float16 consumer of the
    same storage refuses to start."""
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=0)
    with LLM(num_blocks=64, kv_cache_dtype="int8") as plain_int8:
        expected = plain_int8.generate(PROMPTS, params)
    with LLM(num_blocks=64, kv_cache_dtype="int8", kv_transfer_config=transfer("kv_producer", tmp_path)) as producer:
        prefilled = producer.generate(PROMPTS, ONE_TOKEN)
    full_blocks = [(len(o.prompt_token_ids) - 1) // 16 for o in prefilled]
    assert len(stored_blocks(tmp_path)) == sum(full_blocks) > 0
    layout = json.loads(next(model_storage(tmp_path).glob("layout-r0.json")).read_text())
    assert layout["dtype"] == "torch.int8" and layout["block_shapes"][0][-1] == 64 + 4  # values, then 2 scales
    with LLM(num_blocks=64, kv_cache_dtype="int8", kv_transfer_config=transfer("kv_consumer", tmp_path)) as consumer:
        decoded = consumer.generate(PROMPTS, params)
    assert [o.num_cached_tokens for o in decoded] == [16 * n for n in full_blocks]
    for got, want in zip(decoded, expected, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert [e.logprob for e in got.outputs[0].logprobs] == [e.logprob for e in want.outputs[0].logprobs]
    with pytest.raises(Exception, match="another layout"):
        LLM(num_blocks=64, kv_cache_dtype="float16", kv_transfer_config=transfer("kv_consumer", tmp_path))
