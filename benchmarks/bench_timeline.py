"""``rtrace timeline`` on a large step, and what ``rtrace.mark_weight_update`` costs the trainer.

(a) A step of 10,000 rollouts x 20 spans (a root, 6 generations on 4 inference servers, one of
    them slow, 6 tool calls, 6 parsing spans, a reward computation), run by 8 workers 128 at a
    time each, written as a run's dataset by the dataset writer (the parquet sink's), plus a
    weight update per 1,000 rollouts. Then ``rtrace timeline DATASET --step 0 -o FILE`` in a
    fresh process, timed end to end (the interpreter's start and imports included): target
    <= 5 s and a file <= 100 MB. The same from the run's JSONL (the jsonl sink's lines of the
    same trajectories). Perfetto opening the file cannot be measured here (its UI is a web app
    that loads its trace processor as WebAssembly from ui.perfetto.dev).
(b) ``rtrace.mark_weight_update(v, step=v)`` per call in a configured process (jsonl sink), the
    traced call's cost without it (a decorated call) beside it: the update is a trainer's call
    once per step, never on the rollout's path.

Run: ``.venv/bin/python benchmarks/bench_timeline.py [--rollouts 10000] [--spans 20]``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import resource
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _machine import reference_line  # noqa: E402

MS = 1_000_000


def make_step(n: int, spans_per: int, workers: int = 8, slots: int = 128, seed: int = 7) -> tuple[list, list]:
    """``n`` trajectories of step 0 (``spans_per`` spans each), on ``workers`` workers of
    ``slots`` concurrent rollouts, and the trainer's weight updates."""
    from rtrace.events import RunEvent
    from rtrace.trajectory import SpanRecord, Trajectory

    rnd = random.Random(seed)
    servers = [("10.0.0.1", 8000), ("10.0.0.2", 8000), ("10.0.0.3", 8000), ("10.0.0.4", 8000)]
    free = [[0] * slots for _ in range(workers)]  # each slot's next free time
    t0 = 1_800_000_000 * 10**9
    out = []
    turns = max(1, (spans_per - 2) // 3)
    for i in range(n):
        w = i % workers
        slot = min(range(slots), key=lambda k: free[w][k])
        start = t0 + free[w][slot] + rnd.randint(0, 50) * MS
        root = f"{i:016x}"
        spans = [None]
        t = start
        for turn in range(turns):
            host, port = servers[rnd.randrange(4)]
            gen = rnd.randint(200, 900) * MS * (3 if host == "10.0.0.4" else 1)
            spans.append(SpanRecord(f"{i:08x}{3 * turn:08x}", root, "chat", "generation", t, t + gen, attributes={
                "server.address": host, "server.port": port, "gen_ai.usage.output_tokens": rnd.randint(50, 400)}))
            t += gen
            parse = rnd.randint(1, 5) * MS
            spans.append(SpanRecord(f"{i:08x}{3 * turn + 1:08x}", root, "parse", "chain", t, t + parse))
            t += parse + rnd.randint(0, 20) * MS
            tool = rnd.randint(20, 400) * MS
            spans.append(SpanRecord(f"{i:08x}{3 * turn + 2:08x}", root, "calculator", "tool", t, t + tool,
                                    attributes={"gen_ai.tool.name": "calculator"}))
            t += tool + rnd.randint(0, 30) * MS
        spans.append(SpanRecord(f"{i:08x}ffffffff", root, "compute_score", "reward", t, t + 20 * MS))
        t += 20 * MS
        spans = spans[:spans_per]
        spans[0] = SpanRecord(root, None, "rollout", "rollout", start, t)
        free[w][slot] = t - t0
        out.append(Trajectory(f"{i:032x}", "rollout", spans, step=0, sample_index=i // 8, rollout_n=i % 8,
                              group_id=f"p{i // 8}", policy_version=0, reward=float(rnd.random() < 0.5),
                              worker=f"node{w // 2}:{1000 + w}"))
    end = max(x.end_ns for x in out)
    updates = [RunEvent("weight_update", t0 + (end - t0) * k // 10, k, k, "trainer:1", {}, f"{k:016x}")
               for k in range(1, 10)]
    return out, updates


def write_dataset(trajs: list, updates: list, folder: str) -> tuple[str, str]:
    from rtrace.dataset.layout import open_store
    from rtrace.dataset.writer import DatasetWriter
    from rtrace.exporters.jsonl import encode_line

    run = os.path.join(folder, "ds", "bench")
    writer = DatasetWriter(open_store(run), "bench", every_rollout=True)
    for i in range(0, len(trajs), 2048):
        writer.write(trajs[i:i + 2048])
    writer.write_events(updates)
    writer.close()
    jsonl = os.path.join(folder, "bench.jsonl")
    with open(jsonl, "wb") as f:
        for e in updates:
            f.write(json.dumps(e.to_line()).encode() + b"\n")
        for t in trajs:
            f.write(encode_line(t)[0])
    return run, jsonl


def timeline_cli(path: str, out: str) -> tuple[float, float, int, str]:
    """``rtrace timeline`` in a fresh process: (wall seconds, CPU seconds of the process and its
    threads, the file's bytes, its first line of output)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    began = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "rtrace", "timeline", path, "--step", "0", "-o", out],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.path.join(
                              os.path.dirname(__file__), "..")})
    took = time.perf_counter() - began
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        raise RuntimeError(proc.stderr)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return took, cpu, os.path.getsize(out), proc.stdout.splitlines()[0]


def mark_cost(tmp: str) -> tuple[float, float]:
    import rtrace

    rtrace.configure(exporter="jsonl", jsonl_path=os.path.join(tmp, "cost.jsonl"))

    @rtrace.traced(kind="chain")
    def call() -> int:
        return 1

    def best(fn: Any, n: int = 2000) -> float:
        """Microseconds per call, the best of 7 rounds of ``n``, each after a flush (nothing queued)."""
        out = []
        for _ in range(7):
            rtrace.flush(30)
            began = time.perf_counter()
            for _ in range(n):
                fn()
            out.append((time.perf_counter() - began) / n * 1e6)
        return min(out)

    marks = best(lambda: rtrace.mark_weight_update(3, step=3))
    with rtrace.rollout_context(step=1):
        calls = best(call)
    rtrace.shutdown()
    return marks, calls


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rollouts", type=int, default=10_000)
    ap.add_argument("--spans", type=int, default=20)
    ap.add_argument("--runs", type=int, default=2, help="rtrace timeline runs per source")
    args = ap.parse_args()
    print(reference_line())
    tmp = tempfile.mkdtemp(prefix="bench_timeline_")
    try:
        began = time.perf_counter()
        trajs, updates = make_step(args.rollouts, args.spans)
        run, jsonl = write_dataset(trajs, updates, tmp)
        spans = sum(len(t.spans) for t in trajs)
        print(f"(a) a step of {len(trajs)} rollouts, {spans} spans, {len(updates)} weight updates "
              f"(made and written in {time.perf_counter() - began:.1f} s)")
        del trajs
        for name, path in (("dataset", run), ("jsonl", jsonl)):
            for _ in range(args.runs):
                took, cpu, size, line = timeline_cli(path, os.path.join(tmp, f"{name}.json"))
                verdict = "ok" if took <= 5 and size <= 100e6 else "OVER TARGET"
                print(f"    rtrace timeline ({name}): {took:.2f} s end to end ({cpu:.2f} s of CPU), file "
                      f"{size / 1e6:.1f} MB (targets <= 5 s, <= 100 MB: {verdict})")
            print(f"      {line}")
        marks, calls = mark_cost(tmp)
        print(f"(b) rtrace.mark_weight_update: {marks:.2f} us per call (a decorated call inside a rollout: "
              f"{calls:.2f} us); nothing is added to the decorated call")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
