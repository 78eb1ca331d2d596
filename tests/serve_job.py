"""A small GRPO job traced by real rtrace into a Parquet dataset and JSONL at once, for
``rtrace serve``'s tests (tests/test_serve.py) and its browser test (tests/ui/test_serve_page.py).

3 training steps x 3 prompts x 4 rollouts (prompt ids ``q0``..``q2`` recur across steps),
each one generation whose response ids a small word tokenizer (the job's own, handed to
token2text) decodes; the sampler's logprobs travel in the generation's output and the
"trainer" annotates per-token ``old_logprob``, ``loss_mask`` and ``entropy``, and the
scalar advantage. Rewards have two components (``reward/accuracy``, ``reward/format``,
as TRL records them) and ``correct``. Scripted, so the tests know every value:

- :data:`HOSTILE` (step 2, prompt 1, rollout 2): its answer is HTML and script
  (``</pre><script>...``, ``<img ... onerror=...>``); its task too (:data:`HOSTILE_TASK`);
- :data:`CRASH` ends in error with an HTML error message; :data:`LONG` is cut at the
  length limit; :data:`MISMATCH`'s trainer logprob differs at one token (the
  ``logprob_mismatch`` check finds it); :data:`RETOK`'s response re-encodes differently
  (a ``retokenization`` finding at token 2).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import rtrace

STEPS, PROMPTS, ROLLOUTS = 3, 3, 4
#: the tokenizer's vocabulary: id -> text
WORDS = ["The", " answer", " is", " 4", "2", ".", " wrong", "</pre><script>alert(\"x\")</script>",
         "<img src=x onerror=alert(1)>", " long", " and", " so", " on"]
HOSTILE = (2, 1, 2)
HOSTILE_TASK = 'Is 2 < 3 && "a" > \'b\'? <b>bold</b><script>alert("task")</script>'
CRASH = (3, 0, 1)
CRASH_ERROR = "<svg onload=alert(1)> tool crashed"
LONG = (1, 2, 3)
MISMATCH = (2, 0, 0)
RETOK = (3, 2, 0)
SYSTEM = "You are a calculator."


class WordTokenizer:
    """The job's tokenizer: id i is ``WORDS[i]``; ``encode`` splits the text back into ids,
    except that it merges ``" 4" "2"`` into one unknown id (99): decoding and encoding
    again then differ (the retokenization check's finding)."""

    def batch_decode(self, batch: Any, skip_special_tokens: bool = True) -> list[str]:
        return [self.decode(ids) for ids in batch]

    def decode(self, ids: Any, skip_special_tokens: bool = True) -> str:
        return "".join(WORDS[i] if 0 <= i < len(WORDS) else "?" for i in ids)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        out, rest = [], text
        while rest:
            if rest.startswith(" 42"):
                out.append(99)
                rest = rest[3:]
                continue
            for i in sorted(range(len(WORDS)), key=lambda k: -len(WORDS[k])):
                if rest.startswith(WORDS[i]):
                    out.append(i)
                    rest = rest[len(WORDS[i]):]
                    break
            else:
                out.append(98)
                rest = rest[1:]
        return out


def task_of(step: int, prompt: int) -> str:
    if (step, prompt) == HOSTILE[:2]:
        return HOSTILE_TASK
    return f"What is {prompt} + 2?"


def passed(step: int, prompt: int, rollout: int) -> bool:
    return (step + prompt + rollout) % 3 != 0 and (step, prompt, rollout) not in (HOSTILE, CRASH, LONG)


def reply_ids(step: int, prompt: int, rollout: int) -> list[int]:
    key = (step, prompt, rollout)
    if key == HOSTILE:
        return [0, 1, 2, 7, 8]
    if key == LONG:
        return [0, 1, 2, 9, 10, 11, 12, 9]
    if key == RETOK:
        return [0, 1, 2, 3, 4, 5]  # " 4" "2": re-encodes as one id
    return [0, 1, 2, 3, 5] if passed(*key) else [0, 1, 2, 6, 5]


def components(step: int, prompt: int, rollout: int) -> tuple[float, float]:
    accuracy = 1.0 if passed(step, prompt, rollout) else 0.0
    fmt = 0.5 if (prompt + rollout) % 2 else 1.0
    return accuracy, fmt


def reward_of(step: int, prompt: int, rollout: int) -> float | None:
    if (step, prompt, rollout) == CRASH:
        return None
    accuracy, fmt = components(step, prompt, rollout)
    return accuracy + 0.25 * fmt


def sampler_logprobs(ids: list[int]) -> list[float]:
    return [-0.05 * (k + 1) for k in range(len(ids))]


def trainer_logprobs(key: tuple[int, int, int], ids: list[int]) -> list[float]:
    out = sampler_logprobs(ids)
    if key == MISMATCH:
        out[3] -= 2.0  # token 3 of the response
    return out


def entropy(ids: list[int]) -> list[float]:
    return [0.25 * (k % 4) for k in range(len(ids))]


@rtrace.traced_generation(model="toy")
def generate(messages: list[dict[str, Any]], prompt_ids: list[int], reply: list[int], finish: str) -> dict[str, Any]:
    return {"response_ids": list(reply), "finish_reason": finish, "logprobs": sampler_logprobs(reply)}


@rtrace.traced_tool(tool_name="calculator")
def calculator(expression: str, crash: bool = False) -> str:
    if crash:
        raise RuntimeError(CRASH_ERROR)
    return "4"


def run(folder: str, experiment: str = "job", steps: int = STEPS, jsonl: bool = True, pause_s: float = 0.0,
        on_step: Any = None) -> dict[str, Any]:
    """Trace the job into ``folder`` (its dataset under ``folder/ds/<experiment>``, its JSONL
    at ``folder/<experiment>.jsonl``); returns those paths and each rollout's trace id.
    ``on_step(step)`` is called once a step is written; ``pause_s`` waits before the next."""
    jsonl_path = os.path.join(folder, f"{experiment}.jsonl")
    rtrace.configure(exporter="parquet,jsonl" if jsonl else "parquet", parquet_path=os.path.join(folder, "ds"),
                     jsonl_path=jsonl_path, experiment=experiment, token2text=True, tokenizer=WordTokenizer(),
                     health_checks="all", await_annotations="old_logprob", annotation_timeout_s=30,
                     export_interval_s=0.02)
    ids: dict[str, str] = {}
    for step in range(1, steps + 1):
        rows = []
        for p in range(PROMPTS):
            for r in range(ROLLOUTS):
                key = (step, p, r)
                reply = reply_ids(*key)
                messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task_of(step, p)}]
                try:  # the crash ends its rollout in error (the exception leaves the context)
                    with rtrace.rollout_context(step=step, sample_index=p, rollout_n=r, group_id=f"s{step}-q{p}",
                                                prompt_id=f"q{p}") as ctx:
                        ids[f"{step}-{p}-{r}"] = ctx.trace_id
                        generate(messages, [1, 2, 3], reply, "length" if key == LONG else "stop")
                        calculator(f"{p}+2", crash=key == CRASH)
                        accuracy, fmt = components(*key)
                        rtrace.record_reward(reward_of(*key), correct=passed(*key),
                                             **{"reward/accuracy": accuracy, "reward/format": fmt})
                except RuntimeError:
                    pass
                rows.append((key, reply))
        adv = [0.5 if passed(*key) else -0.5 for key, _ in rows]
        rtrace.annotate_batch(step=step, sample_index=[k[1] for k, _ in rows], rollout_n=[k[2] for k, _ in rows],
                              advantage=adv, old_logprob=[trainer_logprobs(k, reply) for k, reply in rows],
                              loss_mask=[[0] + [1] * (len(reply) - 1) for _, reply in rows],
                              entropy=[entropy(reply) for _, reply in rows])
        assert rtrace.flush(60)
        if on_step is not None:
            on_step(step)
        if pause_s and step < steps:
            time.sleep(pause_s)
    rtrace.shutdown()
    return {"dataset": os.path.join(folder, "ds", experiment), "jsonl": jsonl_path, "trace_ids": ids}


if __name__ == "__main__":  # python tests/serve_job.py FOLDER STEPS PAUSE_S: a run written a step at a time
    folder, steps, pause = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    run(folder, steps=steps, jsonl=False, pause_s=pause,
        on_step=lambda step: print(json.dumps({"step": step, "written": time.time()}), flush=True))
