"""How a mixture-of-experts model routes, read from its config (transformers', lmserve.models.GGUFConfig, or
config.json's plain dict) without torch: the worker builds its MoE layers from it and the planner counts all experts
for memory and the active ones for time.

Each family names the same few things differently (transformers' config classes):
- Qwen3-MoE: `num_experts`, `num_experts_per_tok`, `moe_intermediate_size`, `norm_topk_prob`; MoE layers are those
  not in `mlp_only_layers` whose index + 1 is a multiple of `decoder_sparse_step` (the others run a dense MLP of
  `intermediate_size`).
- Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): the same, plus a shared expert of `shared_expert_intermediate_size` that
  every token runs, scaled by a sigmoid gate.
- Mixtral: `num_local_experts` experts of `intermediate_size`, top-`num_experts_per_tok`, the chosen weights
  renormalised (a softmax over the chosen).
- OLMoE: `num_experts` of `intermediate_size`, `norm_topk_prob` (False in OLMoE-1B-7B).
- Qwen3-Next: Qwen2-MoE's names (a shared expert of `shared_expert_intermediate_size`, `decoder_sparse_step`,
  `mlp_only_layers`, `norm_topk_prob`). Qwen3.5-MoE: the same experts and shared expert on every layer, the chosen
  weights always renormalised (its router has no switch).
- gpt-oss: `num_local_experts` of `intermediate_size`, top-`num_experts_per_tok`; its router has a bias and takes the
  top k of its logits, then a softmax over the chosen ones; its experts carry biases and run a clamped SwiGLU
  (`swiglu_alpha`, `swiglu_limit`).
The others score experts with a softmax over the router's logits and take the top k.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lmserve.config import MOE_MODEL_TYPES


@dataclass(frozen=True)
class MoeShape:
    num_experts: int
    top_k: int
    expert_intermediate: int  # each routed expert's MLP columns
    normalize_top_k: bool  # the chosen experts' weights divided by their sum
    shared_intermediate: int = 0  # the shared expert's columns (Qwen2-MoE), 0 for none
    dense_intermediate: int = 0  # the MLP columns of the layers that are not MoE layers
    sparse_step: int = 1  # layer i is a MoE layer when (i + 1) % sparse_step == 0 and i is not in dense_layers
    dense_layers: tuple[int, ...] = ()
    # gpt-oss: the router's logits carry a bias, the top k of them are taken before the softmax (over the chosen
    # alone), and each expert runs gpt-oss's clamped SwiGLU, (up + 1) * gate * sigmoid(alpha * gate), with biases.
    gpt_oss: bool = False
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    def is_moe_layer(self, index: int) -> bool:
        return self.num_experts > 0 and index not in self.dense_layers and (index + 1) % self.sparse_step == 0

    def expert_parameters(self, hidden_size: int) -> int:
        """One routed expert's gate, up and down weights."""
        return 3 * hidden_size * self.expert_intermediate

    def shared_parameters(self, hidden_size: int) -> int:
        """The shared expert's weights and its gate, and the router: what every token of a MoE layer reads."""
        shared = 3 * hidden_size * self.shared_intermediate + (hidden_size if self.shared_intermediate else 0)
        return shared + hidden_size * self.num_experts


def _reader(config: Any) -> Any:
    if isinstance(config, Mapping):
        return lambda name, default=None: config.get(name, default) if config.get(name) is not None else default
    return lambda name, default=None: (value if (value := getattr(config, name, None)) is not None else default)


def moe_shape(config: Any) -> MoeShape | None:
    """The config's routing, or None for a model without experts."""
    get = _reader(config)
    model_type = get("model_type")
    if model_type not in MOE_MODEL_TYPES:
        return None
    num_experts = int(get("num_experts") or get("num_local_experts") or 0)
    top_k = int(get("num_experts_per_tok", 0))
    if num_experts <= 0 or not 0 < top_k <= num_experts:
        raise ValueError(f"a {model_type} config needs 0 < num_experts_per_tok <= the number of experts; it has "
                         f"{top_k} of {num_experts}")
    intermediate = int(get("intermediate_size", 0))
    if model_type in ("qwen2_moe", "qwen3_moe", "qwen3_next", "qwen3_5_moe_text"):
        shared = model_type in ("qwen2_moe", "qwen3_next", "qwen3_5_moe_text")
        normalize = model_type == "qwen3_5_moe_text" or bool(get("norm_topk_prob", False))
        return MoeShape(
            num_experts, top_k, int(get("moe_intermediate_size", intermediate)), normalize,
            shared_intermediate=int(get("shared_expert_intermediate_size", 0)) if shared else 0,
            dense_intermediate=intermediate, sparse_step=max(1, int(get("decoder_sparse_step", 1))),
            dense_layers=tuple(int(i) for i in get("mlp_only_layers", ()) or ()),
        )
    if model_type == "gpt_oss":
        return MoeShape(num_experts, top_k, intermediate, True, dense_intermediate=intermediate, gpt_oss=True,
                        swiglu_alpha=float(get("swiglu_alpha", 1.702)), swiglu_limit=float(get("swiglu_limit", 7.0)))
    # Mixtral renormalises the chosen weights always; OLMoE as its config says.
    normalize = True if model_type == "mixtral" else bool(get("norm_topk_prob", False))
    return MoeShape(num_experts, top_k, intermediate, normalize, dense_intermediate=intermediate)
