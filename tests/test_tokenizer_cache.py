"""A GGUF's tokenizer is converted once (seconds for a large vocabulary) and kept under lmserve's cache; later loads
read the cached files and give the same tokenizer. The conversion is transformers' own, fed by lmserve's header
reader: the same tokenizer as `from_pretrained(gguf_file=...)` builds, without importing torch."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import transformers

from lmserve import model_tokenizer, tokenizer_cache
from lmserve.model_tokenizer import _converted_from_gguf, _saved_tokenizer, load_tokenizer
from lmserve.models import ModelSource

TEXTS = [
    "Hello, world!",
    "  leading spaces and\ttabs\nnew lines\r\n",
    "Ünïcödé — 日本語のテキスト 🙂 emoji",
    "<|im_start|>user\nspecial tokens inline<|im_end|>",
    "def f(x):\n    return x ** 2  # code",
    "",
]


def assert_same_tokenizer(got, expected) -> None:
    assert type(got) is type(expected)
    assert got.backend_tokenizer.to_str() == expected.backend_tokenizer.to_str()  # vocabulary, merges, pre/post
    assert len(got) == len(expected) and got.get_vocab() == expected.get_vocab()
    for attr in ("bos_token", "eos_token", "unk_token", "pad_token", "all_special_tokens", "all_special_ids",
                 "chat_template", "model_max_length", "padding_side", "clean_up_tokenization_spaces"):
        assert getattr(got, attr) == getattr(expected, attr), attr
    assert {i: str(t) for i, t in got.added_tokens_decoder.items()} == {
        i: str(t) for i, t in expected.added_tokens_decoder.items()
    }
    for text in TEXTS:
        for special in (True, False):
            ids = expected.encode(text, add_special_tokens=special)
            assert got.encode(text, add_special_tokens=special) == ids, text
            assert got.decode(ids, skip_special_tokens=special) == expected.decode(ids, skip_special_tokens=special)
            assert got.convert_ids_to_tokens(ids) == expected.convert_ids_to_tokens(ids)
    if expected.chat_template is None:
        return
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    assert got.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        expected.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    )


def test_a_gguf_tokenizer_is_converted_once_then_read_from_the_cache(
    default_source: ModelSource, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LMSERVE_CACHE", str(tmp_path))
    converted = load_tokenizer(default_source)
    (entry,) = (tmp_path / "tokenizers").iterdir()
    assert (entry / "tokenizer.json").is_file()

    calls = []
    original = transformers.PreTrainedTokenizerFast.from_pretrained.__func__

    def from_pretrained(cls, *args, **kwargs):
        calls.append(kwargs.get("gguf_file"))
        return original(cls, *args, **kwargs)

    def convert(path: Path):
        calls.append(path.name)
        return _converted_from_gguf(path)

    monkeypatch.setattr(transformers.PreTrainedTokenizerFast, "from_pretrained", classmethod(from_pretrained))
    monkeypatch.setattr(model_tokenizer, "_converted_from_gguf", convert)
    cached = load_tokenizer(default_source)
    assert calls == []  # read from the cache's folder by the constructor, not converted from the GGUF again
    assert_same_tokenizer(cached, converted)
    assert_same_tokenizer(_saved_tokenizer(entry), transformers.PreTrainedTokenizerFast.from_pretrained(entry))
    calls.clear()

    # A damaged entry is rebuilt, never fatal.
    (entry / "tokenizer.json").write_text("{not json")
    assert_same_tokenizer(load_tokenizer(default_source), converted)
    assert calls == [default_source.path.name]
    assert list((tmp_path / "tokenizers").iterdir()) == [entry] and (entry / "tokenizer.json").stat().st_size > 1000


def test_a_changed_file_gets_its_own_entry(
    default_source: ModelSource, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The entry is keyed by the file (path, size, modification time): a file replaced in place is converted anew,
    and the old file's entry, which no start can read again, is removed."""
    monkeypatch.setenv("LMSERVE_CACHE", str(tmp_path / "cache"))
    copy = tmp_path / "model.gguf"
    shutil.copyfile(default_source.path, copy)
    load_tokenizer(ModelSource("gguf", copy, "copy"))
    (first,) = (tmp_path / "cache" / "tokenizers").iterdir()
    copy.unlink()
    shutil.copyfile(default_source.path, copy)
    later = time.time() + 10
    os.utime(copy, (later, later))
    load_tokenizer(ModelSource("gguf", copy, "copy"))
    (second,) = (tmp_path / "cache" / "tokenizers").iterdir()
    assert second != first
    assert json.loads((second / tokenizer_cache.SOURCE_FILE).read_text())["mtime_ns"] == copy.stat().st_mtime_ns


