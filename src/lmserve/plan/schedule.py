"""Schedule explainer: replays a described workload through the real Scheduler and KVCacheManager.

The model is a stand-in that only counts positions: every scheduled request whose `samples` flag is set gets one
token back. So the iteration table is what the engine itself would do with the same settings, not a second model
of it (the tests check it against the live engine).

Conventions:
- Iterations are numbered from 1. A request with arrival iteration k is added just before iteration k schedules.
- first_token_iteration is absolute; iterations_to_first_token counts from the arrival iteration, which is 1. In the
  budget example (p:10:3@2, budget 6) p is computed in iterations 2, 3 and 4: first token in absolute iteration 4,
  the 3rd iteration of its life.
- Stall caused to others: in each iteration where a request computes prefill (or recompute) positions, every other
  request that produces a token in that iteration waits for those positions too. stall_positions sums, over such
  tokens, the positions the request added; max_stall_positions is the largest delay it added to any one token (the
  inter-token latency spike it causes). With a cost model both become milliseconds (× ms per position). Queueing
  delay (waiting requests kept out of the budget) is not counted: the table shows it as the waiting column.
- Prompts are distinct token ids per request, so no prefix-cache hits between requests; a preempted request can
  still hit its own cached blocks when it resumes, exactly as in the engine.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from lmserve.config import KV_BLOCK_SIZE, CacheConfig, SchedulerConfig
from lmserve.engine.request import Request
from lmserve.engine.scheduler import Scheduler
from lmserve.kv_sizing import blocks_needed
from lmserve.plan.cost_model import CostModel
from lmserve.plan.workload import REQUEST_SYNTAX, RequestSpec
from lmserve.sampling_params import SamplingParams
from lmserve.step import ModelRunnerOutput

# The stand-in's token. Requests carry no EOS id and ignore EOS, so only output_len ends them.
STANDIN_TOKEN = 0


@dataclass
class ScheduleSettings:
    budget: int = SchedulerConfig.max_num_batched_tokens
    max_num_seqs: int = SchedulerConfig.max_num_seqs
    long_prefill_token_threshold: int = 0
    num_blocks: int | None = None  # None: room for every request at once (no preemption)
    block_size: int = KV_BLOCK_SIZE
    enable_prefix_caching: bool = True


@dataclass
class Share:
    """One request's part of one iteration."""

    positions: int
    kind: str  # "prefill" | "decode" | "recompute" (after preemption)
    sampled: bool


@dataclass
class Iteration:
    iteration: int
    shares: dict[str, Share]  # in batch order
    waiting: list[str]  # the waiting queue after this iteration was scheduled, head first
    blocks_used: int
    preempted: list[str]
    arrived: list[str]
    est_ms: float | None = None

    @property
    def scheduled(self) -> dict[str, int]:
        return {name: s.positions for name, s in self.shares.items()}

    @property
    def sampled(self) -> list[str]:
        return [name for name, s in self.shares.items() if s.sampled]

    def to_dict(self) -> dict:
        out: dict = {
            "iteration": self.iteration,
            "scheduled": self.scheduled,
            "sampled": self.sampled,
            "waiting": self.waiting,
            "blocks_used": self.blocks_used,
            "kinds": {name: s.kind for name, s in self.shares.items()},
            "preempted": self.preempted,
            "arrived": self.arrived,
        }
        if self.est_ms is not None:
            out["est_ms"] = round(self.est_ms, 3)
        return out


@dataclass
class RequestSummary:
    name: str
    prompt_len: int
    output_len: int
    arrival: int
    first_scheduled: int | None = None
    first_token_iteration: int | None = None
    iterations_to_first_token: int | None = None  # the arrival iteration is 1
    finished_iteration: int | None = None
    finish_reason: str | None = None
    prefill_chunks: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    stall_positions: int = 0
    max_stall_positions: int = 0
    est_ttft_ms: float | None = None
    est_stall_ms: float | None = None


