"""Layers built before their weights load: a model is built on the meta device with each linear layer already in
the format it will hold (PendingBlockLinear for a block format; float16.PendingFloat16Linear, row_segments'
PendingSegmentsLinear), the checkpoint's rows go straight into them as the loader yields them, and
finish_block_linears turns each into its layer (layer_types.LAYER_TYPES): no float32 copy of a block layer's weights
is ever made. quantize_linears converts an already loaded model's float layers instead.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from lmserve.formats.block_formats import STORED_BLOCK_BYTES, block_width
from lmserve.worker.kernels import cpu_kernels
from lmserve.worker.weights.block_linear import BlockQuantizedLinear
from lmserve.worker.weights.block_packing import PackedBlocks, StoredBlocks, StoredRows, as_blocks
from lmserve.worker.weights.kernel_choice import INTEGER_ACTIVATIONS
from lmserve.worker.weights.kquants import KQuantLinear
from lmserve.worker.weights.layer_format import PendingLayer
from lmserve.worker.weights.layer_types import LAYER_TYPES, layer_fits


def quantize_linears(module: nn.Module, method: str) -> int:
    """Replaces every nn.Linear under module with its `method` version, in place; returns how many were replaced."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, LAYER_TYPES[method](child.weight, child.bias))
            count += 1
        else:
            count += quantize_linears(child, method)
    return count


class PendingBlockLinear(PendingLayer):
    """A block layer whose weights are still being loaded: the checkpoint's rows arrive one tensor (or shard) at a time
    as rows of llama.cpp blocks, a file's blocks of the same format kept where the loader has them (the file's mapping),
    anything else rounded to the format (as_blocks). finish() then packs them into the layer, a fused layer's parts
    (q, k, v; gate, up) together, with no copy of the whole layer first. Built on the meta device with the rest of the
    model (worker/model_builder.py), it never holds the weights in float."""

    def __init__(self, method: str, in_features: int, out_features: int, bias: bool, activations: str = "float32"
                 ) -> None:
        super().__init__()
        self.activations = activations  # the finished layer's (BlockQuantizedLinear)
        width = block_width(method)
        if in_features % width:
            raise ValueError(f"{method} layers need in_features that are a multiple of {width}; a layer has "
                             f"{in_features}")
        self.method, self.in_features, self.out_features = method, in_features, out_features
        self.row_shape = (in_features // width, STORED_BLOCK_BYTES[method])  # a row's blocks and their bytes
        self.parts: dict[int, torch.Tensor] = {}  # first row: those rows' blocks
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        # The layer's blocks as an earlier start packed them (weights/packed_cache.py): the checkpoint's rows are then
        # only checked for shape, neither converted nor packed.
        self.packed: PackedBlocks | None = None

    def use_packed(self, packed: PackedBlocks) -> None:
        if (packed.method, packed.out_features, packed.in_features) != (self.method, self.out_features,
                                                                         self.in_features):
            raise ValueError(f"packed {packed.method} [{packed.out_features}, {packed.in_features}] weights for a "
                             f"[{self.out_features}, {self.in_features}] {self.method} layer")
        self.packed = packed

    def load_rows(self, start: int, weight: torch.Tensor | StoredBlocks) -> None:
        """Rows start, start + 1, ... of the weight (a fused layer's q, k and v arrive one after another)."""
        if self.packed is None:
            blocks = as_blocks(self.method, weight)
        elif weight.shape[1] != self.in_features:
            raise ValueError(f"rows of shape {tuple(weight.shape)} do not fit a [{self.out_features}, "
                             f"{self.in_features}] layer")
        else:  # only the rows' count is needed: a stand-in of their shape, without their bytes
            blocks = torch.empty((weight.shape[0], *self.row_shape), dtype=torch.uint8, device="meta")
        if tuple(blocks.shape[1:]) != self.row_shape or start < 0 or start + blocks.shape[0] > self.out_features:
            raise ValueError(
                f"rows of shape {tuple(weight.shape)} do not fit at row {start} of a "
                f"[{self.out_features}, {self.in_features}] layer"
            )
        if start in self.parts:
            raise ValueError(f"rows {start}.. of a [{self.out_features}, {self.in_features}] {self.method} layer were "
                             f"loaded twice")
        self.parts[start] = blocks

    def finish(self) -> BlockQuantizedLinear:
        parts = self.loaded_parts()
        weight = StoredBlocks(self.method, parts[0]) if len(parts) == 1 else StoredRows(self.method, tuple(parts))
        self.parts = {}
        if self.packed is not None:
            return LAYER_TYPES[self.method](self.packed, self.bias, activations=self.packed.activations)
        return LAYER_TYPES[self.method](weight, self.bias, activations=self.activations)

    def loaded_parts(self) -> list[torch.Tensor]:
        """The loaded rows' blocks in row order; raises where a row was never loaded or loaded twice."""
        starts = sorted(self.parts)
        covered = 0
        for start in starts:
            if start != covered:
                raise ValueError(f"rows {min(start, covered)}.. of a [{self.out_features}, {self.in_features}] "
                                 f"{self.method} layer were {'never loaded' if start > covered else 'loaded twice'}")
            covered += self.parts[start].shape[0]
        if covered != self.out_features:
            raise ValueError(f"rows {covered}.. of a [{self.out_features}, {self.in_features}] {self.method} layer "
                             f"were never loaded")
        return [self.parts[start] for start in starts]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.method} weights, loading"


