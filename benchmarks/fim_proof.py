"""Fill-in-the-middle on a real code model: lmserve against llama.cpp's server on the same GGUF file (issue 74).

    ../shared/models/get_real_models.sh                          # once: the Qwen2.5-Coder-0.5B-Instruct file
    benchmarks/setup_peers.sh llama                              # once: llama-server (outside the repo)
    .venv/bin/python benchmarks/fim_proof.py ~/.cache/lmserve/real-models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf

A by-hand benchmark, not a test (CI has neither the file nor llama-server). One server at a time (as
benchmarks/gguf_peers.py starts them: lmserve with --max-model-len 4096, llama-server -t 2 -c 8192 --parallel 8
--kv-unified), each answering:
  parse:   CASES, short Python files with one function's body removed: the middle asked for at temperature 0,
           max 128 tokens, through lmserve's /v1/completions `suffix`, lmserve's /infill and llama.cpp's /infill;
           how many files prefix + middle + suffix pass ast.parse, as the middle comes and with n_indent (the
           body's indentation, as llama.vscode sends it) sent to the server, which cuts the middle; and whether
           that equals llama.cpp's rule applied here to the middle that came without it (indent_cut);
  same:    lmserve's /infill and `suffix` give the same text for every case (and how many agree with llama.cpp's);
  prompt:  the prompt each server builds, token ids: llama.cpp's /infill answers its prompt as text ("prompt") and
           its length ("tokens_evaluated"); that text through llama.cpp's own /tokenize (special tokens parsed) must
           give as many tokens, and is then its prompt's ids. lmserve's: its /v1/completions with `suffix` and
           prompt_logprobs=0 gives the id at every position but the first, and usage.prompt_tokens the length; the
           whole prompt is also rendered here by api/fim.py's fim_prompt with lmserve's tokenizer of the file (what
           the server calls). PROMPT_PROBES adds inputs beyond the cases: extra files, `prompt`, special-token text;
  editor:  EDITOR_STEPS streamed requests whose prefix grows by 3 to 5 characters each (the same suffix), as an
           editor sends one per keystroke: time to the first non-empty text, the first request (nothing cached but
           the server's warm-up on other text) against the median of the rest. lmserve twice: /infill, then
           /v1/completions `suffix` with a cache_salt (so the second pass starts uncached too); llama.cpp /infill
           (its prompt cache is on by default, as editors rely on).
Prints a JSON summary at the end (--json FILE writes it too). --parse-only: the parse part alone (no prompt
comparison, no editor workload); with --n-indent-only, only the /infill middles with n_indent (no uncut middles, no
`suffix`). --threads N: lmserve's --engine-threads and llama-server's -t (on a machine shared with other work, one
thread each spares them waiting for each other's threads at every barrier; the middles do not depend on it).
"""

from __future__ import annotations

import argparse
import ast
import functools
import json
import statistics
import textwrap
import time
from pathlib import Path
from typing import Any

import httpx
from gguf_peers import free_port, start, stop_server, wait_ready

MAX_TOKENS = 128
EDITOR_STEPS = 50
EDITOR_MAX_TOKENS = 8
EDITOR_FILES = 12  # the cases above the cursor: ~800 tokens of prefix

