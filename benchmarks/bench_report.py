"""``rtrace report --html`` on 10,000 trajectories: build time, page size, time to first render.

Usage: ``.venv/bin/python benchmarks/bench_report.py [--n 10000] [--rounds 3] [--keep DIR]``

The input is a GRPO-like run written as two workers' JSONL files by rtrace's own JSONL
encoder (``encode_line``): 10 steps x 125 prompts x 8 rollouts (``--n`` scales the
prompts), each trajectory 5 spans (rollout, agent, generation, tool, generation with
``gen_ai.*`` usage and finish reasons) and a 5-message conversation (a shared system
prompt, the prompt's question, a tool call, its result, a 60-110 word final answer),
reward 0/1, a GRPO advantage, ``prompt_id``, about 1% errors, 2% truncations and 1%
health findings. Seeded: every run writes the same files.

Measured, the median of ``--rounds``:

* build: ``rtrace.report.run(paths, html_path=...)`` in this process (read the files,
  compute the metrics, write the page), wall time;
* page size in MB;
* first render in Chromium (Debian's, through Playwright; ``make test-ui`` installs
  both): a fresh page opens the file from ``file://``; the time from navigation start to
  the script's ``rtrace-ready`` mark (the data parsed, the run table and the selected
  step drawn), and to the ``load`` event;
* then a click on each of the step's tabs (groups with one group open, failures,
  latency, prompts): the time until it is drawn.

No timing is asserted anywhere: the figures go to README's Performance table.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from rtrace.exporters.jsonl import encode_line  # noqa: E402
from rtrace.report import run  # noqa: E402
from rtrace.trajectory import SpanRecord, Trajectory  # noqa: E402

STEPS, ROLLOUTS = 10, 8
#: 3,000 pseudo-words of 1-4 syllables: text about as compressible as English (gzip ~3x),
#: a small vocabulary would make the page's compressed data unrealistically small
_SYLLABLES = ("ka", "to", "ren", "mi", "sal", "be", "or", "ant", "qu", "is", "de", "lo", "pra", "ven", "tu", "ex",
              "ni", "gar", "sto", "el", "ma", "fi", "cor", "un", "ha", "spe", "di", "mon", "ra", "ti")
_vocab = random.Random(1)
WORDS = tuple("".join(_vocab.choice(_SYLLABLES) for _ in range(_vocab.randint(1, 4))) for _ in range(3000)) + tuple(
    str(i) for i in range(100))
SYSTEM = ("You are a careful math assistant. Think step by step, call the calculator tool for arithmetic, and end "
          "with 'The answer is N.' where N is an integer. " * 2)


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "."


def _trajectory(rng: random.Random, step: int, prompt: int, rollout: int, question: str, t0: int,
                reward: float, advantage: float) -> tuple[Trajectory, list[dict]]:
    gen1, tool, gen2 = rng.uniform(200, 900), rng.uniform(5, 400), rng.uniform(300, 1500)
    truncated = rng.random() < 0.02
    error = rng.random() < 0.01
    ns = 1_000_000
    spans, t = [], t0
    root = SpanRecord(f"{rng.getrandbits(64):016x}", None, "rollout", "rollout", t0, 0)
    agent = SpanRecord(f"{rng.getrandbits(64):016x}", root.span_id, "agent_loop", "agent", t0 + ns, 0)
    for name, kind, ms, extra in (("policy", "generation", gen1, {"gen_ai.response.finish_reasons": ["tool_calls"]}),
                                  ("calculator", "tool", tool, {"gen_ai.tool.name": "calculator"}),
                                  ("policy", "generation", gen2, {"gen_ai.response.finish_reasons":
                                                                  ["length" if truncated else "stop"]})):
        attrs = {"rl.step": step, "gen_ai.usage.input_tokens": rng.randint(300, 700),
                 "gen_ai.usage.output_tokens": rng.randint(40, 300)} if kind == "generation" else {}
        attrs.update(extra)
        start = t + 2 * ns
        t = start + int(ms * ns)
        spans.append(SpanRecord(f"{rng.getrandbits(64):016x}", agent.span_id, name, kind, start, t, attributes=attrs))
    agent.end_ns = t + ns
    root.end_ns = t + int(rng.uniform(2, 60) * ns)
    value = rng.randint(10, 999)
    final = _text(rng, rng.randint(60, 110)) + f" The answer is {value if reward else value + 1}."
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question},
                {"role": "assistant", "content": _text(rng, rng.randint(15, 40)),
                 "tool_calls": [{"id": "call_1", "type": "function", "function": {
                     "name": "calculator", "arguments": json.dumps({"expression": f"{value} * {rollout + 1}"})}}]},
                {"role": "tool", "tool_call_id": "call_1", "name": "calculator", "content": str(value * (rollout + 1))},
                {"role": "assistant", "content": final}]
    traj = Trajectory(f"{rng.getrandbits(128):032x}", "rollout", [root, agent, *spans], step=step, sample_index=prompt,
                      rollout_n=rollout, group_id=f"s{step}-p{prompt}", policy_version=step,
                      extra={"prompt_id": f"gsm8k-{prompt}"}, reward=reward, outcome={"correct": reward == 1.0},
                      annotations={"advantage": advantage}, status="error" if error else "ok",
                      error="TimeoutError: tool call exceeded 30 s" if error else None, messages=messages)
    health = [{"check": "token_continuity", "detail": "turn 2: prompt ids do not extend turn 1's"}] \
        if rng.random() < 0.01 else []
    return traj, health


def write_run(directory: str, n: int, seed: int = 0) -> list[str]:
    """The synthetic run as two workers' JSONL files (about ``n`` trajectories)."""
    rng = random.Random(seed)
    prompts = max(1, n // (STEPS * ROLLOUTS))
    questions = [_text(rng, rng.randint(30, 60)) + " How many are left?" for _ in range(prompts)]
    paths = [os.path.join(directory, f"worker{w}.jsonl") for w in range(2)]
    files = [open(p, "wb") for p in paths]
    t0 = 1_700_000_000_000_000_000
    try:
        for step in range(1, STEPS + 1):
            skill = step / (STEPS + 2)
            for prompt in range(prompts):
                hard = rng.random()
                rewards = [1.0 if rng.random() < skill * (1.5 - hard) else 0.0 for _ in range(ROLLOUTS)]
                mean = sum(rewards) / ROLLOUTS
                std = (sum((r - mean) ** 2 for r in rewards) / ROLLOUTS) ** 0.5
                for rollout, reward in enumerate(rewards):
                    traj, health = _trajectory(rng, step, prompt, rollout, questions[prompt], t0,
                                               reward, (reward - mean) / (std + 1e-6))
                    line, _ = encode_line(traj)
                    line = line[:-2] + b',"health":' + json.dumps(health).encode() + b"}\n"
                    files[(prompt + rollout) % 2].write(line)
                    t0 += 3_000_000_000
    finally:
        for f in files:
            f.close()
    return paths


def _browser_times(page_path: str, rounds: int) -> dict[str, float]:
    from playwright.sync_api import sync_playwright

    chromium = os.environ.get("RTRACE_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    out: dict[str, list[float]] = {}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            for _ in range(rounds):
                page = browser.new_page(viewport={"width": 1500, "height": 1000})
                errors: list[str] = []
                page.on("pageerror", lambda e: errors.append(str(e)))
                page.goto("file://" + os.path.abspath(page_path), timeout=120_000)
                page.wait_for_selector("body[data-ready='1']", timeout=120_000)
                marks = page.evaluate("""() => ({
                    ready: performance.getEntriesByName('rtrace-ready')[0].startTime,
                    load: performance.getEntriesByType('navigation')[0].loadEventEnd})""")
                out.setdefault("first render (ms)", []).append(marks["ready"])
                out.setdefault("load event (ms)", []).append(marks["load"])
                for tab in ("groups", "failures", "latency", "prompts"):
                    start = time.perf_counter()
                    page.click(f".tabs a[data-tab='{tab}']")
                    page.wait_for_selector(f"#{tab}")
                    if tab == "groups":
                        page.click("tr[data-group]")
                        page.wait_for_selector("#group .col")
                    out.setdefault(f"tab {tab} (ms)", []).append((time.perf_counter() - start) * 1000)
                if errors:
                    raise RuntimeError(f"page errors: {errors}")
                page.close()
        finally:
            browser.close()
    return {k: statistics.median(v) for k, v in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=10_000, help="trajectories (default 10,000)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--keep", default=None, help="write the files and the page here and keep them")
    args = parser.parse_args()
    directory = args.keep or tempfile.mkdtemp(prefix="rtrace-bench-report-")
    os.makedirs(directory, exist_ok=True)
    try:
        paths = write_run(directory, args.n)
        page = os.path.join(directory, "report.html")
        builds = []
        for _ in range(args.rounds):
            start = time.perf_counter()
            code = run(paths, io.StringIO(), html_path=page)
            builds.append(time.perf_counter() - start)
            assert code == 0
        n = sum(1 for p in paths for _ in open(p, "rb"))
        size = os.path.getsize(page)
        jsonl = sum(os.path.getsize(p) for p in paths)
        print(f"rtrace report --html: {n:,} trajectories from {len(paths)} files ({jsonl / 1e6:.1f} MB of JSONL)")
        print(f"  build (read, metrics, page), median of {args.rounds}: {statistics.median(builds):.2f} s "
              f"(runs: {', '.join(f'{b:.2f}' for b in builds)})")
        print(f"  page size: {size / 1e6:.2f} MB")
        for name, value in _browser_times(page, args.rounds).items():
            print(f"  chromium, {name}: {value:,.0f}")
    finally:
        if not args.keep:
            shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
