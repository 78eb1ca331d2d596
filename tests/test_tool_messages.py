"""Tool calls and chat sources in the conversation rtrace builds (rtrace/pipeline/messages.py).

Real decorated tools and ops, traced into rtrace's in-memory sink; each returns one of
the shapes agent frameworks use for a tool's answer: veRL's ``(ToolResponse, reward,
metrics)``, gym-style tuples (AReaL / SkyRL environments), SkyRL-Gym's step output,
OpenAI tool messages, plain strings and dicts.
"""

from __future__ import annotations

import json
from typing import Any, Optional

import pytest
from pydantic import BaseModel

import rtrace
import rtrace.testing
from rtrace.pipeline.messages import tool_arguments, tool_result


class ToolResponse(BaseModel):
    """veRL's ToolResponse (verl.tools.schemas)."""

    text: Optional[str] = None
    image: Optional[list[Any]] = None
    video: Optional[list[Any]] = None


class AgentData:
    """An agent-state object with object's default repr (veRL's AgentData)."""


@rtrace.traced_generation
def generate(prompt: str) -> str:
    return "calling the tool"


def run_tool(result: Any, **inputs: Any):
    """One trajectory: a generation, then a tool named ``calc`` returning ``result``."""

    @rtrace.traced_tool(name="calc")
    def calc(**kwargs: Any) -> Any:
        return result

    with rtrace.testing.capture() as got:
        with rtrace.rollout_context(step=1, sample_index=0):
            generate("What is 2 + 3?")
            calc(**inputs)
    (traj,) = got.trajectories
    (tool,) = traj.spans_of_kind("tool")
    return traj, tool


def tool_messages(traj) -> tuple[dict, dict]:
    (call,) = [c for m in traj.messages for c in m.get("tool_calls", [])]
    (answer,) = [m for m in traj.messages if m["role"] == "tool"]
    return call, answer


class TestToolShapes:
    def test_verl_triple(self):
        """veRL: (ToolResponse, reward, metrics) -> the text (+ media markers) as the tool
        message, reward and metrics as rl.tool.* attributes, the parameters as arguments
        (never instance_id nor the agent state, shown without its address)."""
        traj, tool = run_tool((ToolResponse(text="5", image=["<img>"]), 1.0, {"ok": True, "n": 3, "tags": ["a"]}),
                              instance_id="i-1", parameters={"expression": "2 + 3"}, agent_data=AgentData())
        call, answer = tool_messages(traj)
        assert json.loads(call["function"]["arguments"]) == {"expression": "2 + 3"}
        assert (answer["content"], answer["name"], answer["tool_call_id"]) == ("5 [image]", "calc", call["id"])
        assert tool.attributes["rl.tool.reward"] == 1.0
        assert (tool.attributes["rl.tool.metrics.ok"], tool.attributes["rl.tool.metrics.n"]) == (True, 3)
        assert tool.attributes["rl.tool.metrics.tags"] == ["a"]
        assert tool.input["agent_data"] == f"<{__name__}.AgentData object>"

    @pytest.mark.parametrize("result, content, reward, done, metrics", [
        (("obs text", 0.5, True, {"turn": 2}), "obs text", 0.5, True, {"turn": 2}),            # (obs, r, done, info)
        (("obs", -1, False, True, {"why": "len"}), "obs", -1.0, True, {"why": "len"}),      # gymnasium 5-tuple
        ({"observations": [{"role": "user", "content": "score: 3"}], "reward": 0.0, "done": False,
          "metadata": {"k": 1}}, "score: 3", 0.0, False, {"k": 1}),                            # SkyRL-Gym step
        ({"content": "42", "reward": 2}, "42", 2.0, None, None),
        ({"output": "stdout"}, "stdout", None, None, None),
        ("just text", "just text", None, None, None),
    ])
    def test_common_shapes(self, result, content, reward, done, metrics):
        traj, tool = run_tool(result, query="q")
        call, answer = tool_messages(traj)
        assert answer["content"] == content
        assert json.loads(call["function"]["arguments"]) == {"query": "q"}
        assert tool.attributes.get("rl.tool.reward") == reward
        assert tool.attributes.get("rl.tool.done") == done
        got = {k.removeprefix("rl.tool.metrics."): v for k, v in tool.attributes.items()
               if k.startswith("rl.tool.metrics.")}
        assert got == (metrics or {})

    def test_openai_tool_message(self):
        """An OpenAI tool message returned: its content, and its tool_call_id for the call."""
        traj, tool = run_tool({"role": "tool", "tool_call_id": "call_9", "content": [
            {"type": "text", "text": "sunny"}, {"type": "image_url", "image_url": {"url": "x"}}]},
                              arguments='{"city": "Paris"}')
        call, answer = tool_messages(traj)
        assert (call["id"], answer["tool_call_id"], answer["content"]) == ("call_9", "call_9", "sunny [image]")
        assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}

    def test_other_values_are_their_json(self):
        """A dict that is not an answer with companions, a list, a number: their JSON text."""
        assert tool_result({"result": 5, "unit": "C"}).content == '{"result": 5, "unit": "C"}'
        assert tool_result([1, 2.5]).content == "[1, 2.5]"
        assert tool_result(["a", "b"]).content == '["a", "b"]'
        assert tool_result(7).content == "7"
        assert (tool_result(["a", 1.0, {"m": 1}, "x"]).content, tool_result(["a", 1.0]).reward) == (
            '["a", 1.0, {"m": 1}, "x"]', 1.0)

    def test_arguments(self):
        assert tool_arguments({"tool_call_id": "c", "x": 1}) == {"x": 1}
        assert tool_arguments({"instance_id": "i", "parameters": {"a": 1}}) == {"a": 1}
        assert tool_arguments({"arguments": '{"a": 2}', "call_id": "c"}) == {"a": 2}
        assert tool_arguments({"arguments": "not json"}) == {"arguments": "not json"}

    def test_tool_error(self):
        @rtrace.traced_tool
        def broken(parameters):
            raise ValueError("boom")

        with rtrace.testing.capture() as got:
            with rtrace.rollout_context(step=1):
                generate("hi")
                with pytest.raises(ValueError):
                    broken({"a": 1})
        (traj,) = got.trajectories
        assert traj.messages[-1]["content"] == "error: ValueError: boom"
        assert "rl.tool.reward" not in traj.spans_of_kind("tool")[0].attributes


