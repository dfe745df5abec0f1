"""The chat template's options that vLLM's chat requests carry: continue_final_message and add_special_tokens."""

from __future__ import annotations

from lmserve.frontend.input_processor import InputProcessor

MESSAGES = [{"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "The capital of France is"}]


def test_continue_final_message_leaves_the_last_turn_open(default_tokenizer) -> None:
    inputs = InputProcessor(default_tokenizer, max_model_len=256, vocab_size=len(default_tokenizer))
    closed = default_tokenizer.decode(inputs.render_chat(MESSAGES, False, {}))
    opened = default_tokenizer.decode(inputs.render_chat(MESSAGES, False, {"continue_final_message": True}))
    assert closed.rstrip().endswith("<|im_end|>")
    assert opened.endswith("The capital of France is") and opened in closed


def test_add_special_tokens_puts_the_tokenizers_own_in_front(default_tokenizer, monkeypatch) -> None:
    inputs = InputProcessor(default_tokenizer, max_model_len=256, vocab_size=len(default_tokenizer))
    plain = inputs.render_chat(MESSAGES[:1], True, {})
    # SmolLM2's tokenizer adds nothing of its own: a tokenizer that adds a BOS (Llama's) shows the difference.
    real_encode = default_tokenizer.encode

    def with_bos(text, add_special_tokens=True, **kwargs):
        return ([1] if add_special_tokens else []) + real_encode(text, add_special_tokens=False, **kwargs)

    monkeypatch.setattr(default_tokenizer, "encode", with_bos)
    assert inputs.render_chat(MESSAGES[:1], True, {}) == plain
    assert inputs.render_chat(MESSAGES[:1], True, {}, add_special_tokens=True) == [1, *plain]
