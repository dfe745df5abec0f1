"""Chat templates for models whose files carry none, by architecture: what the model was trained on, so a chat
request to such a file gets the model's own turns rather than an error or another family's format (llama.cpp falls
back to ChatML, which Gemma was never trained on)."""

from __future__ import annotations

# Google's template for the Gemma 3 instruction-tuned models (tokenizer_config.json of google/gemma-3-*-it), text
# parts only: a system message becomes the start of the first user turn, the assistant is "model", and each turn
# ends with <end_of_turn>. Gemma 2 was trained on the same turns (its own template refuses a system message).
GEMMA_CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\\n' }}
{%- endif -%}
"""

BUILTIN_CHAT_TEMPLATES = {"gemma2": GEMMA_CHAT_TEMPLATE, "gemma3": GEMMA_CHAT_TEMPLATE,
                          "gemma3_text": GEMMA_CHAT_TEMPLATE}

# llama.cpp's end-of-generation tokens, found by their text in any GGUF vocabulary (llama-vocab.cpp): a GGUF header
# names one EOS, but an instruction-tuned model ends its turns with another (Gemma's <end_of_turn>, Qwen's
# <|im_end|> beside <|endoftext|>), and llama.cpp stops on all of them.
GGUF_END_OF_GENERATION_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>",
    "<|end_of_text|>", "<end_of_utterance>",
)  # fmt: skip