def test_entries_no_start_would_read_are_removed_when_one_is_saved(
    default_source: ModelSource, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each file downloaded again, and each temporary file a test suite makes, would otherwise leave its vocabulary
    in the cache for good."""
    monkeypatch.setenv("LMSERVE_CACHE", str(tmp_path / "cache"))
    entries = tmp_path / "cache" / "tokenizers"
    live = tmp_path / "live.gguf"
    live.write_bytes(b"a model")
    month_ago = time.time() - (tokenizer_cache.UNUSED_DAYS + 1) * 86400

    def entry(name: str, source: Path | None, *, age: float | None = None) -> Path:
        folder = entries / name
        folder.mkdir(parents=True)
        (folder / "tokenizer.json").write_text("{}")
        if source is not None:
            tokenizer_cache.write_source(folder, source, "versions")
        if age is not None:
            os.utime(folder, (age, age))
        return folder

    entry("replaced-file", live)
    live.write_bytes(b"another model, downloaded again")
    kept = {entry("in-use", live), entry(".being-written", None)}
    entry("an-older-lmserves", None)
    gone = tmp_path / "gone.gguf"
    gone.write_bytes(b"a temporary model")
    entry("deleted-file", gone)
    gone.unlink()
    entry("unused-for-a-month", live, age=month_ago)
    entry(".abandoned", None, age=time.time() - 2 * tokenizer_cache.ABANDONED_STAGING_SECONDS)

    load_tokenizer(default_source)
    saved = {folder for folder in entries.iterdir() if folder.name.startswith(default_source.path.stem[:60])}
    assert len(saved) == 1
    assert set(entries.iterdir()) == kept | saved


def test_reading_an_entry_marks_it_used_and_records_an_older_entrys_file(
    default_source: ModelSource, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LMSERVE_CACHE", str(tmp_path))
    load_tokenizer(default_source)
    (entry,) = (tmp_path / "tokenizers").iterdir()
    (entry / tokenizer_cache.SOURCE_FILE).unlink()  # as an older lmserve saved it
    old = time.time() - 86400
    os.utime(entry, (old, old))
    load_tokenizer(default_source)
    assert entry.stat().st_mtime > old + 3600
    record = json.loads((entry / tokenizer_cache.SOURCE_FILE).read_text())
    assert record["path"] == str(default_source.path.resolve()) and record["size"] == default_source.path.stat().st_size


def test_a_cached_gemma_tokenizer_reads_back_as_from_pretrained_builds_it(
    tiny_gemma3_chat_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cache is read by the tokenizer's constructor over tokenizer.json (from_pretrained parses the file three
    more times in Python: a second of start-up for Gemma's vocabulary); a vocabulary with its own added tokens and
    chat template comes back as from_pretrained reads it."""
    monkeypatch.setenv("LMSERVE_CACHE", str(tmp_path))
    source = ModelSource("gguf", tiny_gemma3_chat_gguf, "gemma")
    converted = load_tokenizer(source)
    (entry,) = (tmp_path / "tokenizers").iterdir()
    cached = load_tokenizer(source)
    assert cached.chat_template and "<start_of_turn>" in cached.chat_template
    assert_same_tokenizer(cached, converted)
    assert_same_tokenizer(_saved_tokenizer(entry), transformers.PreTrainedTokenizerFast.from_pretrained(entry))


@pytest.mark.parametrize("fixture", ["default_source", "tiny_gemma3_chat_gguf"])  # a BPE and a SentencePiece vocabulary
def test_the_conversion_builds_what_transformers_gguf_path_builds(request: pytest.FixtureRequest, fixture: str) -> None:
    source = request.getfixturevalue(fixture)
    path = source.path if isinstance(source, ModelSource) else source
    expected = transformers.PreTrainedTokenizerFast.from_pretrained(path.parent, gguf_file=path.name,
                                                                    local_files_only=True)
    assert_same_tokenizer(_converted_from_gguf(path), expected)


def test_a_first_start_converts_without_importing_torch(default_source: ModelSource, tmp_path: Path) -> None:
    """The API process converts the vocabulary on a model's first start: transformers' GGUF reader would import torch
    there (~1.2 s and ~200 MiB, for the server's lifetime)."""
    code = ("import sys; from lmserve.model_tokenizer import load_tokenizer; from lmserve.models import resolve_model; "
            "t = load_tokenizer(resolve_model()); print(len(t), 'torch' in sys.modules)")
    env = {**os.environ, "LMSERVE_CACHE": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == [str(len(load_tokenizer(default_source))), "False"]
    assert (next((tmp_path / "tokenizers").iterdir()) / "tokenizer.json").is_file()  # converted here, not read


def test_a_transformers_without_the_pieces_converts_through_from_pretrained(
    default_source: ModelSource, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LMSERVE_CACHE", str(tmp_path))

    def missing(path: Path):
        raise ImportError("no gguf_tokenizer_mapping in this transformers")

    monkeypatch.setattr(model_tokenizer, "_converted_from_gguf", missing)
    expected = transformers.PreTrainedTokenizerFast.from_pretrained(
        default_source.path.parent, gguf_file=default_source.path.name, local_files_only=True)
    assert_same_tokenizer(load_tokenizer(default_source), expected)


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen3_dir", "tiny_gemma2_dir", "tiny_gemma3_dir",
                                     "tiny_qwen2_dir", "tiny_phi3_dir"])
@pytest.mark.parametrize("declared", ["TokenizersBackend", "PreTrainedTokenizerFast"])  # what save_pretrained, Llama 3 say
def test_a_directory_with_the_generic_class_loads_as_auto_tokenizer_builds_it(
    request: pytest.FixtureRequest, tmp_path: Path, fixture: str, declared: str
) -> None:
    """lmserve builds the generic fast tokenizer itself where AutoTokenizer would (without the config import that
    brings torch into the API process); Qwen2 and Phi-3 directories go through AutoTokenizer, which gives them
    their own classes."""
    directory = tmp_path / "model"
    shutil.copytree(request.getfixturevalue(fixture), directory)
    config_file = directory / "tokenizer_config.json"
    config_file.write_text(config_file.read_text().replace('"TokenizersBackend"', f'"{declared}"'))
    source = ModelSource("hf", directory, "model")
    assert model_tokenizer._plain_fast_tokenizer(directory) == (fixture not in ("tiny_qwen2_dir", "tiny_phi3_dir"))
    assert_same_tokenizer(load_tokenizer(source), transformers.AutoTokenizer.from_pretrained(directory))


def test_a_directory_tokenizer_loads_without_importing_torch(tiny_llama_dir: Path) -> None:
    code = ("import sys; from lmserve.model_tokenizer import load_tokenizer; from lmserve.models import ModelSource; "
            f"t = load_tokenizer(ModelSource('hf', __import__('pathlib').Path({str(tiny_llama_dir)!r}), 'tiny')); "
            "print(len(t), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["49152", "False"]
