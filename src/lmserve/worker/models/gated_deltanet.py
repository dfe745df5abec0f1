"""Gated DeltaNet, the linear-attention layer of Qwen3.5 and Qwen3-Next (transformers' Qwen3_5GatedDeltaNet).

Per token: one projection gives q, k, v (through a causal depthwise convolution of width K and SiLU), the output gate
z, and per value head beta = sigmoid(b) and the decay g = -exp(A_log) * softplus(a + dt_bias). q and k are
L2-normalised per head (q also scaled by 1/sqrt(head_k_dim)), and each value head keeps a state S [Dk, Dv]:

    S = exp(g) * S;  S += k (beta * (v - S^T k))^T;  o = S^T q

o goes through an RMSNorm gated by silu(z) (weight * norm(o) * silu(z), not zero-centred) and the output projection.
What a request carries from one step to the next is fixed in size: the last K - 1 convolution inputs and S for every
value head (LinearStates, one slot per request, which the engine hands out).

Decode rows run the recurrence above, all of a step's decodes at once (element-wise products and sums over each row's
own state: a row's bits do not depend on the others). A prompt chunk runs the chunked form (transformers'
torch_chunk_gated_delta_rule: within a chunk of 64 positions the delta rule's updates as one triangular solve, then one
state update per chunk) from the state its previous chunk left, so a prompt split into any chunks computes the same
function as the whole, to float32 rounding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from lmserve.worker.models.layers import Linear

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# Positions per chunk of the chunked form (transformers' and the FLA library's default).
DELTA_RULE_CHUNK = 64


@dataclass(frozen=True)
class LinearSegment:
    """One request's rows of a step: rows [first_row, first_row + num_rows), its state slot, and whether it starts
    from an empty state (its first prompt chunk: a new request, or one that recomputes after a preemption)."""

    first_row: int
    num_rows: int
    slot: int
    fresh: bool


@dataclass(frozen=True)
class LinearBatch:
    """A step's rows for the linear layers: the decodes (one row each, contiguous from row 0, as the runner lays
    out a batch) and the prompt chunks."""

    decode_rows: int
    decode_slots: torch.Tensor  # [decode_rows] long: each decode row's state slot
    decode_fresh: torch.Tensor  # [decode_rows] bool: a one-token prompt's first (and only) chunk
    chunks: tuple[LinearSegment, ...]


class LinearStates:
    """Every linear layer's per-request state, one slot per running request: the convolution's last K - 1 inputs
    [slots, conv channels, K - 1] and the recurrent state [slots, value heads, Dk, Dv], float32."""

    def __init__(self, num_layers: int, num_slots: int, conv_dim: int, kernel: int, num_v_heads: int,
                 head_k_dim: int, head_v_dim: int, device: torch.device) -> None:
        self.num_slots = num_slots
        self.conv = torch.zeros(num_layers, num_slots, conv_dim, kernel - 1, device=device)
        self.recurrent = torch.zeros(num_layers, num_slots, num_v_heads, head_k_dim, head_v_dim, device=device)

    @staticmethod
    def bytes_per_slot(num_layers: int, conv_dim: int, kernel: int, num_v_heads: int, head_k_dim: int,
                       head_v_dim: int) -> int:
        return 4 * num_layers * (conv_dim * (kernel - 1) + num_v_heads * head_k_dim * head_v_dim)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """As transformers' (and the FLA library's): x / sqrt(sum x^2 + eps) over the last dimension."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor) -> torch.Tensor:
    """One position of N rows: q, k [N, H, Dk] (normalised, q scaled), v [N, H, Dv], g and beta [N, H], state
    [N, H, Dk, Dv] updated in place. Returns o [N, H, Dv]."""
    state.mul_(g.exp()[..., None, None])
    kv_mem = (state * k.unsqueeze(-1)).sum(dim=-2)
    delta = (v - kv_mem) * beta.unsqueeze(-1)
    state.add_(k.unsqueeze(-1) * delta.unsqueeze(-2))
    return (state * q.unsqueeze(-1)).sum(dim=-2)


