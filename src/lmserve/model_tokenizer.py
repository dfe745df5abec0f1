"""A model's tokenizer: a Hugging Face directory's, or a GGUF file's vocabulary converted once and cached, with the
chat template and end-of-generation tokens the file or lmserve's built-in templates give it. transformers is imported
here, when a tokenizer is first loaded; not torch (after the first conversion of a GGUF vocabulary)."""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmserve import tokenizer_cache
from lmserve.chat_templates import BUILTIN_CHAT_TEMPLATES, GGUF_END_OF_GENERATION_TEXTS
from lmserve.config import cache_directory
from lmserve.formats.gguf_file import read_gguf_arrays, read_gguf_header
from lmserve.harmony import STOP_TEXTS as HARMONY_END_OF_TURN_TEXTS
from lmserve.heap import release_freed_heap
from lmserve.models import ModelSource

if TYPE_CHECKING:  # imported where a tokenizer is first loaded
    import transformers

logger = logging.getLogger(__name__)

def load_tokenizer(source: ModelSource) -> transformers.PreTrainedTokenizerBase:
    import transformers

    start = time.perf_counter()
    if source.kind == "hf" and _plain_fast_tokenizer(source.path):
        tokenizer = transformers.TokenizersBackend.from_pretrained(source.path, local_files_only=True)
    elif source.kind == "hf":
        tokenizer = transformers.AutoTokenizer.from_pretrained(source.path, local_files_only=True)
    else:
        tokenizer = _gguf_tokenizer(source.path)
    release_freed_heap()  # the parse's temporaries: ~95 MiB of Qwen2.5's tokenizer stays resident otherwise
    if tokenizer.chat_template is None:
        model_type = model_type_of(source)
        tokenizer.chat_template = BUILTIN_CHAT_TEMPLATES.get(model_type)
        if tokenizer.chat_template is not None:
            logger.info("%s has no chat template; using %s's own", source.name, model_type)
        else:
            logger.warning("%s has no chat template; chat requests will fail", source.name)
    logger.info(
        "loaded tokenizer of %s (%d tokens) in %.2f s",
        source.name,
        len(tokenizer),
        time.perf_counter() - start,
    )
    return tokenizer


# Architectures whose directories AutoTokenizer loads as the class tokenizer_config.json names when that class is
# the generic one: not qwen2 and phi3 (transformers' MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS, given their own
# class), nor mistral (its tekken files choose another backend).
_GENERIC_CLASS_KEPT = {"llama", "qwen3", "gemma2", "gemma3", "gemma3_text"}
_GENERIC_CLASSES = {"PreTrainedTokenizerFast", "TokenizersBackend"}


