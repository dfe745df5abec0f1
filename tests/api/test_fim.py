"""Fill-in-the-middle: the model's FIM tokens found from GGUF metadata or the vocabulary's convention, the infill
prompt's layout (llama.cpp's), and a tiny model whose tokenizer has Qwen2.5-Coder's FIM tokens served end to end:
OpenAI's `suffix` and llama.cpp's `/infill` give the same tokens, generation stops at the file separator, and a model
without FIM tokens (the default one) answers 400."""

from __future__ import annotations

import copy
import itertools
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import transformers
from server_process import Server, start_server
from tiny_sizes import TINY_SIZES

from lmserve.api.fim import SNIPPET_SEPARATOR, fim_prompt
from lmserve.model_tokenizer import FimTokens, fim_tokens

QWEN_FIM = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"]


def vocabulary(*texts: str) -> dict[str, int]:
    return {text: 1000 + i for i, text in enumerate(texts)}


@pytest.mark.parametrize(("texts", "expected"), [
    (QWEN_FIM, FimTokens(1000, 1001, 1002, repo=1004, file_sep=1005, pad=1003)),
    (["<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>", "<file_sep>", "<repo_name>"],
     FimTokens(1000, 1002, 1001, file_sep=1004, pad=1003)),
    (["▁<PRE>", "▁<SUF>", "▁<MID>", "▁<EOT>"], FimTokens(1000, 1001, 1002, end=1003)),
    (["<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"], FimTokens(1000, 1001, 1002)),
    (["[PREFIX]", "[MIDDLE]", "[SUFFIX]"], FimTokens(1000, 1002, 1001, suffix_first=True)),  # Codestral
    (["<|im_start|>", "<|fim_prefix|>", "<|fim_suffix|>"], None),  # no middle: no FIM
])
def test_fim_tokens_are_found_by_the_vocabularys_convention(texts: list[str], expected: FimTokens | None) -> None:
    assert fim_tokens({}, vocabulary(*texts).get) == expected


def test_gguf_metadata_names_the_fim_tokens_first() -> None:
    metadata = {"tokenizer.ggml.fim_pre_token_id": 7, "tokenizer.ggml.fim_suf_token_id": 8,
                "tokenizer.ggml.fim_mid_token_id": 9, "tokenizer.ggml.fim_sep_token_id": 10}
    found = fim_tokens(metadata, vocabulary(*QWEN_FIM).get)
    assert found == FimTokens(7, 8, 9, repo=1004, file_sep=10, pad=1003)
    assert found.stop_ids == [1003, 1004, 10]


def chars(text: str) -> list[int]:
    return [ord(c) for c in text]


def test_the_prompt_is_laid_out_as_llama_cpps_infill() -> None:
    qwen = FimTokens(-1, -2, -3, repo=-4, file_sep=-5)
    ids = fim_prompt(qwen, chars, [], "def f(", "):\n", prompt="x", extra=[("a.py", "A")])
    assert ids == [-4, *chars("myproject\n"), -5, *chars("a.py\n"), *chars("A"), -5, *chars("filename\n"),
                   -1, *chars("def f(x"), -2, *chars("):\n"), -3]
    plain = FimTokens(-1, -2, -3)  # no separators: llama.cpp's snippet line between extra files; a BOS leads
    assert fim_prompt(plain, chars, [99], "p", "s", extra=[("a.py", "A")]) == [
        *chars(SNIPPET_SEPARATOR + "A"), 99, -1, *chars("p"), -2, *chars("s"), -3]
    codestral = FimTokens(-1, -2, -3, suffix_first=True)  # mistral-common's encode_fim: the suffix first, no middle
    assert fim_prompt(codestral, chars, [99], "def f(", "):\n", prompt="x") == [
        99, -2, *chars("):\n"), -1, *chars("def f(x")]


