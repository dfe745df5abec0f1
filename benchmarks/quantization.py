"""`--quantization` against the float32 model: accuracy first, then speed.

Settings: float32 (`--quantization none`), fp16 (float16 weights), q8_0 and q4_1 (llama.cpp's blocks through
lmserve's kernels; q4_1 is the default model's own format, so `auto` picks it), and int8: dynamic W8A8 through fbgemm
(per-channel int8 weights, activations quantized per call), which lmserve does not offer because of what this
script measures; its layer is defined here so the measurement can be repeated. The block formats hand batches
above BLOCK_KERNEL_MAX_ROWS rows (every scored window here) to a float16 copy of their weights (fbgemm, float32
activations); "q4_1 bf16 batches" hands them to a bfloat16 copy instead (oneDNN, activations rounded to bfloat16,
`--batched-weights bf16`), "q4_1 kernel" scores with the block kernel at every batch size, and "q4_1
prompt-bf16" (the default where the CPU has AMX) scores on the AMX kernel's bfloat16 copy.

Accuracy (llama.cpp's `llama-perplexity --kl-divergence` measures the same things): the shipped prose
(lmserve/bench/data/passages.txt) is scored in windows by both models through lmserve's own forward pass; reported are
perplexity, the mean KL divergence of the int8 next-token distribution from the float32 one, the share of positions
where both pick the same top token, and how many of a few chat prompts give the same greedy answer.

Speed: the offline engine, 64 prompts of 256 random tokens with 128 output tokens each, and one stream
(128-token prompt, 256 output tokens), for each setting in one run.

    .venv/bin/python benchmarks/quantization.py [--skip-speed] [--skip-accuracy] [--skip-engine]
        [--settings q4_1 "q4_1 prompt-bf16"]   (accuracy of some settings only)
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
import warnings
from importlib import resources

import torch
from timing import median_ms
from torch import nn

from lmserve import LLM, SamplingParams
from lmserve.config import CacheConfig, ModelConfig
from lmserve.sampling_params import SamplingParams as Params
from lmserve.step import ScheduledRequest
from lmserve.worker.kernels import cpu_kernels
from lmserve.worker.model_runner import ModelRunner
from lmserve.worker.prompt_rows import prompt_rows
from lmserve.worker.weights.batched_copies import Float16WeightLinear
from lmserve.worker.weights.block_linear import use_batched_path
from lmserve.worker.weights.block_packing import pack_q4_1, pack_q8_0
from lmserve.worker.weights.kernel_choice import BLOCK_KERNEL_MAX_ROWS, BatchedPath
from lmserve.worker.weights.layer_types import LAYER_TYPES

SETTINGS = {
    "float32": {"quantization": "none"},
    "fp16": {"quantization": "fp16"},
    "q8_0": {"quantization": "q8_0"},
    "q4_1": {"quantization": "q4_1", "batched": BatchedPath("fp16", BLOCK_KERNEL_MAX_ROWS)},
    "q4_1 bf16 batches": {"quantization": "q4_1", "batched": BatchedPath("bf16", BLOCK_KERNEL_MAX_ROWS)},
    "q4_1 kernel": {"quantization": "q4_1", "batched": BatchedPath("fp16", 1 << 30)},
    # The block kernels at every batch size with 16-bit integer activations (--block-activations int16).
    "q4_1 int16 kernel": {"quantization": "q4_1", "batched": BatchedPath("fp16", 1 << 30), "block_activations": "int16"},
    # The default where the CPU has AMX: prompt rows on the AMX kernel's bfloat16 copy (every scored row here).
    "q4_1 prompt-bf16": {"quantization": "q4_1", "batched_weights": "prompt-bf16"},
    "int8": {"quantization": "int8"},
}
# int8 is not an engine option; "q4_1 kernel" and "q4_1 bf16 batches" are q4_1 with another path for large batches.
ENGINE_SETTINGS = ("float32", "fp16", "q8_0", "q4_1")


class DynamicInt8Linear(nn.Module):
    """fbgemm W8A8: symmetric per-channel int8 weights; each call quantizes its input with one scale for all rows."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        weight = weight.detach().float()
        scales = (weight.abs().amax(dim=1) / 127.0).clamp(min=1e-8).double()
        zero_points = torch.zeros(weight.shape[0], dtype=torch.long)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # quantized tensors are deprecated upstream
            qweight = torch.quantize_per_channel(weight, scales, zero_points, 0, torch.qint8)
        self.packed = torch.ops.quantized.linear_prepack(qweight, None if bias is None else bias.detach().float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # reduce_range=True: 7-bit activations, so AVX2's 16-bit pairwise sums cannot saturate.
        return torch.ops.quantized.linear_dynamic(x.contiguous(), self.packed, True)


def make_runner(kwargs: dict) -> ModelRunner:
    method = kwargs["quantization"]
    runner = ModelRunner(
        ModelConfig(dtype="float32", quantization="none" if method == "int8" else method,
                    batched_weights=kwargs.get("batched_weights", "fp16"),
                    block_activations=kwargs.get("block_activations", "float32")),
        CacheConfig(num_blocks=64),
    )
    if method == "int8":
        LAYER_TYPES["int8"] = DynamicInt8Linear
        runner.model.quantize("int8")
    if "batched" in kwargs:
        use_batched_path(runner.model, kwargs["batched"])
    return runner
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three uses of copper.",
    "How do I reverse a list in Python?",
    "Why is the sky blue?",
    "Give me a short tip for sleeping better.",
    "What is 12 times 7?",
]


