"""The agent loop the benchmarks trace: one rollout of 6 spans (rollout_context root,
the agent, 2 generations, 2 tool calls), shared so every benchmark measures the same."""

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