@dataclass
class ScheduleResult:
    settings: ScheduleSettings
    num_blocks: int
    iterations: list[Iteration]
    requests: list[RequestSummary]
    cost_model: CostModel | None = None

    def to_dict(self) -> dict:
        requests = [asdict(r) for r in self.requests]
        for r in requests:
            for key in ("est_ttft_ms", "est_stall_ms"):
                if r[key] is not None:
                    r[key] = round(r[key], 3)
        return {
            "settings": {**asdict(self.settings), "num_blocks": self.num_blocks},
            "iterations": [it.to_dict() for it in self.iterations],
            "requests": requests,
            "cost_model": None if self.cost_model is None else {
                **asdict(self.cost_model), "note": "estimate: linear in positions, measured on one machine",
            },
        }


def replay(
    specs: list[RequestSpec],
    settings: ScheduleSettings,
    cost_model: CostModel | None = None,
    max_iterations: int = 100_000,
) -> ScheduleResult:
    if not specs:
        raise ValueError(f"no requests: give --request {REQUEST_SYNTAX} (repeatable) or a JSON file")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"request names must be unique, got {', '.join(names)}")
    bs = settings.block_size
    num_blocks = settings.num_blocks
    if num_blocks is None:
        num_blocks = sum(blocks_needed(s.prompt_len + s.output_len, bs) for s in specs)
    scheduler = Scheduler(
        SchedulerConfig(settings.budget, settings.max_num_seqs, settings.long_prefill_token_threshold),
        CacheConfig(block_size=bs, enable_prefix_caching=settings.enable_prefix_caching),
        num_blocks,
        max(s.prompt_len + s.output_len for s in specs),
    )
    kv = scheduler.kv_cache_manager
    summaries = {s.name: RequestSummary(s.name, s.prompt_len, s.output_len, s.arrival) for s in specs}
    pending = sorted(enumerate(specs), key=lambda item: (item[1].arrival, item[0]))
    pending.reverse()  # pop() from the end = the next to arrive
    iterations: list[Iteration] = []
    live: dict[str, Request] = {}  # every request added so far, finished ones included
    clock_ms = 0.0
    started_ms: dict[int, float] = {}  # est. time at which each iteration began

    number = 0
    while pending or scheduler.has_unfinished_requests():
        number += 1
        if number > max_iterations:
            raise RuntimeError(f"the workload did not finish within {max_iterations} iterations")
        arrived = []
        while pending and pending[-1][1].arrival <= number:
            index, spec = pending.pop()
            # Distinct token ids per request: no accidental prefix hits between requests.
            prompt = list(range(index * 10**9, index * 10**9 + spec.prompt_len))
            params = SamplingParams(max_tokens=spec.output_len, ignore_eos=True, temperature=0.0)
            # Arrival order decides FCFS ties and preemption victims (latest arrival first), as in the engine.
            live[spec.name] = Request(spec.name, prompt, params, arrival_time=float(len(live)))
            scheduler.add_request(live[spec.name])
            arrived.append(spec.name)

        out = scheduler.schedule()
        shares = {}
        for planned in out.scheduled:
            request = scheduler.requests[planned.request_id]
            kind = _kind(planned.start_position, planned.num_tokens, planned.samples, request,
                         summaries[request.request_id].prompt_len)
            shares[planned.request_id] = Share(planned.num_tokens, kind, planned.samples)
        iteration = Iteration(
            number, shares, [r.request_id for r in scheduler.waiting], kv.num_used_blocks,
            sorted(out.preempted_request_ids), arrived,
        )
        started_ms[number] = clock_ms
        if cost_model is not None:
            iteration.est_ms = cost_model.step_ms(out.num_batched_tokens)
            clock_ms += iteration.est_ms
        scheduler.update_from_output(
            out, ModelRunnerOutput({s.request_id: STANDIN_TOKEN for s in out.scheduled if s.samples})
        )
        if out.is_empty and not pending and scheduler.has_unfinished_requests():
            stuck = ", ".join(r.request_id for r in scheduler.waiting)
            raise ValueError(f"nothing can be scheduled (waiting: {stuck}): the KV pool of {num_blocks} blocks "
                             "is too small")
        iterations.append(iteration)
        _account(iteration, summaries, live)

    for s in summaries.values():
        if cost_model is not None and s.first_token_iteration is not None:
            end = started_ms[s.first_token_iteration] + (iterations[s.first_token_iteration - 1].est_ms or 0.0)
            s.est_ttft_ms = end - started_ms[s.arrival]
            s.est_stall_ms = s.stall_positions * cost_model.ms_per_position
    return ScheduleResult(settings, num_blocks, iterations, list(summaries.values()), cost_model)