def test_the_prompt_at_the_cursor_has_its_own_tokenizer() -> None:
    """llama.cpp parses special tokens' text in /infill's `prompt`, not in the code: two tokenizers."""
    qwen = FimTokens(-1, -2, -3)
    ids = fim_prompt(qwen, chars, [], "a", "b", prompt="c", tokenize_prompt=lambda text: [7] * len(text))
    assert ids == [-1, *chars("a"), 7, -2, *chars("b"), -3]


def test_what_does_not_fit_is_cut_extra_files_first_then_prefix_and_suffix_3_to_1() -> None:
    plain = FimTokens(-1, -2, -3)
    kept = fim_prompt(plain, chars, [], "p" * 100, "s" * 100, extra=[("f", "E" * 50)], room=43)
    assert kept == [-1, *chars("p" * 30), -2, *chars("s" * 10), -3]
    short_suffix = fim_prompt(plain, chars, [], "p" * 100, "s" * 2, extra=[("f", "E" * 50)], room=43)
    assert short_suffix == [-1, *chars("p" * 38), -2, *chars("ss"), -3]
    roomy = fim_prompt(plain, chars, [], "p", "s", extra=[("f", "E" * 50)], room=10)
    assert roomy == [*chars("E" * 5), -1, *chars("p"), -2, *chars("s"), -3]


@pytest.fixture(scope="module")
def fim_model_dir(tmp_path_factory: pytest.TempPathFactory, default_tokenizer) -> Path:
    """A tiny Qwen2 whose tokenizer is the default one with Qwen2.5-Coder's FIM tokens added."""
    import torch

    tokenizer = copy.deepcopy(default_tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN_FIM})
    config = transformers.Qwen2Config(**{**TINY_SIZES, "vocab_size": len(tokenizer)},
                                      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                      tie_word_embeddings=True)
    directory = tmp_path_factory.mktemp("tiny-fim")
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def fim_server(tmp_path_factory: pytest.TempPathFactory, fim_model_dir: Path) -> Iterator[Server]:
    server = start_server(tmp_path_factory.mktemp("fim"), "--model", str(fim_model_dir), "--dtype", "float32",
                          "--max-model-len", "256", "--served-model-name", "fim")
    try:
        yield server
    finally:
        server.stop(signal.SIGKILL)


PREFIX, SUFFIX = "def add(a, b):\n    ", "\n\nprint(add(1, 2))\n"


