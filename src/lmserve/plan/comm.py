"""Bytes one rank hands to collectives and sends per token under tensor and pipeline parallelism.

The planner's prediction of what the engine's torch.distributed calls move, for the engine to measure against.
"""

from __future__ import annotations

from dataclasses import dataclass

from lmserve.kv_sizing import blocks_needed
from lmserve.plan.model_spec import Layout, ModelSpec, bytes_of_dtype, layers_in_stage


@dataclass(frozen=True)
class CommPerToken:
    dtype: str  # the activations' dtype: float32 on CPU
    tp_all_reduce: list[int]  # per pipeline stage: bytes one TP rank of that stage all-reduces
    tp_all_gather: int  # bytes one TP rank of the last stage contributes to the logits' all-gather
    pp_send: int  # bytes one stage sends the next, per boundary
    pp_boundaries: int

    @property
    def per_rank_max(self) -> int:
        """The busiest rank's bytes: its collectives plus its send to the next stage."""
        last = len(self.tp_all_reduce) - 1
        return max(
            reduce + (self.tp_all_gather if stage == last else 0) + (self.pp_send if stage < last else 0)
            for stage, reduce in enumerate(self.tp_all_reduce)
        )


def comm_per_token(spec: ModelSpec, layout: Layout, dtype: str) -> CommPerToken:
    """Per generated token (one decode position of one sequence), the payload each call is given: the tensor's
    bytes, not the wire's (a ring all-reduce sends 2(tp-1)/tp of its payload per rank, an all-gather (tp-1)/tp of
    the gathered whole). h = hidden_size, V = vocab_size, b = bytes of `dtype`, L_s = the layers of stage s.

    Tensor parallel (Megatron), one rank of stage s, nothing when tp = 1:
        all-reduce  (2 L_s + [s = 0]) h b   two per layer (after o_proj, after down_proj), and on the first stage
                                            one after the vocab-parallel embedding
        all-gather  ceil(V / tp) b          on the last stage, this rank's slice of the output layer's logits
    Pipeline parallel, per boundary between consecutive stages (pp - 1 of them), nothing when pp = 1:
        send        2 h b                   the hidden states and the residual

    A prefill position costs the same all-reduces and sends; only sampled positions gather logits.
    """
    b, h = bytes_of_dtype(dtype), spec.hidden_size
    tp, pp = layout.tp, layout.pp
    all_reduce = [
        (2 * layers_in_stage(spec.num_layers, pp, stage) + (stage == 0)) * h * b if tp > 1 else 0
        for stage in range(pp)
    ]
    all_gather = blocks_needed(spec.vocab_size, tp) * b if tp > 1 else 0
    return CommPerToken(dtype, all_reduce, all_gather, 2 * h * b if pp > 1 else 0, pp - 1)


def render_comm(comm: CommPerToken) -> list[str]:
    reduce = ", ".join(f"{n:,}" for n in comm.tp_all_reduce)
    return [
        f"comm per token       {comm.dtype} activations; payload bytes per rank (busiest rank {comm.per_rank_max:,})",
        f"  TP all-reduce      {reduce} (per stage: 2 per layer, + the embedding's on stage 0)",
        f"  TP all-gather      {comm.tp_all_gather:,} (this rank's logits, last stage)",
        f"  PP send            {comm.pp_send:,} per boundary × {comm.pp_boundaries} (hidden states + residual)",
    ]
