"""The processes of tests/test_timeline.py's job: rollout workers and a trainer, each its own
process with the collector's environment (``RTRACE_EXPORTER=collector``).

``python -m tests.timeline_job worker ID DIR GATEWAY_A GATEWAY_B``: two steps of
:data:`ROLLOUTS` concurrent rollouts (threads), each: a chat call through gateway A (even
rollouts) or B (odd) that asks for a tool, the tool (``sleep``), a second chat call, a pause in
the agent's own code (a wait), the reward computation, ``record_reward``. Before step 2 it waits
for the trainer's first weight update. A rollout of a step goes on past its first model call
only once the step's update is marked (so it runs across it), but step 2's last one, which
begins after it (it crosses none).

``python -m tests.timeline_job trainer DIR``: once both workers have their step's rollouts in
flight, ``rtrace.mark_weight_update(step, step=step)``; writes when (the clock just before and
just after the call) to ``DIR/update<step>.json``.

Files in DIR make the handshake: ``w<ID>.s<step>.started`` (every rollout of the step began),
``update<step>.json``.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

ROLLOUTS = 3
STEPS = (1, 2)
TOOL_S, WAIT_S, REWARD_S = 0.06, 0.04, 0.02
QUESTION = [{"role": "user", "content": "What is 2 + 3?"}]
TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "adds",
                                           "parameters": {"type": "object", "properties": {
                                               "expression": {"type": "string"}}}}}]


def version_of(step: int, i: int) -> int:
    """The policy version rollout ``i`` of ``step`` starts on: step 1 on version 0; in step 2,
    rollouts 0 and 1 on version 1, rollout 2 still on version 0 (two steps stale)."""
    return 0 if step == 1 or i == 2 else 1


def _wait_for(path: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(path)
        time.sleep(0.01)


def worker(wid: int, folder: str, gateways: list[str]) -> None:
    import httpx

    import rtrace

    @rtrace.traced_tool
    def calculator(expression: str) -> str:
        time.sleep(TOOL_S)
        return "5"

    @rtrace.traced(kind="reward")
    def compute_score(answer: str) -> float:
        time.sleep(REWARD_S)
        return 1.0 if "5" in answer else 0.0

    def rollout(step: int, i: int, started: threading.Barrier | None) -> None:
        if started is None:  # the late one: begins after the step's weight update
            _wait_for(os.path.join(folder, f"update{step}.json"))
        with rtrace.rollout_context(step=step, sample_index=10 * wid + i, rollout_n=0, group_id=f"g{wid}{i}",
                                    policy_version=version_of(step, i)):
            if started is not None:
                started.wait()
            access = rtrace.gateway_access(url=gateways[i % 2])
            with httpx.Client(timeout=60) as client:
                first = client.post(f"{access.base_url}/chat/completions", headers=access.headers,
                                    json={"model": "fake-policy", "messages": QUESTION, "tools": TOOLS}).json()
                if started is not None:  # in flight when the trainer marks the step's update
                    _wait_for(os.path.join(folder, f"update{step}.json"))
                call = first["choices"][0]["message"]["tool_calls"][0]
                result = calculator(json.loads(call["function"]["arguments"])["expression"])
                messages = QUESTION + [first["choices"][0]["message"],
                                       {"role": "tool", "tool_call_id": call["id"], "content": result}]
                second = client.post(f"{access.base_url}/chat/completions", headers=access.headers,
                                     json={"model": "fake-policy", "messages": messages, "tools": TOOLS}).json()
            time.sleep(WAIT_S)  # the agent's own code: neither a model call nor a tool
            rtrace.record_reward(compute_score(second["choices"][0]["message"]["content"] or ""))

    for step in STEPS:
        if step > 1:
            _wait_for(os.path.join(folder, f"update{step - 1}.json"))
        early = ROLLOUTS if step == 1 else ROLLOUTS - 1  # step 2's last rollout begins after the update
        started = threading.Barrier(early + 1)
        threads = []
        for i in range(ROLLOUTS):
            t = threading.Thread(target=rollout, args=(step, i, started if i < early else None))
            t.start()
            threads.append(t)
            time.sleep(0.02)  # staggered starts
        started.wait()
        time.sleep(0.05)  # every rollout is in its first model call
        open(os.path.join(folder, f"w{wid}.s{step}.started"), "w").close()
        for t in threads:
            t.join()
    assert rtrace.flush(60)


def trainer(folder: str) -> None:
    import rtrace

    for step in STEPS:
        for wid in (0, 1):
            _wait_for(os.path.join(folder, f"w{wid}.s{step}.started"))
        before = time.time_ns()
        rtrace.mark_weight_update(step, step=step, source="trainer")
        after = time.time_ns()
        with open(os.path.join(folder, f"update{step}.json"), "w") as f:
            json.dump({"before": before, "after": after, "pid": os.getpid()}, f)
    assert rtrace.flush(60)


if __name__ == "__main__":
    role = sys.argv[1]
    if role == "worker":
        worker(int(sys.argv[2]), sys.argv[3], sys.argv[4:6])
    else:
        trainer(sys.argv[2])
