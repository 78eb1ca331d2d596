"""The agent loops the benchmarks trace, shared so every benchmark measures the same: the
toy rollout (6 spans: rollout_context root, the agent, 2 generations, 2 tool calls, with
4-id responses and 2-character tool results) and a realistic one (:func:`make_realistic_agent`:
20 spans, a prompt of 512 ids growing each turn, 256-id responses, 500-character tool
results)."""

from __future__ import annotations

from typing import Any, Callable

SPANS_PER_TRAJECTORY = 6


def decorated_agent(generation: Callable, tool: Callable, rollout: Callable, turns: int = 2
                    ) -> Callable[[list[int]], Any]:
    """``agent(prompt_ids)``: ``turns`` generations and as many tool calls (2: the 6-span
    rollout with its root), decorated with the given tracer's decorators (rtrace's or
    another's: both benchmarks trace the same calls)."""

    @generation
    def generate(prompt_ids):
        return {"response_ids": [1, 2, 3, 4], "finish_reason": "stop"}

    @tool
    def calculator(tool_call_id, expression):
        return "42"

    @rollout
    def agent(prompt_ids):
        out = generate(prompt_ids)
        calculator("c1", "6*7")
        for turn in range(2, turns + 1):
            prompt_ids = prompt_ids + out["response_ids"]  # each turn continues the last
            out = generate(prompt_ids)
            calculator(f"c{turn}", "6*7")
        return out

    return agent


def make_agent(rtrace: Any, coordinates: Callable[[int], dict[str, Any]], turns: int = 2) -> Callable[[int], None]:
    """``trajectory(i)``: one rollout under ``rollout_context(**coordinates(i))`` with a reward
    (``2 + 2 * turns`` spans)."""
    run = decorated_agent(rtrace.traced_generation, rtrace.traced_tool, rtrace.traced_rollout, turns)

    def trajectory(i: int) -> None:
        with rtrace.rollout_context(**coordinates(i)):
            run([1, 2, 3, 4, 5, 6, 7, 8])
            rtrace.record_reward(1.0)

    return trajectory


#: the realistic rollout's sizes: turns (a generation and a tool call each), the first prompt's
#: ids, each response's ids, each tool result's characters and the ids it adds to the next prompt
TURNS, PROMPT_IDS, RESPONSE_IDS, TOOL_CHARS, TOOL_IDS = 9, 512, 256, 500, 128


def realistic_agent(generation: Callable, tool: Callable, rollout: Callable, in_place: bool = True
                    ) -> Callable[[list[int]], Any]:
    """``agent(prompt_ids)``: :data:`TURNS` turns of a generation (its prompt the previous
    prompt + response + the tool result's ids, as an agent loop that continues one token
    stream; a dict with ``response_ids``, ``finish_reason`` and text, as vLLM adapters
    return) and a tool call (a :data:`TOOL_CHARS`-character answer): with the
    ``rollout_context`` root, 2 + 2 * TURNS = 20 spans. The prompt grows ``in_place``
    (``prompt_ids += ...``, as veRL's ToolAgentLoop does), or as a new list each turn
    (``prompt_ids = prompt_ids + ...``). The program's own work is the same traced or not."""
    response = list(range(1000, 1000 + RESPONSE_IDS))
    answer = "x" * (TOOL_CHARS - 10)
    tool_ids = list(range(2000, 2000 + TOOL_IDS))

    @generation
    def generate(prompt_ids):
        return {"response_ids": response[:], "finish_reason": "tool_calls", "text": "<tool_call>search</tool_call>"}

    @tool
    def search(tool_call_id, query):
        return f"{tool_call_id:>10}"[:10] + answer

    @rollout
    def agent(prompt_ids):
        out = None
        for turn in range(TURNS):
            out = generate(prompt_ids)
            search(f"call-{turn}", "what is the capital of France")
            if in_place:  # the next turn continues this one
                prompt_ids += out["response_ids"]
                prompt_ids += tool_ids
            else:
                prompt_ids = prompt_ids + out["response_ids"] + tool_ids
        return out

    return agent


def make_realistic_agent(rtrace: Any, coordinates: Callable[[int], dict[str, Any]], in_place: bool = True
                         ) -> Callable[[int], None]:
    """``trajectory(i)``: one realistic rollout (:func:`realistic_agent`) under
    ``rollout_context(**coordinates(i))`` with a reward."""
    run = realistic_agent(rtrace.traced_generation, rtrace.traced_tool, rtrace.traced_rollout, in_place)
    prompt = list(range(10, 10 + PROMPT_IDS))

    def trajectory(i: int) -> None:
        with rtrace.rollout_context(**coordinates(i)):
            run(prompt[:])
            rtrace.record_reward(1.0)

    return trajectory
