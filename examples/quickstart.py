"""rtrace's quick start, as the README shows it: a traced tool-calling agent loop, runnable.

    pip install "rtrace[trackio]"
    python examples/quickstart.py          # then: trackio show --project quickstart

The "model" is a stand-in that calls the calculator once and then answers, and the
tokenizer is characters: put your inference engine and tokenizer in their place.
"""

import asyncio
import json

import rtrace


class CharTokenizer:
    """A stand-in tokenizer (one id per character): use your model's."""

    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


tokenizer = CharTokenizer()


@rtrace.traced_generation                     # an LLM call: token ids, usage, finish reason
async def generate(prompt_ids):
    text = tokenizer.decode(prompt_ids)       # your inference server / engine goes here
    if "<result>" not in text:
        reply = '<tool_call>{"name": "calculator", "arguments": {"expression": "6 * 7"}}</tool_call>'
    else:
        reply = "The answer is " + text.rsplit("<result>", 1)[1].split("</result>")[0] + "."
    return {"response_ids": tokenizer.encode(reply), "finish_reason": "stop"}


@rtrace.traced_tool                           # a tool call: name, arguments, result, error
async def calculator(tool_call_id, expression):
    a, op, b = expression.split()
    return str(int(a) * int(b) if op == "*" else int(a) + int(b))


def parse_tool_call(response_ids):            # your parser
    text = tokenizer.decode(response_ids)
    if "<tool_call>" not in text:
        return None
    return json.loads(text.split("<tool_call>")[1].split("</tool_call>")[0])


@rtrace.traced_rollout                        # the agent loop: token in, token out
async def agent_loop(prompt_ids):
    for turn in range(4):
        out = await generate(prompt_ids)
        prompt_ids = prompt_ids + out["response_ids"]
        call = parse_tool_call(out["response_ids"])
        if call is None:
            return tokenizer.decode(out["response_ids"])
        result = await calculator(f"call_{turn}", call["arguments"]["expression"])
        prompt_ids = prompt_ids + tokenizer.encode(f"<result>{result}</result>")
    return ""


async def rollout(step, sample_index, n, question):
    with rtrace.rollout_context(step=step, sample_index=sample_index, rollout_n=n,
                                group_id=f"p{sample_index}", policy_version=step):
        answer = await agent_loop(tokenizer.encode(question))
        correct = answer.endswith("42.")
        rtrace.record_reward(1.0 if correct else 0.0, correct=correct)   # on the trajectory's root


rtrace.configure(exporter="trackio", project="quickstart", experiment="run-1",
                 token2text=True, tokenizer=tokenizer, max_traces_per_step=32)
asyncio.run(rollout(step=1, sample_index=0, n=0, question="What is 6 * 7?"))
rtrace.flush()
