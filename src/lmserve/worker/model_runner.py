"""Turns a scheduled batch into flat tensors, runs one forward pass for the whole mixed batch, and samples."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from lmserve.config import CacheConfig, ModelConfig, PlacementConfig, SchedulerConfig
from lmserve.config_values import parse_memory
from lmserve.distributed.layout import RankLayout
from lmserve.distributed.parallel_state import ParallelGroups
from lmserve.heap import release_freed_heap, reuse_large_blocks
from lmserve.models import ModelSource, load_model_config, resolve_model
from lmserve.outputs import Logprobs
from lmserve.spec_decode.draft_model import DraftModelProposer, draft_configs
from lmserve.step import PLACEHOLDER_TOKEN_ID, ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from lmserve.worker.attention import (
    AttentionMetadata,
    ScheduledChunk,
    build_metadata,
)
from lmserve.worker.kernels import check_fused_ops, cpu_kernels
from lmserve.worker.kv_cache_setup import allocate_kv_cache
from lmserve.worker.kv_transfer import KVConnectorWorker, worker_connector
from lmserve.worker.layer_program import ProgramRefused
from lmserve.worker.model_builder import build_model
from lmserve.worker.models.gated_deltanet import LinearBatch, LinearSegment
from lmserve.worker.models.hybrid import HybridForCausalLM
from lmserve.worker.models.layers import NUMPY_BLAS
from lmserve.worker.models.llama import LlamaForCausalLM, decoder_linear_weights
from lmserve.worker.placement import apply_placement
from lmserve.worker.prompt_rows import PromptRows, prompt_rows
from lmserve.worker.rejection_sampler import RejectionSampler, verify
from lmserve.worker.sampler import Sampler, argmax_rows, token_logprobs
from lmserve.worker.sampling_metadata import draft_rows
from lmserve.worker.weights.block_linear import prepare_batched_copies
from lmserve.worker.weights.choice import choose_weight_formats, settle_block_kernels
from lmserve.worker.weights.kernel_choice import LAYER_METHODS
from lmserve.worker.weights.loader import load_weights
from lmserve.worker.weights.packed_cache import PackedWeightsCache, packed_cache_settings, use_packed_cache

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Measured on this machine (docs/benchmarks.md): float32 decodes faster for a small model at small batches.
DEFAULT_CPU_DTYPE = "float32"
# Prompt logprobs take a vocabulary-wide row of logits per prompt token: score them this many rows at a time.
PROMPT_LOGPROB_ROWS_PER_SLICE = 256


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        name = DEFAULT_CPU_DTYPE if device.type == "cpu" else "bfloat16"
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {name!r}: use one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


@dataclass
class BatchInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn: AttentionMetadata
    logits_indices: torch.Tensor
    sampling: list[ScheduledRequest]  # the requests that sample, in logits order (a drafted one once per row)
    prompt_scoring: list[PromptScoring] = field(default_factory=list)
    prompt_rows: PromptRows | None = None


@dataclass
class PromptScoring:
    """Rows of the batch whose logits score a request's prompt tokens (prompt_logprobs)."""

    request_id: str
    first_row: int
    targets: list[int]  # the prompt tokens rows first_row, first_row + 1, ... predict
    num_top: int


