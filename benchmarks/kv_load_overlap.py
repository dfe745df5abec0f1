"""What a consumer's KV load costs the requests already decoding (prefill/decode disaggregation, in-process).

A producer stores a long prompt's blocks (SharedStorageConnector); a consumer decodes one stream, then admits the
prompt, whose ~90 blocks it loads. Reported: the consumer's longest steps while that happens, and its median step.
`--touch` writes the whole KV pool first, as a pool resident from the start would be: the load is then copies only,
without the first-touch page faults of the lazily mapped pool.

    taskset -c 0,1 .venv/bin/python benchmarks/kv_load_overlap.py [--touch] [--blocks 400]
    PYTHONPATH=OTHER_TREE/src ... (the same for another tree)
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time

from lmserve import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--touch", action="store_true", help="write the consumer's whole KV pool before the run")
    parser.add_argument("--blocks", type=int, default=None, help="the consumer's KV blocks (default: its own size)")
    parser.add_argument("--words", type=int, default=1400, help="words of the long prompt (~1 token each)")
    options = parser.parse_args()
    storage = tempfile.mkdtemp(prefix="kv-load-overlap-")

    def transfer(role: str) -> str:
        return json.dumps({"kv_connector": "SharedStorageConnector", "kv_role": role,
                           "kv_connector_extra_config": {"shared_storage_path": storage}})

    rng = random.Random(0)
    words = ["river", "mountain", "sea", "forest", "city", "bridge", "castle", "valley", "island", "desert"]
    prompt = " ".join(rng.choice(words) for _ in range(options.words))
    with LLM(kv_transfer_config=transfer("kv_producer")) as producer:
        tokens = len(producer.generate(prompt, SamplingParams(max_tokens=1))[0].prompt_token_ids)
    sizes = {} if options.blocks is None else {"num_blocks": options.blocks}
    consumer = LLM(kv_transfer_config=transfer("kv_consumer"), **sizes)
    if options.touch:
        for layer in consumer.engine.executor.worker.runner.kv_caches:
            for tensor in layer:
                tensor.zero_()
    consumer._add("Count from one to a thousand: one, two,",
                  SamplingParams(max_tokens=300, ignore_eos=True, temperature=0), 0)
    for _ in range(5):
        consumer._step()
    consumer._add(prompt, SamplingParams(max_tokens=16, temperature=0), 0)
    steps = []
    while consumer.engine.has_unfinished_requests():
        started = time.perf_counter()
        consumer._step()
        steps.append(time.perf_counter() - started)
    loaded = consumer.engine.scheduler.kv_transfer.num_loaded_blocks
    consumer.shutdown()
    longest = sorted(steps, reverse=True)[:3]
    print(f"prompt {tokens} tokens, {loaded} blocks loaded, touch={options.touch}: longest steps "
          f"{', '.join(f'{s * 1e3:.1f}' for s in longest)} ms; median {statistics.median(steps) * 1e3:.1f} ms "
          f"over {len(steps)} steps")


if __name__ == "__main__":
    main()