# (file, name of the function whose body is removed). Short, ordinary Python: the middle is what an editor's FIM
# completion is asked for when the cursor sits on the empty line under a `def`.
CASES: list[tuple[str, str]] = [
    ('''
import math


def circle_area(radius):
    return math.pi * radius ** 2


def is_prime(n):
    if n < 2:
        return False
    for d in range(2, int(math.sqrt(n)) + 1):
        if n % d == 0:
            return False
    return True


print(is_prime(7), circle_area(2.0))
''', "is_prime"),
    ('''
def fibonacci(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


def main():
    print([fibonacci(i) for i in range(10)])
''', "fibonacci"),
    ('''
def reverse_words(sentence):
    words = sentence.split()
    return " ".join(reversed(words))


if __name__ == "__main__":
    print(reverse_words("hello big world"))
''', "reverse_words"),
    ('''
from collections import Counter


def most_common_word(text):
    counts = Counter(text.lower().split())
    word, _ = counts.most_common(1)[0]
    return word


print(most_common_word("a b a c"))
''', "most_common_word"),
    ('''
class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from an empty stack")
        return self.items.pop()

    def __len__(self):
        return len(self.items)
''', "pop"),
    ('''
def binary_search(items, target):
    low, high = 0, len(items) - 1
    while low <= high:
        mid = (low + high) // 2
        if items[mid] == target:
            return mid
        if items[mid] < target:
            low = mid + 1
        else:
            high = mid - 1
    return -1


print(binary_search([1, 3, 5, 7], 5))
''', "binary_search"),
    ('''
def celsius_to_fahrenheit(celsius):
    return celsius * 9 / 5 + 32


def fahrenheit_to_celsius(fahrenheit):
    return (fahrenheit - 32) * 5 / 9


print(fahrenheit_to_celsius(212))
''', "fahrenheit_to_celsius"),
    ('''
import json


def load_config(path):
    with open(path) as f:
        return json.load(f)


def save_config(path, config):
    with open(path, "w") as f:
        json.dump(config, f, indent=2)
''', "save_config"),
    ('''
def flatten(nested):
    result = []
    for item in nested:
        if isinstance(item, list):
            result.extend(flatten(item))
        else:
            result.append(item)
    return result


print(flatten([1, [2, [3, 4]], 5]))
''', "flatten"),
    ('''
def is_palindrome(text):
    cleaned = "".join(c.lower() for c in text if c.isalnum())
    return cleaned == cleaned[::-1]


for word in ["racecar", "hello"]:
    print(word, is_palindrome(word))
''', "is_palindrome"),
    ('''
class BankAccount:
    def __init__(self, owner, balance=0):
        self.owner = owner
        self.balance = balance

    def deposit(self, amount):
        if amount <= 0:
            raise ValueError("amount must be positive")
        self.balance += amount
        return self.balance

    def withdraw(self, amount):
        if amount > self.balance:
            raise ValueError("insufficient funds")
        self.balance -= amount
        return self.balance
''', "deposit"),
    ('''
def factorial(n):
    if n <= 1:
        return 1
    return n * factorial(n - 1)


print(factorial(5))
''', "factorial"),
    ('''
def count_vowels(text):
    return sum(1 for c in text.lower() if c in "aeiou")


def count_consonants(text):
    return sum(1 for c in text.lower() if c.isalpha() and c not in "aeiou")


print(count_vowels("Hello"), count_consonants("Hello"))
''', "count_consonants"),
    ('''
def merge_sorted(left, right):
    merged = []
    i = j = 0
    while i < len(left) and j < len(right):
        if left[i] <= right[j]:
            merged.append(left[i])
            i += 1
        else:
            merged.append(right[j])
            j += 1
    merged.extend(left[i:])
    merged.extend(right[j:])
    return merged


def merge_sort(items):
    if len(items) <= 1:
        return items
    mid = len(items) // 2
    return merge_sorted(merge_sort(items[:mid]), merge_sort(items[mid:]))
''', "merge_sort"),
    ('''
from dataclasses import dataclass


@dataclass
class Point:
    x: float
    y: float

    def distance_to(self, other):
        return ((self.x - other.x) ** 2 + (self.y - other.y) ** 2) ** 0.5


print(Point(0, 0).distance_to(Point(3, 4)))
''', "distance_to"),
    ('''
def gcd(a, b):
    while b:
        a, b = b, a % b
    return a


def lcm(a, b):
    return a * b // gcd(a, b)


print(gcd(12, 18), lcm(4, 6))
''', "gcd"),
    ('''
def read_lines(path):
    with open(path) as f:
        return [line.rstrip("\\n") for line in f]


def count_non_empty_lines(path):
    return sum(1 for line in read_lines(path) if line.strip())
''', "count_non_empty_lines"),
    ('''
def chunk(items, size):
    return [items[i:i + size] for i in range(0, len(items), size)]


print(chunk(list(range(10)), 3))
''', "chunk"),
    ('''
class Temperature:
    def __init__(self, kelvin):
        self.kelvin = kelvin

    @property
    def celsius(self):
        return self.kelvin - 273.15

    @property
    def fahrenheit(self):
        return self.celsius * 9 / 5 + 32
''', "fahrenheit"),
    ('''
def word_lengths(words):
    return {word: len(word) for word in words}


def longest_word(words):
    return max(words, key=len)


print(word_lengths(["a", "abc"]), longest_word(["a", "abc"]))
''', "longest_word"),
    ('''
def sum_of_squares(numbers):
    return sum(n * n for n in numbers)


def mean(numbers):
    if not numbers:
        raise ValueError("mean of an empty list")
    return sum(numbers) / len(numbers)


print(sum_of_squares([1, 2, 3]), mean([1, 2, 3]))
''', "mean"),
    ('''
def remove_duplicates(items):
    seen = set()
    result = []
    for item in items:
        if item not in seen:
            seen.add(item)
            result.append(item)
    return result


print(remove_duplicates([3, 1, 3, 2, 1]))
''', "remove_duplicates"),
    ('''
import re


def is_valid_email(address):
    return re.fullmatch(r"[^@\\s]+@[^@\\s]+\\.[a-z]+", address) is not None


print(is_valid_email("someone@example.com"))
''', "is_valid_email"),
    ('''
def transpose(matrix):
    return [list(row) for row in zip(*matrix)]


def matrix_multiply(a, b):
    return [[sum(x * y for x, y in zip(row, col)) for col in transpose(b)] for row in a]


print(matrix_multiply([[1, 2], [3, 4]], [[5, 6], [7, 8]]))
''', "matrix_multiply"),
]