def _kind(start: int, num: int, samples: bool, request: Request, prompt_len: int) -> str:
    if num == 1 and samples and start >= prompt_len:
        return "decode"
    return "prefill" if start < prompt_len and request.num_preemptions == 0 else "recompute"


def _account(it: Iteration, summaries: dict[str, RequestSummary], requests: dict[str, Request]) -> None:
    sampled = set(it.sampled)
    for name, share in it.shares.items():
        s = summaries[name]
        if s.first_scheduled is None:
            s.first_scheduled = it.iteration
        if share.kind == "prefill":
            s.prefill_chunks.append(share.positions)
        if share.kind != "decode":
            others = len(sampled - {name})
            s.stall_positions += share.positions * others
            if others:
                s.max_stall_positions = max(s.max_stall_positions, share.positions)
        if share.sampled and s.first_token_iteration is None:
            s.first_token_iteration = it.iteration
            s.iterations_to_first_token = it.iteration - s.arrival + 1
        request = requests[name]
        if request.status.finished and s.finish_reason is None:
            s.finished_iteration = it.iteration
            s.finish_reason = request.finish_reason
    for name in it.preempted:
        summaries[name].num_preemptions += 1


# ------------------------------------------------------------------------------------------------ output


def _cell(share: Share | None) -> str:
    if share is None:
        return "."
    return f"{share.kind[0].upper()}{share.positions}{'*' if share.sampled else ''}"


def render(result: ScheduleResult, fmt: str) -> str:
    if fmt == "json":
        return json.dumps(result.to_dict(), indent=2)
    names = [r.name for r in result.requests]
    has_cost = result.cost_model is not None
    head = ["iter", *names, "positions", "waiting", "blocks"] + (["est ms"] if has_cost else [])
    rows = []
    for it in result.iterations:
        row = [str(it.iteration), *(_cell(it.shares.get(n)) for n in names), str(sum(it.scheduled.values())),
               " ".join(it.waiting) or "-", f"{it.blocks_used}/{result.num_blocks}"]
        if it.preempted:
            row[-1] += f" (preempted {' '.join(it.preempted)})"
        if has_cost:
            row.append(f"{it.est_ms:.2f}")
        rows.append(row)
    summary_head = ["request", "prompt", "output", "arrival", "prefill chunks", "first token (iter)",
                    "iters to first token", "finished", "preemptions", "stall caused (pos)", "max stall (pos)"]
    if has_cost:
        summary_head += ["est TTFT ms", "est stall ms"]
    summary = []
    for r in result.requests:
        row = [r.name, str(r.prompt_len), str(r.output_len), str(r.arrival),
               ",".join(map(str, r.prefill_chunks)), str(r.first_token_iteration),
               str(r.iterations_to_first_token), f"{r.finished_iteration} ({r.finish_reason})",
               str(r.num_preemptions), str(r.stall_positions), str(r.max_stall_positions)]
        if has_cost:
            row += [f"{r.est_ttft_ms:.2f}", f"{r.est_stall_ms:.2f}"]
        summary.append(row)
    s = result.settings
    title = (f"budget {s.budget}, max_num_seqs {s.max_num_seqs}, long_prefill_token_threshold "
             f"{s.long_prefill_token_threshold}, {result.num_blocks} blocks of {s.block_size}")
    legend = ("cells: P = prefill chunk, D = decode, R = recompute after preemption; number = positions; "
              "* = produced a token")
    cost = ""
    if result.cost_model is not None:
        c = result.cost_model
        cost = (f"ESTIMATE: times from a linear cost model ({c.ms_per_step:.3f} ms per step + "
                f"{c.ms_per_position:.4f} ms per position; {c.source})")
    if fmt == "markdown":
        parts = [f"**{title}**", "", legend, "", _markdown(head, rows), "", _markdown(summary_head, summary)]
    else:
        parts = [title, legend, "", _table(head, rows), "", _table(summary_head, summary)]
    if cost:
        parts += ["", cost]
    return "\n".join(parts)


def _table(head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) if c[:1].isdigit() or c == "." else c.ljust(w) for c, w in zip(r, widths))
             for r in [head, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(line.rstrip() for line in lines)


def _markdown(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)
