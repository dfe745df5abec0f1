"""The mixture-of-experts feed-forward block, one layer that Qwen2-MoE, Qwen3-MoE, Mixtral and OLMoE all run (and the
families built on them): route each token to its top-k experts, run every active expert once over the tokens that
chose it, and sum each token's experts' outputs, weighted, in a fixed order.

Each expert is an MLP of this rank's columns whose linear layers are the ordinary ones (weights/block_linear.py), so a
GGUF's expert blocks are taken as the file stores them, one layer an expert, in the same kernels' layout as a dense
layer: no float copy of an expert ever exists. An expert's layers run their block kernel on every row, prompt rows
too (BlockQuantizedLinear.kernel_only): a per-expert float copy for prompts would cost the experts' bytes again.

Where every expert's layers are block kernels (or fbgemm's float16 weights) the whole block runs as one C++ call
(kernels/moe_block.h: the same ops in the same order, so the same bits), and a decode step's LayerProgram runs it in
its single call; Python's loop here is for the rest (float32 experts, activations without the fused op).

Batch invariance: a token's output depends on its own routing alone. Each expert's kernels compute a row without
reference to the other rows, and a token's k experts are summed in its own top-k order (highest weight first), so
neither which other tokens share the step nor how many chose the same expert changes a token's result.

Under tensor parallel every rank holds its share of every expert's columns (Megatron, as the dense MLP) and the block
sums the routed and shared experts' partial outputs with one all-reduce. With expert parallel (vLLM's
--enable-expert-parallel) a rank holds whole experts instead, experts e with e % tp == tp_rank, and the same
all-reduce adds the ranks that hold each token's experts.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lmserve.distributed.parallel_state import ParallelGroups
from lmserve.moe_shape import MoeShape
from lmserve.worker.kernels import moe_combine_op
from lmserve.worker.layer_program import add_linear, new_moe_block
from lmserve.worker.models.layers import MLP, MissingLayer

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class RouterWeight(nn.Module):
    """A [out, hidden] weight that is never quantized: the router's logits decide which experts run (a rounding that
    flips a choice changes a token's whole output), and it is a small matrix. llama.cpp keeps ffn_gate_inp in float32
    in its quantized files too.

    The product runs in float64 and is rounded to float32: BLAS sums a row's products in an order that depends on
    how many rows it is given (measured here: a decode alone and beside a prefill differed by 5e-6), and a token's
    routing must not depend on its batch. In float64 those orders agree to ~1e-16, far inside float32's rounding."""

    def __init__(self, out_features: int, hidden_size: int, bias: bool = False) -> None:
        """bias: gpt-oss's router adds one to its logits."""
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self._weight64: torch.Tensor | None = None

    def keep_in_float64(self) -> None:
        """Once loaded: the weight in float64 only (the float32 copy freed)."""
        self._weight64 = self.weight.detach().double()
        self.weight = nn.Parameter(torch.empty(0, device=self._weight64.device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._weight64 is None:
            self.keep_in_float64()
        logits = x.double() @ self._weight64.t()
        return (logits if self.bias is None else logits + self.bias.double()).float()


class SparseMoeBlock(nn.Module):
    def __init__(self, config: PretrainedConfig, parallel: ParallelGroups, shape: MoeShape,
                 expert_parallel: bool = False) -> None:
        super().__init__()
        self.shape = shape
        self.parallel = parallel
        self.num_experts, self.top_k = shape.num_experts, shape.top_k
        self.gate = RouterWeight(shape.num_experts, config.hidden_size, bias=shape.gpt_oss)
        tp, rank = parallel.tp_size, parallel.tp_rank
        self.expert_parallel = expert_parallel and tp > 1
        # Experts split by columns (each rank a share of each) or placed whole (expert parallel: the MLP takes its
        # share of tp times the columns, all of them).
        columns = shape.expert_intermediate * (tp if self.expert_parallel else 1)
        self.local_experts = [e for e in range(shape.num_experts) if not self.expert_parallel or e % tp == rank]
        local = set(self.local_experts)
        self.experts = nn.ModuleList(
            _expert(config, parallel, columns, shape) if e in local else MissingLayer()
            for e in range(shape.num_experts)
        )
        self.shared_expert = (_expert(config, parallel, shape.shared_intermediate) if shape.shared_intermediate
                              else None)
        self.shared_expert_gate = RouterWeight(1, config.hidden_size) if shape.shared_intermediate else None
        # Tokens routed to each expert so far (expert load, per layer; made at the first forward pass: the module is
        # built on the meta device).
        self.routed_tokens: torch.Tensor | None = None
        self._program: Any = None  # kernels/moe_block.h's MoeBlock (program_block)
        self._program_checked = False

    def is_local(self, expert: int) -> bool:
        return not self.expert_parallel or expert % self.parallel.tp_size == self.parallel.tp_rank

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k experts (highest score first) and their weights, in float32."""
        if self.shape.gpt_oss:  # the top k logits, then a softmax over those alone
            logits, chosen = torch.topk(self.gate(x), self.top_k, dim=-1)
            return torch.softmax(logits, dim=-1), chosen
        probs = torch.softmax(self.gate(x), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)  # sorted: highest first
        if self.shape.normalize_top_k:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, chosen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        program = self.program_block()
        if program is not None:
            return self.parallel.all_reduce(program.forward(x))
        return self.parallel.all_reduce(self.python_forward(x))

    def python_forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the block's output, op by op from Python (what program_block's call computes)."""
        weights, chosen = self.route(x)
        counts = torch.bincount(chosen.flatten(), minlength=self.num_experts)
        if self.routed_tokens is None:
            self.routed_tokens = torch.zeros_like(counts)
        self.routed_tokens.add_(counts)
        out = self._experts(x, weights, chosen, counts)
        if self.shared_expert is not None:
            gate = torch.sigmoid(self.shared_expert_gate(x))
            out.add_(self.shared_expert(x) * gate.to(x.dtype))
        return out

    def program_block(self) -> Any | None:
        """The block as one C++ call (kernels/moe_block.h's MoeBlock), built at the first forward pass once the
        weights are in place; None where an expert's layers are not what that call runs."""
        if not self._program_checked:
            self._program_checked = True
            self._program = self._new_program()
        return self._program

    def _new_program(self) -> Any | None:
        if self.shape.gpt_oss:  # its router's bias and order, its experts' activation: the Python loop runs them
            return None
        mlps = {e: self.experts[e] for e in self.local_experts}
        if self.shared_expert is not None:
            mlps[-1] = self.shared_expert
        activations = {mlp.activation for mlp in mlps.values()}
        if activations == {"gelu_pytorch_tanh"}:
            gelu = True
        elif activations == {"silu"} and all(mlp.fused is not None for mlp in mlps.values()):
            gelu = False
        else:
            return None
        plans = {}
        for e, mlp in mlps.items():
            for slot, linear in (("gate_up", mlp.gate_up_proj), ("down", mlp.down_proj)):
                plan = getattr(linear, "program_plan", lambda: None)()
                # Every row, prompt rows too, on the kernel the eager layer calls.
                if plan is None or plan.max_rows != sys.maxsize or plan.prompt_rows_apart:
                    return None
                plans[e, slot] = plan
        for router in (self.gate, self.shared_expert_gate):
            if router is not None and router._weight64 is None:
                router.keep_in_float64()
        if self.routed_tokens is None:
            self.routed_tokens = torch.zeros(self.num_experts, dtype=torch.long)
        shared_router = self.shared_expert_gate._weight64 if self.shared_expert_gate is not None else None
        shared_width = self.shared_expert.intermediate if self.shared_expert is not None else 0
        first = self.experts[self.local_experts[0]]
        program = new_moe_block(self.top_k, first.intermediate, shared_width, self.shape.normalize_top_k, gelu,
                                self.gate._weight64, shared_router, self.routed_tokens)
        for (e, slot), plan in plans.items():
            add_linear(program, slot, plan, f"expert {e}'s {slot}", e)
        return program

    def _experts(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, counts: torch.Tensor
                 ) -> torch.Tensor:
        """sum over j of weights[t, j] * expert[chosen[t, j]](x[t]), each active expert run once over its tokens."""
        tokens, k = chosen.shape
        scale = weights.to(x.dtype)
        if tokens == 1 and not self.expert_parallel:
            # One decode: its experts in turn, no grouping to do; the same products and sums as below, to the bit.
            return _combine(torch.cat([self.experts[e](x) for e in chosen[0].tolist()]), scale)
        # Slot s = t * k + j: token t's j-th choice. Grouped by expert (stable: tokens in order within an expert).
        order = torch.argsort(chosen.flatten(), stable=True)
        slot_out = x.new_zeros(tokens * k, x.shape[1]) if self.expert_parallel else x.new_empty(tokens * k, x.shape[1])
        start = 0
        for expert, count in enumerate(counts.tolist()):
            if count == 0:
                continue
            slots = order[start : start + count]
            start += count
            if self.is_local(expert):
                slot_out[slots] = self.experts[expert](x[slots // k])
        return _combine(slot_out, scale)

    def keep_experts_on_kernels(self) -> None:
        """Once loaded: every expert's block layers, the shared expert's too, run their kernel on every row and never
        build a float copy (the module's docstring says why); the routers keep only their float64 weights."""
        for expert in [*self.experts, self.shared_expert]:
            for linear in (getattr(expert, "gate_up_proj", None), getattr(expert, "down_proj", None)):
                if hasattr(linear, "kernel_only"):
                    linear.kernel_only = True
        for router in (self.gate, self.shared_expert_gate):
            if router is not None and router._weight64 is None:
                router.keep_in_float64()

    def routed_token_counts(self) -> list[int]:
        """Tokens routed to each expert so far (each token counted once for each of its top-k experts)."""
        if self.routed_tokens is None:
            return [0] * self.num_experts
        return self.routed_tokens.tolist()


def _combine(slot_out: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """sum over j of scale[t, j] * slot_out[t * k + j], one token's experts in its own top-k order whatever the batch:
    on CPU in float32 the C++ MoE block's own function (kernels/moe_block.h's combine_slots), so both agree to the bit."""
    tokens, k = scale.shape
    combine = moe_combine_op() if slot_out.device.type == "cpu" and slot_out.dtype == torch.float32 else None
    if combine is not None:
        return combine(slot_out, scale.float())
    by_choice = slot_out.view(tokens, k, -1)
    out = by_choice[:, 0] * scale[:, :1]
    for j in range(1, k):
        out.addcmul_(by_choice[:, j], scale[:, j : j + 1])
    return out


def _expert(config: PretrainedConfig, parallel: ParallelGroups, intermediate: int, shape: MoeShape | None = None) -> MLP:
    """One expert: an MLP of `intermediate` columns (this rank's share) whose output the block sums first (gpt-oss's:
    biases and its clamped SwiGLU)."""
    if shape is not None and shape.gpt_oss:
        return MLP(config, parallel, intermediate_size=intermediate, reduce=False, activation="gpt_oss_swiglu",
                   bias=True, swiglu=(shape.swiglu_alpha, shape.swiglu_limit))
    return MLP(config, parallel, intermediate_size=intermediate, reduce=False)