# Inputs for the prompt comparison alone (no parse check): extra files, a `prompt` at the cursor, text that spells
# special tokens (llama.cpp tokenizes the prefix and suffix without parsing special tokens).
PROMPT_PROBES: list[dict[str, Any]] = [
    {"input_prefix": "def add(a, b):\n", "input_suffix": "\n\nprint(add(1, 2))\n",
     "input_extra": [{"filename": "utils/math.py", "text": "def sub(a, b):\n    return a - b\n"},
                     {"filename": "README.md", "text": "# A tiny project\n"}]},
    {"input_prefix": "import os\n\n", "input_suffix": "\n", "prompt": "def home():\n    return os."},
    {"input_prefix": "TOKENS = ['<|fim_prefix|>', '<|endoftext|>', '<|file_sep|>', '<tool_call>']\n",
     "input_suffix": "\n"},
    {"input_prefix": "s = 'caf\u00e9 \u2014 \u65e5\u672c'\n", "input_suffix": "  \n\t\n"},
]


def split_case(source: str, function: str) -> tuple[str, str, str]:
    """(prefix, removed body, suffix): the prefix ends with the `def` line's newline, the suffix starts on the line
    after the body."""
    source = textwrap.dedent(source).lstrip("\n")
    node = next(n for n in ast.walk(ast.parse(source))
                if isinstance(n, ast.FunctionDef) and n.name == function)
    lines = source.splitlines(keepends=True)
    first, last = node.body[0].lineno - 1, node.end_lineno or node.body[-1].lineno
    return "".join(lines[:first]), "".join(lines[first:last]), "".join(lines[last:])


def indent_cut(middle: str, n_indent: int) -> str:
    """The middle as llama.cpp's `n_indent` (llama.vscode sends it) stops it (server-context.cpp): at the first line
    after the first whose indentation (spaces, tabs) is less than n_indent, cut at its first other character (its
    blanks kept; an empty line's first character is its newline). Both servers now do this themselves."""
    lines = middle.split("\n")
    kept = [lines[0]]
    for number, line in enumerate(lines[1:], 1):
        indent = len(line) - len(line.lstrip(" \t"))
        if indent < n_indent and (indent < len(line) or number < len(lines) - 1):  # the last: no newline after it
            return "\n".join([*kept, line[:indent]])
        kept.append(line)
    return middle


def body_indent(prefix: str) -> int:
    """The removed body's indentation: its `def` line's and 4."""
    def_line = prefix.rstrip("\n").splitlines()[-1]
    return len(def_line) - len(def_line.lstrip()) + 4


def parses(text: str) -> bool:
    try:
        ast.parse(text)
    except SyntaxError:
        return False
    return True