class ModelRunner:
    def __init__(
        self, model_config: ModelConfig, cache_config: CacheConfig, placement: PlacementConfig | None = None,
        parallel: ParallelGroups | None = None,
        scheduler_config: SchedulerConfig | None = None,  # its step size sizes the CUDA profiling step
        expert_parallel: bool = False,
    ) -> None:
        """`parallel`: this rank's place among the engine's ranks (default: the only rank). expert_parallel: a
        mixture of experts' tensor ranks hold whole experts (worker/models/moe.py)."""
        self.expert_parallel = expert_parallel
        self.parallel = parallel or ParallelGroups(RankLayout(0))
        self.layout = self.parallel.layout
        self.device = resolve_device(model_config.device)
        self.dtype = resolve_dtype(model_config.dtype, self.device)
        source = resolve_model(model_config.model)
        self.weight_formats = choose_weight_formats(model_config, source, self.device, self.dtype)
        self.quantization = self.weight_formats.quantization
        self.block_size = cache_config.block_size
        self.numpy_matmuls = False
        if self.device.type == "cpu":
            self.numpy_matmuls = self.dtype == torch.float32 and NUMPY_BLAS and self.quantization == "none"
            apply_placement(placement or PlacementConfig(), blas_does_matmuls=self.numpy_matmuls)
        self.hf_config = load_model_config(source)
        native_len = int(getattr(self.hf_config, "max_position_embeddings", 2048))
        self.max_model_len = model_config.max_model_len or native_len
        if self.max_model_len > native_len:
            logger.warning("max_model_len %d exceeds the model's %d positions", self.max_model_len, native_len)
        model = self._load_model(model_config, source)
        scheduler_config = scheduler_config or SchedulerConfig()
        self._allocate_kv_cache(model, model_config, cache_config, scheduler_config)
        self._allocate_states(model, scheduler_config)
        self.layer_program = "off (--enforce-eager)" if model_config.enforce_eager else self._use_layer_program(model)
        logger.info("decoder layers: %s", self.layer_program)
        self.kv_connector = self._kv_connector(cache_config, source, model_config)
        # Each request's token from the last step that sampled it, for a step planned before that token was known
        # (async scheduling: ScheduledRequest.uses_previous_token). Ints: the step already waits for its tokens
        # (ModelRunnerOutput carries them), so filling them in costs no extra device sync on CUDA.
        self.last_sampled: dict[str, int] = {}
        self.rejection_sampler = RejectionSampler(Sampler(), self.device, self.last_sampled)
        spec = scheduler_config.speculative_config
        self.drafter: DraftModelProposer | None = None
        if spec is not None and spec.model is not None:
            draft_model, draft_cache = draft_configs(spec.model, model_config, cache_config, self.num_blocks)
            draft_runner = ModelRunner(draft_model, draft_cache, placement, self.parallel)
            if self.device.type == "cpu" and (self.numpy_matmuls or draft_runner.numpy_matmuls):
                # One process, one CPU placement: with NumPy's BLAS doing either model's matmuls, torch keeps one
                # thread (its OpenMP workers spinning against BLAS's made every step 3x slower).
                apply_placement(placement or PlacementConfig(), blas_does_matmuls=True)
            self.drafter = DraftModelProposer(spec.model, draft_runner, self)
        if self.device.type == "cpu":
            reuse_large_blocks()  # steps' activations from reused heap memory, not fresh pages

    def _load_model(self, model_config: ModelConfig, source: ModelSource) -> LlamaForCausalLM:
        """Builds the model on this rank's share of the weights, each layer in the format self.weight_formats
        chose and on the kernel the settings choose (worker/weights/choice.py), and logs what it loaded."""
        started = time.perf_counter()
        # Seeds the draws of requests without a seed; the weights all come from the checkpoint (load_weights raises
        # on a missing one), so no parameter depends on it.
        torch.manual_seed(model_config.seed)
        formats = self.weight_formats
        decoder_weights = decoder_linear_weights(self.hf_config)
        model = build_model(self.hf_config, self.max_model_len, self.device, self.dtype, self.parallel,
                            formats.block_method, formats.per_layer, formats.formats,
                            formats.layer_activations(model_config, decoder_weights), formats.float16_layers,
                            formats.embedding_dtype(source), expert_parallel=self.expert_parallel)
        packed_cache, self.packed_weights_mapped = self._packed_cache(model, model_config, source)
        # float16 layers load their rows as the checkpoint stores them; a block layer takes the file's own blocks.
        model.load_weights(load_weights(source, None if formats.float16_layers else self.dtype,
                                        blocks=formats.loaded_blocks, wanted=model.wants, part=model.checkpoint_part))
        self.block_kernels = settle_block_kernels(model, model.layers, formats, model_config, decoder_weights)
        # A first start writes what it packed for the next (the thread: tests wait for it).
        self.packed_weights_saving = (packed_cache.save_in_background(model)
                                      if packed_cache is not None and not self.packed_weights_mapped else None)
        self.block_activations = self.block_kernels.activations
        self.batched_path = self.block_kernels.batched_path
        self.prompt_copies = self.block_kernels.prompt_copies
        self.fused_ops = check_fused_ops(model_config.fused_ops, self.device, self.dtype)
        if self.fused_ops == "cpu":
            model.use_fused_ops(cpu_kernels())
        self.model = model.eval()
        release_freed_heap()  # packing's temporaries: ~35 MiB of Qwen2.5 0.5B Q4_K_M's engine otherwise
        if self.quantization in LAYER_METHODS:
            # Not a daemon: killed at exit while inside torch, a daemon thread aborts the process ("terminate called
            # without an active exception"); exit waits for the copies instead (~2 s at most).
            threading.Thread(target=prepare_batched_copies, args=(model.layers, torch.get_num_threads()),
                             name="batched-copies").start()
        self.vocab_size = self.hf_config.vocab_size
        logger.info(
            "loaded %s (%s, quantization %s%s, fused ops %s, %s) in %.1fs", source.name, self.dtype, self.quantization,
            self.block_kernels.describe(), self.fused_ops, self.device, time.perf_counter() - started,
        )
        return model

    def _packed_cache(self, model: LlamaForCausalLM, model_config: ModelConfig, source: ModelSource
                      ) -> tuple[PackedWeightsCache | None, bool]:
        """A GGUF's block layers from the packed weights cache where an earlier start wrote them (weights/
        packed_cache.py), keyed by what chose their layout here as well as by the file."""
        if source.kind != "gguf":
            return None, False
        settings = packed_cache_settings(model_config.packed_weights_cache,
                                         parse_memory(model_config.packed_weights_cache_size),
                                         model_config.packed_weights_cache_min_bytes)
        context = {
            "quantization": self.quantization, "dtype": str(self.dtype), "device": str(self.device),
            "block_activations": model_config.block_activations, "batched_weights": model_config.batched_weights,
            "rank": [self.layout.rank, self.layout.tp_size, self.layout.pp_size], "expert_parallel": self.expert_parallel,
        }
        return use_packed_cache(model, settings, source.path, context)

    def _allocate_kv_cache(self, model: LlamaForCausalLM, model_config: ModelConfig, cache_config: CacheConfig,
                           scheduler_config: SchedulerConfig) -> None:
        """The block pool (worker/kv_cache_setup.py) and what decided it, kept on the runner."""
        setup = allocate_kv_cache(model, self.hf_config, self.layout.pp_size, self.device, self.dtype,
                                  self.max_model_len, self.block_size, model_config, cache_config, scheduler_config)
        self.attention_backend, self.kv_cache_dtype, self.kv_groups = setup.attention_backend, setup.dtype, setup.groups
        self.num_blocks, self.kv_caches, self.kv_bytes_per_block = setup.num_blocks, setup.caches, setup.bytes_per_block
        self.kv_state_slots = setup.state_slots

    def _allocate_states(self, model: LlamaForCausalLM, scheduler_config: SchedulerConfig) -> None:
        """A hybrid model's per-request states (worker/models/hybrid.py): the slots kv_cache_setup took from the KV
        memory budget (one per request that may run at once, where half the budget holds them); the engine hands
        them out."""
        self.num_state_slots, self.state_bytes_per_slot = 0, 0
        if not isinstance(model, HybridForCausalLM):
            return
        if scheduler_config.speculative_config is not None:
            raise ValueError(f"speculative decoding is not supported for {self.hf_config.model_type} (hybrid linear "
                             "attention) yet: a rejected draft would need the recurrent state before it")
        self.num_state_slots = self.kv_state_slots
        self.state_bytes_per_slot = model.state_bytes_per_slot
        model.allocate_states(self.num_state_slots, self.device)
        logger.info("linear-attention state: %d slots of %.2f MiB (%d layers), constant in a request's length",
                    self.num_state_slots, self.state_bytes_per_slot / 2**20, len(model.linear_layers))

    def _linear_batch(self, order: list[ScheduledRequest]) -> LinearBatch:
        """The step's rows for a hybrid model's linear layers: decodes (first in `order`, one row each), then each
        prompt chunk's rows, with each request's state slot."""
        if any(r.state_slot < 0 for r in order):
            raise ValueError("a hybrid model's request was scheduled without a state slot")
        decodes = 0
        while decodes < len(order) and order[decodes].num_tokens == 1:
            decodes += 1
        chunks, row = [], decodes
        for r in order[decodes:]:
            chunks.append(LinearSegment(row, r.num_tokens, r.state_slot, r.start_position == 0))
            row += r.num_tokens
        return LinearBatch(
            decodes,
            torch.as_tensor([r.state_slot for r in order[:decodes]], dtype=torch.long, device=self.device),
            torch.as_tensor([r.start_position == 0 for r in order[:decodes]], dtype=torch.bool, device=self.device),
            tuple(chunks),
        )

    def _use_layer_program(self, model: LlamaForCausalLM) -> str:
        """How the decoder layers run: one C++ program where the model's layers are what it runs, else from Python."""
        if self.attention_backend != "paged-cpu":
            return f"from Python (the program runs paged-cpu attention, not {self.attention_backend})"
        try:
            model.use_layer_program(self.kv_caches)
        except ProgramRefused as refused:
            return f"from Python (no layer program: {refused})"
        return "one C++ program for the batches it takes (--enforce-eager: from Python)"

    def _kv_connector(self, cache_config: CacheConfig, source: ModelSource,
                      model_config: ModelConfig) -> KVConnectorWorker | None:
        """Prefill/decode disaggregation's worker side (worker/kv_transfer.py), keyed to this model as it runs."""
        transfer = cache_config.kv_transfer_config
        if transfer is None:
            return None
        if self.num_state_slots:
            raise ValueError(f"kv transfer is not supported for {self.hf_config.model_type} (hybrid linear attention): "
                             "a consumer would need each request's recurrent state as well as its blocks")
        if self.kv_groups.is_hybrid:
            raise ValueError("kv transfer needs one KV-cache group; this model has sliding-window layers in groups "
                             "of their own: start both instances with --disable-hybrid-kv-cache-manager")
        size = source.path.stat().st_size if source.kind == "gguf" else 0
        identity = f"{source.kind}:{source.path.name}:{size}:{self.quantization}:{model_config.dtype}"
        return worker_connector(transfer, self.kv_caches, self.layout.rank, identity)

    def prepare_inputs(self, scheduled: list[ScheduledRequest]) -> BatchInputs:
        # Decodes first so their queries form one contiguous, batched attention call.
        order = sorted(scheduled, key=lambda r: r.num_tokens != 1)
        input_ids: list[int] = []
        logits_rows: list[int] = []
        sampling: list[ScheduledRequest] = []
        prompt_scoring: list[PromptScoring] = []
        row = 0
        for r in order:
            if r.uses_previous_token:
                input_ids.append(self.last_sampled[r.request_id])
            else:
                input_ids.extend(r.token_ids)
            if r.prompt_logprob_targets:
                prompt_scoring.append(PromptScoring(
                    r.request_id, row + r.prompt_logprobs_row, r.prompt_logprob_targets, r.num_prompt_logprobs
                ))
            row += r.num_tokens
            if r.draft_token_ids:
                logits_rows.extend(range(row - 1 - len(r.draft_token_ids), row))
                sampling.extend(draft_rows(r))
            elif r.samples:
                logits_rows.append(row - 1)
                sampling.append(r)
        positions = np.concatenate([np.arange(r.start_position, r.start_position + r.num_tokens) for r in order])
        prompt_ends = np.repeat([len(r.prompt_token_ids) for r in order], [r.num_tokens for r in order])
        dev = self.device
        attn = [
            build_metadata(
                [ScheduledChunk(r.start_position, r.num_tokens, r.group_block_ids[group] if r.group_block_ids
                                else r.block_ids) for r in order],
                self.block_size, self.attention_backend, dev, self.dtype,
            )
            for group in range(self.kv_groups.num_groups)
        ]
        if len(attn) > 1:
            attn[0].groups = attn  # each layer reads its group's tables (LlamaForCausalLM.forward)
        if self.num_state_slots:
            attn[0].linear = self._linear_batch(order)  # (HybridForCausalLM.forward)
        return BatchInputs(
            input_ids=torch.as_tensor(input_ids, dtype=torch.long, device=dev),
            positions=torch.as_tensor(positions, device=dev),
            attn=attn[0],
            logits_indices=torch.as_tensor(logits_rows, dtype=torch.long, device=dev),
            sampling=sampling,
            prompt_scoring=prompt_scoring,
            prompt_rows=PromptRows.from_mask(positions < prompt_ends),
        )

    @torch.inference_mode()
    def forward(self, batch: BatchInputs) -> torch.Tensor:
        """One forward pass over the whole mixed batch; float32 logits for the sampling positions only."""
        return self.model.compute_logits(self._hidden_states(batch)[batch.logits_indices])

    def _hidden_states(self, batch: BatchInputs) -> torch.Tensor:
        with prompt_rows(batch.prompt_rows):
            return self.model(batch.input_ids, batch.positions, self.kv_caches, batch.attn)

    @torch.inference_mode()
    def compute_kv(self, batch: BatchInputs) -> None:
        """This model's K/V for every position of a batch (a draft model's, for the batch its target ran)."""
        self._hidden_states(batch)

    @torch.inference_mode()
    def greedy_tokens(self, token_ids: list[int], positions: list[int], block_tables: list[list[int]]) -> list[int]:
        """One generated position a row (token_ids[i] at positions[i], its K/V into block_tables[i]'s blocks): the
        argmax of each row's next-token logits (a draft model's guesses)."""
        dev = self.device
        chunks = [ScheduledChunk(p, 1, blocks) for p, blocks in zip(positions, block_tables, strict=True)]
        attn = build_metadata(chunks, self.block_size, self.attention_backend, dev, self.dtype)
        input_ids = torch.as_tensor(token_ids, dtype=torch.long, device=dev)
        with prompt_rows(PromptRows.from_mask(np.zeros(len(token_ids), dtype=bool))):  # generated rows
            hidden = self.model(input_ids, torch.as_tensor(positions, device=dev), self.kv_caches, attn)
        return argmax_rows(self.model.compute_logits(hidden)).tolist()

    def _with_draft_tokens(self, scheduled: list[ScheduledRequest]) -> list[ScheduledRequest]:
        """The step's requests with the draft model's guesses in the positions the scheduler reserved for them
        (placeholders): copies, which the batch is built from; the scheduler's plan stays as it planned it."""
        if self.drafter is None:
            return scheduled
        reserved = [s for s in scheduled if s.draft_token_ids and s.draft_token_ids[0] == PLACEHOLDER_TOKEN_ID]
        if not reserved:
            return scheduled
        proposals = self.drafter.propose(reserved, [len(s.draft_token_ids) for s in reserved])
        guesses = {s.request_id: drafts for s, drafts in zip(reserved, proposals, strict=True)}
        return [s if s.request_id not in guesses else dataclasses.replace(
                    s, token_ids=[s.token_ids[0], *guesses[s.request_id]], draft_token_ids=guesses[s.request_id])
                for s in scheduled]

    def _score_prompts(self, hidden: torch.Tensor, batch: BatchInputs) -> dict[str, list[Logprobs]]:
        """Each scored prompt token's logprob in the raw model distribution (as vLLM), a slice of rows at a time so
        a long chunk never holds more than PROMPT_LOGPROB_ROWS_PER_SLICE vocabulary-wide rows."""
        scored: dict[str, list[Logprobs]] = {}
        for s in batch.prompt_scoring:
            entries = scored.setdefault(s.request_id, [])
            for lo in range(0, len(s.targets), PROMPT_LOGPROB_ROWS_PER_SLICE):
                targets = s.targets[lo : lo + PROMPT_LOGPROB_ROWS_PER_SLICE]
                rows = hidden[s.first_row + lo : s.first_row + lo + len(targets)]
                lp = self.model.compute_logits(rows).to(torch.float32).log_softmax(dim=-1)
                tokens = torch.as_tensor(targets, dtype=torch.long, device=lp.device)
                entries.extend(token_logprobs(lp, tokens, [s.num_top] * len(targets)))
        return scored

    def _stage_forward(self, batch: BatchInputs) -> torch.Tensor | None:
        """This pipeline stage's layers: hidden states from the previous stage in, to the next stage out. The last
        stage returns the final hidden states, the others None."""
        intermediate = None
        if not self.layout.is_first_stage:
            shape = (batch.input_ids.shape[0], self.hf_config.hidden_size)
            hidden, residual = self.parallel.recv_from_previous_stage([shape, shape], self.dtype, self.device)
            intermediate = (hidden, residual)
        with prompt_rows(batch.prompt_rows):
            out = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.attn, intermediate)
        if not self.layout.is_last_stage:
            self.parallel.send_to_next_stage(list(out))
            return None
        return out

    def expert_load(self) -> dict[str, list[int]]:
        """Tokens routed to each expert so far, by the index of each mixture-of-experts layer this rank runs (as a
        string: the engine sends it on as JSON); empty for a model without experts."""
        return {str(index): block.routed_token_counts() for index, block in self.model.moe_blocks().items()}

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """The step's sampled tokens on the driver rank (the only rank with one rank); None on the other ranks,
        which take their part in the same forward pass. A consumer's KV loads run beside it (worker/kv_transfer.py):
        the driver's output names the requests whose loads ended."""
        if self.kv_connector is None:
            return self._execute(scheduler_output)
        # Before a step reads or reuses a loading request's blocks (it runs, ended, was preempted, or another request
        # shares its blocks through the prefix cache), its load must be in.
        scheduled = scheduler_output.scheduled
        self.kv_connector.wait_for(
            [s.request_id for s in scheduled] + [*scheduler_output.finished_request_ids],
            [block for s in scheduled for block in s.block_ids] if self.kv_connector.loading else ())
        if scheduler_output.kv_loads:
            self.kv_connector.start_loads(scheduler_output.kv_loads)
        finished, failed = self.kv_connector.finished_loads()
        if failed and not self.layout.is_driver:
            # Only the driver rank's report reaches the scheduler, which could not know that this rank's part of
            # the blocks is missing: the engine must not compute with it.
            raise RuntimeError(f"kv transfer: rank {self.layout.rank} could not load the stored blocks of "
                               f"{len(failed)} request(s)")
        output = self._execute(scheduler_output)
        failed_saves, self.kv_connector.num_failed_saves = self.kv_connector.num_failed_saves, 0
        if output is None and self.layout.is_driver and (finished or failed_saves):
            output = ModelRunnerOutput(sampled_token_ids={})
        if output is not None:
            output.finished_kv_loads = finished
            output.failed_kv_loads = failed
            output.failed_kv_saves = failed_saves
        return output

    def _execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        for request_id in scheduler_output.finished_request_ids:
            self.last_sampled.pop(request_id, None)
        if not scheduler_output.scheduled:
            return ModelRunnerOutput(sampled_token_ids={}) if self.layout.is_driver else None
        batch = self.prepare_inputs(self._with_draft_tokens(scheduler_output.scheduled))
        hidden = self._stage_forward(batch)
        if scheduler_output.kv_saves and self.kv_connector is not None:
            self.kv_connector.save(scheduler_output.kv_saves)  # a producer's blocks, now that the step wrote them
        if self.drafter is not None:
            self.drafter.mirror(batch)
        if hidden is None:
            return None
        # Every tensor rank of the last stage computes logits (their all-gather needs each); the driver samples.
        prompt_logprobs = self._score_prompts(hidden, batch) if batch.prompt_scoring else {}
        if not batch.sampling:
            return ModelRunnerOutput(sampled_token_ids={}, prompt_logprobs=prompt_logprobs) \
                if self.layout.is_driver else None
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        if not self.layout.is_driver:
            return None
        token_ids, logprobs = self.rejection_sampler.sample(logits, batch.sampling, scheduler_output.grammar)
        output = ModelRunnerOutput(sampled_token_ids={}, prompt_logprobs=prompt_logprobs)
        verify(batch.sampling, token_ids, logprobs, output)
        self.last_sampled.update(output.sampled_token_ids)
        return output
