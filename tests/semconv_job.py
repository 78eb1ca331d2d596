"""Trajectories that exercise every feature rtrace exports, for the conventions' tests.

``run(tok)`` (tracing configured by the caller: any sinks, ``token2text`` on with the
demo's tokenizer ``tok``) records, in this process:

* a demo-like agent loop: a ``rollout_context`` root, the decorated agent, generations
  given chat ``messages`` and token ids, a calculator tool (a captured call id), a lookup
  tool returning a gym step ``(obs, reward, done, info)`` (``rl.tool.*``), a tool that raises;
  rewards with outcome components, extra coordinates, a group and a policy version;
* a validation trajectory, a truncated one (``finish_reason`` ``length``), a failed one;
* annotations (``advantage``, ``returns``) awaited by the caller's settings or joined;
* a stale trajectory (``policy_version`` behind ``step``: the ``staleness`` health finding);
* a segment (``rtrace.extract`` of a carrier whose trajectory lives in "another process");
* a generation with a reasoning (``<think>``) answer, and one with only token ids;
* ``log_rollout_batch`` samples (tensor batch: ``rl.loss_tokens``, per-turn versions);
* a partial trajectory (its root never ends before ``rtrace.shutdown``) when
  ``partial=True``.

Everything is scripted, so tests know every text.
"""

from __future__ import annotations

import json
import threading
import uuid
from typing import Any

import rtrace

MODEL = "toy-policy"
SYSTEM = "You are a calculator agent."
QUESTION = "What is 17 * 3?"
ANSWER = "The answer is 51."
THOUGHT = "17 * 3 is 51"