class Server:
    """One server started as gguf_peers starts it; `kind` is "lmserve" or "llama"."""

    def __init__(self, kind: str, model: str, threads: int | None = None) -> None:
        self.kind, self.port = kind, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        started = time.perf_counter()
        if threads is None:
            self.proc = start(kind, model, self.port, [])
        else:
            self.proc = start(kind, model, self.port, ["--engine-threads", str(threads)], llama_threads=threads)
        try:
            self.ready_s = wait_ready(self.port, self.proc, started)
        except BaseException:
            stop_server(self.proc)
            raise
        # A connection per request: llama-server (cpp-httplib) closes a kept-alive connection after a few requests,
        # which a client that reuses it sees as "Server disconnected"; both servers are measured the same way.
        self.client = httpx.Client(base_url=self.url, timeout=600, limits=httpx.Limits(max_keepalive_connections=0))
        self.model = self.client.get("/v1/models").json()["data"][0]["id"]

    def close(self) -> None:
        self.client.close()
        stop_server(self.proc)

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        response = self.client.post(path, json=body)
        if response.status_code != 200:
            raise RuntimeError(f"{self.kind} {path}: {response.status_code} {response.text[:500]}")
        return response.json()

    def infill(self, prefix: str, suffix: str, max_tokens: int = MAX_TOKENS, **extra: Any) -> dict[str, Any]:
        return self.post("/infill", {"input_prefix": prefix, "input_suffix": suffix, "n_predict": max_tokens,
                                     "temperature": 0, **extra})

    def suffix_completion(self, prefix: str, suffix: str, max_tokens: int = MAX_TOKENS,
                          **extra: Any) -> dict[str, Any]:
        return self.post("/v1/completions", {"model": self.model, "prompt": prefix, "suffix": suffix,
                                             "max_tokens": max_tokens, "temperature": 0, **extra})

    def first_token_s(self, path: str, body: dict[str, Any]) -> float:
        """Seconds from sending a streamed request to its first event with text (the rest of the stream is read)."""
        started, first = time.perf_counter(), None
        with self.client.stream("POST", path, json={**body, "stream": True}) as response:
            if response.status_code != 200:
                raise RuntimeError(f"{self.kind} {path}: {response.status_code} {response.read()[:500]!r}")
            for line in response.iter_lines():
                if first is not None or not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: "):])
                text = event["choices"][0]["text"] if event.get("choices") else event.get("content")
                if text:
                    first = time.perf_counter() - started
        if first is None:
            raise RuntimeError(f"{self.kind} {path}: no text in the stream")
        return first


def editor_sequence() -> list[tuple[str, str]]:
    """(prefix, suffix) per keystroke batch: a module's code above, a new function typed 3 to 5 characters at a
    time, the same code below."""
    above = "\n\n".join(textwrap.dedent(source).strip() for source, _ in CASES[:EDITOR_FILES])
    typed = ("def moving_average(values, window):\n"
             "    \"\"\"The mean of each run of `window` values, in order.\"\"\"\n"
             "    if window <= 0:\n        raise ValueError(\"window must be positive\")\n"
             "    averages = []\n    total = sum(values[:window])\n    averages.append(total / window)\n"
             "    for i in range(window, len(values)):\n        total += values[i] - values[i - window]\n"
             "        averages.append(total / window)\n    return averages\n")
    below = "\n\nif __name__ == \"__main__\":\n    print(moving_average([1, 2, 3, 4, 5], 2))\n"
    steps, position = [], 0
    for step in range(EDITOR_STEPS):
        position += 3 + step % 3
        steps.append((above + "\n\n" + typed[:position], below))
    assert position <= len(typed), "the typed text is shorter than the keystrokes"
    return steps