def _plain_fast_tokenizer(directory: Path) -> bool:
    """Whether AutoTokenizer would build transformers' generic fast tokenizer over the directory's tokenizer.json,
    which lmserve then builds itself: AutoTokenizer first reads the model's config through transformers' config
    classes, which import torch (~2 s of start-up and ~240 MiB that the API process would hold for its lifetime).
    tests/test_tokenizer_cache.py holds the two equal."""
    try:
        tokenizer_config = json.loads((directory / "tokenizer_config.json").read_text())
        model_type = json.loads((directory / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return False
    return (tokenizer_config.get("tokenizer_class") in _GENERIC_CLASSES and "auto_map" not in tokenizer_config
            and model_type in _GENERIC_CLASS_KEPT and (directory / "tokenizer.json").is_file())


def model_type_of(source: ModelSource) -> str | None:
    """The architecture of the model a tokenizer came with, if the source says (a tokenizer-only directory does not)."""
    if source.kind == "gguf":
        return read_gguf_header(source.path).metadata.get("general.architecture")
    config_file = source.path / "config.json"
    return json.loads(config_file.read_text()).get("model_type") if config_file.is_file() else None


def end_of_generation_ids(source: ModelSource, tokenizer: transformers.PreTrainedTokenizerBase) -> list[int]:
    """What else ends generation besides the model config's EOS ids: the tokenizer's EOS, and for a GGUF file
    llama.cpp's end-of-generation tokens found in its vocabulary, so a file stops where llama.cpp stops it."""
    ids = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    if source.kind == "gguf":
        vocabulary = tokenizer.backend_tokenizer
        texts = GGUF_END_OF_GENERATION_TEXTS
        if all(vocabulary.token_to_id(text) is not None for text in HARMONY_END_OF_TURN_TEXTS):
            # gpt-oss's <|end|> closes a message the model goes on after (its thinking): its turn ends at <|return|>
            # or <|call|>, as llama.cpp decides for a vocabulary that has both (llama-vocab.cpp).
            texts = tuple(text for text in texts if text != "<|end|>") + HARMONY_END_OF_TURN_TEXTS
        found = (vocabulary.token_to_id(text) for text in texts)
        ids += [token_id for token_id in found if token_id is not None and token_id not in ids]
    return ids


@dataclass(frozen=True)
class FimTokens:
    """A model's fill-in-the-middle tokens (ids): the prompt is `prefix PRE_TEXT suffix SUF_TEXT middle`, after
    optional repository and file headers; generation stops at the end, pad, repository or file-separator token."""

    prefix: int
    suffix: int
    middle: int
    repo: int | None = None  # <|repo_name|>: a project's header
    file_sep: int | None = None  # <|file_sep|>: each file's header (its name)
    pad: int | None = None
    end: int | None = None  # CodeLlama's ▁<EOT>
    # Codestral's [SUFFIX] suffix [PREFIX] prefix (mistral-common's encode_fim): the suffix first, no middle token.
    suffix_first: bool = False

    @property
    def stop_ids(self) -> list[int]:
        return [token for token in (self.end, self.pad, self.repo, self.file_sep) if token is not None]


CODESTRAL_PREFIX = "[PREFIX]"
# The GGUF keys llama.cpp writes and reads (llama-arch.cpp), by FimTokens field.
_GGUF_FIM_KEYS = {"prefix": "fim_pre", "suffix": "fim_suf", "middle": "fim_mid", "pad": "fim_pad",
                  "repo": "fim_rep", "file_sep": "fim_sep"}
# The token texts of the conventions llama.cpp recognises when a file's metadata names none (llama-vocab.cpp), in its
# order: Qwen2.5-Coder, StarCoder/StarCoder2/Granite, CodeLlama, DeepSeek-Coder; then Codestral's control tokens.
_FIM_TEXTS: dict[str, tuple[str, ...]] = {
    "prefix": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "▁<PRE>", "<｜fim▁begin｜>", "<PRE>", "[PREFIX]"),
    "suffix": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "▁<SUF>", "<｜fim▁hole｜>", "<SUF>", "[SUFFIX]"),
    "middle": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "▁<MID>", "<｜fim▁end｜>", "<MID>", "[MIDDLE]"),
    "pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>"),
    "repo": ("<|repo_name|>", "<repo-name>", "<reponame>"),
    "file_sep": ("<|file_sep|>", "<file_sep>", "<filename>"),
    "end": ("▁<EOT>", "<EOT>"),
}


def fim_tokens(metadata: dict[str, Any], token_to_id: Any) -> FimTokens | None:
    """The model's FIM tokens: the GGUF metadata's `tokenizer.ggml.fim_*_token_id`, else the vocabulary's tokens of
    a known convention (`token_to_id(text)` -> id or None); None when it has no prefix, suffix and middle."""
    found: dict[str, int | None] = {}
    for name, key in _GGUF_FIM_KEYS.items():
        value = metadata.get(f"tokenizer.ggml.{key}_token_id")
        found[name] = int(value) if isinstance(value, int) and value >= 0 else None
    for name, texts in _FIM_TEXTS.items():
        if found.get(name) is None:
            found[name] = next((token for text in texts if (token := token_to_id(text)) is not None), None)
    if found["prefix"] is None or found["suffix"] is None or found["middle"] is None:
        return None
    suffix_first = found["prefix"] == token_to_id(CODESTRAL_PREFIX)
    return FimTokens(**found, suffix_first=suffix_first)  # type: ignore[arg-type]


