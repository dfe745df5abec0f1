"""The front-end's check before an engine starts: can the model be split as -tp / -pp ask, and do the ranks fit?

Reads the model's config only (a GGUF header or config.json, no torch, no weights), so that a layout the engine
cannot run fails in about a second with its reason, instead of after every rank has imported torch and loaded its
weights. The rule is the planner's (plan.model_spec.check_layout) and so are the bytes (plan.fit): `lmserve plan` never
recommends what `lmserve serve` refuses.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from lmserve.config import EngineConfig, ModelConfig
from lmserve.formats.gguf_file import gguf_held_bits
from lmserve.models import read_config_dict, resolve_model
from lmserve.plan import model_spec
from lmserve.plan.fit import check_fits, engine_layout
from lmserve.plan.memory import gib
from lmserve.plan.model_spec import ModelSpec

logger = logging.getLogger(__name__)


def engine_model_spec(model_config: ModelConfig) -> ModelSpec:
    """The sizes of the model the engine will load (the same file, not a shipped look-alike). Under --quantization
    auto a GGUF's matrices are held at their stored size (or the kernel format they convert into), as `lmserve plan`
    counts them: an 8B Q4_K_M file takes ~5 GB, not the 32 GB of float32 weights it was checked as."""
    source = resolve_model(model_config.model)
    spec = ModelSpec.from_hf_dict(source.name, read_config_dict(source))
    # The blocks need float32 compute on CPU (worker/weights/kernel_choice.check_quantization); with bfloat16 or float16
    # the engine dequantizes them.
    keeps_blocks = (model_config.quantization or "auto") == "auto" and model_config.dtype in ("auto", "float32")
    if source.kind == "gguf" and keeps_blocks:
        spec = replace(spec, stored_bits=gguf_held_bits(source.path), gguf_path=str(source.path))
    return spec


def check_layout(config: EngineConfig) -> None:
    """Raises ValueError naming the reason when the engine could not run `config`'s layout: -tp must divide the
    attention heads, the KV heads and the MLP's intermediate size, -pp may not exceed the layers, and on CPU all
    -tp × -pp × -dp ranks (weights, per-rank KV cache, activations, runtime) must fit the memory available."""
    spec = engine_model_spec(config.model)
    layout = engine_layout(config)
    model_spec.check_layout(spec, layout)
    need = check_fits(spec, config)
    if need is not None:
        logger.info("layout -tp %d -pp %d -dp %d of %s: %s over %d rank(s), largest rank %s",
                    layout.tp, layout.pp, layout.replicas, spec.name, gib(need.total), need.num_ranks,
                    gib(need.largest.total))
