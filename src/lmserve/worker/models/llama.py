"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3, Gemma 2/3) over a flat batch of positions and a
paged KV cache.

Gemma 2 and 3 are the same decoder with what their configs name: sliding-window attention on their local layers (each
layer type with its own RoPE base on Gemma 3), a norm after attention and after the MLP as well as before each
("sandwich" norms), GeGLU, embeddings scaled by sqrt(hidden size), q/k norms (Gemma 3), tanh soft-capping of the
attention scores and logits (Gemma 2). Gemma's RMSNorm multiplies by (1 + weight): weights/loader.py adds the 1 to
a checkpoint's norm weights as it reads them (a GGUF file stores them with it), so the norm here is Llama's.

The layers are worker/models/layers.py's (RMSNorm, attention, MLP, decoder layer, embedding); this module is the model
over them: its forward pass, its layers' weight formats, and loading its share of a checkpoint. q/k/v and gate/up
are fused into one matmul each because every matmul call has a fixed cost on CPU.

Split across ranks as Megatron splits it (distributed/parallel_state.py): each tensor rank holds its share of the
attention heads and MLP columns (q/k/v and gate/up split by output rows, o_proj and down_proj by input columns, then
one all-reduce each per layer) and its share of the vocabulary (embedding rows, output-layer rows); each pipeline
stage holds consecutive layers, the first stage the embedding, the last the final norm and output layer. With one
rank every split is the whole and every collective a no-op.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from lmserve.config import GEMMA_MODEL_TYPES, SUPPORTED_MODEL_TYPES
from lmserve.distributed.layout import RankLayout
from lmserve.distributed.parallel_state import ParallelGroups
from lmserve.moe_shape import moe_shape
from lmserve.worker.layer_program import LayerProgram, ProgramRefused, add_linear, new_program
from lmserve.worker.models.layers import (
    MLP,
    Attention,
    DecoderLayer,
    Linear,
    MissingLayer,
    RMSNorm,
    SandwichDecoderLayer,
    VocabParallelEmbedding,
    blas_matmul,
    check_tensor_parallel,
    kv_head_replicas,
    layer_types,
    vocab_rows,
)
from lmserve.worker.models.moe import SparseMoeBlock
from lmserve.worker.models.rotary import RotaryEmbedding
from lmserve.worker.weights.block_embedding import BlockEmbedding
from lmserve.worker.weights.block_packing import StoredBlocks
from lmserve.worker.weights.float16 import PendingFloat16Linear, pend_float16_linears
from lmserve.worker.weights.layer_format import PendingLayer
from lmserve.worker.weights.layer_types import LAYER_TYPES, OUTPUT_LAYER_METHOD, layer_fits
from lmserve.worker.weights.loader import FusedRowsPart, TensorPart, fused_parts, fused_sizes
from lmserve.worker.weights.pending import (
    PendingBlockLinear,
    finish_block_linears,
    pend_block_linears,
    quantize_linears,
)
from lmserve.worker.weights.row_segments import PendingSegmentsLinear
from lmserve.worker.weights.shards import as_floats, column_shard, num_rows, select_rows, unfit_layers_message
from lmserve.worker.weights.stored_formats import (
    KERNEL_FORMATS,
    STORED_BLOCK_TYPES,
    exact_kernel_format,
)

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    # A transformers config, or for a GGUF file lmserve.models.GGUFConfig: the same attributes without transformers.
    from transformers import PretrainedConfig


