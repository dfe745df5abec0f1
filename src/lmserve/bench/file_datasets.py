"""vLLM's file datasets, read from local files only: `sharegpt` (ShareGPT JSON) and `custom` (JSONL of prompts).

Both follow vllm/benchmarks/datasets (ShareGPTDataset, CustomDataset, is_valid_sequence, maybe_oversample_requests)
so that the same file, seed and tokenizer give both clients the same prompts in the same order:
- the entries are shuffled by Python's `random` seeded with --seed (unless --disable-shuffle), as vLLM's
  `random.seed(seed); random.shuffle(data)`;
- lengths are the tokenizer's with its special tokens (vLLM's `tokenizer(text).input_ids`);
- too few prompts are topped up with `random.choice` of the kept ones under the same seed (unless --no-oversample);
- the warm-ups repeat the first request, as vLLM's warm-up repeats its test prompt.
Without a tokenizer, lengths are the word estimate of dataset_types.py and the result says so.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from lmserve.bench.dataset_types import BenchRequest, Dataset, DatasetSpec, PromptTokens


def is_valid_sequence(prompt_len: int, output_len: int, min_len: int = 4, max_prompt_len: int = 1024,
                      max_total_len: int = 2048, skip_min_output_len_check: bool = False) -> bool:
    """vLLM's pruning: prompt of 4-1024 tokens, reply of at least 4 (unless its length is given), 2048 in all."""
    prompt_too_short = prompt_len < min_len
    output_too_short = (not skip_min_output_len_check) and output_len < min_len
    prompt_too_long = prompt_len > max_prompt_len
    combined_too_long = prompt_len + output_len > max_total_len
    return not (prompt_too_short or output_too_short or prompt_too_long or combined_too_long)


def _num_requests(spec: DatasetSpec) -> int:
    return 1000 if spec.num_prompts is None else spec.num_prompts  # vLLM's --num-prompts default


def _shuffled(data: list[Any], spec: DatasetSpec) -> list[Any]:
    if not spec.disable_shuffle:
        random.Random(spec.seed).shuffle(data)  # the same permutation as random.seed(seed); random.shuffle(data)
    return data


def _finish(requests: list[BenchRequest], spec: DatasetSpec, tokens: PromptTokens, what: str) -> Dataset:
    if not requests:
        raise ValueError(f"--dataset-path {spec.path}: no {what} left after vLLM's filters")
    wanted = _num_requests(spec)
    if not spec.no_oversample and len(requests) < wanted:
        rng = random.Random(spec.seed)
        requests = requests + [rng.choice(requests) for _ in range(wanted - len(requests))]
    return Dataset(requests, [requests[0]] * spec.num_warmups, input_lens_approximate=tokens.tokenizer is None)


def _load(path: str | None, what: str) -> str:
    if path is None:
        raise ValueError(f"--dataset-name {what} needs --dataset-path")
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"--dataset-path {path}: no such file")
    return file.read_text(encoding="utf-8")


# ------------------------------------------------------------------------------------------------ sharegpt


def read_sharegpt(path: str) -> list[dict[str, Any]]:
    """The entries with at least two turns, as vLLM keeps them; a file that is not ShareGPT's shape is an error."""
    try:
        data = json.loads(_load(path, "sharegpt"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"--dataset-path {path}: not valid JSON ({exc.msg}, line {exc.lineno})") from None
    if not isinstance(data, list):
        raise ValueError(f'--dataset-path {path}: expected a JSON list of {{"conversations": [...]}}')  # noqa: TRY004
    kept = []
    for i, entry in enumerate(data):
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        if not all(isinstance(t, dict) and isinstance(t.get("value"), str) for t in turns[:2]):
            raise ValueError(f'--dataset-path {path}: entry {i}: the first two turns need a string "value"')
        kept.append(entry)
    return kept


def sharegpt_dataset(spec: DatasetSpec, tokens: PromptTokens) -> Dataset:
    """The first turn of each conversation as the prompt; the second turn's length as max_tokens, unless
    --sharegpt-output-len gives one (vLLM takes turns 0 and 1 whoever speaks them)."""
    data = _shuffled(read_sharegpt(spec.path or ""), spec)
    wanted = _num_requests(spec)
    fixed = spec.sharegpt_output_len
    requests: list[BenchRequest] = []
    for entry in data:
        if len(requests) >= wanted:
            break
        prompt, completion = entry["conversations"][0]["value"], entry["conversations"][1]["value"]
        prompt_len = tokens.count(prompt, add_special_tokens=True)
        output_len = tokens.count(completion, add_special_tokens=True) if fixed is None else fixed
        if is_valid_sequence(prompt_len, output_len, skip_min_output_len_check=fixed is not None):
            requests.append(BenchRequest(prompt_len, output_len, prompt=prompt))
    return _finish(requests, spec, tokens, "conversation")


# -------------------------------------------------------------------------------------------------- custom


def read_custom(path: str) -> list[dict[str, Any]]:
    """vLLM's custom dataset: a .jsonl file, a "prompt" string on every line (blank lines skipped)."""
    if not path.endswith(".jsonl"):
        raise ValueError(f"--dataset-path {path}: the custom dataset reads .jsonl files only (as vLLM)")
    rows = []
    for lineno, line in enumerate(_load(path, "custom").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise ValueError(f'{path}:{lineno}: expected an object with a "prompt" string')  # noqa: TRY004 - exit 2
        rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no prompts")
    return rows


def custom_dataset(spec: DatasetSpec, tokens: PromptTokens) -> Dataset:
    """Each prompt through the model's chat template as one user turn (unless --skip-chat-template), sent as
    text with --custom-output-len as max_tokens. As in vLLM the template is applied whatever the backend: with
    openai-chat the server templates it again, so pass --skip-chat-template there."""
    rows = _shuffled(read_custom(spec.path or ""), spec)
    tok = tokens.tokenizer
    if not spec.skip_chat_template and (tok is None or not tok.chat_template):
        raise ValueError("--dataset-name custom applies the model's chat template: pass --tokenizer of a model "
                         "with one, or --skip-chat-template")
    requests = []
    for row in rows[:_num_requests(spec)]:
        prompt = row["prompt"]
        if not spec.skip_chat_template and tok is not None:
            prompt = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                             tokenize=False)
        requests.append(BenchRequest(tokens.count(prompt, add_special_tokens=True), spec.custom_output_len,
                                     prompt=prompt))
    return _finish(requests, spec, tokens, "prompt")
