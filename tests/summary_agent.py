"""The varied agent the summary tests run (tests/test_summaries.py): in the test's process,
or in a spawned worker configured by the environment alone (``worker``).

Each prompt ``p`` of a step is one kind of rollout (``KINDS[p % len(KINDS)]``): nested
agents, a tool that raises, a truncated last generation, generations returning a dict, an
object with ``response_ids`` or a plain id list, a root that raises (with a secret in its
message), a reward annotated after the rollout, an empty tool result and an empty
response (health findings). Deterministic: the same rollouts and values every run.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

KINDS = ("nested", "tool_raises", "truncated", "root_raises", "annotated", "empty_tool", "empty_response")
#: in the message of the exception a ``root_raises`` rollout raises: redacted wherever it is written
SECRET = "sk-proj-PLANTEDsk0123456789abcdef"


@dataclasses.dataclass
class Completion:
    """A generation's result as an object (veRL's TokenOutput is one)."""

    response_ids: list
    finish_reason: str


def build(rtrace: Any) -> Any:
    """``agent_loop(kind, p, r)``: the body of one rollout (inside its rollout_context)."""

    @rtrace.traced_generation(model="tiny")
    def gen_dict(prompt_ids, n=3, reason="stop"):
        return {"response_ids": list(range(100, 100 + n)), "finish_reason": reason}

    @rtrace.traced_generation
    def gen_object(prompt_ids):
        return Completion([5, 6], "stop")

    @rtrace.traced_generation
    def gen_ids(prompt_ids):
        return [7, 8, 9, 10]

    @rtrace.traced_tool(tool_name="calculator")
    def calc(tool_call_id, expression):
        if expression == "boom":
            raise ValueError(f"cannot evaluate {expression!r}")
        return "" if expression == "empty" else "42"

    @rtrace.traced(kind="agent")
    def planner(prompt_ids):
        out = gen_dict(prompt_ids)
        calc("c0", "6*7")
        return out

    @rtrace.traced_rollout
    def agent_loop(kind: str, p: int, r: int) -> None:
        prompt = [1, 2, 3, p]
        if kind == "nested":
            out = planner(prompt)
            gen_object(prompt + out["response_ids"])
        elif kind == "tool_raises":
            gen_ids(prompt)
            try:
                calc("c1", "boom")
            except ValueError:
                pass
            gen_dict(prompt + [7, 8, 9, 10])
        elif kind == "truncated":
            out = gen_dict(prompt)
            calc("c1", "1+1")
            gen_dict(prompt + out["response_ids"], n=5 + r, reason="length")
        elif kind == "root_raises":
            gen_dict(prompt)
            raise RuntimeError(f"rollout {p}/{r} failed (key {SECRET})")
        elif kind == "annotated":
            gen_object(prompt)
            calc("c1", "2*2")
        elif kind == "empty_tool":
            gen_dict(prompt)
            calc("c1", "empty")
        else:  # empty_response: an empty first turn, then a normal one (the last is not empty)
            gen_dict(prompt, n=0)
            gen_dict(prompt + [0])

    return agent_loop


def run(rtrace: Any, steps: int = 2, prompts: int = 7, n: int = 2, annotate: bool = True) -> int:
    """``steps`` x ``prompts`` x ``n`` rollouts (group ``p<prompt>``); each step's advantages (and
    the ``annotated`` kind's rewards) are annotated once the step's rollouts ended. Returns the
    number of rollouts."""
    agent_loop = build(rtrace)
    for step in range(steps):
        for p in range(prompts):
            kind = KINDS[p % len(KINDS)]
            for r in range(n):
                try:
                    with rtrace.rollout_context(step=step, sample_index=p, rollout_n=r, group_id=f"p{p}",
                                                policy_version=step):
                        if kind != "annotated":
                            rtrace.record_reward(float((p + r) % 3), correct=(p + r) % 3 == 2)
                        agent_loop(kind, p, r)
                except RuntimeError:
                    assert kind == "root_raises"
        if annotate:
            for p in range(prompts):
                for r in range(n):
                    values = {"advantage": (p - 3) / 4 + r}
                    if KINDS[p % len(KINDS)] == "annotated":
                        values["reward"] = 0.25 * (r + 1)
                    rtrace.annotate(step=step, sample_index=p, rollout_n=r, **values)
    return steps * prompts * n


def worker(env: dict[str, str], steps: int, prompts: int, n: int, out: Any) -> None:
    """A rollout worker (spawned) configured by ``env`` alone: runs :func:`run`, flushes, and
    puts its ``rtrace.stats()`` in ``out``."""
    os.environ.update(env)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import rtrace

    run(rtrace, steps, prompts, n)
    ok = rtrace.flush(60)
    out.put((ok, rtrace.stats()))
    out.close()
    out.join_thread()
    time.sleep(0.2)
    os._exit(0)
