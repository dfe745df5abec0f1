"""The runner of a pooling model (an encoder: BERT, XLM-R, MPNet, nomic-bert; or a decoder in sentence-transformers'
layout: Qwen3-Embedding, EmbeddingGemma): each scheduled request is a whole prompt, and the step returns one pooled
vector per request instead of a sampled token.

A decoder runs the generating models' own code (worker/models/llama.py), built and loaded as the decoder runner builds
it, with its attention told to take whole sequences without a KV cache (attention.WholeSequences): causal for
Qwen3-Embedding, both ways for EmbeddingGemma (use_bidirectional_attention). Its output layer is not built.

Why no paged KV cache here: an encoder's attention is bidirectional, so a request is computed in one forward pass over
its whole prompt and its K/V are never read again (no decode follows, and a prefix's K/V depend on the tokens after
it, so the prefix cache could never reuse them either). Writing them into pool blocks only to free them after the step
would cost memory bandwidth and a share of the pool for nothing: the runner keeps K/V inside the forward pass, holds
no block pool, and the scheduler allocates no block for a pooling request (engine/scheduler.py, _admit_pooling). The
token budget, max_num_seqs, queues, aborts and timelines are the same as for generation.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import torch

from lmserve.config import (
    DECODER_EMBEDDING_MODEL_TYPES,
    CacheConfig,
    ModelConfig,
    PlacementConfig,
    SchedulerConfig,
)
from lmserve.distributed.layout import RankLayout
from lmserve.distributed.parallel_state import ParallelGroups
from lmserve.formats.gguf_file import ggml_type_name, read_gguf_header, read_gguf_tensor
from lmserve.models import load_model_config, resolve_model
from lmserve.pooling_config import YES_NO_TOKENS, DenseLayer, load_pooling_config
from lmserve.step import ModelRunnerOutput, SchedulerOutput
from lmserve.worker.attention import WholeSequences
from lmserve.worker.kernels import check_fused_ops, cpu_kernels
from lmserve.worker.model_builder import build_model
from lmserve.worker.model_runner import resolve_device, resolve_dtype
from lmserve.worker.models.bert import (
    ENCODER_PREFIXES,
    GGUF_FLOAT_TYPES,
    BertCrossEncoder,
    BertModel,
    max_sequence_length,
)
from lmserve.worker.models.layers import NUMPY_BLAS, Linear
from lmserve.worker.models.llama import LlamaForCausalLM
from lmserve.worker.models.nomic_bert import NomicBertModel
from lmserve.worker.placement import apply_placement
from lmserve.worker.pooler import pool
from lmserve.worker.weights.loader import load_weights

logger = logging.getLogger(__name__)


class PoolingModelRunner:
    """ModelRunner's interface (execute, and what WorkerInfo reads) for an encoder."""

    runner = "pooling"

    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig,
                 placement: PlacementConfig | None = None, parallel: ParallelGroups | None = None,
                 scheduler_config: SchedulerConfig | None = None) -> None:
        self.parallel = parallel or ParallelGroups(RankLayout(0))
        self.layout = self.parallel.layout
        if self.layout.world_size > 1:
            raise ValueError("an embedding model runs on one rank: --tensor-parallel-size and "
                             "--pipeline-parallel-size must be 1 (use --data-parallel-size for more throughput)")
        if model_config.quantization not in (None, "auto", "none"):
            raise ValueError(f"--quantization {model_config.quantization} is not supported for embedding models: "
                             "they run float weights")
        started = time.perf_counter()
        self.device = resolve_device(model_config.device)
        self.dtype = resolve_dtype(model_config.dtype, self.device)
        if self.device.type == "cpu":
            # float32 products through NumPy's BLAS (layers.Linear), as the decoders' runner does: measured on 4
            # prompts of 300 tokens of nomic-embed-text, 15 s against 24-29 s with torch's (2026-12-07, an AVX2 EPYC
            # under a load of 10 from other jobs: the ratio, not the times); torch then keeps one thread.
            apply_placement(placement or PlacementConfig(),
                            blas_does_matmuls=self.dtype == torch.float32 and NUMPY_BLAS)
        source = resolve_model(model_config.model)
        self.hf_config = load_model_config(source)
        native_len = max_sequence_length(self.hf_config) if self.hf_config.model_type in ENCODER_PREFIXES \
            else int(self.hf_config.max_position_embeddings)
        self.pooling = load_pooling_config(source, model_config.task)
        # Learned positions end at native_len; a sentence-transformers model was trained up to its max_seq_length
        # (vLLM takes it as the default length too). A longer input is a 400, or cut with truncate_prompt_tokens.
        default_len = min(native_len, self.pooling.max_seq_length or native_len)
        self.max_model_len = min(model_config.max_model_len or default_len, native_len)
        torch.manual_seed(model_config.seed)
        self.fused_ops = model_config.fused_ops
        self.project: torch.nn.Sequential | None = None  # sentence-transformers' Dense modules
        model_type = self.hf_config.model_type
        if self.pooling.yes_no:
            model = self._load_yes_no_reranker(source)
        elif model_type in DECODER_EMBEDDING_MODEL_TYPES:
            model = self._load_decoder(source)
        elif model_type not in (*ENCODER_PREFIXES, "nomic_bert"):
            raise ValueError(f"{source.path}: {model_type} is not an embedding model lmserve runs")
        elif model_type == "nomic_bert":
            if source.kind != "gguf":
                raise ValueError(f"{source.path}: nomic-bert runs from GGUF files (llama.cpp's tensor names); its "
                                 "Hugging Face checkpoints need remote code")
            if getattr(self.hf_config, "is_causal", False):
                raise ValueError(f"{source.path}: a causal nomic-bert is not an encoder lmserve runs")
            model: BertModel | BertCrossEncoder | NomicBertModel | LlamaForCausalLM = NomicBertModel(self.hf_config)
            model.load_gguf(source.path)
            model.to(device=self.device, dtype=self.dtype)
        elif source.kind == "gguf":  # llama.cpp's bert (BERT, and XLM-RoBERTa written as one)
            if self.pooling.task != "embed":
                raise ValueError(f"{source.path}: a reranker from GGUF is not served yet")
            model = BertModel(self.hf_config)
            model.to(device=self.device, dtype=self.dtype)
            model.load_gguf(source.path)
        else:
            model = BertCrossEncoder(self.hf_config) if self.pooling.task == "score" else BertModel(self.hf_config)
            model.to(device=self.device, dtype=self.dtype)
            model.load_weights(load_weights(source, self.dtype))
        self.model = model.eval()
        if self.pooling.dense:
            self.project = load_dense_layers(source.path, self.pooling.dense, self.device, self.dtype)
        self.vocab_size = self.hf_config.vocab_size
        self.hidden_size = self.hf_config.hidden_size
        # What WorkerInfo reads of a runner: no block pool, nothing computed apart, no layer program, no transfer.
        self.num_blocks = 0
        self.kv_bytes_per_block = 0
        self.kv_groups = None
        self.prompt_copies = False
        self.layer_program = "encoder from Python (no KV cache)"
        self.kv_connector = None
        self.quantization = "none"
        logger.info("loaded %s (%s encoder, %s pooling%s, %s, %s) in %.1fs", source.name,
                    self.hf_config.model_type, self.pooling.pooling, ", normalised" if self.pooling.normalize else "",
                    self.dtype, self.device, time.perf_counter() - started)

    def _load_decoder(self, source) -> LlamaForCausalLM:
        """The decoder as the generating runner builds it (float layers), without its output layer: an embedding
        checkpoint (Qwen3-Embedding, EmbeddingGemma) has none, and the vectors come from the final norm's output."""
        config = self.hf_config
        self.causal = not getattr(config, "use_bidirectional_attention", False)
        if self.pooling.task != "embed":
            raise ValueError(f"{source.path}: a {config.model_type} checkpoint serves embeddings only")
        if self.causal and self.pooling.pooling != "last":
            logger.warning("%s: a causal decoder pooled by %s (its last token alone has seen the whole text)",
                           source.name, self.pooling.pooling)
        model = self._build_decoder(source)
        model.lm_head = None
        return model

    def _build_decoder(self, source) -> LlamaForCausalLM:
        """The decoder with its weights, float layers, and the generating runner's fused CPU ops where they run
        (--fused-ops: RMSNorm + residual, SiLU-and-multiply, RoPE as one C++ op each). From GGUF, float tensors only
        (as the encoders': a block format is refused rather than turned into a float copy)."""
        if source.kind == "gguf":
            for info in read_gguf_header(source.path).tensors:
                if (stored := ggml_type_name(info.ggml_type)) not in GGUF_FLOAT_TYPES:
                    raise ValueError(f"{source.path}: {info.name} is stored as {stored}; lmserve runs embedding models "
                                     "and rerankers from float GGUF files (F32, F16, BF16) only so far: use the "
                                     "model's F16 file")
        model = build_model(self.hf_config, self.max_model_len, self.device, self.dtype)
        model.load_weights(load_weights(source, self.dtype, wanted=model.wants))
        if check_fused_ops(self.fused_ops, self.device, self.dtype) == "cpu":
            model.use_fused_ops(cpu_kernels())
        return model

    def _load_yes_no_reranker(self, source) -> LlamaForCausalLM:
        """A Qwen3 decoder scoring pairs (Qwen3-Reranker): causal attention, and of its output layer only the rows of
        "no" and "yes" (two rows kept instead of the vocabulary's)."""
        from lmserve.model_tokenizer import load_tokenizer

        self.causal = True
        model = self._build_decoder(source)
        if source.kind == "gguf":  # llama.cpp's converter keeps the two rows, "yes" first (Qwen3Model._get_cls_out_tensor)
            info = next((t for t in read_gguf_header(source.path).tensors if t.name == "cls.output.weight"), None)
            if info is None:
                raise ValueError(f"{source.path}: a rank-pooling qwen3 file without cls.output.weight")
            yes, no = torch.from_numpy(read_gguf_tensor(source.path, info).copy()).to(self.dtype)
            self.yes_no_rows = torch.stack([no, yes]).to(self.device)
        else:
            tokenizer = load_tokenizer(source)
            ids = [tokenizer.convert_tokens_to_ids(token) for token in YES_NO_TOKENS]
            if any(i is None or i == tokenizer.unk_token_id for i in ids):
                raise ValueError(f"{source.path}: the tokenizer has no single token for "
                                 f"{' and '.join(YES_NO_TOKENS)}, which a yes/no reranker scores")
            table = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
            self.yes_no_rows = table[ids].detach().clone()  # [2, hidden]: "no", "yes"
        model.lm_head = None
        return model

    @torch.inference_mode()
    def embed(self, prompts: list[list[int]], dimensions: list[int | None] | None = None,
              second_segments: list[int | None] | None = None) -> list[torch.Tensor]:
        """The pooled vectors of whole prompts, in one forward pass (a cross-encoder's: its relevance, one value).
        second_segments: per prompt, where its second text starts (token type 1), or None."""
        seq_lens = [len(p) for p in prompts]
        input_ids = torch.as_tensor([t for p in prompts for t in p], dtype=torch.long, device=self.device)
        positions_np = np.concatenate([np.arange(n) for n in seq_lens])
        positions = torch.as_tensor(positions_np, device=self.device)
        token_types = None
        if second_segments is not None and any(s is not None for s in second_segments):
            starts = np.repeat([n if s is None else s for s, n in zip(second_segments, seq_lens, strict=True)],
                               seq_lens)
            token_types = torch.as_tensor((positions_np >= starts).astype(np.int64), device=self.device)
        if isinstance(self.model, BertCrossEncoder):
            hidden = self.model.bert(input_ids, positions, seq_lens, token_types)
            return list(self.model.scores(hidden, seq_lens))
        if isinstance(self.model, LlamaForCausalLM):
            no_cache = [(None, None)] * self.model.num_layers
            hidden = self.model(input_ids, positions, no_cache, WholeSequences(seq_lens, self.causal))
            if self.pooling.yes_no:  # P(yes) against "no" at each pair's last token: sigmoid(yes - no)
                last = hidden[torch.as_tensor(np.cumsum(seq_lens) - 1, device=hidden.device)]
                logits = (last @ self.yes_no_rows.t()).float()
                return list(torch.sigmoid(logits[:, 1:] - logits[:, :1]))
        elif token_types is not None:
            hidden = self.model(input_ids, positions, seq_lens, token_types)
        else:
            hidden = self.model(input_ids, positions, seq_lens)
        return pool(hidden, seq_lens, self.pooling, dimensions or [None] * len(prompts), self.project)

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        scheduled = scheduler_output.scheduled
        if not scheduled:
            return ModelRunnerOutput(sampled_token_ids={})
        for s in scheduled:
            if s.pooling_params is None or s.start_position != 0:
                raise RuntimeError(f"request {s.request_id!r} is not a whole pooling prompt: an encoder computes "
                                   "each request in one step")
        vectors = self.embed([s.token_ids for s in scheduled], [s.pooling_params.dimensions for s in scheduled],
                             [s.pooling_params.second_segment_start for s in scheduled])
        return ModelRunnerOutput(sampled_token_ids={}, pooled={
            s.request_id: v.cpu().numpy().astype("<f4").tobytes() for s, v in zip(scheduled, vectors, strict=True)})

    def expert_load(self) -> dict[str, list[int]]:
        return {}


def load_dense_layers(directory: Path, layers: tuple[DenseLayer, ...], device: torch.device,
                      dtype: torch.dtype) -> torch.nn.Sequential:
    """sentence-transformers' Dense modules (linear, then its activation) from their folders' weights, in order."""
    from safetensors.torch import load_file

    modules: list[torch.nn.Module] = []
    for layer in layers:
        folder = directory / layer.path
        path = folder / "model.safetensors"
        if not path.is_file():
            raise ValueError(f"{folder}: the Dense module's weights (model.safetensors) are missing")
        weights = load_file(path)
        linear = Linear(layer.in_features, layer.out_features, bias=layer.bias)
        expected = {"linear.weight": linear.weight, **({"linear.bias": linear.bias} if layer.bias else {})}
        for name, param in expected.items():
            if name not in weights or weights[name].shape != param.shape:
                raise ValueError(f"{path}: expected {name} of shape {tuple(param.shape)}")
            with torch.no_grad():
                param.copy_(weights[name])
        modules.append(linear)
        if layer.activation.endswith(".Tanh"):
            modules.append(torch.nn.Tanh())
    return torch.nn.Sequential(*modules).to(device=device, dtype=dtype).eval()
