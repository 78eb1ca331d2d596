"""Train the demo policy: ``python -m rtrace.demo.train`` (CPU, offline, deterministic).

Supervised fine-tuning of a freshly initialised tiny Qwen2 (:data:`rtrace.demo.model.ARCHITECTURE`)
on synthetic tool-use dialogues generated here, in the exact format the demo's agent
loop renders and parses (the chat helpers of :mod:`rtrace.demo.agent`)::

    system  Use the calculator or lookup tool, then give the answer.
    user    What is 47 - 12 * 9?                      (or "Evaluate ...", "Look up the ...")
    asst    <tool_call>\\n{"name": "calculator", "arguments": {"expression": "47 - 12 * 9"}}\\n</tool_call>
    tool    -61
    asst    The answer is -61.

The tasks are drawn with :func:`rtrace.demo.agent.make_tasks` (the demo's own task
distribution); tool results come from the real tools. The loss is on the assistant
turns only, exactly the ``(prompt_ids, response_ids)`` pairs the agent loop feeds the
model (each dialogue is packed into one sequence when its tokenization allows it).

The training is deliberately short (:data:`DEFAULT_STEPS` steps of
:data:`DEFAULT_BATCH` dialogues, ~110 s of CPU time on one thread): the model learns the
format and to copy keys, operands and tool results, but not perfectly. Sampled at
temperature 1 it gets about 3 answers in 4 right (lookups nearly always, arithmetic
about half the time: a miscopied operand, a wrong operator, a miscopied result), which
gives GRPO groups a reward signal; 1000 steps would give ~93%.

Deterministic: data from ``random.Random(seed)``, the initialisation from a forked,
seeded torch generator (there is no dropout), one CPU thread; the same command writes
the same weights. At the end it writes ``rtrace/demo/policy.safetensors`` (float16,
0.75 MB; how it was trained is in the file's metadata) and reports the reward of the
saved policy on held-out tasks, sampled and greedy.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import sys
import time
import types
from pathlib import Path
from typing import Any, Sequence

from .agent import (ANSWER_TEMPLATE, SYSTEM_PROMPT, FACTS, Task, ToolAgentLoop, assistant_message, calculate,
                    compute_reward, format_tool_call, make_tasks, render_prompt, tool_message)
from .model import ARCHITECTURE, WEIGHTS_PATH, Policy, load_model, new_model, save_model

__all__ = ["build_example", "sample_task", "train", "evaluate", "main"]

DEFAULT_STEPS = 600
DEFAULT_BATCH = 16
DEFAULT_LR = 5e-3
DEFAULT_SEED = 0


def sample_task(rng: random.Random) -> Task:
    """A training task from the demo's distribution: arithmetic 2/3 of the time (both
    phrasings: "What is ...?" and the validation's "Evaluate ..."), else a lookup."""
    if rng.random() < 2 / 3:
        return make_tasks(1, rng, validation=rng.random() < 0.5)[0]
    key = sorted(FACTS)[rng.randrange(len(FACTS))]
    return Task(f"Look up the {key}.", FACTS[key], "lookup")


def _call_for(task: Task) -> dict[str, Any]:
    """The call the task needs: the expression or key parsed from the question (the same
    parse as the agent's fallback call)."""
    [call] = ToolAgentLoop._forced_call(task.question, task.kind)
    return {"id": "call_1_0", **call}


def build_example(task: Task, tokenizer: Any, parser: ToolAgentLoop) -> list[tuple[list[int], list[int]]]:
    """The dialogue of ``task`` as the agent loop would see it: ``(prompt_ids, response_ids)``
    of the tool-call turn and of the answer turn (responses end with ``<|im_end|>``)."""
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    call = _call_for(task)
    text1 = format_tool_call(call["name"], call["arguments"])
    parsed = parser._parse_tool_calls(text1)  # what the loop will read from it
    assert parsed == [{"name": call["name"], "arguments": call["arguments"]}], (text1, parsed)
    result = calculate(call["arguments"]["expression"]) if task.kind == "arithmetic" else FACTS[call["arguments"]["key"]]
    assert result == task.answer, (task, result)
    text2 = ANSWER_TEMPLATE.format(result)

    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM_PROMPT},
                                      {"role": "user", "content": task.question}]
    p1 = render_prompt(tokenizer, messages)
    r1 = tokenizer(text1, add_special_tokens=False)["input_ids"] + [im_end]
    content, calls = parser._split_tool_calls(text1)
    messages += [assistant_message(content, [{**calls[0], "id": call["id"]}]), tool_message(call, result)]
    p2 = render_prompt(tokenizer, messages)
    r2 = tokenizer(text2, add_special_tokens=False)["input_ids"] + [im_end]
    return [(p1, r1), (p2, r2)]


def _pack(turns: list[tuple[list[int], list[int]]]) -> list[tuple[list[int], list[int]]]:
    """``(input_ids, labels)`` sequences: one per dialogue when each turn's prompt plus
    response (without its ``<|im_end|>``) is a prefix of the next prompt, else one per turn.
    ``labels[t]`` is the token position ``t`` must predict (-100: none)."""
    (p1, r1), (p2, r2) = turns
    if p2[:len(p1) + len(r1) - 1] == p1 + r1[:-1]:
        ids = p2 + r2[:-1]
        labels = [-100] * len(ids)
        for prompt, response in turns:
            for j, token in enumerate(response):
                labels[len(prompt) - 1 + j] = token  # the tool-call turn's <|im_end|> included
        return [(ids, labels)]
    return [(p + r[:-1], [-100] * (len(p) - 1) + r) for p, r in turns]