def window_logprobs(runner: ModelRunner, tokens: list[int]) -> torch.Tensor:
    """log-softmax of the next-token distribution at every position of one prefill."""
    blocks = list(range(-(-len(tokens) // runner.block_size)))
    request = ScheduledRequest(
        request_id="score", token_ids=tokens, start_position=0, block_ids=blocks, samples=True,
        sampling_params=Params(max_tokens=1), prompt_token_ids=tokens, output_token_ids=[],
    )
    batch = runner.prepare_inputs([request])
    with torch.inference_mode(), prompt_rows(batch.prompt_rows):
        hidden = runner.model(batch.input_ids, batch.positions, runner.kv_caches, batch.attn)
        return torch.log_softmax(runner.model.compute_logits(hidden), dim=-1)


def greedy(runner: ModelRunner, prompt: list[int], eos: int, max_tokens: int = 64) -> list[int]:
    """Greedy answer, recomputing the whole sequence each token: slow, but the same path for every setting."""
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(int(window_logprobs(runner, tokens)[-1].argmax()))
        if tokens[-1] == eos:
            break
    return tokens[len(prompt) :]


def passage_windows(processor, window: int) -> list[list[int]]:
    """The shipped prose's tokens (lmserve/bench/data/passages.txt) in consecutive windows of `window` tokens."""
    text = resources.files("lmserve.bench").joinpath("data/passages.txt").read_text()
    ids = processor.tokenize(text, add_special_tokens=False).token_ids
    return [ids[i : i + window] for i in range(0, len(ids) - window + 1, window)]


def accuracy(window: int, settings: list[str]) -> dict:
    llm = LLM(enable_prefix_caching=False, num_blocks=64)
    processor = llm.input_processor
    windows = passage_windows(processor, window)
    chats = [
        processor.tokenize(processor.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False)
        .token_ids
        for p in CHAT_PROMPTS
    ]
    eos = processor.tokenizer.eos_token_id
    del llm
    logprobs, answers = {}, {}
    for name, kwargs in SETTINGS.items():
        if name != "float32" and name not in settings:
            continue
        runner = make_runner(kwargs)
        logprobs[name] = [window_logprobs(runner, w) for w in windows]
        answers[name] = [greedy(runner, chat, eos) for chat in chats]
    report = {"positions": sum(len(w) - 1 for w in windows)}
    for name, lps in logprobs.items():
        report[name] = scores_against(windows, lps, logprobs["float32"]) | {
            "greedy_same": sum(a == b for a, b in zip(answers[name], answers["float32"], strict=True)),
        }
    return report


def scores_against(windows: list[list[int]], logprobs: list[torch.Tensor], base: list[torch.Tensor]) -> dict:
    """Perplexity of `logprobs` on the windows' next tokens, their mean KL divergence from `base`'s distributions,
    and the share of positions where both pick the same top token."""
    nll, kl, same, count = 0.0, 0.0, 0, 0
    for w, lp, ref in zip(windows, logprobs, base, strict=True):
        targets = torch.tensor(w[1:])
        nll -= lp[:-1].gather(1, targets[:, None]).sum().item()
        kl += (ref[:-1].exp() * (ref[:-1] - lp[:-1])).sum().item()
        same += (lp[:-1].argmax(-1) == ref[:-1].argmax(-1)).sum().item()
        count += len(w) - 1
    return {"perplexity": math.exp(nll / count), "kl": kl / count, "top1_same": same / count}


def layer_speed(rows: int, layers: int = 30) -> dict[str, float]:
    """ms for one pass over `layers` layers of distinct weights (qkv, o, gate_up, down of the default model), so
    every weight comes from memory as in a real decode step, not from cache."""
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
    weights = [[torch.randn(n, k) * 0.05 for n, k in shapes] for _ in range(layers)]
    inputs = {k: torch.randn(rows, k) for k in (576, 1536)}

    def int8_weight_only(w: torch.Tensor):
        scale = (w.abs().amax(1) / 127).clamp(min=1e-8)
        q = torch.round(w / scale[:, None]).to(torch.int8)
        return lambda x: torch.ops.aten._weight_int8pack_mm(x.bfloat16(), q, scale.bfloat16()).float()

    def float32_openblas(w: torch.Tensor):
        wn = w.numpy()
        return lambda x: torch.from_numpy(x.numpy() @ wn.T)

    def block_kernel(pack, op):
        def make(w: torch.Tensor):
            blocks = pack(w)
            return lambda x: op(x, blocks, w.shape[0], None)

        return make

    ops = cpu_kernels()
    def fp16_widened_per_call(w: torch.Tensor):
        half = w.half()
        return lambda x: nn.functional.linear(x, half.float())

    kinds = {
        "float32 (OpenBLAS)": float32_openblas,
        "fp16 weights (fbgemm)": lambda w: Float16WeightLinear(w, None),
        "fp16 weights widened to float32 per call (MKL; the old path above 128 rows)": fp16_widened_per_call,
        "q8_0 blocks (lmserve kernel)": block_kernel(pack_q8_0, ops.q8_0_linear),
        "q4_1 blocks (lmserve kernel)": block_kernel(pack_q4_1, ops.q4_1_linear),
        "int8 W8A8 (fbgemm)": lambda w: DynamicInt8Linear(w, None),
        "int8 weight-only (_weight_int8pack_mm)": int8_weight_only,
    }
    result = {}
    for kind, make in kinds.items():
        fns = [[make(w) for w in layer] for layer in weights]

        def one_pass(fns=fns) -> None:
            for layer in fns:
                for (_, k), fn in zip(shapes, layer, strict=True):
                    fn(inputs[k])

        result[kind] = median_ms(one_pass, repeats=5)
    return result


def speed(kwargs: dict) -> dict:
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(1000, 49152, (64, 256), generator=g).tolist()
    llm = LLM(enable_prefix_caching=False, **kwargs)
    llm.generate(prompts[:4], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    started = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=128, temperature=0, ignore_eos=True))
    throughput = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - started)
    gaps, last = [], None
    for _ in llm.stream(prompts[0][:128], SamplingParams(max_tokens=256, temperature=0, ignore_eos=True)):
        now = time.perf_counter()
        if last is not None:
            gaps.append(now - last)
        last = now
    return {"throughput": throughput, "single": 1 / statistics.median(gaps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--skip-accuracy", action="store_true")
    parser.add_argument("--skip-engine", action="store_true", help="linear layers only, not the offline engine")
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS),
                        help="accuracy of these settings only (float32, the reference, always runs)")
    args = parser.parse_args()
    if not args.skip_accuracy:
        acc = accuracy(args.window, args.settings)
        print(f"Accuracy over {acc['positions']} positions of passages.txt ({args.window}-token windows)\n")
        print("| setting | perplexity | KL from float32 | same top token | same greedy answer (64 tokens) |")
        print("|---|---|---|---|---|")
        for name in SETTINGS:
            if name not in acc:
                continue
            r = acc[name]
            print(
                f"| {name} | {r['perplexity']:.3f} | {r['kl']:.5f} | {100 * r['top1_same']:.1f}% "
                f"| {r['greedy_same']}/{len(CHAT_PROMPTS)} |", flush=True,
            )
    if args.skip_speed:
        return
    torch.set_num_threads(os.cpu_count() or 1)
    speeds = {rows: layer_speed(rows) for rows in (1, 4, 8, 16, 64, 256, 1024)}
    print("\n| linear layers, 30 layers of distinct weights, ms | " + " | ".join(f"{r} rows" for r in speeds) + " |")
    print("|---" * (len(speeds) + 1) + "|")
    for kind in speeds[1]:
        print(f"| {kind} | " + " | ".join(f"{speeds[r][kind]:.1f}" for r in speeds) + " |", flush=True)
    if args.skip_engine:
        return
    print("\n| setting | 64×(256 in, 128 out) output tok/s | single stream decode tok/s (1 / median gap) |")
    print("|---|---|---|")
    for name in ENGINE_SETTINGS:
        r = speed(SETTINGS[name])
        print(f"| {name} | {r['throughput']:.1f} | {r['single']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
