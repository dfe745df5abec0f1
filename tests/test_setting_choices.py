"""Each setting's choices are declared twice: in config.py, for the command line (config imports no room), and in the
room that acts on them. Nothing else ties the two, so a choice added to one only (a kernel path the CLI refuses, or a
flag the code then rejects at start-up) is caught here."""

from __future__ import annotations

import dataclasses

import pytest

from lmserve.config import CacheConfig, ModelConfig
from lmserve.worker import attention, kernels
from lmserve.worker.weights import kernel_choice


def cli_choices(config: type, name: str) -> tuple[str, ...]:
    (found,) = [f for f in dataclasses.fields(config) if f.name == name]
    return found.metadata["choices"]


@pytest.mark.parametrize(("config", "name", "accepted"), [
    (ModelConfig, "quantization", kernel_choice.QUANTIZATION_METHODS),
    (ModelConfig, "batched_weights", kernel_choice.BATCHED_WEIGHTS),
    (ModelConfig, "block_activations", kernel_choice.BLOCK_ACTIVATIONS),
    (ModelConfig, "attention_backend", attention.ATTENTION_BACKENDS),
    (ModelConfig, "fused_ops", kernels.FUSED_OPS),
    (CacheConfig, "kv_cache_dtype", ("auto", *attention.KV_CACHE_DTYPES, *attention.FP8_KV_CACHE_DTYPES)),
], ids=lambda value: value if isinstance(value, str) else "")  # fmt: skip
def test_the_command_lines_choices_are_what_the_code_accepts(config: type, name: str, accepted: tuple[str, ...]) -> None:
    assert set(cli_choices(config, name)) == set(accepted)


def test_every_batched_weights_choice_is_one_the_dispatch_knows() -> None:
    """Each choice either resolves to a path or is refused with a reason naming what the CPU lacks, never as unknown."""
    for choice in cli_choices(ModelConfig, "batched_weights"):
        try:
            kernel_choice.batched_path(choice)
        except ValueError as exc:
            assert "unknown" not in str(exc), choice
    with pytest.raises(ValueError, match="unknown batched weights"):
        kernel_choice.batched_path("prompt-int4")