def _batch(seqs: Sequence[tuple[list[int], list[int]]], pad_id: int) -> tuple[Any, Any, Any]:
    import torch

    width = max(len(ids) for ids, _ in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, (x, y) in enumerate(seqs):
        ids[i, :len(x)] = torch.tensor(x)
        labels[i, :len(y)] = torch.tensor(y)
        mask[i, :len(x)] = 1
    return ids, labels, mask


def train(steps: int = DEFAULT_STEPS, batch: int = DEFAULT_BATCH, lr: float = DEFAULT_LR, seed: int = DEFAULT_SEED,
          architecture: dict[str, int] | None = None, log_every: int = 50,
          out: Any = sys.stderr) -> tuple[Any, Any, dict[str, Any]]:
    """Train from scratch; returns ``(model, tokenizer, info)``."""
    import torch

    from .tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    parser = ToolAgentLoop(types.SimpleNamespace(tokenizer=tokenizer))  # only its tool-call parser is used
    rng = random.Random(seed)
    model = new_model(tokenizer, seed, architecture)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))))
    start, cpu_start = time.perf_counter(), time.process_time()
    running = None
    for step in range(1, steps + 1):
        seqs = [seq for _ in range(batch) for seq in _pack(build_example(sample_task(rng), tokenizer, parser))]
        ids, labels, mask = _batch(seqs, tokenizer.pad_token_id)
        logits = model(input_ids=ids, attention_mask=mask).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                                 ignore_index=-100)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        value = loss.item()
        running = value if running is None else 0.9 * running + 0.1 * value
        if step % log_every == 0 or step == steps:
            out.write(f"step {step:4d}/{steps}  loss {running:.4f}  {time.perf_counter() - start:6.1f}s wall  "
                      f"{time.process_time() - cpu_start:6.1f}s cpu\n")
            out.flush()
    model.eval()
    info = {"trained_by": "python -m rtrace.demo.train", "steps": steps, "batch": batch, "lr": lr, "seed": seed,
            "train_seconds": round(time.perf_counter() - start, 1),
            "train_cpu_seconds": round(time.process_time() - cpu_start, 1), "final_loss": round(running or 0.0, 4)}
    return model, tokenizer, info


async def _evaluate(policy: Policy, tasks: Sequence[Task], temperature: float, seed: int) -> dict[str, float]:
    agent = ToolAgentLoop(policy, max_turns=3)
    rewards, written = [], 0
    for i, task in enumerate(tasks):
        out = await agent.run(task.question, task.kind, seed=seed + i, temperature=temperature)
        rewards.append(compute_reward(task, out["answer"]))
        written += out["policy_tool_calls"] > 0
    by_kind = {k: [r for r, t in zip(rewards, tasks) if t.kind == k] for k in ("arithmetic", "lookup")}
    return {"reward": sum(rewards) / len(rewards), "policy_tool_calls": written / len(tasks),
            **{f"reward_{k}": sum(v) / max(len(v), 1) for k, v in by_kind.items()}}


def evaluate(policy: Policy, n: int = 100, seed: int = 12345) -> dict[str, dict[str, float]]:
    """Mean reward of ``policy`` on ``n`` held-out demo tasks, sampled (T=1) and greedy."""
    tasks = make_tasks(n, random.Random(seed))
    return {"sampled": asyncio.run(_evaluate(policy, tasks, 1.0, seed)),
            "greedy": asyncio.run(_evaluate(policy, tasks, 0.0, seed))}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rtrace.demo.train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    parser.add_argument("--batch", type=int, default=DEFAULT_BATCH)
    parser.add_argument("--lr", type=float, default=DEFAULT_LR)
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--out", default=str(WEIGHTS_PATH), help=f"weights file (default {WEIGHTS_PATH})")
    parser.add_argument("--eval", type=int, default=100, help="held-out tasks to evaluate on (0: skip)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--hidden-size", type=int, default=ARCHITECTURE["hidden_size"])
    parser.add_argument("--layers", type=int, default=ARCHITECTURE["num_hidden_layers"])
    parser.add_argument("--intermediate-size", type=int, default=ARCHITECTURE["intermediate_size"])
    args = parser.parse_args(argv)

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    architecture = {**ARCHITECTURE, "hidden_size": args.hidden_size, "num_hidden_layers": args.layers,
                    "intermediate_size": args.intermediate_size}
    model, tokenizer, info = train(args.steps, args.batch, args.lr, args.seed, architecture=architecture)
    info["parameters"] = sum(p.numel() for p in model.parameters())
    save_model(model, tokenizer, args.out, architecture, info)
    size = Path(args.out).stat().st_size
    print(f"wrote {args.out}: {info['parameters']:,} parameters, {size / 1e6:.2f} MB, "
          f"trained in {info['train_seconds']}s ({info['train_cpu_seconds']}s cpu), final loss {info['final_loss']}")
    if args.eval:
        loaded, meta = load_model(tokenizer, args.out)  # evaluate what was written (float16 round trip)
        policy = Policy(loaded, tokenizer, max_new_tokens=64, info=meta)
        try:
            for mode, stats in evaluate(policy, args.eval).items():
                print(f"{mode:8s} " + "  ".join(f"{k} {v:.2f}" for k, v in stats.items()))
        finally:
            policy.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