def editor_ttft(server: Server, path: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    times = []
    for prefix, suffix in editor_sequence():
        if path == "/infill":
            body = {"input_prefix": prefix, "input_suffix": suffix, "n_predict": EDITOR_MAX_TOKENS, "temperature": 0}
        else:
            body = {"model": server.model, "prompt": prefix, "suffix": suffix, "max_tokens": EDITOR_MAX_TOKENS,
                    "temperature": 0}
        times.append(server.first_token_s(path, {**body, **(extra or {})}))
    return {"first_ms": times[0] * 1e3, "median_rest_ms": statistics.median(times[1:]) * 1e3,
            "p90_rest_ms": sorted(times[1:])[int(0.9 * (len(times) - 1))] * 1e3,
            "ratio_median_to_first": statistics.median(times[1:]) / times[0]}


def warm_up(server: Server) -> None:
    """Requests on other text of about the editor prompt's length, so that the first measured request finds nothing
    cached but pays no first-call costs either."""
    other = "\n\n".join(textwrap.dedent(source).strip() for source, _ in reversed(CASES[EDITOR_FILES:]))
    for _ in range(2):
        server.infill(other, "\n", max_tokens=EDITOR_MAX_TOKENS)


def lmserve_prompt_from_server(server: Server, probe: dict[str, Any]) -> tuple[int, list[int]] | None:
    """(length, ids from the second position on) of the prompt lmserve's /v1/completions builds for `suffix`; None
    for a probe that only /infill can send (extra files, `prompt`)."""
    if probe.keys() - {"input_prefix", "input_suffix"}:
        return None
    out = server.suffix_completion(probe["input_prefix"], probe["input_suffix"], max_tokens=1, prompt_logprobs=0)
    entries = out["choices"][0]["prompt_logprobs"]
    return out["usage"]["prompt_tokens"], [int(next(iter(entry))) for entry in entries[1:]]


@functools.cache
def lmserve_tokenizer(model: str) -> tuple[Any, Any]:
    from lmserve.model_tokenizer import load_tokenizer, model_fim_tokens
    from lmserve.models import resolve_model

    source = resolve_model(model)
    tokenizer = load_tokenizer(source)
    return tokenizer, model_fim_tokens(source, tokenizer)


def lmserve_tokenize(model: str, text: str) -> list[int]:
    """As api/serving.py tokenizes a FIM prompt's texts: no BOS, special tokens' text left as text."""
    tokenizer, _ = lmserve_tokenizer(model)
    return tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True) if text else []


def lmserve_prompt_in_process(model: str, probe: dict[str, Any]) -> list[int]:
    """api/fim.py's fim_prompt with lmserve's tokenizer of the file, as api/serving.py calls it (room unlimited: these
    prompts are short)."""
    from lmserve.api.fim import fim_prompt

    tokenizer, fim = lmserve_tokenizer(model)
    with_bos, without = tokenizer.encode("\n", add_special_tokens=True), tokenizer.encode("\n", add_special_tokens=False)
    extra = [(chunk.get("filename", "tmp"), chunk.get("text", "")) for chunk in probe.get("input_extra", ())]
    return fim_prompt(fim, lambda text: lmserve_tokenize(model, text), with_bos[:len(with_bos) - len(without)],
                      probe["input_prefix"], probe["input_suffix"], probe.get("prompt", ""), extra)


def llama_prompt(server: Server, probe: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's prompt for a probe: its length, its ids (None where its text does not tokenize back to as many
    tokens: text that spells special tokens), and its own tokens of the prefix alone (special tokens not parsed, as
    its infill prompt tokenizes it)."""
    out = server.post("/infill", {**probe, "n_predict": 1, "temperature": 0})
    ids = server.post("/tokenize", {"content": out["prompt"], "add_special": False, "parse_special": True})["tokens"]
    prefix = server.post("/tokenize", {"content": probe["input_prefix"], "add_special": False,
                                       "parse_special": False})["tokens"]
    return {"length": out["tokens_evaluated"], "ids": ids if len(ids) == out["tokens_evaluated"] else None,
            "prefix_ids": prefix}


def fim_probes() -> list[dict[str, Any]]:
    probes = []
    for source, name in CASES:
        prefix, _, suffix = split_case(source, name)
        probes.append({"input_prefix": prefix, "input_suffix": suffix})
    return probes + PROMPT_PROBES


def middles(server: Server, n_indent_only: bool = False) -> dict[str, list[Any]]:
    """Each case's middle through /infill (and lmserve's `suffix`), as it comes and with n_indent sent (the body's
    indentation); /infill's stop_type with n_indent. `n_indent_only`: /infill with n_indent alone."""
    out: dict[str, list[Any]] = {}
    for source, name in CASES:
        prefix, _, suffix = split_case(source, name)
        n_indent = body_indent(prefix)
        answer = server.infill(prefix, suffix, n_indent=n_indent)
        out.setdefault("infill_texts_n_indent", []).append(answer["content"])
        out.setdefault("infill_stop_type_n_indent", []).append(answer["stop_type"])
        if n_indent_only:
            continue
        if server.kind == "lmserve":
            out.setdefault("suffix_texts", []).append(server.suffix_completion(prefix, suffix)["choices"][0]["text"])
            choice = server.suffix_completion(prefix, suffix, n_indent=n_indent)["choices"][0]
            out.setdefault("suffix_texts_n_indent", []).append(choice["text"])
            out.setdefault("suffix_finish_n_indent", []).append(choice["finish_reason"])
        out.setdefault("infill_texts", []).append(server.infill(prefix, suffix)["content"])
    return out


