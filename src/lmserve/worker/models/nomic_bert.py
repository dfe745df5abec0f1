"""nomic-bert (nomic-embed-text v1/v1.5) from a GGUF file, by llama.cpp's tensor names: a BERT-shaped encoder with
rotary positions instead of learned ones (NeoX's rotate-half, base from the header), a fused q/k/v without biases,
SwiGLU MLPs, and post-norm LayerNorms as BERT's. One token type (type 0's row is added to every token).

llama.cpp's graph (build_bert, LLM_ARCH_NOMIC_BERT) is the reference this follows: embeddings + token_types[0] ->
token_embd_norm; per layer: attn_qkv -> rope(q, k) -> bidirectional attention -> attn_output -> + residual ->
attn_output_norm; ffn_down(silu(ffn_gate(x)) * ffn_up(x)) -> + residual -> layer_output_norm.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from lmserve.worker.models.bert import encoder_attention, load_gguf_floats
from lmserve.worker.models.layers import Linear


class NomicBertLayer(nn.Module):
    def __init__(self, hidden: int, intermediate: int, eps: float) -> None:
        super().__init__()
        self.attn_qkv = Linear(hidden, 3 * hidden, bias=False)
        self.attn_output = Linear(hidden, hidden, bias=False)
        self.attn_output_norm = nn.LayerNorm(hidden, eps=eps)
        self.ffn_up = Linear(hidden, intermediate, bias=False)
        self.ffn_gate = Linear(hidden, intermediate, bias=False)
        self.ffn_down = Linear(intermediate, hidden, bias=False)
        self.layer_output_norm = nn.LayerNorm(hidden, eps=eps)


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX rotary: x [rows, heads, head_dim], cos and sin [rows, 1, head_dim / 2]."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


class NomicBertModel(nn.Module):
    """Hidden states [rows, hidden] of a flat batch of whole sequences, as BertModel's forward."""

    def __init__(self, config) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.layer_norm_eps
        self.num_heads = config.num_attention_heads
        self.head_dim = hidden // self.num_heads
        self.token_embd = nn.Embedding(config.vocab_size, hidden)
        self.token_types = nn.Embedding(2, hidden)
        self.token_embd_norm = nn.LayerNorm(hidden, eps=eps)
        self.blk = nn.ModuleList(NomicBertLayer(hidden, config.intermediate_size, eps)
                                 for _ in range(config.num_hidden_layers))
        base = float(config.rope_parameters["rope_theta"])
        inv_freq = base ** (-torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        hidden = self.token_embd_norm(self.token_embd(input_ids) + self.token_types.weight[0])
        angles = positions.float()[:, None] * self.inv_freq[None, :]
        cos, sin = (f(angles).to(hidden.dtype)[:, None, :] for f in (torch.cos, torch.sin))
        rows = hidden.shape[0]
        for layer in self.blk:
            q, k, v = layer.attn_qkv(hidden).split(hidden.shape[1], dim=-1)
            q = rotate_half(q.view(rows, self.num_heads, self.head_dim), cos, sin).reshape(rows, -1)
            k = rotate_half(k.view(rows, self.num_heads, self.head_dim), cos, sin).reshape(rows, -1)
            attended = layer.attn_output(encoder_attention(q, k, v, seq_lens, self.num_heads))
            hidden = layer.attn_output_norm(attended + hidden)
            mlp = layer.ffn_down(F.silu(layer.ffn_gate(hidden)) * layer.ffn_up(hidden))
            hidden = layer.layer_output_norm(mlp + hidden)
        return hidden

    def load_gguf(self, path: Path) -> None:
        """Every parameter from the file by llama.cpp's name (bert.load_gguf_floats: float tensors only)."""
        load_gguf_floats(self, path, lambda name: name, "nomic-bert")