class LlamaForCausalLM(nn.Module):
    def __init__(
        self, config: PretrainedConfig, max_position: int, parallel: ParallelGroups | None = None,
        rope_device: torch.device | None = None, expert_parallel: bool = False,
    ) -> None:
        """rope_device: where the RoPE tables live (default: the default device); worker/model_builder.py builds
        the parameters on meta and passes the target device here. expert_parallel: a mixture of experts' tensor
        ranks hold whole experts each instead of a share of every expert (worker/models/moe.py)."""
        super().__init__()
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported architecture {config.model_type!r}: lmserve supports {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        parallel = parallel or ParallelGroups(RankLayout(0))
        check_tensor_parallel(config, parallel.tp_size, expert_parallel)
        layout = parallel.layout
        self.config = config
        self.parallel = parallel
        self.vocab_size = config.vocab_size
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        types = layer_types(config)
        self.layer_types = types
        # One table per layer type (Gemma 3's local layers turn at another base than its global ones).
        self.rotary = {kind: RotaryEmbedding(config, head_dim, max_position, rope_device, kind)
                       for kind in dict.fromkeys(types[i] for i in layout.stage_layers(config.num_hidden_layers))
                       if kind != "linear_attention"}  # (a hybrid model's linear layers turn nothing)
        gemma = config.model_type in GEMMA_MODEL_TYPES
        # Gemma multiplies the embeddings by sqrt(hidden size), rounded to the activations' dtype as transformers does.
        self.embedding_scale = config.hidden_size**0.5 if gemma else None
        self.final_logit_softcap = getattr(config, "final_logit_softcapping", None) or 0.0
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.stage_layers = layout.stage_layers(config.num_hidden_layers)
        # Each layer's KV-cache group (lmserve.kv_groups), set by the runner when sliding layers have their own.
        self.kv_layer_groups: Sequence[int] = (0,) * config.num_hidden_layers
        # The embedding lives on the first stage, and on the last too when it is also the output layer.
        needs_embedding = layout.is_first_stage or (layout.is_last_stage and self.tie_word_embeddings)
        self.embed_tokens = (
            VocabParallelEmbedding(config.vocab_size, config.hidden_size, parallel) if needs_embedding else None
        )
        self.moe = moe_shape(config)
        self.layers = nn.ModuleList(
            self._make_layer(i, types[i], expert_parallel) if i in self.stage_layers else MissingLayer()
            for i in range(config.num_hidden_layers)
        )
        last = layout.is_last_stage
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if last else None
        self.program: LayerProgram | None = None  # use_layer_program
        rows_per_rank = -(-config.vocab_size // parallel.tp_size)
        self.lm_head = (
            Linear(config.hidden_size, rows_per_rank, bias=False) if last and not self.tie_word_embeddings else None
        )

    def _make_layer(self, index: int, layer_type: str, expert_parallel: bool) -> nn.Module:
        """Decoder layer `index` (a subclass builds its own kinds: worker/models/hybrid.py)."""
        if self.config.model_type in GEMMA_MODEL_TYPES:
            return SandwichDecoderLayer(self.config, self.parallel, layer_type)
        return DecoderLayer(self.config, self.parallel, layer_type, self._feed_forward(index, expert_parallel))

    def _feed_forward(self, index: int, expert_parallel: bool) -> nn.Module | None:
        """Layer `index`'s feed-forward block where it is not the config's MLP: a mixture of experts, or a MoE model's
        dense layer (its own columns)."""
        if self.moe is None:
            return None
        if self.moe.is_moe_layer(index):
            return SparseMoeBlock(self.config, self.parallel, self.moe, expert_parallel)
        return MLP(self.config, self.parallel, intermediate_size=self.moe.dense_intermediate)

    def _keep_experts_on_kernels(self) -> None:
        for block in self.moe_blocks().values():
            block.keep_experts_on_kernels()

    def moe_blocks(self) -> dict[int, SparseMoeBlock]:
        """This rank's mixture-of-experts blocks by layer index."""
        return {i: self.layers[i].mlp for i in self.stage_layers if isinstance(self.layers[i].mlp, SparseMoeBlock)}

    @property
    def num_layers(self) -> int:
        """Layers this rank runs (and holds KV for)."""
        return len(self.stage_layers)

    @property
    def kv_shape(self) -> tuple[int, int]:
        attn = self.layers[self.stage_layers.start].self_attn
        return attn.num_kv_heads, attn.head_dim

    def forward(self, input_ids, positions, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], md,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None):
        """The last stage returns the final hidden states; the others (hidden states, residual) for the next stage,
        which passes them back in as `intermediate`."""
        if intermediate is None:
            x, residual = self.embed_tokens(input_ids), None
            if self.embedding_scale is not None:
                x = x * torch.tensor(self.embedding_scale, dtype=x.dtype)
        else:
            x, residual = intermediate
        rope = {kind: rotary.tables(positions) for kind, rotary in self.rotary.items()}
        if self.program is not None and self.program.takes(x.shape[0], md):
            x, residual = self.program.run(x, residual, list(rope.values()), md)
            return (x, residual) if self.norm is None else self.norm(x, residual)[0]
        groups = getattr(md, "groups", None)  # per KV-cache group, where sliding layers have tables of their own
        for index, kv_cache in zip(self.stage_layers, kv_caches, strict=True):
            layer = self.layers[index]
            layer_md = groups[self.kv_layer_groups[index]] if groups else md
            x, residual = layer(rope[layer.self_attn.layer_type], x, residual, kv_cache, layer_md)
        if self.norm is None:
            return x, x if residual is None else residual
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            logits = blas_matmul(hidden, self.embed_tokens.weight).float()
        else:
            logits = self.lm_head(hidden).float()
        if self.final_logit_softcap:  # Gemma 2: cap * tanh(logits / cap), a bound that keeps the order
            logits = torch.tanh(logits / self.final_logit_softcap) * self.final_logit_softcap
        if self.parallel.tp_size == 1:
            return logits
        return self.parallel.all_gather_last_dim(logits)[:, : self.vocab_size]

    def use_layer_program(self, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Run the decoder layers of the batches it takes as one C++ program (worker/layer_program.py) over these
        KV caches; raises ProgramRefused, naming why, where this model's layers are not what the program runs."""
        self.program = None
        parallel = self.parallel
        # A pipeline stage runs its own layers (hidden states and residual in from the stage before, out to the next);
        # tensor-parallel layers would need all-reduces inside the program.
        if parallel.tp_size != 1:
            raise ProgramRefused("tensor parallel ranks")
        layers = [self.layers[i] for i in self.stage_layers]
        first = layers[0]
        if first.input_layernorm.fused is None:
            raise ProgramRefused("no fused ops (--fused-ops none, or not float32 on CPU)")
        attn = first.self_attn
        if attn.clip_qkv is not None:
            raise ProgramRefused("clipped q/k/v")
        if attn.sinks is not None:
            raise ProgramRefused("attention sinks")
        dense = [layer.mlp for layer in layers if not isinstance(layer.mlp, SparseMoeBlock)]
        activation = dense[0].activation if dense else "silu"
        if activation not in ("silu", "gelu_pytorch_tanh"):
            raise ProgramRefused(f"activation {activation}")
        sandwich = isinstance(first, SandwichDecoderLayer)
        program = new_program(attn.num_heads, attn.num_kv_heads, attn.head_dim, dense[0].intermediate if dense else 0,
                              first.input_layernorm.eps, sandwich, activation == "gelu_pytorch_tanh")
        kinds = list(self.rotary)
        limits = []
        for index, layer, (k_cache, v_cache) in zip(self.stage_layers, layers, kv_caches, strict=True):
            attn = layer.self_attn
            norms = [layer.input_layernorm, layer.post_attention_layernorm]
            if sandwich:
                norms += [layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm]
            qk_norms = (attn.q_norm.weight, attn.k_norm.weight) if attn.q_norm is not None else (None, None)
            program.add_layer([n.weight for n in norms], *qk_norms, kinds.index(attn.layer_type), attn.full_rotary,
                              self.kv_layer_groups[index], attn.attn.scale, attn.attn.window, attn.attn.softcap,
                              k_cache, v_cache)
            if attn.full_qk_norm:
                program.set_full_qk_norm()
            linears = [("qkv", attn.qkv_proj), ("o", attn.o_proj)]
            if isinstance(layer.mlp, SparseMoeBlock):
                block = layer.mlp.program_block()
                if block is None:
                    raise ProgramRefused(f"layer {index}'s experts are not all on the kernels")
                program.set_moe(block)
            else:
                linears += [("gate_up", layer.mlp.gate_up_proj), ("down", layer.mlp.down_proj)]
            for slot, linear in linears:
                plan = getattr(linear, "program_plan", lambda: None)()
                limits.append(add_linear(program, slot, plan, f"layer {index}'s {slot}"))
        self.program = LayerProgram(
            program, first.self_attn.num_kv_heads, max(self.kv_layer_groups) + 1,
            max_rows=min(rows for rows, _ in limits), prompt_rows_apart=any(apart for _, apart in limits),
        )

    def use_fused_ops(self, ops) -> None:
        """Run RMSNorm + residual, SiLU-and-multiply and RoPE through `ops` (torch.ops.lmserve: kernels/fused_ops.cpp)
        instead of several PyTorch ops each. Float32 on CPU only."""
        for module in self.modules():
            if isinstance(module, RMSNorm | MLP | Attention):
                module.fused = ops

    def quantize(self, method: str, output_layer: bool = True) -> None:
        """Every linear layer to `method` (weights/block_linear.py); the output layer too unless output_layer is False.
        A tied embedding keeps its float table for lookups and gets a quantized copy as the output layer, in
        OUTPUT_LAYER_METHOD's format where the method names one."""
        quantize_linears(self.layers, method)
        self._keep_experts_on_kernels()
        if output_layer and self.parallel.layout.is_last_stage:
            head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
            self.lm_head = LAYER_TYPES[OUTPUT_LAYER_METHOD.get(method, method)](head, None)

    def pend_block_layers(
        self, method: str, stored_types: Mapping[str, str] | None = None, formats: Sequence[str] = KERNEL_FORMATS,
        activations: str = "float32",
    ) -> None:
        """What quantize(method) makes of a loaded model, decided before loading (on the meta device): every linear
        layer, and on the last stage the output layer (in OUTPUT_LAYER_METHOD's format; a tied embedding's rows feed
        it too), becomes a PendingBlockLinear, which load_weights fills from the checkpoint and turns into the block
        layer. A file's blocks in the layer's format go straight into it: no float32 copy of those weights is made.

        stored_types (a GGUF's matrices' types by Hugging Face name, loader.stored_matrix_types): each layer instead
        takes the kernel format that holds all of its stored rows exactly (stored_formats.exact_kernel_format), and
        a layer with none stays a float layer (quantize_float_layers); `formats` are those that run here. A fused
        layer whose parts are stored in types that share no format, but each has one (Q4_K q and k, Q6_K v), is run
        as segments of rows in their own formats (worker/weights/row_segments.py)."""
        def stored_format(sources: list[str]) -> str | None:
            assert stored_types is not None
            return exact_kernel_format((stored_types.get(name, "float") for name in sources), formats)

        if stored_types is not None:
            self._pend_mixed_fused_layers(stored_format, activations)

        def layer_format(name: str) -> str | None:  # name under self.layers: "3.self_attn.qkv_proj"
            if stored_types is None:
                return method
            index, *path = name.split(".")
            parts = self._SOURCES.get(path[-1], (path[-1],))
            return stored_format([f"model.layers.{index}.{'.'.join([*path[:-1], p])}.weight" for p in parts])

        unfit: list[tuple[str, str, int, int]] = []
        pend_block_linears(self.layers, layer_format, activations=activations, unfit=unfit)
        if unfit:
            logger.warning("%s", unfit_layers_message(unfit, self.parallel.tp_size))
        if self.parallel.layout.is_last_stage:
            rows = -(-self.vocab_size // self.parallel.tp_size)
            if stored_types is None:
                output_format = OUTPUT_LAYER_METHOD.get(method, method)
            else:
                output_format = stored_format(
                    ["model.embed_tokens.weight" if self.tie_word_embeddings else "lm_head.weight"])
            if output_format is not None and layer_fits(output_format, rows, self.config.hidden_size):
                self.lm_head = PendingBlockLinear(output_format, self.config.hidden_size, rows, False, activations)
        # The embedding's lookups read the file's blocks (weights/block_embedding.py) unless the output layer needs
        # its float table (tied, and no block layer of its own).
        embedding_type = stored_types and stored_types.get("model.embed_tokens.weight")
        tied_to_floats = self.tie_word_embeddings and not isinstance(self.lm_head, PendingBlockLinear)
        if embedding_type in STORED_BLOCK_TYPES and self.embed_tokens is not None and not tied_to_floats:
            self.embed_tokens = BlockEmbedding(self.vocab_size, self.config.hidden_size, self.parallel, embedding_type)

    def _pend_mixed_fused_layers(self, stored_format: Callable[[list[str]], str | None], activations: str) -> None:
        """Fused q/k/v and gate/up layers whose parts each have a kernel format, but not one for all of them:
        PendingSegmentsLinear, a format a part."""
        for index in self.stage_layers:
            layer = self.layers[index]
            for owner, name in ((layer.self_attn, "qkv_proj"), (layer.mlp, "gate_up_proj")):
                fused = getattr(owner, name, None)  # none on a mixture of experts
                prefix = f"model.layers.{index}.{'self_attn' if owner is layer.self_attn else 'mlp'}"
                sources = [f"{prefix}.{part}.weight" for part in self._SOURCES[name]]
                if not isinstance(fused, nn.Linear) or stored_format(sources) is not None:
                    continue
                parts = [stored_format([source]) for source in sources]
                sizes = [self._shard_rows(name, shard, owner)[1] for shard in range(len(sources))]
                if all(f is not None and layer_fits(f, rows, fused.in_features) for f, rows in zip(parts, sizes,
                                                                                                  strict=True)):
                    segments = list(zip(sizes, parts, strict=True))
                    setattr(owner, name, PendingSegmentsLinear(fused.in_features, segments, fused.bias is not None,
                                                               activations))

    def pend_float16_layers(self, embedding_dtype: torch.dtype | None = None) -> None:
        """What quantize("fp16") makes of a loaded model, decided before loading (on the meta device, after the cast
        to the model's dtype): every linear layer still float, and on the last stage the output layer unless it is
        pending in a block format, becomes a PendingFloat16Linear (worker/weights/float16.py), which load_weights
        fills as the checkpoint's tensors arrive: the float32 weights of those layers never exist. A tied
        embedding's rows feed the output layer too. embedding_dtype: the table's dtype when not the model's (a
        16-bit checkpoint's own, VocabParallelEmbedding.keep_table_in)."""
        pend_float16_linears(self.layers)
        if self.parallel.layout.is_last_stage and not isinstance(self.lm_head, PendingLayer):
            rows = -(-self.vocab_size // self.parallel.tp_size)
            self.lm_head = PendingFloat16Linear(self.config.hidden_size, rows, False)
        if embedding_dtype is not None and isinstance(self.embed_tokens, VocabParallelEmbedding):
            self.embed_tokens.keep_table_in(embedding_dtype)

    def quantize_float_layers(self, method: str) -> int:
        """The layers pend_block_layers left in float (their stored type has no exact kernel format) to `method`
        (fp16), the output layer too; returns how many were replaced."""
        count = quantize_linears(self.layers, method)
        self._keep_experts_on_kernels()
        if not self.parallel.layout.is_last_stage:
            return count
        if self.lm_head is None:
            self.lm_head = LAYER_TYPES[method](self.embed_tokens.weight, None)
        elif isinstance(self.lm_head, nn.Linear):
            self.lm_head = LAYER_TYPES[method](self.lm_head.weight, None)
        else:
            return count
        return count + 1

    # Hugging Face names → our fused parameters: (our name, shard index in the fused tensor)
    _FUSED: ClassVar[dict[str, tuple[str, int]]] = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    # Our fused layers' Hugging Face sources, in row order.
    _SOURCES: ClassVar[dict[str, tuple[str, ...]]] = {
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "gate_up_proj": ("gate_proj", "up_proj"),
    }

    # Split by input columns across tensor ranks (their outputs are summed by an all-reduce).
    _ROW_PARALLEL: ClassVar[tuple[str, ...]] = ("o_proj", "down_proj")
    _VOCAB_PARALLEL: ClassVar[tuple[str, ...]] = ("embed_tokens.weight", "lm_head.weight")

    def wants(self, hf_name: str) -> bool:
        """Whether this rank loads a checkpoint weight (the loader skips the others unread)."""
        return not self._is_other_ranks(self._our_name(hf_name))

    # Mixtral's checkpoints name the experts' block and weights their own way: w1 is the gate, w3 up, w2 down.
    _MIXTRAL_NAMES: ClassVar[tuple[tuple[str, str], ...]] = (
        ("block_sparse_moe.", "mlp."), (".w1.", ".gate_proj."), (".w3.", ".up_proj."), (".w2.", ".down_proj."))

    def _our_name(self, hf_name: str) -> str:
        """A checkpoint weight's name under this module ("layers.3.mlp.experts.5.gate_proj.weight")."""
        name = hf_name.removeprefix("model.")
        if "block_sparse_moe." in name:
            for theirs, ours in self._MIXTRAL_NAMES:
                name = name.replace(theirs, ours)
        return name

    def _owner(self, parts: list[str]) -> nn.Module:
        """The module that holds a layer's weight ["layers", index, ..., linear, "weight"]: its attention, MLP or
        expert."""
        return self.layers[int(parts[1])].get_submodule(".".join(parts[2:-2]))

    def _whole_on_rank(self, parts: list[str]) -> bool:
        """Whether a layer weight is held whole by the rank that holds it (an expert under expert parallel)."""
        if "experts" not in parts:
            return False
        return bool(self.layers[int(parts[1])].mlp.expert_parallel)

    def _is_other_ranks(self, name: str) -> bool:
        """Whether a checkpoint weight belongs to another pipeline stage or expert-parallel rank (or, tied, is not
        needed at all)."""
        parts = name.split(".")
        if parts[0] == "layers":
            if int(parts[1]) not in self.stage_layers:
                return True
            # (a checkpoint that stacks its experts, gpt-oss's, names none: weights/gpt_oss.py splits them)
            expert = parts[parts.index("experts") + 1] if "experts" in parts[:-1] else ""
            return expert.isdigit() and not self.layers[int(parts[1])].mlp.is_local(int(expert))
        if name == "embed_tokens.weight":
            return self.embed_tokens is None
        if name == "lm_head.weight":
            return self.tie_word_embeddings or self.lm_head is None
        if parts[0] == "norm":
            return self.norm is None
        return False

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | StoredBlocks]]) -> None:
        """Float tensors, or (from a GGUF file, weights/loader.py) StoredBlocks: a PendingBlockLinear takes those as
        they are, a float parameter gets them dequantized. Finishes the pending block layers."""
        params = dict(self.named_parameters())
        pending = {f"{name}.weight": module for name, module in self.named_modules()
                   if isinstance(module, PendingLayer | BlockEmbedding)
                   and ".segments." not in name}  # a segment's rows come through its PendingSegmentsLinear
        loaded: set[str] = set()
        tp, tp_rank = self.parallel.tp_size, self.parallel.tp_rank
        for hf_name, tensor in weights:
            name = self._our_name(hf_name)
            if "rotary_emb.inv_freq" in name or self._is_other_ranks(name):
                continue
            parts = name.split(".")
            fused = self._FUSED.get(parts[-2]) if len(parts) >= 2 else None
            if fused is not None:
                parts[-2] = fused[0]
                target = ".".join(parts)
                offset, size = self._shard_rows(fused[0], fused[1], self._owner(parts))
                # The loader may have read this rank's rows only (checkpoint_part): then the tensor is its share.
                rows = (None if num_rows(tensor) == size
                        else self._rank_rows(fused, num_rows(tensor), self._whole_on_rank(parts)))
                shard = tensor if rows is None else select_rows(tensor, lambda t, rows=rows: t[rows[0] : rows[1]])
                if shard.shape[0] != size:
                    raise ValueError(f"{hf_name!r} has {shard.shape[0]} rows for this rank, expected {size}")
                if target in pending:
                    pending[target].load_rows(offset, shard)
                else:
                    params[target].data[offset : offset + size].copy_(as_floats(shard))
            else:
                target = name
                if target not in params and target not in pending:
                    raise ValueError(f"unexpected weight {hf_name!r} in checkpoint")
                if name in self._VOCAB_PARALLEL:
                    tensor = select_rows(tensor, lambda t: vocab_rows(t, self.parallel, self.vocab_size))
                elif (len(parts) >= 2 and parts[-2] in self._ROW_PARALLEL and parts[-1] == "weight"
                      and tensor.shape[1] != self._rank_columns(parts)):  # not already this rank's columns
                    tensor = column_shard(tensor, tp, tp_rank)
                if target in pending:
                    pending[target].load_rows(0, tensor)
                else:  # (a GGUF stores the shared expert's [1, hidden] gate as [hidden])
                    params[target].data.copy_(as_floats(tensor).reshape(params[target].shape))
                if name == "embed_tokens.weight" and self.tie_word_embeddings and "lm_head.weight" in pending:
                    pending["lm_head.weight"].load_rows(0, tensor)  # the tied output layer's own blocks
                    loaded.add("lm_head.weight")
            loaded.add(target)
        missing = (set(params) | set(pending)) - loaded
        if missing:
            raise ValueError(f"checkpoint is missing weights: {sorted(missing)[:5]}")
        finish_block_linears(self)
        self._keep_experts_on_kernels()
        tied_blocks = self.tie_word_embeddings and isinstance(self.embed_tokens, BlockEmbedding)
        # The tied blocks held once where the layouts allow; elsewhere the table's pages that the output layer's
        # packing read go back to the file.
        if tied_blocks and self.lm_head is not None and not self.embed_tokens.share_rows_of(self.lm_head):
            self.embed_tokens.release_file_pages()

    def checkpoint_part(self, hf_name: str, shape: tuple[int, ...]) -> TensorPart | FusedRowsPart | None:
        """The rows or columns of a checkpoint tensor that this tensor rank keeps (None: all of it, or not split here),
        so that the loader reads and converts only those (weights/loader.py): q, k, v, gate and up by rows (weights
        and biases; stored fused, as Phi-3's, this rank's rows of each part), o_proj and down_proj by columns, the
        vocabulary by rows, as load_weights splits them."""
        tp, rank = self.parallel.tp_size, self.parallel.tp_rank
        name = self._our_name(hf_name)
        parts = name.split(".")
        if tp == 1 or not shape or self._is_other_ranks(name):
            return None
        if parts[0] == "layers" and self._whole_on_rank(parts):
            return None
        if len(parts) >= 2 and parts[-2] in self._FUSED:
            rows = self._rank_rows(self._FUSED[parts[-2]], shape[0])
            return TensorPart(0, *rows) if rows is not None else None
        if len(parts) >= 2 and parts[-2] in self._SOURCES:  # stored fused (Phi-3): this rank's rows of each part
            return self._fused_rows_part(hf_name, shape[0])
        if name in self._VOCAB_PARALLEL and shape[0] == self.vocab_size:
            per_rank = -(-self.vocab_size // tp)
            return TensorPart(0, min(rank * per_rank, shape[0]), min((rank + 1) * per_rank, shape[0]))
        if (len(parts) >= 2 and parts[-2] in self._ROW_PARALLEL and parts[-1] == "weight" and len(shape) == 2
                and shape[1] == self._rank_columns(parts) * tp):
            columns = shape[1] // tp
            return TensorPart(1, rank * columns, (rank + 1) * columns)
        return None

    def _fused_rows_part(self, hf_name: str, total_rows: int) -> FusedRowsPart | None:
        """This rank's rows of each weight a fused checkpoint tensor holds; None (read whole, split after) where a
        part's rows do not split evenly or the rows are not the config's."""
        names = fused_parts(hf_name)
        sizes = fused_sizes(len(names), total_rows, self.config)
        if sum(sizes) != total_rows:
            return None
        pieces, offset = [], 0
        for name, size in zip(names, sizes, strict=True):
            rows = self._rank_rows(self._FUSED[name.split(".")[-2]], size)
            if rows is None:
                return None
            pieces.append((name, offset + rows[0], offset + rows[1]))
            offset += size
        return FusedRowsPart(tuple(pieces))

    def _rank_rows(self, fused: tuple[str, int], total_rows: int, whole: bool = False) -> tuple[int, int] | None:
        """This tensor rank's rows (first, end) of a checkpoint's q, k, v, gate or up of total_rows; None when they
        do not split evenly. K and v split by KV heads, which ranks share when they outnumber them. whole: the
        weight is not split (an expert under expert parallel)."""
        tp, rank = self.parallel.tp_size, self.parallel.tp_rank
        if whole:
            return 0, total_rows
        parts, index = tp, rank
        if fused[0] == "qkv_proj" and fused[1] > 0:
            replicas = kv_head_replicas(self.config, tp)
            parts, index = tp // replicas, rank // replicas
        if total_rows % parts:
            return None
        rows = total_rows // parts
        return index * rows, (index + 1) * rows

    def _rank_columns(self, parts: list[str]) -> int:
        """This rank's input columns of a row-parallel weight (["layers", index, ..., "o_proj" | "down_proj", ...])."""
        owner = self._owner(parts)
        return owner.q_size if parts[-2] == "o_proj" else owner.intermediate

    def _shard_rows(self, fused_name: str, shard: int, owner: nn.Module) -> tuple[int, int]:
        """Where this tensor rank's rows of q, k, v, gate or up go in the fused matrix of `owner` (an attention, MLP
        or expert): (first row, rows)."""
        if fused_name == "qkv_proj":
            sizes = [owner.q_size, owner.kv_size, owner.kv_size]
        else:
            sizes = [owner.intermediate] * 2
        return sum(sizes[:shard]), sizes[shard]


def decoder_linear_weights(config: PretrainedConfig) -> int:
    """The whole model's q, k, v, o, gate, up and down weights, from its config: the same answer on every rank and
    stage (a choice made from it, as block_activations' auto, must not differ between the ranks of one model)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    q_size = config.num_attention_heads * head_dim
    kv_size = (getattr(config, "num_key_value_heads", None) or config.num_attention_heads) * head_dim
    attention = config.hidden_size * (2 * q_size + 2 * kv_size)
    shape = moe_shape(config)
    if shape is None:
        return config.num_hidden_layers * (attention + 3 * config.hidden_size * config.intermediate_size)
    # A mixture of experts: the weights a token reads (its top-k experts and the shared one), which is what a
    # step's integer products scale with.
    total = 0
    for index in range(config.num_hidden_layers):
        if shape.is_moe_layer(index):
            mlp = shape.top_k * shape.expert_intermediate + shape.shared_intermediate
        else:
            mlp = shape.dense_intermediate
        total += attention + 3 * config.hidden_size * mlp
    return total
