"""An agent framework pointed at the server as its users point it: LangChain's ChatOpenAI with `bind_tools`, through
chat completions and through the Responses API, streamed and not. The fake engine answers with the last message's
words, so the model "calls" the tool when the user message is a Hermes tool call, as Qwen2.5 writes one."""

from __future__ import annotations

from collections.abc import Iterator

import langchain_openai  # a test dependency (pyproject's test extras): missing, this file fails rather than skips
import pytest
from test_api_fake_engine import MODEL, ServerThread
from test_responses import CALL, RenderingEngine

from lmserve.api.server import build_app
from lmserve.api.serving import ToolConfig


def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    tools = ToolConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")
    with ServerThread(build_app(RenderingEngine(), tools=tools)) as running:
        yield f"{running.url}/v1"


@pytest.mark.parametrize("use_responses_api", [False, True], ids=["chat", "responses"])
def test_langchain_bind_tools_gets_the_call_and_the_answer(url: str, use_responses_api: bool) -> None:
    llm = langchain_openai.ChatOpenAI(model=MODEL, base_url=url, api_key="unused", max_retries=0, timeout=10,
                                      use_responses_api=use_responses_api)
    agent = llm.bind_tools([get_weather])
    called = agent.invoke(CALL)
    assert [(c["name"], c["args"]) for c in called.tool_calls] == [("get_weather", {"city": "Paris"})]
    streamed = None
    for chunk in agent.stream(CALL):
        streamed = chunk if streamed is None else streamed + chunk
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [("get_weather", {"city": "Paris"})]
    # The tool's result goes back as the framework sends it, and the answer comes back as text.
    from langchain_core.messages import HumanMessage, ToolMessage

    answer = agent.invoke([HumanMessage(CALL), called, ToolMessage("sunny", tool_call_id=called.tool_calls[0]["id"])])
    assert answer.text == "sunny" and not answer.tool_calls


# ------------------------------------------------------------------------------ the OpenAI Agents SDK (openai-agents)


def agents_sdk_run(url: str, api: str, stream: bool) -> tuple[object, list[str]]:
    """One Agents SDK run of an agent with a function tool, on a fresh client (an asyncio.run each)."""
    import asyncio

    import agents  # a test dependency, as langchain_openai
    import openai

    agents.set_tracing_disabled(True)  # no trace upload to OpenAI's servers
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    async def run() -> object:
        client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=10)
        model_type = agents.OpenAIResponsesModel if api == "responses" else agents.OpenAIChatCompletionsModel
        agent = agents.Agent(name="assistant", instructions="Use the tools.", tools=[get_weather],
                             model=model_type(model=MODEL, openai_client=client))
        if not stream:
            return await agents.Runner.run(agent, CALL, max_turns=3)
        result = agents.Runner.run_streamed(agent, CALL, max_turns=3)
        async for _ in result.stream_events():
            pass
        return result

    return asyncio.run(run()), calls


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("api", ["chat", "responses"])
def test_the_openai_agents_sdk_calls_the_tool_and_answers_with_its_result(url: str, api: str, stream: bool) -> None:
    """The Agents SDK's loop through the server: the model's call (a Hermes tool call, the fake engine's echo of the
    input) runs the Python function, its result goes back as the SDK sends tool results (a function_call_output item,
    or a tool message), and the echoed result is the agent's final answer."""
    result, calls = agents_sdk_run(url, api, stream)
    assert calls == ["Paris"]
    assert result.final_output == "sunny in Paris"
    kinds = [type(item).__name__ for item in result.new_items]
    assert kinds == ["ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"], kinds
