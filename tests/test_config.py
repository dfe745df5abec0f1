"""Each engine setting is declared once (lmserve/config.py); the flags and LLM's keywords come from it."""

from __future__ import annotations

import argparse

import pytest

from lmserve.config import (
    EngineConfig,
    add_engine_args,
    engine_kwargs,
    engine_settings,
    make_engine_config,
)


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return parser.parse_args(list(argv))


def test_defaults_of_flags_and_keywords_are_the_dataclasses_defaults() -> None:
    assert make_engine_config(**engine_kwargs(parse())) == EngineConfig()


def test_every_setting_is_a_flag_and_a_keyword() -> None:
    flags = {action.dest for action in argparse.ArgumentParser()._actions}
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    flags = {action.dest for action in parser._actions} - flags
    for _, flat, field, _ in engine_settings():
        assert flat in flags or not field.metadata["flag"], flat
        assert field.metadata["help"], f"{flat} has no help"


def test_flags_reach_their_sections() -> None:
    config = make_engine_config(**engine_kwargs(parse(
        "--max-num-seqs", "3", "--scheduling-policy", "priority", "--kv-cache-memory", "2MiB",
        "--no-enable-prefix-caching", "--engine-cpus", "0", "-q", "q8_0",
    )))
    assert config.scheduler.max_num_seqs == 3 and config.scheduler.policy == "priority"
    assert config.cache.kv_cache_memory == 2 << 20 and config.cache.enable_prefix_caching is False
    assert config.placement.engine_cpus == [0] and config.model.quantization == "q8_0"


def test_keywords_without_flags_and_unknown_keywords() -> None:
    assert make_engine_config(num_blocks=7).cache.num_blocks == 7
    with pytest.raises(TypeError, match="max_num_seq.*known: .*max_num_seqs"):
        make_engine_config(max_num_seq=3)


def test_serve_takes_the_model_as_its_first_argument_as_vllm_serve() -> None:
    from lmserve.cli import build_parser

    parser = build_parser()
    assert engine_kwargs(parser.parse_args(["serve", "/models/x.gguf", "--port", "9"]))["model"] == "/models/x.gguf"
    assert engine_kwargs(parser.parse_args(["serve", "--model", "/models/y"]))["model"] == "/models/y"
    assert engine_kwargs(parser.parse_args(["serve"]))["model"] == EngineConfig().model.model
