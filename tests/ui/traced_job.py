"""A small traced job for the browser test: a scripted tool-calling policy, real tokens.

Run as a script (``python tests/ui/traced_job.py PROJECT``) with ``TRACKIO_DIR`` set: it
writes two training trajectories (step 1) and one validation trajectory to trackio, with
token2text on (the demo's offline tokenizer), and prints their trace ids as JSON. The
policy is scripted so the test knows every text the page must show: turn 1 asks for
the calculator, turn 2 answers with the tool's result.
"""

from __future__ import annotations

import asyncio
import json
import sys

import rtrace

SYSTEM = "You are a calculator agent. Call the calculator, then give the answer."
MODEL = "toy-policy"
#: (question, expression, validate)
TASKS = [("What is 17 * 3?", "17 * 3", False), ("What is 12 + 30?", "12 + 30", False),
         ("Evaluate 6 * 7.", "6 * 7", True)]
EXPRESSIONS = {q: e for q, e, _ in TASKS}


def tool_call_text(expression: str) -> str:
    return f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}</tool_call>'


def answer_text(value: str) -> str:
    return f"The answer is {value}."


class Policy:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    @rtrace.traced_generation(model=MODEL)
    async def generate(self, messages, prompt_ids, temperature=1.0):
        """Scripted: the calculator call first, then the answer with the tool's result."""
        await asyncio.sleep(0.01)
        if messages[-1]["role"] == "user":
            text = tool_call_text(EXPRESSIONS[messages[-1]["content"]])
        else:
            text = answer_text(messages[-1]["content"])
        return {"response_ids": self.tokenizer(text, add_special_tokens=False)["input_ids"], "finish_reason": "stop"}


class Calculator:
    name = "calculator"

    @rtrace.traced_tool
    async def execute(self, tool_call_id, expression):
        a, op, b = expression.split()
        return str(int(a) * int(b) if op == "*" else int(a) + int(b))


async def episode(policy: Policy, question: str) -> str:
    tok = policy.tokenizer
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    for turn in (1, 2):
        prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        out = await policy.generate(list(messages), tok(prompt, add_special_tokens=False)["input_ids"],
                                    temperature=0.7)
        text = tok.decode(out["response_ids"], skip_special_tokens=True)
        if turn == 1:
            call_id = "call_1"
            messages.append({"role": "assistant", "content": text, "tool_calls": [
                {"id": call_id, "type": "function",
                 "function": {"name": "calculator", "arguments": json.dumps({"expression": EXPRESSIONS[question]})}}]})
            result = await Calculator().execute(call_id, EXPRESSIONS[question])
            messages.append({"role": "tool", "tool_call_id": call_id, "name": "calculator", "content": result})
    return text


async def main(project: str) -> dict[str, str]:
    from rtrace.demo import build_tokenizer

    tok = build_tokenizer()
    rtrace.configure(exporter="trackio", project=project, experiment="ui-run", token2text=True, tokenizer=tok)
    policy = Policy(tok)
    ids = {}
    for i, (question, expression, validate) in enumerate(TASKS):
        with rtrace.rollout_context(step=1, sample_index=i, rollout_n=0, validate=validate, group_id=f"q{i}",
                                    policy_version=1) as ctx:
            answer = await episode(policy, question)
            a, op, b = expression.split()
            expected = str(int(a) * int(b) if op == "*" else int(a) + int(b))
            correct = answer == answer_text(expected)
            rtrace.record_reward(1.0 if correct else 0.0, correct=correct)
        ids[question] = ctx.trace_id
    assert rtrace.flush(60)
    rtrace.shutdown()
    return ids


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1]))))