def test_suffix_and_infill_give_the_same_tokens_whole_and_streamed(fim_server: Server, fim_model_dir: Path) -> None:
    url = fim_server.base_url
    completion = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 8, "temperature": 0}).json()
    infill = httpx.post(f"{url}/infill", timeout=60, json={
        "input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 8, "temperature": 0,
        "cache_prompt": True, "t_max_predict_ms": 500}).json()
    assert infill["content"] == completion["choices"][0]["text"]
    assert infill["tokens_evaluated"] == completion["usage"]["prompt_tokens"]
    assert infill["tokens_predicted"] == completion["usage"]["completion_tokens"] > 0
    assert infill["stop"] is True and infill["stop_type"] in ("limit", "eos")

    tokenizer = transformers.AutoTokenizer.from_pretrained(fim_model_dir)
    expected = tokenizer.encode("<|repo_name|>myproject\n<|file_sep|>filename\n<|fim_prefix|>" + PREFIX
                                + "<|fim_suffix|>" + SUFFIX + "<|fim_middle|>", add_special_tokens=False)
    assert completion["usage"]["prompt_tokens"] == len(expected)

    with httpx.stream("POST", f"{url}/infill", timeout=60, json={
            "input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 8, "temperature": 0, "stream": True}) as r:
        events = [httpx.Response(200, content=line[6:]).json() for line in r.iter_lines() if line.startswith("data: ")]
    assert "".join(e["content"] for e in events) == infill["content"]
    assert [e["stop"] for e in events][-1] is True and not any(e["stop"] for e in events[:-1])


def test_code_that_spells_a_special_token_stays_text(fim_server: Server, fim_model_dir: Path) -> None:
    """As llama.cpp's /infill tokenizes the code (parse_special=false): `'<|file_sep|>'` in a string literal is text,
    not the file separator; the `prompt` at the cursor is read with special tokens parsed, as llama.cpp reads it."""
    code = "SEP = '<|file_sep|>'  # <|endoftext|>\n"
    tokenizer = transformers.AutoTokenizer.from_pretrained(fim_model_dir)

    def encode(text: str, split: bool = False) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False, split_special_tokens=split)

    head = encode("<|repo_name|>myproject\n<|file_sep|>filename\n<|fim_prefix|>")
    tail = [*encode("<|fim_suffix|>"), *encode(SUFFIX), *encode("<|fim_middle|>")]
    expected = [*head, *encode(code, split=True), *tail]
    assert len(encode(code, split=True)) > len(encode(code))  # the text is not the special tokens' ids
    completion = httpx.post(f"{fim_server.base_url}/v1/completions", timeout=60, json={
        "prompt": code, "suffix": SUFFIX, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0}).json()
    assert completion["usage"]["prompt_tokens"] == len(expected)
    assert [int(next(iter(e))) for e in completion["choices"][0]["prompt_logprobs"][1:]] == expected[1:]
    as_prefix = httpx.post(f"{fim_server.base_url}/infill", timeout=60, json={
        "input_prefix": code, "input_suffix": SUFFIX, "n_predict": 1}).json()
    as_prompt = httpx.post(f"{fim_server.base_url}/infill", timeout=60, json={
        "prompt": code, "input_suffix": SUFFIX, "n_predict": 1}).json()
    assert as_prefix["tokens_evaluated"] == len(expected)
    assert as_prompt["tokens_evaluated"] == len(head) + len(encode(code)) + len(tail)


def test_generation_stops_at_the_file_separator(fim_server: Server, fim_model_dir: Path) -> None:
    file_sep = transformers.AutoTokenizer.from_pretrained(fim_model_dir).convert_tokens_to_ids("<|file_sep|>")
    choice = httpx.post(f"{fim_server.base_url}/v1/completions", timeout=60, json={
        "prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 8, "logit_bias": {str(file_sep): 100}}).json()["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == ("", "stop")
    infill = httpx.post(f"{fim_server.base_url}/infill", timeout=60, json={
        "input_prefix": PREFIX, "input_extra": [{"filename": "util.py", "text": "X = 1\n"}], "n_predict": 8,
        "temperature": 0}).json()
    assert infill["tokens_evaluated"] > len(PREFIX) // 8  # the extra file's header and text are in the prompt


@pytest.mark.parametrize(("path", "body", "words"), [
    ("/infill", {"input_prefix": "x", "input_extra": [{"filename": "a", "text": "b"}] * 5000}, "4096"),
    ("/infill", {"input_prefix": "x", "input_extra": [{"filename": "a" * 2000}]}, "filename"),
    ("/infill", {"input_prefix": 5}, "input_prefix"),
    ("/infill", {"input_prefix": "x", "n_predict": 10**6}, "max_tokens"),
    ("/infill", {"input_prefix": "x", "made_up": 1}, "made_up"),
    ("/infill", {"input_prefix": "x", "model": "other"}, "other"),
    ("/v1/completions", {"prompt": [1, 2], "suffix": "x"}, "text prompts"),
    ("/v1/completions", {"prompt": "x", "suffix": "x", "echo": True}, "echo"),
    ("/v1/completions", {"prompt": "x", "suffix": 5}, "suffix"),
])
def test_hostile_fim_requests_get_a_4xx(fim_server: Server, path: str, body: dict, words: str) -> None:
    answer = httpx.post(f"{fim_server.base_url}{path}", json=body, timeout=60)
    assert 400 <= answer.status_code < 500, answer.text
    assert words in answer.json()["error"]["message"]


def test_a_model_without_fim_tokens_says_so(default_hermes_server: Server) -> None:
    """The default model has no FIM tokens (its tool parser plays no part here)."""
    for path, body in (("/v1/completions", {"prompt": "def f(", "suffix": "):"}), ("/infill", {"input_prefix": "a"})):
        answer = httpx.post(f"{default_hermes_server.base_url}{path}", json=body, timeout=60)
        assert answer.status_code == 400 and "no fill-in-the-middle tokens" in answer.json()["error"]["message"]


def test_a_keystroke_later_the_prefix_cache_serves_the_unchanged_start(fim_server: Server) -> None:
    """An editor resends the file at every keystroke: the headers and the prefix lead the prompt, so the blocks before
    the cursor are found in the prefix cache."""
    url, code = fim_server.base_url, "import os\n\n" + "".join(f"def f{i}(x):\n    return x + {i}\n\n" for i in range(12))
    stats = httpx.get(f"{url}/debug/engine").json()
    before = stats["prefix_cache_hits"]
    for typed in ("def g(", "def g(y"):
        answer = httpx.post(f"{url}/infill", timeout=60, json={"input_prefix": code + typed, "input_suffix": "\n",
                                                                "n_predict": 2, "temperature": 0})
        assert answer.status_code == 200, answer.text
    hits = httpx.get(f"{url}/debug/engine").json()["prefix_cache_hits"] - before
    assert hits >= answer.json()["tokens_evaluated"] // 2, hits


# What the scripted model below writes after <|fim_middle|>, one token a piece (every piece a different token):
# a first line indented less than n_indent=4 (never checked), two lines indented enough, then "  return" whose
# blanks are split over two tokens ("\n " and " return"), then more lines that must never be sent.
SCRIPT = ["acc", " =", " ", "0", "\n   ", " for", " item", " in", " values", ":", "\n       ", " acc", " +=", " it",
          "em", "\n ", " return", " result", "\n\n", "def", " after", "_", "cut", "():", "\n    ", " print", "(\"",
          "never", " sent", "\")", "\n"]
CUT_TOKEN = SCRIPT.index(" return")
KEPT = "".join(SCRIPT[:CUT_TOKEN]) + " "  # the under-indented line's blanks are kept, as llama.cpp keeps them


@pytest.fixture(scope="module")
def scripted_model_dir(tmp_path_factory: pytest.TempPathFactory, default_tokenizer) -> Path:
    """A tiny Qwen2 with Qwen2.5-Coder's FIM tokens that writes SCRIPT after <|fim_middle|>, then <|file_sep|>,
    whatever the prompt: its layers add nothing (attention and MLP outputs zero), each scripted token's embedding is
    a dimension of its own, and the output head maps that dimension to the next token. (The random tiny model writes
    no lines to cut.)"""
    import torch

    tokenizer = copy.deepcopy(default_tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN_FIM})
    chain = [tokenizer.convert_tokens_to_ids("<|fim_middle|>")]
    for piece in SCRIPT:
        (token_id,) = tokenizer.encode(piece, add_special_tokens=False)
        chain.append(token_id)
    chain.append(tokenizer.convert_tokens_to_ids("<|file_sep|>"))
    assert len(set(chain)) == len(chain) and len(chain) - 1 <= TINY_SIZES["hidden_size"]
    config = transformers.Qwen2Config(**{**TINY_SIZES, "vocab_size": len(tokenizer)},
                                      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.lm_head.weight.zero_()
        for dim, (token_id, next_id) in enumerate(itertools.pairwise(chain)):
            model.model.embed_tokens.weight[token_id] = 0.0
            model.model.embed_tokens.weight[token_id, dim] = 1.0
            model.lm_head.weight[next_id, dim] = 2.0  # logit 16 after the final norm, every other logit 0
    directory = tmp_path_factory.mktemp("scripted-fim")
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def scripted_server(tmp_path_factory: pytest.TempPathFactory, scripted_model_dir: Path) -> Iterator[Server]:
    server = start_server(tmp_path_factory.mktemp("scripted"), "--model", str(scripted_model_dir), "--dtype",
                          "float32", "--max-model-len", "256", "--served-model-name", "scripted")
    try:
        yield server
    finally:
        server.stop(signal.SIGKILL)


def infill_stream(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{url}/infill", timeout=60, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        return [httpx.Response(200, content=line[6:]).json() for line in r.iter_lines() if line.startswith("data: ")]


def test_n_indent_cuts_the_middle_at_the_first_line_indented_less(scripted_server: Server) -> None:
    """llama.cpp's n_indent through /infill, whole and streamed, and through `suffix`: the text ends where the
    under-indented line's text starts, no later line is sent, the engine stops computing, and stop_type is
    llama.cpp's "limit" while OpenAI's finish_reason is "stop"."""
    url = scripted_server.base_url
    body = {"input_prefix": "def total(values):\n", "input_suffix": "\n", "n_predict": 64, "temperature": 0}
    full = httpx.post(f"{url}/infill", timeout=60, json=body).json()
    assert full["content"] == "".join(SCRIPT) and full["stop_type"] == "eos"  # the script, to <|file_sep|>

    steps_before = httpx.get(f"{url}/debug/engine", timeout=10).json()["num_steps"]
    cut = httpx.post(f"{url}/infill", timeout=60, json={**body, "n_indent": 4}).json()
    steps = httpx.get(f"{url}/debug/engine", timeout=10).json()["num_steps"] - steps_before
    assert cut["content"] == KEPT
    assert (cut["stop_type"], cut["stopping_word"], cut["tokens_predicted"]) == ("limit", "", CUT_TOKEN + 1)
    assert steps < len(SCRIPT) - 4, f"{steps} engine steps: the request ran on after the cut"

    events = infill_stream(url, {**body, "n_indent": 4})
    assert "".join(e["content"] for e in events) == KEPT  # streamed as whole, not a character after the cut
    assert events[-1]["stop"] is True and events[-1]["stop_type"] == "limit"
    assert events[-1]["tokens_predicted"] == CUT_TOKEN + 1

    choice = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "prompt": body["input_prefix"], "suffix": "\n", "max_tokens": 64, "temperature": 0, "n_indent": 4,
    }).json()["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (KEPT, "stop", None)

    # 0 is off; an indentation every line meets cuts nothing; a stop string before the cut still wins
    assert httpx.post(f"{url}/infill", timeout=60, json={**body, "n_indent": 0}).json()["content"] == "".join(SCRIPT)
    assert httpx.post(f"{url}/infill", timeout=60, json={**body, "n_indent": 1}).json()["content"] == "".join(
        SCRIPT[:SCRIPT.index("\n\n")]) + "\n"  # the empty line is indented 0
    worded = httpx.post(f"{url}/infill", timeout=60, json={**body, "n_indent": 4, "stop": [" item"]}).json()
    assert (worded["content"], worded["stop_type"], worded["stopping_word"]) == ("acc = 0\n    for", "word", " item")


@pytest.mark.parametrize(("path", "body"), [
    ("/infill", {"input_prefix": "x", "n_indent": -1}),
    ("/infill", {"input_prefix": "x", "n_indent": 10**6}),
    ("/infill", {"input_prefix": "x", "n_indent": "4"}),
    ("/v1/completions", {"prompt": "x", "suffix": "y", "n_indent": -4}),
    ("/v1/completions", {"prompt": "x", "n_indent": 2.5}),
])
def test_a_bad_n_indent_is_a_400_naming_it(fim_server: Server, path: str, body: dict) -> None:
    answer = httpx.post(f"{fim_server.base_url}{path}", json=body, timeout=60)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert "n_indent" in error["message"] and error["param"] == "n_indent", error
