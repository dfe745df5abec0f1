"""Rotary position embeddings (RoPE) as the Llama family's configs describe them: transformers' default, linear,
LongRoPE (Phi-3) and YaRN (gpt-oss) computed here, without importing transformers (what a GGUF file can hold), other
types from an HF directory's config through transformers' own functions; a GGUF's rope_freqs tensor (Llama 3.1+) as llama.cpp applies it;
partial rotary (Phi-4-mini). Tables are float32, one per layer type, computed as positions are first used."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from lmserve.worker.lazy_zeros import zeroed_lazily

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def rope_parameters(config: PretrainedConfig, layer_type: str = "full_attention") -> dict:
    """The RoPE of a layer type: a config may give each its own (Gemma 3: rope_parameters by layer type)."""
    params = getattr(config, "rope_parameters", None)
    if params:
        params = params.get(layer_type, params) if isinstance(params.get(layer_type), dict) else params
        return dict(params)
    params = dict(getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params


def _rope_frequencies(
    config: PretrainedConfig, head_dim: int, max_position: int, layer_type: str = "full_attention"
) -> tuple[torch.Tensor, float]:
    """float32 inverse frequencies, [rotary_dim(config, head_dim) / 2], on the CPU, and the factor cos and sin are
    scaled by."""
    params = rope_parameters(config, layer_type)
    rope_type = params.get("rope_type", "default")
    cpu = torch.device("cpu")
    dim = rotary_dim(config, head_dim)
    if rope_type in ("default", "linear", "longrope", "yarn"):
        # transformers' default, linear, LongRoPE and YaRN (those a GGUF file can hold), without importing
        # transformers.
        base = params["rope_theta"]
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device=cpu).float() / dim))
        scaling = 1.0
        if rope_type == "linear":
            inv_freq = inv_freq / params["factor"]
        elif rope_type == "longrope":
            inv_freq, scaling = _longrope(config, params, inv_freq, max_position)
        elif rope_type == "yarn":
            inv_freq, scaling = _yarn(config, params, dim)
    else:
        # Other rope types come from an HF directory's config (a transformers config): transformers' functions.
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        if rope_type not in ROPE_INIT_FUNCTIONS:
            raise ValueError(f"unsupported rope type {rope_type!r}")
        by_type = isinstance((getattr(config, "rope_parameters", None) or {}).get(layer_type), dict)
        kwargs = {"layer_type": layer_type} if by_type else {}
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, cpu, **kwargs)
    rope_freqs = getattr(config, "rope_freqs", None)
    if rope_freqs is not None:
        # A GGUF's rope_freqs tensor (Llama 3.1+), as llama.cpp applies it: theta_i = base^(-2i/d) / rope_freqs[i].
        if rope_type != "default" or len(rope_freqs) != head_dim // 2:
            raise ValueError(f"rope_freqs of {len(rope_freqs)} values for {rope_type} rope, head_dim {head_dim}")
        inv_freq = inv_freq / torch.tensor(rope_freqs, dtype=torch.float, device=cpu)
    return inv_freq.to(cpu, torch.float), scaling


def _table_rows(inv_freq: torch.Tensor, scaling: float, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of positions start ... stop - 1, [stop - start, inv_freq size]."""
    freqs = torch.outer(torch.arange(start, stop, dtype=torch.float, device=inv_freq.device), inv_freq)
    return freqs.cos() * scaling, freqs.sin() * scaling


def rotary_dim(config: PretrainedConfig, head_dim: int, layer_type: str = "full_attention") -> int:
    """How many of a head's dimensions RoPE turns: all, or the first partial_rotary_factor of them (Phi-4-mini)."""
    return int(head_dim * rope_parameters(config, layer_type).get("partial_rotary_factor", 1.0))


