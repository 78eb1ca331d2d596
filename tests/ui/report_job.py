"""A small GRPO job for the report's browser test: real rtrace, two workers' JSONL files.

Run as a script (``python tests/ui/report_job.py OUT_DIR``): 3 training steps x 3 prompts x
4 rollouts of a scripted tool-calling policy (turn 1 calls the calculator, turn 2 answers),
then 2 validation trajectories at step 3, traced with rtrace's decorators into JSONL. The
even rollouts are written by one configuration (``worker0.jsonl``) and the odd ones by
another (``worker1.jsonl``), as two workers would. Rewards, advantages (annotated by the
"trainer", GRPO: ``(r - mean) / (std + 1e-6)``), one crashed episode, one truncated
generation and one slow tool call are scripted (:data:`PASS`, :data:`ERROR`,
:data:`TRUNCATED`, :data:`SLOW`), so the test knows every value the page must show.

Rollout health: the job runs with the pipeline's checks off (``health: null`` on every
line, as a file written without them) and then sets ``health`` on the training lines to
scripted findings (an empty list when healthy; :data:`HEALTH` holds the findings), so the
test knows every value; the validation lines keep ``null``: their health is unknown.
tests/test_health.py checks the pipeline's own findings.

Prints ``{"paths": [...], "trace_ids": {"step-prompt-rollout": id}}`` as JSON.
"""

from __future__ import annotations

import json
import os
import sys
import time

import rtrace

SYSTEM = "You are a calculator agent. Call the calculator, then give the answer."
#: prompt -> (question, a, b); prompt ids follow a prompt across steps (group ids do not)
PROMPTS = {0: ("What is 17 * 3?", 17, 3), 1: ("What is 23 * 4?", 23, 4), 2: ("What is 12 * 12?", 12, 12)}
#: (step, prompt) -> whether each of the 4 rollouts answers correctly
PASS = {(1, 0): (1, 1, 0, 1), (2, 0): (1, 1, 1, 1), (3, 0): (1, 1, 1, 1),
        (1, 1): (0, 0, 1, 0), (2, 1): (1, 0, 1, 0), (3, 1): (1, 1, 1, 1),
        (1, 2): (0, 0, 0, 0), (2, 2): (0, 1, 0, 0), (3, 2): (1, 0, 1, 1)}
ERROR = (2, 1, 3)       # (step, prompt, rollout): the tool crashes, the episode ends in error
TRUNCATED = (3, 2, 1)   # the answer is cut by the length limit: finish reason "length"
SLOW = (1, 0, 2)        # the calculator takes 0.4 s: the slowest trajectory of step 1
HEALTH = {(2, 1, 0): [{"check": "token_continuity", "detail": "turn 2: prompt ids do not extend turn 1's at 57"}],
          (3, 0, 1): [{"check": "retokenization", "detail": "response re-encodes to 3 tokens fewer"}]}
VALIDATION = [(3, 10, "What is 6 * 7?", 6, 7), (3, 11, "What is 9 * 9?", 9, 9)]
MODEL = "toy-policy"


def reasoning(a: int, b: int, value: int) -> str:
    return f"I multiplied {a} by {b} with the calculator and it returned {value}."


def answer_text(step: int, prompt: int, rollout: int) -> str:
    """The final answer a rollout writes (the test reads the same function)."""
    _, a, b = PROMPTS[prompt]
    if (step, prompt, rollout) == TRUNCATED:
        return reasoning(a, b, a * b) + " The answer is"
    right = PASS[(step, prompt)][rollout]
    value = a * b if right else a * b + 1 + rollout
    return reasoning(a, b, a * b) + f" The answer is {value}."


def reward_of(step: int, prompt: int, rollout: int) -> float | None:
    if (step, prompt, rollout) == ERROR:
        return None
    if (step, prompt, rollout) == TRUNCATED:
        return 0.0
    return float(PASS[(step, prompt)][rollout])


