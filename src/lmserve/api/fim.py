"""Fill-in-the-middle: OpenAI's `suffix` on /v1/completions and llama.cpp's `/infill`, one prompt for both.

The prompt is laid out as llama.cpp's server lays out an infill prompt (format_infill), with the model's own FIM
tokens (GGUF `tokenizer.ggml.fim_*_token_id`, or the vocabulary's Qwen2.5-Coder / StarCoder / CodeLlama /
DeepSeek-Coder tokens: lmserve.model_tokenizer.fim_tokens):

    [<repo>myproject\\n] [<file_sep>NAME\\nTEXT ...for each input_extra file] [<file_sep>filename\\n]
    [BOS] <PRE> input_prefix prompt <SUF> input_suffix <MID>

(Codestral's, whose tokens are [PREFIX] [SUFFIX] [MIDDLE], as mistral-common's encode_fim: [BOS] [SUFFIX] input_suffix
[PREFIX] input_prefix prompt.)

The repository and file headers appear only when the vocabulary has those tokens; without a file separator, each
extra file is preceded by llama.cpp's "\\n\\n--- snippet ---\\n\\n". The code (prefix, suffix, extra files) is
tokenized as llama.cpp tokenizes it, a special token's text left as text (`'<|endoftext|>'` in a string literal does
not end the text); the `prompt` with special tokens parsed, as llama.cpp does. The generated middle ends at EOS or at
the model's FIM end, pad, repository or file-separator token. What does not fit the context is cut as llama.cpp cuts
it: the extra files first (the oldest), then the prefix from its start and the suffix from its end, 3:1.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from lmserve.api.protocol import MAX_CHAT_MESSAGES
from lmserve.api.request_error import RequestError
from lmserve.model_tokenizer import FimTokens

# llama.cpp's fixed texts (tools/server/utils.hpp): the project name, the current file's name, the snippet separator.
REPO_HEADER = "myproject\n"
CURRENT_FILE_HEADER = "filename\n"
SNIPPET_SEPARATOR = "\n\n--- snippet ---\n\n"
DEFAULT_EXTRA_FILENAME = "tmp"
MAX_EXTRA_FILES = MAX_CHAT_MESSAGES
MAX_FILENAME_CHARS = 1024

Tokenize = Callable[[str], list[int]]


def no_fim_tokens_error(param: str) -> RequestError:
    return RequestError("this model has no fill-in-the-middle tokens (its GGUF metadata names no "
                        "tokenizer.ggml.fim_pre/suf/mid_token_id and its vocabulary has no <|fim_prefix|>, "
                        "<fim_prefix> or <PRE> tokens): serve a code model trained for infilling", param)


def fim_prompt(
    fim: FimTokens, tokenize: Tokenize, bos: list[int], prefix: str, suffix: str, prompt: str = "",
    extra: list[tuple[str, str]] | None = None, room: int | None = None, tokenize_prompt: Tokenize | None = None,
) -> list[int]:
    """The infill prompt's token ids; `room`: how many tokens it may take (None: no limit). `tokenize` reads the
    code (prefix, suffix, extra files, headers), `tokenize_prompt` the prompt (default: `tokenize`): llama.cpp
    parses special tokens' text in the prompt only, never in the code."""
    extra_tokens: list[int] = []
    if fim.repo is not None:
        extra_tokens += [fim.repo, *tokenize(REPO_HEADER)]
    for filename, text in extra or ():
        if fim.file_sep is not None:
            extra_tokens += [fim.file_sep, *tokenize(filename + "\n")]
        else:
            extra_tokens += tokenize(SNIPPET_SEPARATOR)
        extra_tokens += tokenize(text)
    if fim.file_sep is not None:
        extra_tokens += [fim.file_sep, *tokenize(CURRENT_FILE_HEADER)]
    prefix_tokens, suffix_tokens = tokenize(prefix), tokenize(suffix)
    prompt_tokens = (tokenize_prompt or tokenize)(prompt)
    fixed = len(bos) + 3 + len(prompt_tokens)  # BOS, <PRE> <SUF> <MID>, the prompt
    if room is not None:
        core = max(0, room - fixed)
        if len(prefix_tokens) + len(suffix_tokens) > core:  # the prefix keeps 3/4, the suffix 1/4 (llama.cpp's)
            suffix_take = min(len(suffix_tokens), max(core // 4, core - len(prefix_tokens)))
            prefix_take = min(len(prefix_tokens), core - suffix_take)
            prefix_tokens = prefix_tokens[len(prefix_tokens) - prefix_take:]
            suffix_tokens = suffix_tokens[:suffix_take]
        extra_take = max(0, room - fixed - len(prefix_tokens) - len(suffix_tokens))
        extra_tokens = extra_tokens[len(extra_tokens) - min(extra_take, len(extra_tokens)):]
    if fim.suffix_first:  # Codestral: the middle follows the prefix, with no token of its own
        return [*extra_tokens, *bos, fim.suffix, *suffix_tokens, fim.prefix, *prefix_tokens, *prompt_tokens]
    return [*extra_tokens, *bos, fim.prefix, *prefix_tokens, *prompt_tokens, fim.suffix, *suffix_tokens, fim.middle]


class ExtraFile(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    filename: str = Field(default=DEFAULT_EXTRA_FILENAME, max_length=MAX_FILENAME_CHARS)
    text: str = ""


class InfillRequest(BaseModel):
    """llama.cpp's /infill: its FIM fields and the sampling fields of its /completion that lmserve implements."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    model: str | None = None
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: Annotated[list[ExtraFile], Field(max_length=MAX_EXTRA_FILES)] | None = None
    prompt: str = ""  # text after the prefix, where the cursor is (llama.vscode: the current line's start)
    n_predict: int | None = None  # -1: up to the context length (llama.cpp's)
    max_tokens: int | None = None  # the OpenAI name llama.cpp also reads
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: list[str] | None = None
    stream: bool | None = False
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # llama.cpp's code-completion stop (what llama.vscode sends: the cursor line's indentation): after the first
    # newline, a line indented less ends the middle (lmserve.frontend.stop_strings.IndentationLimit); 0: off.
    n_indent: int | None = None
    # What editors (llama.vscode, llama.vim) send that changes nothing here: lmserve's prefix cache is always on,
    # it has no slots, and it keeps no time limits per request.
    cache_prompt: bool | None = None
    id_slot: int | None = None
    t_max_prompt_ms: int | None = None
    t_max_predict_ms: int | None = None
    samplers: list[str] | None = Field(default=None, max_length=32)
    response_fields: list[str] | None = Field(default=None, max_length=32)

    def extra_files(self) -> list[tuple[str, str]]:
        return [(chunk.filename, chunk.text) for chunk in self.input_extra or ()]

    def completion_fields(self) -> dict[str, Any]:
        """The /v1/completions fields this request means (its prompt is rendered apart)."""
        length = self.max_tokens if self.max_tokens is not None else self.n_predict
        fields: dict[str, Any] = {"model": self.model, "stream": bool(self.stream),
                                  "max_tokens": None if length is None or length < 0 else length}
        for ours, theirs in (("temperature", "temperature"), ("top_k", "top_k"), ("top_p", "top_p"),
                             ("min_p", "min_p"), ("seed", "seed"), ("stop", "stop"),
                             ("repeat_penalty", "repetition_penalty"), ("presence_penalty", "presence_penalty"),
                             ("frequency_penalty", "frequency_penalty"), ("n_indent", "n_indent")):
            if getattr(self, ours) is not None:
                fields[theirs] = getattr(self, ours)
        return fields


def stop_type(finish_reason: str | None, stop_reason: int | str | None, indent_stop: bool = False) -> str:
    """llama.cpp's stop_type: eos, limit or word (an n_indent stop is a "limit" to llama.cpp, as max_tokens)."""
    if finish_reason == "length" or indent_stop:
        return "limit"
    return "word" if isinstance(stop_reason, str) else "eos"


def infill_body(model: str, content: str, tokens: list[int], finish_reason: str | None, stop_reason: int | str | None,
                num_prompt_tokens: int, num_generated: int, indent_stop: bool = False) -> dict[str, Any]:
    """llama.cpp's /infill answer (whole, or a stream's last event)."""
    return {"index": 0, "content": content, "tokens": tokens, "id_slot": 0, "stop": True, "model": model,
            "tokens_predicted": num_generated, "tokens_evaluated": num_prompt_tokens, "truncated": False,
            "stop_type": stop_type(finish_reason, stop_reason, indent_stop),
            "stopping_word": stop_reason if isinstance(stop_reason, str) else ""}


class InfillBody(BaseModel):
    model_config = ConfigDict(extra="allow")