def run_server(kind: str, model: str, prompts_only: bool, parse_only: bool, n_indent_only: bool = False,
               threads: int | None = None) -> dict[str, Any]:
    server = Server(kind, model, threads)
    try:
        result: dict[str, Any] = {"ready_s": server.ready_s}
        if not parse_only:
            warm_up(server)
            if kind == "lmserve":
                result["prompts_server"] = [lmserve_prompt_from_server(server, probe) for probe in fim_probes()]
            else:
                result["prompts"] = [llama_prompt(server, probe) for probe in fim_probes()]
            if prompts_only:
                return result
            result["editor_infill"] = editor_ttft(server, "/infill")
            if kind == "lmserve":
                result["editor_suffix"] = editor_ttft(server, "/v1/completions", {"cache_salt": "second"})
        return result | middles(server, n_indent_only)
    finally:
        server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--json", help="also write the summary (and every middle) here")
    parser.add_argument("--prompts-only", action="store_true", help="the prompt comparison alone (no generation)")
    parser.add_argument("--parse-only", action="store_true",
                        help="the parse part alone (no prompt comparison, no editor workload)")
    parser.add_argument("--n-indent-only", action="store_true",
                        help="with --parse-only: only the /infill middles with n_indent")
    parser.add_argument("--threads", type=int, help="lmserve's --engine-threads and llama-server's -t")
    args = parser.parse_args()
    if args.n_indent_only and not args.parse_only:
        parser.error("--n-indent-only goes with --parse-only")
    assert len(CASES) >= 20
    splits = [split_case(source, name) for source, name in CASES]
    for prefix, body, suffix in splits:  # each case parses whole and fails without its body
        assert parses(prefix + body + suffix) and not parses(prefix + suffix)

    lm = run_server("lmserve", args.model, args.prompts_only, args.parse_only, args.n_indent_only, args.threads)
    if args.json:  # kept should llama.cpp's part fail
        Path(args.json + ".lmserve").write_text(json.dumps(lm))
    llama = run_server("llama", args.model, args.prompts_only, args.parse_only, args.n_indent_only, args.threads)

    def parsed(texts: list[str]) -> int:
        return sum(parses(prefix + text + suffix) for (prefix, _, suffix), text in zip(splits, texts, strict=True))

    def cut_here(texts: list[str]) -> list[str]:
        return [indent_cut(text, body_indent(prefix)) for (prefix, _, _), text in zip(splits, texts, strict=True)]

    def same(a: list[str], b: list[str]) -> int:
        return sum(x == y for x, y in zip(a, b, strict=True))

    def parse_summary() -> dict[str, Any]:
        return {
            "parse_ok": {"lmserve suffix": parsed(lm["suffix_texts"]), "lmserve /infill": parsed(lm["infill_texts"]),
                         "llama.cpp /infill": parsed(llama["infill_texts"])},
            "parse_ok_n_indent_sent": {"lmserve suffix": parsed(lm["suffix_texts_n_indent"]),
                                       "lmserve /infill": parsed(lm["infill_texts_n_indent"]),
                                       "llama.cpp /infill": parsed(llama["infill_texts_n_indent"])},
            # the server's cut against llama.cpp's rule applied here to the middle that came without n_indent
            "n_indent_middle == indent_cut(middle)": {
                "lmserve suffix": same(lm["suffix_texts_n_indent"], cut_here(lm["suffix_texts"])),
                "lmserve /infill": same(lm["infill_texts_n_indent"], cut_here(lm["infill_texts"])),
                "llama.cpp /infill": same(llama["infill_texts_n_indent"], cut_here(llama["infill_texts"]))},
            "stop_type_n_indent": {"lmserve /infill": lm["infill_stop_type_n_indent"],
                                   "llama.cpp /infill": llama["infill_stop_type_n_indent"]},
            "finish_reason_n_indent": {"lmserve suffix": lm["suffix_finish_n_indent"]},
            "lmserve /infill == suffix": same(lm["infill_texts"], lm["suffix_texts"]),
            "lmserve /infill == suffix (n_indent)": same(lm["infill_texts_n_indent"], lm["suffix_texts_n_indent"]),
            "lmserve == llama.cpp (text)": same(lm["infill_texts"], llama["infill_texts"]),
            "lmserve == llama.cpp (text, n_indent)": same(lm["infill_texts_n_indent"], llama["infill_texts_n_indent"]),
        }

    def all_middles() -> dict[str, list[str]]:
        return {"lmserve suffix": lm["suffix_texts"], "lmserve /infill": lm["infill_texts"],
                "llama.cpp /infill": llama["infill_texts"], "lmserve suffix n_indent": lm["suffix_texts_n_indent"],
                "lmserve /infill n_indent": lm["infill_texts_n_indent"],
                "llama.cpp /infill n_indent": llama["infill_texts_n_indent"]}

    if args.n_indent_only:
        summary = {"model": args.model, "cases": len(CASES),
                   "parse_ok_n_indent_sent": {"lmserve /infill": parsed(lm["infill_texts_n_indent"]),
                                              "llama.cpp /infill": parsed(llama["infill_texts_n_indent"])},
                   "stop_type_n_indent": {"lmserve /infill": lm["infill_stop_type_n_indent"],
                                          "llama.cpp /infill": llama["infill_stop_type_n_indent"]},
                   "lmserve == llama.cpp (text, n_indent)": same(lm["infill_texts_n_indent"],
                                                                 llama["infill_texts_n_indent"]),
                   "ready_s": {"lmserve": lm["ready_s"], "llama.cpp": llama["ready_s"]}}
        print(json.dumps(summary, indent=1))
        if args.json:
            Path(args.json).write_text(json.dumps({**summary, "middles": {
                "lmserve /infill n_indent": lm["infill_texts_n_indent"],
                "llama.cpp /infill n_indent": llama["infill_texts_n_indent"]}}, indent=1))
        return
    if args.parse_only:
        summary = {"model": args.model, "cases": len(CASES), **parse_summary(),
                   "ready_s": {"lmserve": lm["ready_s"], "llama.cpp": llama["ready_s"]}}
        print(json.dumps(summary, indent=1))
        if args.json:
            Path(args.json).write_text(json.dumps({**summary, "middles": all_middles()}, indent=1))
        return
    local = [lmserve_prompt_in_process(args.model, probe) for probe in fim_probes()]

    prompt_rows = []
    for i, (probe, reference, mine, from_server) in enumerate(
            zip(fim_probes(), llama["prompts"], local, lm["prompts_server"], strict=True)):
        ids = reference["ids"]
        row: dict[str, Any] = {
            "probe": i, "llama_tokens": reference["length"], "lmserve_tokens": len(mine),
            # llama.cpp's ids where its prompt text tokenizes back to them, else its length and prefix tokens
            "equal_in_process": mine == ids if ids is not None else len(mine) == reference["length"],
            "prefix_tokens_equal": lmserve_tokenize(args.model, probe["input_prefix"]) == reference["prefix_ids"],
        }
        if from_server is not None:
            length, tail = from_server
            row["equal_server"] = length == reference["length"] and (ids is None or tail == ids[1:])
        if ids is not None and mine != ids:
            first = next((j for j, (a, b) in enumerate(zip(mine, ids)) if a != b), min(len(mine), len(ids)))
            row["first_difference"] = {"at": first, "lmserve": mine[first:first + 8], "llama": ids[first:first + 8]}
        prompt_rows.append(row)

    summary: dict[str, Any] = {
        "model": args.model, "cases": len(CASES),
        "prompts_equal_in_process": sum(r["equal_in_process"] for r in prompt_rows),
        "prompts_equal_server": f"{sum(r.get('equal_server', False) for r in prompt_rows)} of "
                                f"{sum('equal_server' in r for r in prompt_rows)}",
        "prompts": len(prompt_rows),
        "prompt_differences": [r for r in prompt_rows if not (r["equal_in_process"] and r["prefix_tokens_equal"]
                                                              and r.get("equal_server", True))],
        "ready_s": {"lmserve": lm["ready_s"], "llama.cpp": llama["ready_s"]},
    }
    if args.prompts_only:
        print(json.dumps(summary, indent=1))
        return
    summary |= parse_summary() | {
        "editor_ttft": {"lmserve /infill": lm["editor_infill"], "lmserve suffix": lm["editor_suffix"],
                        "llama.cpp /infill": llama["editor_infill"]},
    }
    print(json.dumps(summary, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps({**summary, "middles": all_middles()}, indent=1))


if __name__ == "__main__":
    main()