def advantages(step: int, prompt: int) -> list[float]:
    rewards = [reward_of(step, prompt, r) or 0.0 for r in range(4)]
    mean = sum(rewards) / 4
    std = (sum((r - mean) ** 2 for r in rewards) / 4) ** 0.5
    return [(r - mean) / (std + 1e-6) for r in rewards]


@rtrace.traced_generation(model=MODEL)
def generate(messages, prompt_ids, final_text):
    if messages[-1]["role"] == "user":
        text = f"<tool_call>{json.dumps({'name': 'calculator', 'arguments': {'expression': 'a * b'}})}</tool_call>"
        return {"content": text, "response_ids": list(range(12)), "finish_reason": "tool_calls"}
    finish = "length" if final_text.endswith("is") else "stop"
    return {"content": final_text, "response_ids": list(range(len(final_text.split()))), "finish_reason": finish}


@rtrace.traced_tool(tool_name="calculator")
def calculator(tool_call_id, expression, delay=0.005, crash=False):
    time.sleep(delay)
    if crash:
        raise TimeoutError("calculator did not answer within 30 s")
    a, _, b = expression.split()
    return str(int(a) * int(b))


def episode(question: str, a: int, b: int, final: str, delay: float, crash: bool) -> None:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    out = generate(list(messages), list(range(20)), final)
    messages.append({"role": "assistant", "content": out["content"], "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "calculator", "arguments": json.dumps({"expression": f"{a} * {b}"})}}]})
    result = calculator("call_1", f"{a} * {b}", delay=delay, crash=crash)
    messages.append({"role": "tool", "tool_call_id": "call_1", "name": "calculator", "content": result})
    generate(list(messages), list(range(40)), final)


def run_worker(path: str, parity: int, ids: dict[str, str]) -> None:
    rtrace.configure(exporter="jsonl", jsonl_path=path, export_interval_s=0.02, await_annotations="advantage",
                     annotation_timeout_s=0.5, health_checks="none")
    for step in (1, 2, 3):
        for prompt, (question, a, b) in PROMPTS.items():
            for rollout in range(parity, 4, 2):
                key = (step, prompt, rollout)
                try:
                    with rtrace.rollout_context(step=step, sample_index=prompt, rollout_n=rollout,
                                                group_id=f"s{step}-q{prompt}", policy_version=step,
                                                prompt_id=f"arith-{prompt}") as ctx:
                        ids[f"{step}-{prompt}-{rollout}"] = ctx.trace_id
                        episode(question, a, b, answer_text(*key), 0.4 if key == SLOW else 0.005, key == ERROR)
                        reward = reward_of(*key)
                        rtrace.record_reward(reward, correct=reward == 1.0)
                except TimeoutError:
                    pass
                rtrace.annotate(step=step, sample_index=prompt, rollout_n=rollout,
                                advantage=advantages(step, prompt)[rollout])
    if parity == 0:
        for step, index, question, a, b in VALIDATION:
            with rtrace.rollout_context(step=step, sample_index=index, rollout_n=0, validate=True,
                                        group_id=f"val-{index}", prompt_id=f"val-{index}") as ctx:
                ids[f"val-{index}"] = ctx.trace_id
                episode(question, a, b, reasoning(a, b, a * b) + f" The answer is {a * b}.", 0.005, False)
                rtrace.record_reward(1.0, correct=True)
    assert rtrace.flush(60)
    rtrace.shutdown()


def add_health(path: str, ids: dict[str, str]) -> None:
    """``health`` on every training line, as the checked pipeline writes it."""
    findings = {ids[f"{s}-{p}-{r}"]: f for (s, p, r), f in HEALTH.items()}
    lines = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            data = json.loads(line)
            if not data["validate"]:
                data["health"] = findings.get(data["trace_id"], [])
            lines.append(json.dumps(data, separators=(",", ":")))
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def main(out_dir: str) -> dict:
    ids: dict[str, str] = {}
    paths = [os.path.join(out_dir, f"worker{w}.jsonl") for w in (0, 1)]
    for parity, path in enumerate(paths):
        run_worker(path, parity, ids)
    for path in paths:
        add_health(path, ids)
    return {"paths": paths, "trace_ids": ids}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
