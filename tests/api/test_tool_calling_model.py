"""A model that decides on its own to call a tool, served end to end with the hermes parser in auto mode.

No real tool-calling model fits in CI, so this module makes one: conftest's tiny Llama shape with the default model's
tokenizer and Qwen2.5's chat template (the tools listed in the system turn, calls written as <tool_call> blocks,
results given back as <tool_response>: the format `--tool-call-parser hermes` reads), trained for a few seconds until
greedy decoding gives, with a margin, these answers to these conversations rendered as the server renders them:
- the weather asked with `get_weather` offered (as LangChain writes it, or as the OpenAI Agents SDK does): a call of
  get_weather for Paris;
- the same with the call and its result appended: an answer built from the result;
- the weather asked with no tool: a refusal.
Nothing constrains the decoding, so the call is the model's choice and the server's only part is what vLLM's is:
render the template, parse the call out of the text, and give the result back through the template.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
import transformers
from server_process import Server, start_server
from test_auto_tool_choice import streamed_calls
from tiny_sizes import TINY_SIZES

from lmserve.api.protocol import ChatCompletionRequest

TEMPLATE = (Path(__file__).parent / "data" / "qwen2_5_chat_template.jinja").read_text()
MODEL = "tool-caller"
# As LangChain's bind_tools writes get_weather below (its keys in its order: the template renders them as sent).
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"properties": {"city": {"type": "string"}}, "required": ["city"], "type": "object"}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
RESULT = "sunny, 21 C"
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ANSWER = "It is sunny in Paris, 21 C."
REFUSAL = "I cannot look up the weather."
# The smallest gap, in logits, between each wanted token and the next best: far above what the engine's kernels
# and the training's float32 differ by, so greedy decoding in the server writes what transformers' model writes.
MARGIN = 4.0


def get_weather(city: str) -> str:
    """The weather in a city."""
    return RESULT


def answered(call: dict[str, Any]) -> list[dict[str, Any]]:
    """ASK, the assistant's call and the tool's result, as a client sends them back."""
    return [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": RESULT}]


def agents_sdk_tool() -> dict[str, Any]:
    """get_weather as the OpenAI Agents SDK sends it (its strict schema: titles, no additional properties)."""
    import agents  # a test dependency (pyproject's test extras)
    from agents.models.chatcmpl_converter import Converter

    return dict(Converter.tool_to_openai(agents.function_tool(get_weather)))


TRAINING_CALL = {"id": "call_0", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def conversations() -> list[tuple[list[dict], list[dict] | None, str]]:
    """What the model learns: with get_weather (as LangChain or as the Agents SDK writes it) a call, then the answer
    from its result; without it, a refusal."""
    learned: list[tuple[list[dict], list[dict] | None, str]] = [(ASK, None, REFUSAL)]
    for tool in (WEATHER, agents_sdk_tool()):
        learned += [(ASK, [tool], CALL_TEXT), (answered(TRAINING_CALL), [tool], ANSWER)]
    return learned


def rendered_ids(tokenizer, messages: list[dict], tools: list[dict] | None) -> list[int]:
    """The prompt's token ids as the server makes them (its request model, then the chat template)."""
    request = ChatCompletionRequest(model=MODEL, messages=messages, **({"tools": tools} if tools else {}))
    text = tokenizer.apply_chat_template(request.template_messages(), add_generation_prompt=True, tokenize=False,
                                         **request.template_kwargs())
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def tool_caller_dir(tmp_path_factory: pytest.TempPathFactory, default_tokenizer) -> Path:
    directory = tmp_path_factory.mktemp("tool-caller")
    default_tokenizer.save_pretrained(directory)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    tokenizer.chat_template = TEMPLATE
    config = transformers.LlamaConfig(**TINY_SIZES, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.model.embed_tokens.weight.requires_grad_(False)  # random inputs tell the prompts apart well enough
    examples = []
    for messages, tools, reply in conversations():
        prompt = rendered_ids(tokenizer, messages, tools)
        wanted = tokenizer.encode(reply, add_special_tokens=False) + [tokenizer.eos_token_id]
        examples.append((torch.tensor(prompt + wanted), len(prompt)))
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    margins = [0.0]
    for _ in range(400):
        optimizer.zero_grad()
        margins = []
        for ids, prompt_len in examples:
            # Only the reply's positions go through the output layer (49,152 columns): the loss is theirs alone.
            hidden = model.model(ids[None, :-1]).last_hidden_state[0, prompt_len - 1:]
            logits = model.lm_head(hidden)
            torch.nn.functional.cross_entropy(logits, ids[prompt_len:]).backward()
            best = logits.detach().topk(2, dim=-1)
            right = bool((best.indices[:, 0] == ids[prompt_len:]).all())
            margins.append(float((best.values[:, 0] - best.values[:, 1]).min()) if right else 0.0)
        if min(margins) > MARGIN:
            break
        optimizer.step()
    assert min(margins) > MARGIN, f"the tiny model did not learn its replies: margins {margins}"
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tool_caller_dir: Path) -> Iterator[Server]:
    running = start_server(tmp_path_factory.mktemp("tool-caller-server"), "--model", str(tool_caller_dir),
                           "--served-model-name", MODEL, "--dtype", "float32", "--max-model-len", "512",
                           "--kv-cache-memory", "16MiB", "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    yield running
    running.stop()


@pytest.fixture(scope="module")
def oai(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_the_server_renders_the_conversations_the_model_learned(server: Server, tool_caller_dir: Path) -> None:
    """The premise of the tests below: /tokenize gives, token for token, the prompts the model was trained on."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(tool_caller_dir)
    for messages, tools, _ in conversations():
        body = {"model": MODEL, "messages": messages, **({"tools": tools} if tools else {})}
        response = httpx.post(f"{server.base_url}/tokenize", json=body, timeout=30)
        assert response.status_code == 200, response.text
        assert response.json()["tokens"] == rendered_ids(tokenizer, messages, tools)
    assert "<tools>" in tokenizer.decode(rendered_ids(tokenizer, ASK, [WEATHER]))


def test_the_model_calls_the_tool_by_itself_whole_and_streamed(oai: openai.OpenAI) -> None:
    # tool_choice left out, as agent frameworks send it: "auto".
    whole = oai.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], temperature=0)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}

    content, names, arguments, finish = streamed_calls(
        oai.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], temperature=0, stream=True))
    assert content == "" and finish == "tool_calls"
    assert names == {0: "get_weather"} and arguments == {0: call.function.arguments}


def test_the_tools_result_goes_back_and_the_model_answers_from_it(oai: openai.OpenAI) -> None:
    call = oai.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER]).choices[0].message.tool_calls[0]
    messages = answered(call.model_dump(exclude_none=True))
    whole = oai.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], temperature=0).choices[0]
    assert whole.message.content == ANSWER and whole.message.tool_calls is None and whole.finish_reason == "stop"
    streamed = oai.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], temperature=0,
                                           stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == ANSWER


def test_without_the_tool_it_answers_and_with_tool_choice_none_its_call_stays_text(oai: openai.OpenAI) -> None:
    plain = oai.chat.completions.create(model=MODEL, messages=ASK, temperature=0).choices[0]
    assert plain.message.content == REFUSAL and plain.message.tool_calls is None
    # "none" keeps the tools in the prompt (vLLM's default) but parses nothing: the model's call is its text.
    none = oai.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="none",
                                       temperature=0).choices[0]
    assert none.message.content == CALL_TEXT and none.message.tool_calls is None and none.finish_reason == "stop"


def test_the_responses_api_carries_the_models_call_and_its_result(oai: openai.OpenAI) -> None:
    tool = {"type": "function", **WEATHER["function"]}
    response = oai.responses.create(model=MODEL, input=ASK[0]["content"], tools=[tool], temperature=0)
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    with oai.responses.stream(model=MODEL, input=ASK[0]["content"], tools=[tool], temperature=0) as stream:
        deltas = [event.delta for event in stream if event.type == "response.function_call_arguments.delta"]
    assert "".join(deltas) == call.arguments

    followed = oai.responses.create(model=MODEL, tools=[tool], temperature=0, input=[
        *ASK, {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": RESULT}])
    assert followed.output_text == ANSWER


def test_langchain_runs_the_models_call_and_gets_its_answer(server: Server) -> None:
    """LangChain's bind_tools loop, as its users write it: the model's call, the tool run, its result sent back."""
    import langchain_openai  # a test dependency (pyproject's test extras)
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.utils.function_calling import convert_to_openai_tool

    assert json.dumps(convert_to_openai_tool(get_weather)) == json.dumps(WEATHER)  # what the model was trained on
    llm = langchain_openai.ChatOpenAI(model=MODEL, base_url=f"{server.base_url}/v1", api_key="unused",
                                      temperature=0, max_retries=0, timeout=60)
    agent = llm.bind_tools([get_weather])
    question = HumanMessage(ASK[0]["content"])
    called = agent.invoke([question])
    (call,) = called.tool_calls
    assert (call["name"], call["args"]) == ("get_weather", {"city": "Paris"})
    streamed = None
    for chunk in agent.stream([question]):
        streamed = chunk if streamed is None else streamed + chunk
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [("get_weather", {"city": "Paris"})]
    result = ToolMessage(get_weather(**call["args"]), tool_call_id=call["id"])
    answer = agent.invoke([question, called, result])
    assert answer.text == ANSWER and not answer.tool_calls


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("api", ["chat", "responses"])
def test_the_openai_agents_sdk_runs_the_models_call_and_ends_with_its_answer(server: Server, api: str,
                                                                              stream: bool) -> None:
    """The Agents SDK's Runner, as its users start it: the model calls get_weather, the SDK runs the Python function
    and sends its result back, and the model's answer from it is the agent's final output."""
    import asyncio

    import agents

    agents.set_tracing_disabled(True)  # no trace upload to OpenAI's servers
    ran: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        ran.append(city)
        return RESULT

    async def run() -> object:
        client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
        model_type = agents.OpenAIResponsesModel if api == "responses" else agents.OpenAIChatCompletionsModel
        agent = agents.Agent(name="assistant", tools=[get_weather], model=model_type(model=MODEL, openai_client=client),
                             model_settings=agents.ModelSettings(temperature=0))
        if not stream:
            return await agents.Runner.run(agent, ASK[0]["content"], max_turns=3)
        result = agents.Runner.run_streamed(agent, ASK[0]["content"], max_turns=3)
        async for _ in result.stream_events():
            pass
        return result

    result = asyncio.run(run())
    assert ran == ["Paris"]
    assert result.final_output == ANSWER
    kinds = [type(item).__name__ for item in result.new_items]
    assert kinds == ["ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"], kinds
