"""The pieces of the Llama-family decoder (worker/models/llama.py puts them together): RMSNorm, attention (its rotary
embedding in worker/models/rotary.py), MLP, the decoder layer (and Gemma's with sandwich norms), the vocabulary-parallel
embedding. Each takes this rank's share of heads, columns or vocabulary rows (distributed/parallel_state.py); norms,
RoPE and softmax run in float32.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
from torch import nn

from lmserve.config import (
    ATTENTION_SINK_MODEL_TYPES,
    FULL_QK_NORM_MODEL_TYPES,
    QK_NORM_MODEL_TYPES,
    QKV_BIAS_MODEL_TYPES,
    model_layer_types,
)
from lmserve.distributed.parallel_state import ParallelGroups
from lmserve.moe_shape import moe_shape
from lmserve.worker.attention import AttentionMetadata, PagedAttention
from lmserve.worker.models.rotary import apply_rotary, rotary_dim

if TYPE_CHECKING:
    # A transformers config, or for a GGUF file lmserve.models.GGUFConfig: the same attributes without transformers.
    from transformers import PretrainedConfig

# Every activation an MLP here runs: transformers' names, and gpt-oss's clamped SwiGLU (its experts'; no config names
# it in hidden_act).
MLP_ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gpt_oss_swiglu")
# LMSERVE_BLAS=torch sends CPU float32 matmuls to torch's own BLAS instead (for comparisons).
NUMPY_BLAS = os.environ.get("LMSERVE_BLAS", "numpy") == "numpy"


def blas_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T. On CPU in float32 through NumPy's OpenBLAS, which on this project's AVX2 machines is 2-5× faster
    than torch's MKL sgemm for the few-row products of decoding (benchmarks/matmul_backends.py)."""
    if NUMPY_BLAS and x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32:
        return torch.from_numpy(x.contiguous().numpy() @ weight.numpy().T)
    return x @ weight.t()


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = blas_matmul(x, self.weight)
        return out if self.bias is None else out.add_(self.bias)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.fused = None  # torch.ops.lmserve once LlamaForCausalLM.use_fused_ops() ran

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Returns norm(x + residual) and the new residual (x + residual), like vLLM's fused add-norm."""
        if self.fused is not None and residual is not None:
            self.fused.fused_add_rms_norm(x, residual, self.weight, self.eps)  # both in place
            return x, residual
        if residual is not None:
            x = x + residual
        residual = x
        if self.fused is not None and x.dim() in (2, 3) and x.stride(-1) == 1:
            out = torch.empty_like(x)
            self.fused.rms_norm(out, x, self.weight, self.eps)
            return out, residual
        if x.dtype == torch.float32:
            # One op instead of six: on CPU every op costs ~5-10 us of dispatch, and a decode step has 61 norms.
            return nn.functional.rms_norm(x, self.weight.shape, self.weight, self.eps), residual
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * h).to(x.dtype), residual


def layer_types(config: PretrainedConfig) -> list[str]:
    """Each layer's attention, as transformers names it: "full_attention", or "sliding_attention" (a window of
    config.sliding_window positions); the architecture's pattern where a config does not list them."""
    return model_layer_types(config)


