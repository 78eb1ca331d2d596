"""The agent loop the benchmarks trace: one rollout of 6 spans (rollout_context root,
the agent, 2 generations, 2 tool calls), shared so every benchmark measures the same."""

from __future__ import annotations

from typing import Any, Callable

SPANS_PER_TRAJECTORY = 6


def decorated_agent(generation: Callable, tool: Callable, rollout: Callable) -> Callable[[list[int]], Any]:
    """``agent(prompt_ids)``: 2 generations and 2 tool calls, decorated with the given
    tracer's decorators (rtrace's or another's: both benchmarks trace the same calls)."""

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
        out = generate(prompt_ids + out["response_ids"])
        calculator("c2", "6*7")
        return out

    return agent


def make_agent(rtrace: Any, coordinates: Callable[[int], dict[str, Any]]) -> Callable[[int], None]:
    """``trajectory(i)``: one rollout under ``rollout_context(**coordinates(i))`` with a reward."""
    run = decorated_agent(rtrace.traced_generation, rtrace.traced_tool, rtrace.traced_rollout)

    def trajectory(i: int) -> None:
        with rtrace.rollout_context(**coordinates(i)):
            run([1, 2, 3, 4, 5, 6, 7, 8])
            rtrace.record_reward(1.0)

    return trajectory
