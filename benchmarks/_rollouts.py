"""Synthetic finished trajectories for the dataset benchmark: 6 spans (rollout, agent, 2
generations, 2 tool calls) and ~2 KB of text (a 7-message conversation), with the
attributes rtrace's pipeline gives them. Deterministic in (step, index, seed)."""

from __future__ import annotations

import random
from typing import Any

from rtrace.trajectory import SpanRecord, Trajectory

_WORDS = ("the", "answer", "is", "compute", "sum", "of", "numbers", "tool", "call", "result", "check", "step",
          "value", "first", "then", "finally", "we", "get", "list", "python", "print", "x", "y", "total")


def _text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n_words))


def make_trajectory(step: int, index: int, group_size: int = 8, seed: int = 0, t0_ns: int = 1_700_000_000 * 10**9,
                    validate: bool = False) -> Trajectory:
    """One trajectory of ``step``: sample ``index // group_size``, rollout ``index % group_size``."""
    rng = random.Random(hash((seed, step, index, validate)) & 0xFFFFFFFF)
    sample, rollout = divmod(index, group_size)
    # a quarter of the groups all get the same reward: zero-variance groups
    flat = random.Random(hash((seed, step, sample)) & 0xFFFF).random() < 0.25
    reward = 1.0 if flat else float(rng.random() < 0.5)
    trace_id = "%032x" % rng.getrandbits(128)
    ids = ["%016x" % rng.getrandbits(64) for _ in range(6)]
    start = t0_ns + (step * 4096 + index) * 1_000_000
    coords = {"rl.step": step, "rl.sample_index": sample, "rl.rollout_n": rollout, "rl.validate": validate,
              "rl.experiment": "bench", "rl.group_id": f"p{sample}"}
    question = f"Problem {sample}: " + _text(rng, 40)
    system = "You are a careful assistant. Use the calculator tool when arithmetic is needed. " * 3
    a1, a2, a3 = _text(rng, 45), _text(rng, 45), _text(rng, 50)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": system},
        {"role": "user", "content": question},
        {"role": "assistant", "content": a1, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "6*7"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "name": "calculator", "content": "42"},
        {"role": "assistant", "content": a2, "tool_calls": [
            {"id": "c2", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "42+1"}'}}]},
        {"role": "tool", "tool_call_id": "c2", "name": "calculator", "content": "43"},
        {"role": "assistant", "content": a3},
    ]
    t = start

    def span(i: int, parent: int | None, name: str, kind: str, dur_ms: float, attrs: dict[str, Any], inp: Any = None,
             out: Any = None) -> SpanRecord:
        nonlocal t
        s = SpanRecord(span_id=ids[i], parent_id=None if parent is None else ids[parent], name=name, kind=kind,
                       start_ns=t, end_ns=t + int(dur_ms * 1e6), attributes={**coords, **attrs}, input=inp, output=out)
        t += int(dur_ms * 1e6) // 4
        return s

    gen = {"gen_ai.operation.name": "chat", "gen_ai.request.model": "qwen-tiny", "gen_ai.usage.input_tokens": 180,
           "gen_ai.usage.output_tokens": 60, "gen_ai.response.finish_reasons": ["stop"]}
    spans = [
        span(0, None, "rollout", "rollout", 40.0, {"rl.reward": reward}),
        span(1, 0, "agent", "agent", 38.0, {}, {"messages": messages[:2]}),
        span(2, 1, "qwen-tiny", "generation", 12.0, {**gen, "rtrace.message_index": 2}, None, {"text": a1}),
        span(3, 1, "calculator", "tool", 2.0, {"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "calculator",
                                              "gen_ai.tool.call.id": "c1"}, {"expression": "6*7"}, "42"),
        span(4, 1, "qwen-tiny", "generation", 11.0, {**gen, "rtrace.message_index": 4}, None, {"text": a2}),
        span(5, 1, "calculator", "tool", 2.0, {"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "calculator",
                                              "gen_ai.tool.call.id": "c2"}, {"expression": "42+1"}, "43"),
    ]
    return Trajectory(trace_id=trace_id, name="rollout", spans=spans, step=step, sample_index=sample,
                      rollout_n=rollout, validate=validate, experiment="bench", group_id=f"p{sample}", reward=reward,
                      outcome={"correct": reward > 0.5}, annotations={"advantage": reward - 0.5}, messages=messages,
                      health=[], kept=["sampled"])
