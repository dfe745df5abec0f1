"""A KV connector of the user's own (vLLM's kv_connector_module_path): its scheduler and worker sides, written
against the interface alone (tests/engine/memory_kv_connector.py keeps blocks in this process's memory), carry a
prompt's KV from a producer to a consumer that then gives one instance's greedy tokens; a module or class that is not
a connector is a clear error at start-up."""

from __future__ import annotations

import json

import memory_kv_connector
import pytest
from test_engine_e2e import assert_idle
from test_kv_transfer import GREEDY, ONE_TOKEN, PROMPTS

from lmserve import LLM
from lmserve.kv_transfer_config import KVTransferConfig


def plugged(role: str, store: str, name: str = "MemoryConnector", module: str = "memory_kv_connector") -> str:
    return json.dumps({"kv_connector": name, "kv_connector_module_path": module, "kv_role": role,
                       "kv_connector_extra_config": {"store": store}})


def test_a_plugged_connector_carries_the_prompts_kv_to_the_consumer() -> None:
    plain = LLM(num_blocks=200)
    expected = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, GREEDY)]
    plain.shutdown()
    producer = LLM(num_blocks=200, kv_transfer_config=plugged("kv_producer", "pair"))
    prefilled = producer.generate(PROMPTS, ONE_TOKEN)
    assert_idle(producer)
    producer.shutdown()
    full_blocks = [(len(o.prompt_token_ids) - 1) // 16 for o in prefilled]
    store = memory_kv_connector.STORES["pair"]
    assert len(store) >= sum(full_blocks) > 0
    assert "elsewhere" not in memory_kv_connector.STORES  # the extra config reached the worker side as given

    consumer = LLM(num_blocks=200, kv_transfer_config=plugged("kv_consumer", "pair"))
    decoded = consumer.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in decoded] == expected
    assert [o.num_cached_tokens for o in decoded] == [16 * n for n in full_blocks]
    assert consumer.engine.scheduler.kv_transfer.num_loaded_blocks == sum(full_blocks)
    assert_idle(consumer)
    consumer.shutdown()

    # Another store holds nothing: the same prompts are computed there.
    empty = LLM(num_blocks=200, kv_transfer_config=plugged("kv_consumer", "elsewhere"))
    again = empty.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in again] == expected
    assert [o.num_cached_tokens for o in again] == [0, 0]
    empty.shutdown()


def test_the_config_takes_a_module_path_and_bounds_it() -> None:
    config = KVTransferConfig.from_json(json.loads(plugged("kv_both", "s")))
    assert (config.kv_connector, config.module_path, config.extra_config) == (
        "MemoryConnector", "memory_kv_connector", {"store": "s"})
    assert config.saves and config.loads
    for bad, message in [({"kv_connector_module_path": "not a module"}, "dotted module name"),
                         ({"kv_connector_module_path": "x" * 300}, "dotted module name"),
                         ({"kv_connector": "no-such class"}, "must name a class"),
                         ({"kv_role": "kv_leader"}, "kv_role"),
                         ({"kv_connector_extra_config": {"store": "x" * 70_000}}, "at most 65536 bytes"),
                         ({"kv_connector_extra_config": []}, "must be an object")]:
        with pytest.raises(ValueError, match=message):
            KVTransferConfig.from_json({**json.loads(plugged("kv_both", "s")), **bad})


@pytest.mark.parametrize(("name", "module", "message"), [
    ("MemoryConnector", "no_such_module_anywhere", "cannot import kv_connector_module_path 'no_such_module_anywhere'"),
    ("Missing", "memory_kv_connector", "memory_kv_connector has no Missing"),
    ("NoScheduler", "memory_kv_connector", "NoScheduler.scheduler must be a subclass of .*KVConnectorScheduler"),
    ("NoWorker", "memory_kv_connector", "NoWorker.worker must be a subclass of .*KVConnectorWorker"),
])
def test_a_module_or_class_that_is_not_a_connector_is_refused_at_start(name: str, module: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(num_blocks=64, kv_transfer_config=plugged("kv_consumer", "s", name, module))