def chunked_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor, chunk: int = DELTA_RULE_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """T positions of one request: q, k [H, T, Dk] (normalised, q scaled), v [H, T, Dv], g and beta [H, T], state
    [H, Dk, Dv] the state before them. Returns (o [H, T, Dv], the state after them), as transformers'
    torch_chunk_gated_delta_rule computes them."""
    length = q.shape[1]
    pad = (chunk - length % chunk) % chunk
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    heads, total = q.shape[0], length + pad
    v_beta = v * beta.unsqueeze(-1)
    k_beta = k * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (x.reshape(heads, total // chunk, chunk, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    g = g.reshape(heads, total // chunk, chunk).cumsum(dim=-1)
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (g.unsqueeze(-1) - g.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * decay
    within = (q @ k.transpose(-1, -2)) * decay
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(system, k_beta * g.exp().unsqueeze(-1), upper=False,
                                               unitriangular=True)
    q = q * g.exp().unsqueeze(-1)
    k = k * (g[..., -1:] - g).exp().unsqueeze(-1)
    chunk_decay = g[..., -1].exp()[..., None, None]
    out = torch.empty_like(new_values)
    for i in range(total // chunk):
        v_new = new_values[:, i] - k_cumdecay[:, i] @ state
        out[:, i] = q[:, i] @ state + within[:, i] @ v_new
        state = state * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_new
    return out.reshape(heads, total, -1)[:, :length], state


class GatedRMSNorm(nn.Module):
    """weight * rmsnorm(x) * silu(gate), over each value head's Dv (the weight as stored: not zero-centred)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x * F.silu(gate.float())


class ConvWeight(nn.Module):
    """The depthwise convolution's weight [channels, 1, K], under the checkpoint's name (conv1d.weight)."""

    def __init__(self, channels: int, kernel: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel))


class GatedDeltaNet(nn.Module):
    def __init__(self, config: PretrainedConfig, state_index: int) -> None:
        """state_index: this layer's place among the model's linear layers (its row of LinearStates)."""
        super().__init__()
        self.state_index = state_index
        self.num_k_heads = config.linear_num_key_heads
        self.num_v_heads = config.linear_num_value_heads
        self.head_k_dim = config.linear_key_head_dim
        self.head_v_dim = config.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = config.linear_conv_kernel_dim
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"{self.num_v_heads} value heads are not a multiple of {self.num_k_heads} key heads")
        activation = getattr(config, "hidden_act", "silu")
        if activation != "silu":
            raise ValueError(f"unsupported linear-attention activation {activation!r}: lmserve runs silu")
        # q, k, v (the convolution's channels), z, b, a: one matmul (transformers' in_proj_qkv, _z, _b, _a).
        self.in_proj = Linear(config.hidden_size, self.conv_dim + self.value_dim + 2 * self.num_v_heads, bias=False)
        self.conv1d = ConvWeight(self.conv_dim, self.kernel)
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads))
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps)
        self.out_proj = Linear(self.value_dim, config.hidden_size, bias=False)

    @property
    def in_proj_rows(self) -> list[int]:
        """Rows of in_proj from each checkpoint weight: qkv, z, b, a."""
        return [self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads]

    def forward(self, x: torch.Tensor, states: LinearStates, batch: LinearBatch) -> torch.Tensor:
        proj = self.in_proj(x)
        mixed, z, b, a = proj.split(self.in_proj_rows, dim=-1)
        beta = torch.sigmoid(b.float())
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        conv_state = states.conv[self.state_index]
        recurrent = states.recurrent[self.state_index]
        weight = self.conv1d.weight[:, 0].float()  # [C, K]
        out = x.new_empty(x.shape[0], self.num_v_heads, self.head_v_dim, dtype=torch.float32)
        n = batch.decode_rows
        if n:
            slots = batch.decode_slots
            window = torch.cat([conv_state[slots], mixed[:n].float().unsqueeze(-1)], dim=-1)  # [n, C, K]
            window[batch.decode_fresh, :, :-1] = 0.0
            conv_state[slots] = window[:, :, 1:]
            conv_out = F.silu((window * weight).sum(dim=-1))
            q, k, v = self._heads(conv_out)
            state = recurrent[slots]
            state[batch.decode_fresh] = 0.0
            out[:n] = recurrent_step(q, k, v, g[:n], beta[:n], state)
            recurrent[slots] = state
        for seg in batch.chunks:
            rows = slice(seg.first_row, seg.first_row + seg.num_rows)
            if seg.fresh:
                conv_state[seg.slot].zero_()
                recurrent[seg.slot].zero_()
            padded = torch.cat([conv_state[seg.slot], mixed[rows].float().t()], dim=-1)  # [C, K - 1 + T]
            conv_state[seg.slot] = padded[:, padded.shape[1] - (self.kernel - 1) :]
            conv_out = F.silu(F.conv1d(padded.unsqueeze(0), weight.unsqueeze(1), groups=self.conv_dim)[0]).t()
            q, k, v = self._heads(conv_out)  # [T, H, D]
            o, final = chunked_delta_rule(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                          g[rows].t(), beta[rows].t(), recurrent[seg.slot])
            recurrent[seg.slot] = final
            out[rows] = o.transpose(0, 1)
        o = self.norm(out, z.reshape(-1, self.num_v_heads, self.head_v_dim))
        return self.out_proj(o.reshape(x.shape[0], self.value_dim).to(x.dtype))

    def _heads(self, conv_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k [rows, value heads, Dk] (L2-normalised, q scaled; each key head serves its group of value heads)
        and v [rows, value heads, Dv] from the convolution's output."""
        q, k, v = conv_out.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        rows = conv_out.shape[0]
        q = l2norm(q.reshape(rows, self.num_k_heads, self.head_k_dim)) * self.head_k_dim**-0.5
        k = l2norm(k.reshape(rows, self.num_k_heads, self.head_k_dim))
        group = self.num_v_heads // self.num_k_heads
        if group > 1:
            q, k = q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)
        return q, k, v.reshape(rows, self.num_v_heads, self.head_v_dim)