def model_fim_tokens(source: ModelSource, tokenizer: transformers.PreTrainedTokenizerBase) -> FimTokens | None:
    """fim_tokens() of a model: its GGUF metadata (a GGUF file), and its tokenizer's vocabulary."""
    metadata = read_gguf_header(source.path).metadata if source.kind == "gguf" else {}
    vocabulary = tokenizer.get_vocab()
    return fim_tokens(metadata, vocabulary.get)


# What save_pretrained writes into tokenizer_config.json that is not a constructor argument, or that the constructor
# below cannot take as the file has it (added_tokens_decoder: dicts that from_pretrained turns into AddedTokens).
_SAVED_CONFIG_NOT_ARGUMENTS = {"tokenizer_class", "is_local", "local_files_only", "auto_map"}
_SAVED_CONFIG_NEEDS_FROM_PRETRAINED = {"added_tokens_decoder", "extra_special_tokens"}


def _saved_tokenizer(directory: Path) -> transformers.PreTrainedTokenizerBase:
    """A tokenizer that _gguf_tokenizer saved. from_pretrained parses tokenizer.json three more times in Python and
    deep-copies every added token (1.0 s of Gemma 3's 262,144-token vocabulary, 0.4 s of Qwen2.5's, on top of the
    Rust parse); the constructor over the file builds the same tokenizer (tests/test_models.py holds them equal)."""
    import transformers

    config = json.loads((directory / "tokenizer_config.json").read_text())
    if config.keys() & _SAVED_CONFIG_NEEDS_FROM_PRETRAINED:
        return transformers.PreTrainedTokenizerFast.from_pretrained(directory, local_files_only=True)
    arguments = {key: value for key, value in config.items() if key not in _SAVED_CONFIG_NOT_ARGUMENTS}
    template = directory / "chat_template.jinja"
    if template.is_file():
        arguments["chat_template"] = template.read_text()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(directory / "tokenizer.json"), name_or_path=str(directory), **arguments
    )


def _gguf_tokenizer(path: Path) -> transformers.PreTrainedTokenizerBase:
    """A GGUF file's tokenizer. transformers builds it from the file's vocabulary and merges (_converted_from_gguf):
    seconds for a large vocabulary (Gemma 3's 262,144 tokens: ~2.5 s). What it builds is kept under lmserve's cache
    (tokenizer.json and its config, save_pretrained's files; see tokenizer_cache), and later starts load that
    (~0.3 s)."""
    import tokenizers
    import transformers

    versions = f"{transformers.__version__} {tokenizers.__version__}"
    cached = tokenizer_cache.entry_directory(cache_directory() / "tokenizers", path, versions)
    if cached.is_dir():
        try:
            tokenizer = _saved_tokenizer(cached)
            tokenizer_cache.mark_used(cached, path, versions)
            return tokenizer
        except Exception as exc:  # noqa: BLE001 - a damaged cache entry is rebuilt, never fatal
            logger.warning("rebuilding the cached tokenizer %s: %s", cached, exc)
            shutil.rmtree(cached, ignore_errors=True)
    try:
        tokenizer = _converted_from_gguf(path)
    # A transformers without those pieces, or a vocabulary lmserve's reader does not take: transformers' own path.
    except (ImportError, AttributeError, KeyError, TypeError, ValueError) as exc:
        logger.info("converting the tokenizer of %s through transformers' GGUF reader: %s", path.name, exc)
        # PreTrainedTokenizerFast rather than AutoTokenizer: the latter also rebuilds the model config through
        # gguf.GGUFReader, which costs seconds and is not needed here.
        tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(
            path.parent, gguf_file=path.name, local_files_only=True
        )
    if tokenizer.chat_template is None:  # older transformers drop it
        tokenizer.chat_template = read_gguf_header(path).metadata.get("tokenizer.chat_template")
    staging = None
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{cached.name}-", dir=cached.parent))
        tokenizer.save_pretrained(staging)
        tokenizer_cache.write_source(staging, path, versions)
        staging.rename(cached)  # whole or not at all; a concurrent start that saved first wins
        tokenizer_cache.remove_stale_entries(cached.parent, keep=cached)
    except OSError as exc:
        logger.info("tokenizer of %s not cached: %s", path, exc)
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
    return tokenizer


