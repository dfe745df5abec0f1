"""Imported by the ranks' fork server (lmserve.executor.rank_starter) for a Hugging Face directory's ranks: transformers'
config classes of the architectures lmserve runs, which each rank reads its model's config.json with (their imports
take ~1 s: they pull in torch.distributed.tensor)."""

from __future__ import annotations

from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from lmserve.config import SUPPORTED_MODEL_TYPES

for _model_type in SUPPORTED_MODEL_TYPES:
    CONFIG_MAPPING[_model_type]