def pend_block_linears(
    module: nn.Module, method: str | Callable[[str], str | None], prefix: str = "", activations: str = "float32",
    unfit: list[tuple[str, str, int, int]] | None = None,
) -> int:
    """Replaces every nn.Linear under module (on the meta device: shapes only) with a PendingBlockLinear of
    `method`, in place; returns how many were replaced. `method` may be a function of the layer's name under module
    (e.g. "0.mlp.down_proj"), whose None leaves that layer a float one. activations: the finished layers' kernel.
    unfit: where given, gets (name, method, out_features, in_features) of each layer that has a format but whose
    shape (this rank's slice, under tensor parallel) does not fit it, so it stays a float layer."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            layer_method = method(prefix + name) if callable(method) else method
            if layer_method is None:
                continue
            if not layer_fits(layer_method, child.out_features, child.in_features):
                if unfit is not None:
                    unfit.append((prefix + name, layer_method, child.out_features, child.in_features))
                continue
            bias = child.bias is not None
            setattr(module, name, PendingBlockLinear(layer_method, child.in_features, child.out_features, bias,
                                                     activations))
            count += 1
        else:
            count += pend_block_linears(child, method, f"{prefix}{name}.", activations, unfit)
    return count


def finish_block_linears(module: nn.Module) -> None:
    """Replaces every PendingLayer under module (PendingBlockLinear, weights/row_segments.PendingSegmentsLinear) with
    the layer its loaded rows make; the like layers of a list's modules (a mixture's experts) packed in one call."""
    if isinstance(module, nn.ModuleList):
        _finish_alike_together(module)
    for name, child in list(module.named_children()):
        if isinstance(child, PendingLayer):
            setattr(module, name, child.finish())
        else:
            finish_block_linears(child)


def _finish_alike_together(modules: nn.ModuleList) -> None:
    """The same-named pending layers of the list's modules (every expert's gate_up_proj, every expert's down_proj)
    finished from one pack call each, each layer's blocks a view of its rows of the result: one call per stacked
    expert tensor instead of one per expert (the packer's start-up and a fresh allocation each time cost ~40% of
    packing a mixture's experts). Only for the integer-only formats, whose layout packs every 16 rows on their own,
    so that the rows of one call are the layers' own packs one after another; any other group finishes layer by
    layer."""
    groups: dict[str, list[tuple[nn.Module, PendingBlockLinear]]] = {}
    for owner in modules:
        for name, child in owner.named_children():
            if isinstance(child, PendingBlockLinear):
                groups.setdefault(name, []).append((owner, child))
    for name, members in groups.items():
        layers = [layer for _, layer in members]
        finished = _finish_in_one_call(layers) if len(layers) > 1 else None
        for (owner, _), layer in zip(members, finished or (), strict=False):
            setattr(owner, name, layer)


def _finish_in_one_call(layers: list[PendingBlockLinear]) -> list[nn.Module] | None:
    """The layers finished from one pack call, or None where they cannot share one (see _finish_alike_together)."""
    first = layers[0]
    layer_type = LAYER_TYPES[first.method]
    if (not issubclass(layer_type, KQuantLinear) or any(layer.packed is not None for layer in layers)
            or any((layer.method, layer.in_features) != (first.method, first.in_features) or layer.out_features % 16
                   for layer in layers)):
        return None
    parts = [layer.loaded_parts() for layer in layers]
    groups = getattr(cpu_kernels(), f"{first.method}_int16_pack")([part for own in parts for part in own])
    views = groups.split([layer.out_features // 16 for layer in layers])
    finished = []
    for layer, blocks in zip(layers, views, strict=True):
        # The activations KQuantLinear takes (integer ones only), for the layout just packed.
        activations = layer.activations if layer.activations in INTEGER_ACTIVATIONS else "int16"
        packed = PackedBlocks(layer.method, blocks, layer.out_features, layer.in_features, activations)
        layer.parts = {}
        finished.append(layer_type(packed, layer.bias, activations=activations))
    return finished