# The metadata arrays transformers' GGUF tokenizer mapping reads; lmserve's header reader leaves them as lengths.
_TOKENIZER_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type",
                     "tokenizer.ggml.merges", "tokenizer.ggml.precompiled_charsmap")


# llama.cpp's converter writes a WordPiece vocabulary with a "phantom space": a word's first piece as "\u2581word", a
# continuation ("##ing") as "ing", special tokens ("[CLS]") as they are.
_PHANTOM_SPACE = "\u2581"


def _wordpiece_from_gguf(metadata: dict[str, Any]) -> transformers.PreTrainedTokenizerBase:
    """A BERT WordPiece tokenizer (llama.cpp's "bert" vocabulary, as nomic-bert's and bert's GGUF files hold it):
    the vocabulary back in its original spelling, lower-casing as the uncased BERT vocabularies these files carry
    (llama.cpp's WPM tokenizer lower-cases too), [CLS] ... [SEP] around each text."""
    import transformers

    tokens = metadata["tokenizer.ggml.tokens"]
    vocab: dict[str, int] = {}
    for token_id, token in enumerate(tokens):
        if token.startswith(_PHANTOM_SPACE):
            original = token[len(_PHANTOM_SPACE):]
        elif token.startswith("[") and token.endswith("]"):
            original = token
        else:
            original = "##" + token
        vocab.setdefault(original, token_id)

    def special(key: str, default: str) -> str:
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        return tokens[token_id] if token_id is not None else default

    return transformers.BertTokenizer(
        vocab=vocab, do_lower_case=True, unk_token=special("unknown_token_id", "[UNK]"),
        cls_token=special("bos_token_id", "[CLS]"), sep_token=special("seperator_token_id", "[SEP]"),
        pad_token=special("padding_token_id", "[PAD]"), mask_token="[MASK]",
    )


def _converted_from_gguf(path: Path) -> transformers.PreTrainedTokenizerFast:
    """What `PreTrainedTokenizerFast.from_pretrained(dir, gguf_file=...)` builds, step for step as transformers'
    get_gguf_tokenizer and convert_gguf_tokenizer do it (tested equal), with two costs left out of a first start:
    the file's metadata comes from lmserve's reader (transformers' imports torch: ~1.2 s and ~200 MiB in the API
    process, and decodes every array), and the built tokenizer goes into the wrapper as transformers' own GGUF path
    puts it, uncopied (`tokenizer_object=` would deep-copy it: ~1 s for Gemma's vocabulary)."""
    import transformers
    from transformers.integrations.gguf import gguf_tokenizer_mapping as mapping

    metadata = {**read_gguf_header(path).metadata, **read_gguf_arrays(path, _TOKENIZER_ARRAYS)}
    if metadata.get("tokenizer.ggml.model") == "bert":
        return _wordpiece_from_gguf(metadata)
    grouped = {
        group: {name: metadata[f"tokenizer.{key}"] for key, name in renames.items() if f"tokenizer.{key}" in metadata}
        for group, renames in mapping.GGUF_TOKENIZER_MAPPING.items()
    }
    tokenizer_dict, config = grouped["tokenizer"], grouped["tokenizer_config"]
    tokenizer_type = tokenizer_dict.get("tokenizer_type")
    if tokenizer_type == "llama":
        config.setdefault("add_bos_token", True)
    elif tokenizer_type == "gemma4":
        config["add_bos_token"] = False
    for name, key in mapping._SPECIAL_TOKENS.items():
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        config[name] = tokenizer_dict["tokens"][token_id] if token_id is not None else None
    backend, extra = mapping.convert_gguf_tokenizer(metadata["general.architecture"], tokenizer_dict)
    tokenizer = transformers.PreTrainedTokenizerFast.__new__(transformers.PreTrainedTokenizerFast)
    tokenizer._tokenizer = backend  # as __init__ keeps the backend that a gguf_file= call converts
    tokenizer.__init__(name_or_path=str(path.parent), **config, **extra)
    return tokenizer