# ----------------------------------------------------------------------------- chat sources


class ChatLoop:
    @rtrace.traced
    def chat(self, messages: list[dict]) -> dict:
        return {"role": "assistant", "content": self.llm(messages)}

    @rtrace.traced_generation
    def llm(self, messages: list[dict]) -> str:
        return f"answer to {messages[-1]['content']}"

    @rtrace.traced_rollout
    def run(self, raw_prompt: list[dict]) -> dict:
        return {"response_text": "untraced model said hi"}


CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


class TestChatSources:
    def test_any_op_with_messages(self):
        """An op (not a generation) taking `messages` gives the conversation; the
        generation inside it gives the reply."""
        loop = ChatLoop()
        with rtrace.testing.capture() as got:
            with rtrace.rollout_context(step=1):
                loop.chat(CHAT)
        (traj,) = got.trajectories
        assert traj.messages == CHAT + [{"role": "assistant", "content": "answer to hi"}]

    def test_op_without_traced_generation_gives_its_output(self):
        """veRL's raw_prompt on the agent loop, no generation traced: the op's output
        (response_text) is the assistant turn, as veRL's trackio backend shows it."""
        with rtrace.testing.capture() as got:
            with rtrace.rollout_context(step=1):
                ChatLoop().run(CHAT)
        (traj,) = got.trajectories
        assert traj.messages == CHAT + [{"role": "assistant", "content": "untraced model said hi"}]

    def test_op_output_is_not_a_reply_when_a_generation_follows(self):
        """An op that formats the conversation into a prompt is not the assistant."""

        @rtrace.traced
        def format_prompt(messages: list[dict]) -> str:
            return "\n".join(m["content"] for m in messages)

        with rtrace.testing.capture() as got:
            with rtrace.rollout_context(step=1):
                generate(format_prompt(CHAT))
        (traj,) = got.trajectories
        assert traj.messages == CHAT + [{"role": "assistant", "content": "calling the tool"}]
