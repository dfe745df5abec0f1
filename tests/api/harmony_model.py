"""A tiny model that speaks harmony on cue, for the server tests (tests/api/test_harmony_server.py).

A Qwen2 with harmony's special tokens and gpt-oss's chat template (so the server takes it for a harmony model) whose
output is scripted, whatever the prompt, as the FIM tests' model is (tests/api/test_fim.py): its layers add nothing
but one attention head, each scripted token's embedding is a dimension of its own, and the output head maps that
dimension to the next token. The script branches once, after the first `<|channel|>`:
- the conversation holds the word SUN (a user says it, or a tool's result does): the model thinks on the analysis
  channel, then answers on the final channel and ends with <|return|> (ANSWER);
- it does not: the model calls get_weather for Paris on the commentary channel and ends with <|call|> (CALL).
One attention head finds SUN anywhere before (its key is the SUN dimension, its query a constant on a RoPE pair that
barely turns over the context) and writes a "sun" feature that tips the branch.

A token has one successor, so a marker the script writes twice is spelled the second time in ordinary added tokens
(`<|chan` `nel|>`), whose text is the same: the parsers read text. After <|return|> and <|call|> the script has
nothing: only the server's stop tokens end the turn there.
"""

from __future__ import annotations

import copy
import itertools
from pathlib import Path

import transformers
from tiny_sizes import TINY_SIZES

TEMPLATE = (Path(__file__).parent / "data" / "gpt_oss_chat_template.jinja").read_text()
HARMONY_TOKENS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]
SUN = "☀"  # an added token: its embedding is the dimension the attention head looks for
# Second spellings of the markers, and a whole-word "assistant" so the prompt's last token is never the script's.
SPELLINGS = ["<|chan", "nel|>", "<|me", "ssage|>", "<|mess", "age|>", "assistant"]

THOUGHT, ANSWER_TEXT = "The user wants weather", "It is sunny"
ARGUMENTS = '{"city": "Paris"}'
# The pieces after the prompt's `<|start|>assistant`, as the model writes them (one token each).
BRANCH = "<|channel|>"
ANSWER = [BRANCH, "analysis", "<|message|>", "The", " user", " wants", " weather", "<|end|>", "<|start|>", "ass",
          "istant", "<|chan", "nel|>", "final", "<|me", "ssage|>", "It", " is", " sunny", "<|return|>"]
CALL = [BRANCH, "comment", "ary", " to", "=", "functions", ".", "get", "_", "weather", " ", "<|constrain|>", "json",
        "<|mess", "age|>", '{"', "city", '":', ' "', "Paris", '"}', "<|call|>"]


def build_harmony_model(directory: Path, default_tokenizer: transformers.PreTrainedTokenizerBase) -> Path:
    import torch

    tokenizer = copy.deepcopy(default_tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": HARMONY_TOKENS})
    tokenizer.add_tokens([SUN, *SPELLINGS])
    tokenizer.chat_template = TEMPLATE

    def token(piece: str) -> int:
        (token_id,) = tokenizer.encode(piece, add_special_tokens=False)
        return token_id

    start = tokenizer.convert_tokens_to_ids("assistant")  # the prompt's last token
    answer, call = [start, *map(token, ANSWER)], [start, *map(token, CALL)]
    # The two pieces "ass" "istant" must not be read as the added "assistant": ids of the vocabulary's own pieces.
    answer[ANSWER.index("ass") + 1:ANSWER.index("istant") + 2] = tokenizer.convert_tokens_to_ids(["ass", "istant"])
    scripted = set(answer) | set(call)
    assert len(scripted) == len(answer) + len(call) - 2, "a scripted token is used twice"
    assert tokenizer.decode(answer[1:]) == "".join(ANSWER) and tokenizer.decode(call[1:]) == "".join(CALL)

    config = transformers.Qwen2Config(**{**TINY_SIZES, "vocab_size": len(tokenizer)}, bos_token_id=None,
                                      eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False,
                                      rope_theta=1e6)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config)
    hidden, head_dim = config.hidden_size, config.hidden_size // config.num_attention_heads
    dims = iter(range(hidden))
    sun_dim, feature_dim, other_dim = next(dims), next(dims), next(dims)
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                         layer.self_attn.o_proj):
                proj.weight.zero_()
                if proj.bias is not None:
                    proj.bias.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed = model.model.embed_tokens.weight
        embed.zero_()
        embed[:, other_dim] = 1.0  # every other token: a dimension the output head ignores
        embed[token(SUN), other_dim] = 0.0
        embed[token(SUN), sun_dim] = 1.0
        # Head 0 of layer 0: query a constant, key the SUN dimension, on RoPE's slowest pair (head dims 7 and 15);
        # its value (the SUN dimension again) goes to the feature dimension. After the input norm a one-hot
        # embedding is 8, so the score is 5 * 5 * 8 / sqrt(16) = 50 at SUN, 0 elsewhere.
        attention = model.model.layers[0].self_attn
        slow = head_dim // 2 - 1
        attention.q_proj.bias[slow] = 5.0
        attention.k_proj.weight[slow, sun_dim] = 5.0
        attention.v_proj.weight[0, sun_dim] = 1.0 / 8
        attention.o_proj.weight[feature_dim, 0] = 1.0
        head = model.lm_head.weight
        head.zero_()
        for token_id in dict.fromkeys(answer + call):
            embed[token_id, other_dim] = 0.0
            embed[token_id, next(dims)] = 1.0
        branch = answer[1]
        for current, following in itertools.pairwise(answer):
            if current != branch:
                head[following, int(embed[current].argmax())] = 2.0  # logit 16 after the final norm (11.3 with sun)
        for current, following in itertools.pairwise(call[1:]):
            head[following, int(embed[current].argmax())] = 2.0
        # The branch: CALL's second token by default, ANSWER's (logit 8, 14.1 with the sun feature) when SUN was seen.
        head[answer[2], int(embed[branch].argmax())] = 1.0
        head[answer[2], feature_dim] = 1.5
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
