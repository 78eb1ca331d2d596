"""A small traced job for the browser test: a scripted tool-calling policy, real tokens.

Run as a script (``python tests/ui/traced_job.py PROJECT``) with ``TRACKIO_DIR`` set: it
writes two training steps (GRPO groups of two rollouts, some wrong, one answering without
the tool) and one validation trajectory to trackio, with token2text on (the demo's
offline tokenizer) and the trainer's advantages annotated, and prints the rollouts
(trace id, coordinates, question, verdict) as JSON. The policy is scripted so the test
knows every text the page must show: turn 1 asks for the calculator, turn 2 answers with
the tool's result (or, for a "wrong" rollout, with a wrong one).
"""

from __future__ import annotations

import asyncio
import json
import sys

import rtrace

SYSTEM = "You are a calculator agent. Call the calculator, then give the answer."
MODEL = "toy-policy"
#: (step, sample_index, rollout_n, question, expression, validate, mode): mode "tool" calls
#: the calculator and answers right, "wrong" calls it and answers wrong, "direct" answers
#: right without calling it
ROLLOUTS = [
    (1, 0, 0, "What is 17 * 3?", "17 * 3", False, "tool"),
    (1, 0, 1, "What is 17 * 3?", "17 * 3", False, "wrong"),
    (1, 1, 0, "What is 12 + 30?", "12 + 30", False, "tool"),
    (1, 1, 1, "What is 12 + 30?", "12 + 30", False, "direct"),
    (2, 2, 0, "What is 9 * 8?", "9 * 8", False, "wrong"),
    (2, 2, 1, "What is 9 * 8?", "9 * 8", False, "tool"),
    (2, 3, 0, "Evaluate 6 * 7.", "6 * 7", True, "tool"),
]


def tool_call_text(expression: str) -> str:
    return f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}</tool_call>'


def answer_text(value: str) -> str:
    return f"The answer is {value}."


def evaluate(expression: str) -> int:
    a, op, b = expression.split()
    return int(a) * int(b) if op == "*" else int(a) + int(b)


class Policy:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    @rtrace.traced_generation(model=MODEL)
    async def generate(self, messages, prompt_ids, temperature=1.0, mode="tool", expression=""):
        """Scripted: the calculator call first, then the answer with the tool's result."""
        await asyncio.sleep(0.01)
        if mode == "direct":
            text = answer_text(str(evaluate(expression)))
        elif messages[-1]["role"] == "user":
            text = tool_call_text(expression)
        else:
            result = int(messages[-1]["content"])
            text = answer_text(str(result + 1 if mode == "wrong" else result))
        return {"response_ids": self.tokenizer(text, add_special_tokens=False)["input_ids"], "finish_reason": "stop"}


class Calculator:
    name = "calculator"

    @rtrace.traced_tool
    async def execute(self, tool_call_id, expression):
        return str(evaluate(expression))


async def episode(policy: Policy, question: str, expression: str, mode: str) -> str:
    tok = policy.tokenizer
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    for turn in (1, 2):
        prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        out = await policy.generate(list(messages), tok(prompt, add_special_tokens=False)["input_ids"],
                                    temperature=0.7, mode=mode, expression=expression)
        text = tok.decode(out["response_ids"], skip_special_tokens=True)
        if turn == 1 and mode != "direct":
            call_id = "call_1"
            # the turn is kept without its tool-call markup, as veRL's ToolAgentLoop and the demo do
            messages.append({"role": "assistant", "content": "", "tool_calls": [
                {"id": call_id, "type": "function",
                 "function": {"name": "calculator", "arguments": json.dumps({"expression": expression})}}]})
            result = await Calculator().execute(call_id, expression)
            messages.append({"role": "tool", "tool_call_id": call_id, "name": "calculator", "content": result})
        else:
            return text
    return text


async def main(project: str) -> list[dict]:
    from rtrace.demo import build_tokenizer

    tok = build_tokenizer()
    rtrace.configure(exporter="trackio", project=project, experiment="ui-run", token2text=True, tokenizer=tok,
                     await_annotations="advantage", annotation_timeout_s=60)
    policy = Policy(tok)
    out = []
    for step, index, n, question, expression, validate, mode in ROLLOUTS:
        with rtrace.rollout_context(step=step, sample_index=index, rollout_n=n, validate=validate,
                                    group_id=f"q{index}", policy_version=step) as ctx:
            answer = await episode(policy, question, expression, mode)
            correct = answer == answer_text(str(evaluate(expression)))
            rtrace.record_reward(1.0 if correct else 0.0, correct=correct)
        out.append({"trace_id": ctx.trace_id, "step": step, "sample_index": index, "rollout_n": n,
                    "question": question, "validate": validate, "mode": mode, "correct": correct,
                    "answer": answer})
    # the trainer's GRPO advantages (reward minus its group's mean, over the group's std)
    for row in out:
        if row["validate"]:
            continue
        group = [r for r in out if r["step"] == row["step"] and r["sample_index"] == row["sample_index"]]
        rewards = [float(r["correct"]) for r in group]
        mean = sum(rewards) / len(rewards)
        std = (sum((x - mean) ** 2 for x in rewards) / len(rewards)) ** 0.5
        row["advantage"] = (float(row["correct"]) - mean) / std if std else 0.0
        rtrace.annotate(step=row["step"], sample_index=row["sample_index"], rollout_n=row["rollout_n"],
                        advantage=row["advantage"])
    assert rtrace.flush(60)
    rtrace.shutdown()
    return out


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1]))))