class Policy:
    def __init__(self, tok: Any) -> None:
        self.tok = tok

    def ids(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    @rtrace.traced_generation(model=MODEL)
    def generate(self, messages, prompt_ids, temperature=0.7, reply="", finish="stop"):
        return {"id": f"chatcmpl-{len(messages)}", "response_ids": self.ids(reply), "finish_reason": finish}

    @rtrace.traced_generation
    def complete(self, prompt_ids, reply=""):
        """A generation given token ids only (its prompt is decoded by token2text), with the
        sampler's per-token logprobs."""
        ids = self.ids(reply)
        return {"response_ids": ids, "finish_reason": "stop", "logprobs": [-0.5] * len(ids)}


@rtrace.traced_tool
def calculator(tool_call_id, expression):
    a, op, b = expression.split()
    return str(int(a) * int(b) if op == "*" else int(a) + int(b))


@rtrace.traced_tool(name="lookup")
def lookup(key):
    """An environment step's shape: (observation, step reward, done, info)."""
    return ("found " + key, 0.5, False, {"hits": 1})


@rtrace.traced_tool
def broken(x):
    raise ZeroDivisionError("division by zero")


def _tool_call(call_id: str, name: str, arguments: dict) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


@rtrace.traced_rollout
def agent(policy: Policy, question: str, finish: str = "stop", fail: bool = False, think: bool = False) -> str:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    policy.generate(list(messages), policy.ids(question), reply='<tool_call>{"name": "calculator"}</tool_call>')
    messages.append({"role": "assistant", "content": "", "tool_calls": [
        _tool_call("call_1", "calculator", {"expression": "17 * 3"})]})
    result = calculator("call_1", "17 * 3")
    messages.append({"role": "tool", "tool_call_id": "call_1", "name": "calculator", "content": result})
    lookup("answer")
    if fail:
        broken(1)
    reply = f"<think>{THOUGHT}</think>{ANSWER}" if think else ANSWER
    policy.generate(list(messages), policy.ids(question), reply=reply, finish=finish)
    return reply


def run(tok: Any, partial: bool = False) -> dict[str, Any]:
    """Record the feature trajectories; returns what the tests check against (trace ids)."""
    policy = Policy(tok)
    ids: dict[str, Any] = {}
    # 1-2. a GRPO group of two training rollouts, rewarded with components
    for n, correct in ((0, True), (1, False)):
        with rtrace.rollout_context(step=1, sample_index=0, rollout_n=n, group_id="q0", policy_version=1,
                                    prompt_id="gsm8k-17") as ctx:
            agent(policy, QUESTION, think=n == 0)
            rtrace.record_reward(1.0 if correct else 0.0, correct=correct, format=0.5, answer="51")
        ids[f"train{n}"] = ctx.trace_id
    # 3. validation; 4. truncated; 5. failed (a tool raised, the rollout too)
    with rtrace.rollout_context(step=1, sample_index=1, rollout_n=0, validate=True) as ctx:
        agent(policy, QUESTION)
        rtrace.record_reward(1.0, correct=True)
    ids["validate"] = ctx.trace_id
    with rtrace.rollout_context(step=2, sample_index=2, rollout_n=0, policy_version=2) as ctx:
        agent(policy, QUESTION, finish="length")
        rtrace.record_reward(0.0)
    ids["truncated"] = ctx.trace_id
    try:
        with rtrace.rollout_context(step=2, sample_index=3, rollout_n=0, policy_version=2) as ctx:
            agent(policy, QUESTION, fail=True)
    except ZeroDivisionError:
        pass
    ids["failed"] = ctx.trace_id
    # 6. stale: policy_version 1 at step 5 (health: staleness); token ids only
    with rtrace.rollout_context(step=5, sample_index=4, rollout_n=0, policy_version=1) as ctx:
        policy.complete(policy.ids(QUESTION), reply=ANSWER)
        rtrace.record_reward(1.0, correct=True)
    ids["stale"] = ctx.trace_id
    # the trainer's per-token logprobs for it, off at its first token (logprob_mismatch)
    answer = policy.ids(ANSWER)
    rtrace.annotate_batch(step=5, sample_index=[4], rollout_n=[0],
                          old_logprob=[[-3.0] + [-0.5] * (len(answer) - 1)], loss_mask=[[1] * len(answer)])
    # annotations, as a trainer computes them after the batch
    rtrace.annotate(step=1, sample_index=0, rollout_n=0, advantage=0.7, returns=1.0)
    rtrace.annotate(step=1, sample_index=0, rollout_n=1, advantage=-0.7, returns=0.0)
    # 7. a segment: the part of a trajectory that ran in "another process"
    segment_trace = uuid.uuid4().hex  # a trace of its own per run: backends keep traces across runs
    carrier = {"traceparent": f"00-{segment_trace}-b7ad6b7169203331-01",
               "baggage": "rl.step=1,rl.sample_index=0,rl.rollout_n=0"}
    seen: list[Any] = []

    def worker() -> None:
        with rtrace.extract(carrier):
            seen.append(calculator("call_9", "6 * 7"))

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    ids["segment"] = segment_trace
    # 8. a tensor batch (two samples: a prompt, an assistant turn, a tool turn, an assistant turn)
    prompt, turn1, obs, turn2 = policy.ids(QUESTION), policy.ids("calc"), policy.ids("51"), policy.ids(ANSWER)
    row = prompt + turn1 + obs + turn2
    mask = [0] * len(prompt) + [1] * len(turn1) + [0] * len(obs) + [1] * len(turn2)
    rtrace.log_rollout_batch([row, row], loss_mask=[mask, mask], assistant_mask=[mask, mask],
                             prompt_lengths=[len(prompt)] * 2,
                             rewards=[1.0, 0.0], versions=[3, 3], n_samples_per_prompt=2, step=3,
                             finish_reasons=["stop", "stop"])
    # 9. partial: a root that has not ended when rtrace shuts down
    if partial:
        opened = rtrace.rollout_context(step=4, sample_index=9, rollout_n=0)
        opened.__enter__()
        calculator("call_p", "1 + 1")
        ids["partial_ctx"] = opened
    return ids