def check_tensor_parallel(config: PretrainedConfig, tp_size: int, expert_parallel: bool = False) -> None:
    """Megatron's split needs whole heads and whole MLP columns on every rank; KV heads fewer than the ranks are
    replicated (kv_head_replicas). A mixture of experts splits each expert's columns the same way, or with
    expert_parallel places whole experts on ranks."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if tp_size > 1 and config.model_type in ATTENTION_SINK_MODEL_TYPES:
        # Its output projection's and experts' biases would be added once per rank by the all-reduce.
        raise ValueError(f"tensor parallel is not supported for {config.model_type} yet: run it on one rank, or "
                         "data parallel")
    shape = moe_shape(config)
    columns = [("attention heads", heads), ("MLP columns", config.intermediate_size)]
    if shape is not None:
        columns[1:] = [("MLP columns", shape.dense_intermediate)] if shape.sparse_step > 1 or shape.dense_layers else []
        if not expert_parallel:
            columns.append(("expert MLP columns", shape.expert_intermediate))
        if shape.shared_intermediate:
            columns.append(("shared expert MLP columns", shape.shared_intermediate))
    for what, count in columns:
        if count % tp_size:
            raise ValueError(f"tensor parallel size {tp_size} does not divide the model's {count} {what}")
    if kv_heads % tp_size and tp_size % kv_heads:
        raise ValueError(f"tensor parallel size {tp_size} neither divides the model's {kv_heads} KV heads nor is a "
                         "multiple of them")


def kv_head_replicas(config: PretrainedConfig, tp_size: int) -> int:
    """How many tensor ranks hold each KV head: 1, or tp / KV heads when there are fewer KV heads than ranks (vLLM's
    QKVParallelLinear): ranks r*R ... r*R + R - 1 then share KV head r, the one their query heads read."""
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return max(1, tp_size // kv_heads)


class Attention(nn.Module):
    def __init__(self, config: PretrainedConfig, parallel: ParallelGroups, layer_type: str = "full_attention") -> None:
        super().__init__()
        self.layer_type = layer_type
        tp = parallel.tp_size
        self.parallel = parallel
        total_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.num_heads = config.num_attention_heads // tp  # this rank's heads
        self.num_kv_heads = max(1, total_kv_heads // tp)  # one, replicated, when the ranks outnumber them
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = config.model_type in QKV_BIAS_MODEL_TYPES or getattr(config, "attention_bias", False)
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        # gpt-oss: a learned logit per head that joins every softmax and takes no value, and a bias on the output
        # projection (one rank: check_tensor_parallel refuses more).
        sinks = config.model_type in ATTENTION_SINK_MODEL_TYPES
        self.sinks = nn.Parameter(torch.empty(self.num_heads), requires_grad=False) if sinks else None
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=sinks)
        # Qwen3 and Gemma 3 normalize each head of q and k before RoPE, one weight of head_dim shared by the heads;
        # OLMoE normalizes q and k whole (one weight over all heads: under tensor parallel, a norm across ranks).
        qk_norm = config.model_type in QK_NORM_MODEL_TYPES
        self.full_qk_norm = config.model_type in FULL_QK_NORM_MODEL_TYPES
        if self.full_qk_norm and tp != 1:
            raise ValueError(f"{config.model_type} normalizes q and k across all heads: tensor parallel is not "
                             "supported for it (run it on one rank, or data parallel)")
        norm_sizes = (self.q_size, self.kv_size) if self.full_qk_norm else (self.head_dim, self.head_dim)
        self.q_norm = RMSNorm(norm_sizes[0], config.rms_norm_eps) if qk_norm or self.full_qk_norm else None
        self.k_norm = RMSNorm(norm_sizes[1], config.rms_norm_eps) if qk_norm or self.full_qk_norm else None
        # OLMoE's optional clamp of q, k and v (None in its released configs).
        self.clip_qkv = getattr(config, "clip_qkv", None)
        # Gemma scales scores by query_pre_attn_scalar^-1/2, which is not always head_dim's (Gemma 2 27B).
        scale = (getattr(config, "query_pre_attn_scalar", None) or self.head_dim) ** -0.5
        window = config.sliding_window if layer_type == "sliding_attention" else 0
        softcap = getattr(config, "attn_logit_softcapping", None) or 0.0
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, scale, window or 0, softcap)
        self.full_rotary = rotary_dim(config, self.head_dim, layer_type) == self.head_dim  # the fused op's case
        self.fused = None

    def forward(self, rope, x, kv_cache: tuple[torch.Tensor, torch.Tensor], md: AttentionMetadata):
        qkv = self.qkv_proj(x)
        if self.clip_qkv is not None:
            qkv = qkv.clamp_(-self.clip_qkv, self.clip_qkv)
        if self.full_qk_norm:
            q, k = qkv[:, : self.q_size], qkv[:, self.q_size : self.q_size + self.kv_size]
            q.copy_(self.q_norm(q.contiguous())[0])
            k.copy_(self.k_norm(k.contiguous())[0])
        qkv = qkv.view(-1, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and not self.full_qk_norm:
            q, k = qkv[:, : self.num_heads], qkv[:, self.num_heads : self.num_heads + self.num_kv_heads]
            if self.fused is not None:  # in place, each head a row
                self.fused.rms_norm(q, q, self.q_norm.weight, self.q_norm.eps)
                self.fused.rms_norm(k, k, self.k_norm.weight, self.k_norm.eps)
            else:
                q.copy_(self.q_norm(q)[0])
                k.copy_(self.k_norm(k)[0])
        if self.fused is not None and self.full_rotary:
            self.fused.rotary_embedding(qkv, *rope, self.num_heads + self.num_kv_heads)  # q and k, in place
            q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        else:
            qk, v = qkv.split([self.num_heads + self.num_kv_heads, self.num_kv_heads], dim=1)
            q, k = apply_rotary(qk, *rope).split([self.num_heads, self.num_kv_heads], dim=1)
        o = self.attn.forward(q, k, v, kv_cache[0], kv_cache[1], md, self.sinks)
        return self.parallel.all_reduce(self.o_proj(o.reshape(-1, self.q_size)))


class MLP(nn.Module):
    def __init__(self, config: PretrainedConfig, parallel: ParallelGroups, intermediate_size: int | None = None,
                 reduce: bool = True, activation: str | None = None, bias: bool = False,
                 swiglu: tuple[float, float] = (1.702, 7.0)) -> None:
        """intermediate_size: the whole MLP's columns (default the config's); this rank holds its share. reduce:
        whether forward() sums the ranks' shares (an expert's caller sums every expert's share first, once).
        activation: where it is not the config's (gpt-oss's experts: "gpt_oss_swiglu", with `swiglu`'s (alpha,
        limit)); bias: biases on gate/up and down (one rank only: check_tensor_parallel)."""
        super().__init__()
        self.parallel = parallel if reduce else None
        self.intermediate = (intermediate_size or config.intermediate_size) // parallel.tp_size  # this rank's
        self.gate_up_proj = Linear(config.hidden_size, 2 * self.intermediate, bias=bias)
        self.down_proj = Linear(self.intermediate, config.hidden_size, bias=bias)
        # Gemma's configs name hidden_activation (GeGLU); the others hidden_act.
        self.activation = (activation or getattr(config, "hidden_activation", None)
                           or getattr(config, "hidden_act", "silu"))
        if self.activation not in MLP_ACTIVATIONS:
            raise ValueError(f"unsupported activation {self.activation!r}: lmserve runs {', '.join(MLP_ACTIVATIONS)}")
        self.swiglu_alpha, self.swiglu_limit = swiglu
        self.fused = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.activation == "gpt_oss_swiglu":
            # transformers' GptOssExperts._apply_gate: the gate clamped from above, up on both sides, then
            # (up + 1) * gate * sigmoid(alpha * gate).
            gate, up = gate_up.split(self.intermediate, dim=-1)
            gate = gate.clamp(max=self.swiglu_limit)
            up = up.clamp(min=-self.swiglu_limit, max=self.swiglu_limit)
            out = self.down_proj((up + 1) * (gate * torch.sigmoid(gate * self.swiglu_alpha)))
        elif self.activation == "gelu_pytorch_tanh":
            gate, up = gate_up.split(self.intermediate, dim=-1)
            out = self.down_proj(nn.functional.gelu(gate, approximate="tanh") * up)
        elif self.fused is not None:
            hidden = gate_up.new_empty(gate_up.shape[0], self.intermediate)
            self.fused.silu_and_mul(hidden, gate_up)
            out = self.down_proj(hidden)
        else:
            gate, up = gate_up.split(self.intermediate, dim=-1)
            out = self.down_proj(nn.functional.silu(gate) * up)
        return out if self.parallel is None else self.parallel.all_reduce(out)


class DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, parallel: ParallelGroups, layer_type: str = "full_attention",
                 mlp: nn.Module | None = None) -> None:
        """mlp: the layer's feed-forward block where it is not the config's MLP (a mixture of experts)."""
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, parallel, layer_type)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp if mlp is not None else MLP(config, parallel)

    def forward(self, rope, x, residual, kv_cache, md):
        x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(rope, x, kv_cache, md)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class SandwichDecoderLayer(nn.Module):
    """Gemma 2/3's layer: attention and MLP each between two norms (post_attention_layernorm normalizes attention's
    output here, where Llama's normalizes the MLP's input), before each adds to the residual stream."""

    def __init__(self, config: PretrainedConfig, parallel: ParallelGroups, layer_type: str = "full_attention") -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, parallel, layer_type)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, parallel)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, rope, x, residual, kv_cache, md):
        x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(rope, x, kv_cache, md))[0]
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x))[0], residual


def vocab_rows(full: torch.Tensor, parallel: ParallelGroups, vocab_size: int | None = None) -> torch.Tensor:
    """This tensor rank's rows of a [vocab, hidden] tensor, zero-padded so that every rank holds as many. Given the
    vocabulary's size, a tensor of at most one rank's rows is taken as this rank's already (the loader read only
    those: LlamaForCausalLM.checkpoint_part)."""
    per_rank = -(-(vocab_size or full.shape[0]) // parallel.tp_size)
    if vocab_size is not None and full.shape[0] <= per_rank < vocab_size:
        rows = full
    else:
        rows = full[parallel.tp_rank * per_rank : (parallel.tp_rank + 1) * per_rank]
    if rows.shape[0] < per_rank:
        rows = torch.cat([rows, rows.new_zeros(per_rank - rows.shape[0], *rows.shape[1:])])
    return rows


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the vocabulary (padded so that every rank holds as many); a token another rank holds
    looks up zeros here, and the all-reduce adds the rank that holds it."""

    def __init__(self, vocab_size: int, hidden_size: int, parallel: ParallelGroups) -> None:
        super().__init__()
        self.parallel = parallel
        self.rows_per_rank = -(-vocab_size // parallel.tp_size)
        self.first_row = parallel.tp_rank * self.rows_per_rank
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, hidden_size))
        self.activation_dtype: torch.dtype | None = None  # set where the table is kept in another dtype

    def keep_table_in(self, dtype: torch.dtype) -> None:
        """The table in `dtype` (a 16-bit checkpoint's own: its values exactly, half the bytes), looked up rows
        widened to the activations' dtype. Call on the meta device, after the model's cast to its dtype."""
        self.activation_dtype = self.weight.dtype
        self.weight = nn.Parameter(torch.empty(self.weight.shape, dtype=dtype, device=self.weight.device),
                                   requires_grad=False)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        x = nn.functional.embedding(ids, self.weight)
        return x if self.activation_dtype is None else x.to(self.activation_dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.tp_size == 1:
            return self._lookup(input_ids)
        local = input_ids - self.first_row
        outside = (local < 0) | (local >= self.rows_per_rank)
        x = self._lookup(local.masked_fill(outside, 0))
        x.masked_fill_(outside.unsqueeze(-1), 0)
        return self.parallel.all_reduce(x)



class MissingLayer(nn.Identity):
    """A layer another pipeline stage runs: keeps the layer indices (and so the checkpoint's names) in place."""
