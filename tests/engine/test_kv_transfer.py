"""Prefill/decode disaggregation over shared storage (--kv-transfer-config SharedStorageConnector) on the default
model, in-process: a consumer that loads a producer's blocks gives one instance's greedy tokens, counts the loaded
tokens as cached, holds no block afterwards and leaves no pin behind; a block missing from the storage is computed;
a consumer of another KV layout refuses to start; the producer keeps to its byte cap."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_engine_e2e import assert_idle

from lmserve import LLM, SamplingParams
from lmserve.config import KVTransferConfig, parse_kv_transfer_config
from lmserve.engine.kv_cache import hash_block_tokens

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


def stored_blocks(path: Path) -> list[Path]:
    return sorted(path.glob("*.kv"))


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
    (storage / f"{chain.hex()}-r0.kv").unlink()
    again = consumer.generate(prompt, GREEDY)[0]
    assert again.outputs[0].token_ids == out.outputs[0].token_ids
    assert again.num_cached_tokens == 32  # the run of stored blocks ends where one is missing


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
    block_bytes = json.loads((tmp_path / "probe" / "layout-r0.json").read_text())["block_bytes"]
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