def _longrope(
    config: PretrainedConfig, params: dict, inv_freq: torch.Tensor, max_position: int
) -> tuple[torch.Tensor, float]:
    """Phi-3's LongRoPE: per frequency, the long factors when the model runs past its original context (this
    engine's max_model_len decides once, as llama.cpp's context size does; transformers switches per forward on the
    sequence's length, the same choice for any sequence on the same side), else the short ones; cos and sin scaled
    by the attention factor (transformers' _compute_longrope_parameters)."""
    original = params.get("original_max_position_embeddings") or config.original_max_position_embeddings
    factor = params.get("factor") or config.max_position_embeddings / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1.0 else 1.0
    factors = params["long_factor"] if max_position > original else params["short_factor"]
    if len(factors) != inv_freq.numel():
        raise ValueError(f"LongRoPE has {len(factors)} factors for {inv_freq.numel()} rotary frequencies")
    return inv_freq / torch.tensor(factors, dtype=torch.float), attention_factor


def _yarn(config: PretrainedConfig, params: dict, dim: int) -> tuple[torch.Tensor, float]:
    """YaRN (gpt-oss, Qwen's long-context configs), as transformers' _compute_yarn_parameters computes it: per
    frequency a blend of the original (extrapolated) and the factor-scaled (interpolated) one, ramping linearly
    between the dimensions that turn beta_fast and beta_slow times over the original context (floored and ceiled
    unless `truncate` is False, as gpt-oss's config says), and cos and sin scaled by the attention factor
    (0.1 ln(factor) + 1 unless given)."""
    base = params["rope_theta"]
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or config.max_position_embeddings / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


# On the CPU the tables are computed this many positions at a time, as positions are first used: a model's whole
# context is rarely reached, and Gemma 3's tables (head dim 256, two layer types) are 64 MiB at 32k positions.
ROPE_CHUNK = 1024


class RotaryEmbedding(nn.Module):
    """float32 cos/sin tables for every position up to max_position. On the CPU their pages are filled on first use,
    ROPE_CHUNK positions at a time (always the same pieces, so a position's values never depend on the batch that
    first reached it); on other devices they are computed whole, once."""

    def __init__(
        self, config: PretrainedConfig, head_dim: int, max_position: int, device: torch.device | None = None,
        layer_type: str = "full_attention",
    ) -> None:
        super().__init__()
        # On the CPU whatever default device is active (the model may be built under `with torch.device("meta")` or
        # "cuda"): transformers' init functions mix their own device with the default one, and meta has no values.
        with torch.device("cpu"):
            self._inv_freq, self._scaling = _rope_frequencies(config, head_dim, max_position, layer_type)
        # Plain attributes, not buffers: module.to(dtype) must not round the tables to bfloat16, and to_empty() must
        # not replace them with uninitialised memory. So they go to the model's device here, once.
        device = torch.device(device) if device is not None else torch.get_default_device()
        self.max_position = max_position
        if device.type == "cpu":
            shape = (max_position, self._inv_freq.numel())
            self._cos, self._sin = (zeroed_lazily(shape, torch.float32, device) for _ in range(2))
            self._filled = 0
        else:
            cos, sin = _table_rows(self._inv_freq, self._scaling, 0, max_position)
            self._cos, self._sin = cos.to(device), sin.to(device)
            self._filled = max_position

    @property
    def cos(self) -> torch.Tensor:
        """The whole table (computing what is not yet)."""
        self._fill(self.max_position)
        return self._cos

    @property
    def sin(self) -> torch.Tensor:
        self._fill(self.max_position)
        return self._sin

    def _fill(self, stop: int) -> None:
        while self._filled < stop:
            start = self._filled
            end = min(start - start % ROPE_CHUNK + ROPE_CHUNK, self.max_position)
            self._cos[start:end], self._sin[start:end] = _table_rows(self._inv_freq, self._scaling, start, end)
            self._filled = end

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for the batch's positions, [T, 1, D/2]: looked up once per forward, shared by every layer."""
        if self._filled < self.max_position and positions.numel():
            self._fill(min(int(positions.max()) + 1, self.max_position))
        return self._cos.index_select(0, positions).unsqueeze(1), self._sin.index_select(0, positions).unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D] in HF's rotate-half layout; q and k heads go through in one call. cos and sin narrower than
    D/2 turn the first 2 * width dimensions only (partial rotary), the rest pass through."""
    width = cos.shape[-1]
    if 2 * width < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., : 2 * width], cos, sin), x[..., 2 * width :]), dim=-1)
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
