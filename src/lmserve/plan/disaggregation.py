"""When prefill/decode separation pays, from a step-time cost model (`lmserve schedule --calibrate`).

Colocated (one instance, chunked prefill), a decode step that carries a prompt chunk takes the chunk's time too: the
streams' worst inter-token latency is step_ms(chunk + streams), the chunk being min(prompt, budget). Separated on the
same hardware split in two, the decode instance never carries a chunk but has half the compute: 2 x step_ms(streams);
the prompt takes 2 x step_ms(prompt) on the prefill half. Separation pays when the colocated worst ITL misses the
target and the separated one meets it. A linear model of one machine: an estimate to choose what to measure.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from lmserve.plan.cost_model import CostModel


@dataclass
class SeparationAdvice:
    colocated_worst_itl_ms: float
    separated_itl_ms: float
    colocated_ttft_ms: float
    separated_ttft_ms: float
    itl_target_ms: float
    pays: bool
    commands: list[str]

    def render(self) -> str:
        verdict = ("separate prefill and decode" if self.pays else
                   "keep one instance (separation would not meet the target or is not needed)")
        lines = [f"prefill/decode separation for an ITL target of {self.itl_target_ms:.0f} ms: {verdict}",
                 f"  colocated: worst ITL {self.colocated_worst_itl_ms:.1f} ms, TTFT {self.colocated_ttft_ms:.0f} ms",
                 (f"  separated: ITL {self.separated_itl_ms:.1f} ms, TTFT {self.separated_ttft_ms:.0f} ms "
                  "(each side on half the hardware, plus the KV's trip through storage)")]
        if self.pays:
            lines += ["  commands:", *(f"    {c}" for c in self.commands),
                      ("  on two machines, each --kv-transfer-config instead: "
                       '{"kv_connector": "PyNcclConnector", "kv_role": "kv_producer" (or "kv_consumer"), '
                       '"kv_ip": "<the prefill machine\'s address>"} (the KV over torch.distributed)')]
        return "\n".join(lines)


def separation_advice(cost: CostModel, prompt_len: int, streams: int, budget: int, itl_target_ms: float,
                      model: str, storage: str = "/dev/shm/lmserve-kv") -> SeparationAdvice:
    if prompt_len < 1 or streams < 1 or budget < 1 or itl_target_ms <= 0:
        raise ValueError("prompt length, streams and budget must be >= 1 and the ITL target > 0")
    chunk = min(prompt_len, budget)
    colocated_itl = cost.step_ms(chunk + streams)
    chunks = -(-prompt_len // budget)
    colocated_ttft = chunks * cost.step_ms(chunk + streams)
    separated_itl = 2 * cost.step_ms(streams)
    separated_ttft = 2 * cost.step_ms(prompt_len)
    pays = colocated_itl > itl_target_ms >= separated_itl

    def role(name: str) -> str:
        return json.dumps({"kv_connector": "SharedStorageConnector", "kv_role": name,
                           "kv_connector_extra_config": {"shared_storage_path": storage}})

    commands = [f"lmserve serve {model} --port 8100 --kv-transfer-config '{role('kv_producer')}'",
                f"lmserve serve {model} --port 8200 --kv-transfer-config '{role('kv_consumer')}'",
                "lmserve router --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000"]
    return SeparationAdvice(colocated_itl, separated_itl, colocated_ttft, separated_ttft, itl_target_ms, pays,
                            commands)
