"""Hybrid linear-attention decoders: Qwen3.5 (dense, Qwen3_5ForCausalLM), Qwen3.5-MoE (Qwen3_5MoeForCausalLM) and
Qwen3-Next (Qwen3NextForCausalLM). Three Gated DeltaNet layers (worker/models/gated_deltanet.py) to one full-attention
layer, as each config's layer_types lists them.

The full-attention layers are Qwen3's with three changes: q_proj gives each head its query and an output gate
(o = attention * sigmoid(gate) before o_proj), RoPE turns the first partial_rotary_factor of each head (Qwen3.5's
multimodal RoPE reduces to that for text: its three position streams are the same), and every RMSNorm but the linear
layers' gated one scales by (1 + weight): the loader adds the 1 (as for Gemma), so the norms are Llama's. Their K/V live
in the paged cache, one KV layer per full-attention layer; the linear layers keep a state slot per request instead
(LinearStates), which the engine hands out (engine/kv_cache.py's StateSlots) and the runner passes in each step.

The MoE feed-forward block (a shared expert beside the routed ones) is worker/models/moe.py's. Qwen3-Next's checkpoints
store the linear layers' projections interleaved by key head (in_proj_qkvz, in_proj_ba); they are taken apart into
Qwen3.5's separate q/k/v, z, b and a as they load, so both run one layer.

One rank only: tensor and pipeline parallel, the C++ layer program, prefix caching (a hit would need the state at the
hit's end) and speculative decoding (the state before the first rejected draft) are not done for these models yet.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from lmserve.distributed.layout import RankLayout
from lmserve.distributed.parallel_state import ParallelGroups
from lmserve.worker.layer_program import ProgramRefused
from lmserve.worker.models.gated_deltanet import GatedDeltaNet, LinearBatch, LinearStates
from lmserve.worker.models.layers import MLP, Attention, RMSNorm
from lmserve.worker.models.llama import LlamaForCausalLM
from lmserve.worker.models.rotary import apply_rotary
from lmserve.worker.weights.block_packing import StoredBlocks

if TYPE_CHECKING:
    from transformers import PretrainedConfig

LINEAR = "linear_attention"


class GatedAttention(Attention):
    """Full attention whose q_proj rows give each head [query, gate] (transformers' Qwen3_5Attention)."""

    def __init__(self, config: PretrainedConfig, parallel: ParallelGroups) -> None:
        super().__init__(config, parallel, "full_attention")
        # q/k/v plus the gate's rows, in the checkpoint's order (per head: head_dim query rows, head_dim gate rows).
        self.qkv_proj = type(self.qkv_proj)(config.hidden_size, 2 * self.q_size + 2 * self.kv_size,
                                            bias=self.qkv_proj.bias is not None)

    def forward(self, rope, x, kv_cache: tuple[torch.Tensor, torch.Tensor], md):
        rows = x.shape[0]
        qkv = self.qkv_proj(x)
        query_gate = qkv[:, : 2 * self.q_size].view(rows, self.num_heads, 2 * self.head_dim)
        q = query_gate[..., : self.head_dim].contiguous()
        gate = query_gate[..., self.head_dim :].reshape(rows, self.q_size)
        k, v = qkv[:, 2 * self.q_size :].view(rows, 2 * self.num_kv_heads, self.head_dim).split(self.num_kv_heads, 1)
        q, k = self.q_norm(q)[0], self.k_norm(k.contiguous())[0]
        q, k = apply_rotary(torch.cat([q, k], dim=1), *rope).split([self.num_heads, self.num_kv_heads], dim=1)
        o = self.attn.forward(q, k, v, kv_cache[0], kv_cache[1], md)
        return self.o_proj(o.reshape(rows, self.q_size) * torch.sigmoid(gate))


class HybridDecoderLayer(nn.Module):
    """Norm, token mixer (a Gated DeltaNet or gated full attention), norm, MLP or mixture of experts."""

    def __init__(self, config: PretrainedConfig, parallel: ParallelGroups, mixer: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if isinstance(mixer, GatedDeltaNet):
            self.linear_attn = mixer
        else:
            self.self_attn = mixer
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp

    @property
    def is_linear(self) -> bool:
        return hasattr(self, "linear_attn")

    def forward(self, rope, x, residual, kv_cache, md, states: LinearStates | None = None,
                linear: LinearBatch | None = None):
        x, residual = self.input_layernorm(x, residual)
        x = self.linear_attn(x, states, linear) if self.is_linear else self.self_attn(rope, x, kv_cache, md)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class HybridForCausalLM(LlamaForCausalLM):
    def __init__(self, config: PretrainedConfig, max_position: int, parallel: ParallelGroups | None = None,
                 rope_device: torch.device | None = None, expert_parallel: bool = False) -> None:
        parallel = parallel or ParallelGroups(RankLayout(0))
        if parallel.tp_size != 1 or parallel.layout.pp_size != 1:
            raise ValueError(f"{config.model_type} (hybrid linear attention) runs on one rank: tensor and pipeline "
                             "parallel are not supported for it yet (use data parallel)")
        self._linear_count = 0
        super().__init__(config, max_position, parallel, rope_device, expert_parallel)
        self.attention_layers = [i for i in self.stage_layers if not self.layers[i].is_linear]
        self.linear_layers = [i for i in self.stage_layers if self.layers[i].is_linear]
        self.states: LinearStates | None = None  # allocate_states

    def _make_layer(self, index: int, layer_type: str, expert_parallel: bool) -> nn.Module:
        if layer_type == LINEAR:
            mixer: nn.Module = GatedDeltaNet(self.config, self._linear_count)
            self._linear_count += 1
        else:
            mixer = GatedAttention(self.config, self.parallel)
        mlp = self._feed_forward(index, expert_parallel) or MLP(self.config, self.parallel)
        return HybridDecoderLayer(self.config, self.parallel, mixer, mlp)

    # ---- the state the linear layers keep per request ---------------------------------------------------------

    def _state_shape(self) -> tuple[int, int, int, int, int, int]:
        layer = self.layers[self.linear_layers[0]].linear_attn
        return (len(self.linear_layers), layer.conv_dim, layer.kernel, layer.num_v_heads, layer.head_k_dim,
                layer.head_v_dim)

    @property
    def state_bytes_per_slot(self) -> int:
        """One request's state over every linear layer (constant in its length)."""
        return LinearStates.bytes_per_slot(*self._state_shape())

    def allocate_states(self, num_slots: int, device: torch.device) -> None:
        num_layers, conv_dim, kernel, v_heads, k_dim, v_dim = self._state_shape()
        self.states = LinearStates(num_layers, num_slots, conv_dim, kernel, v_heads, k_dim, v_dim, device)

    # ---- forward ---------------------------------------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        """Layers that hold KV (the full-attention ones)."""
        return len(self.attention_layers)

    @property
    def kv_shape(self) -> tuple[int, int]:
        attn = self.layers[self.attention_layers[0]].self_attn
        return attn.num_kv_heads, attn.head_dim

    def forward(self, input_ids, positions, kv_caches, md, intermediate=None):
        x, residual = self.embed_tokens(input_ids), None
        rope = self.rotary["full_attention"].tables(positions)
        linear: LinearBatch | None = getattr(md, "linear", None)
        caches = iter(kv_caches)
        for index in self.stage_layers:
            layer = self.layers[index]
            if layer.is_linear:
                if linear is None or self.states is None:
                    raise RuntimeError("a hybrid model's step needs its requests' state slots (LinearBatch)")
                x, residual = layer(None, x, residual, None, md, self.states, linear)
            else:
                x, residual = layer(rope, x, residual, next(caches), md)
        return self.norm(x, residual)[0]

    def use_layer_program(self, kv_caches) -> None:
        raise ProgramRefused("hybrid linear-attention layers")

    # ---- loading ---------------------------------------------------------------------------------------------

    _FUSED: ClassVar[dict[str, tuple[str, int]]] = {
        **LlamaForCausalLM._FUSED,
        "in_proj_qkv": ("in_proj", 0),
        "in_proj_z": ("in_proj", 1),
        "in_proj_b": ("in_proj", 2),
        "in_proj_a": ("in_proj", 3),
    }
    _SOURCES: ClassVar[dict[str, tuple[str, ...]]] = {
        **LlamaForCausalLM._SOURCES, "in_proj": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
    }

    def _shard_rows(self, fused_name: str, shard: int, owner: nn.Module) -> tuple[int, int]:
        if fused_name == "in_proj":
            sizes = owner.in_proj_rows
        elif fused_name == "qkv_proj" and isinstance(owner, GatedAttention):
            sizes = [2 * owner.q_size, owner.kv_size, owner.kv_size]
        else:
            return super()._shard_rows(fused_name, shard, owner)
        return sum(sizes[:shard]), sizes[shard]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | StoredBlocks]]) -> None:
        super().load_weights(self._as_qwen3_5(weights))

    def _as_qwen3_5(self, weights: Iterable[tuple[str, torch.Tensor | StoredBlocks]]
                    ) -> Iterator[tuple[str, torch.Tensor | StoredBlocks]]:
        """The checkpoint's weights as Qwen3.5's: the zero-centred norms with their 1 added (all but the linear
        layers' gated norm), Qwen3-Next's interleaved projections taken apart."""
        for name, tensor in weights:
            if isinstance(tensor, StoredBlocks):
                yield name, tensor
                continue
            if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
                yield name, tensor.float() + 1.0
            elif name.endswith("linear_attn.in_proj_qkvz.weight"):
                yield from self._split_qkvz(name, tensor)
            elif name.endswith("linear_attn.in_proj_ba.weight"):
                yield from self._split_ba(name, tensor)
            else:
                yield name, tensor

    def _deltanet(self, name: str) -> GatedDeltaNet:
        return self.layers[int(name.split("layers.")[1].split(".")[0])].linear_attn

    def _split_qkvz(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """Qwen3-Next's [key heads x (q, k, v group, z group), hidden] rows as q, k, v (in_proj_qkv) and z."""
        layer = self._deltanet(name)
        group_v = layer.num_v_heads // layer.num_k_heads * layer.head_v_dim
        per_head = tensor.reshape(layer.num_k_heads, -1, tensor.shape[-1])
        q, k, v, z = per_head.split([layer.head_k_dim, layer.head_k_dim, group_v, group_v], dim=1)
        prefix = name.removesuffix("in_proj_qkvz.weight")
        flat = [t.reshape(-1, tensor.shape[-1]) for t in (q, k, v, z)]
        yield prefix + "in_proj_qkv.weight", torch.cat(flat[:3])
        yield prefix + "in_proj_z.weight", flat[3]

    def _split_ba(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        layer = self._deltanet(name)
        per_head = tensor.reshape(layer.num_k_heads, -1, tensor.shape[-1])
        b, a = per_head.split(layer.num_v_heads // layer.num_k_heads, dim=1)
        prefix = name.removesuffix("in_proj_ba.weight")
        yield prefix + "in_proj_b.weight", b.reshape(-1, tensor.shape[-1])
        yield prefix + "in_proj_a.weight", a.reshape(-1, tensor.shape[-1])
