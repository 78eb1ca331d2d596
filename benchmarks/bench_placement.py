"""Placement across collectors (issue 40), measured.

(a) The route on the worker: the collector sink's CPU per 6-span segment (rtrace's record as
    the worker sends it) to encode a request, without and with the placement key on the
    request's resources (one resource per key, ``rtrace.route``), and with the ring of 3
    collectors consulted; bytes per segment. Every segment here has a key of its own (one
    rollout per prompt): a GRPO group's members share one resource.
(b) The ring: ``Ring.owner`` per key.
(c) A trainer's burst: one ``annotate_batch`` of ``--rows`` rows (two values each) in a trainer
    process (``RTRACE_EXPORTER=collector``) into a collector in this process: the call's time on
    the trainer's thread, the flush, the trainer's and the collector's CPU, requests made, rows
    arrived.

Run: ``.venv/bin/python benchmarks/bench_placement.py [--rows 100000] [--parts a,b,c]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _machine import reference_line  # noqa: E402


def _segment(i: int):
    from rtrace._serialize import vouch
    from rtrace.trajectory import SpanRecord, Trajectory

    attrs = {"rl.step": i // 64, "rl.sample_index": i % 64, "rl.rollout_n": 0, "rl.validate": False,
             "rl.experiment": "run-7", "rtrace.root": True, "rl.reward": 1.0}
    root = SpanRecord(f"{i + 1:016x}", None, "rollout", "rollout", 10, 100, attributes=attrs)
    kids = [SpanRecord(f"{i + 1:08x}{c + 1:08x}", f"{i + 1:016x}", "calculator", "tool", 20 + c, 30 + c,
                       input={"expression": "6*7"}, output="42", attributes={"gen_ai.tool.name": "calculator"})
            for c in range(5)]
    traj = Trajectory(f"{i + 1:032x}", "rollout", [root] + kids)
    vouch(traj)  # converted values only, as the worker's segments
    return traj


def part_a(repeat: int = 5) -> None:
    from rtrace.exporters.collector import route_of
    from rtrace.exporters.otel import encode_compact
    from rtrace.placement import Ring

    batches = [[_segment(b * 64 + i) for i in range(64)] for b in range(60)]
    resource = {"service.name": "worker", "process.pid": 1}
    ring = Ring(["h1:4317", "h2:4317", "h3:4317"])

    def plain(batch):
        return encode_compact(batch, resource, 20_000).SerializeToString()

    def routed(batch, ring=None):
        items = []
        for n, traj in enumerate(batch):
            key = route_of(traj, "run-7")
            items.append((key, n, traj, ring.owner(key) if ring is not None else None))
        items.sort(key=lambda item: (item[0], item[1]))
        return encode_compact([t for _, _, t, _ in items], resource, 20_000,
                              [k for k, _, _, _ in items]).SerializeToString()

    n = sum(len(b) for b in batches)
    print("(a) the collector sink's encoding per 6-span segment (process CPU, median of %d):" % repeat)
    base = None
    for name, fn in (("no key (before)", plain), ("key on the resources", routed),
                     ("key + ring of 3 consulted", lambda b: routed(b, ring))):
        runs = []
        for _ in range(repeat):
            t = time.process_time()
            for batch in batches:
                fn(batch)
            runs.append((time.process_time() - t) / n * 1e6)
        us = statistics.median(runs)
        base = base or us
        size = sum(len(fn(b)) for b in batches) / n
        print(f"    {name:28s} {us:6.1f} us  ({us / base:.2f}x)  {size:6.0f} bytes")


def part_b() -> None:
    from rtrace.placement import Ring, route_key

    ring = Ring([f"collector-{i}:4317" for i in range(8)])
    keys = [route_key("run-7", False, i // 1000, i % 1000) for i in range(100_000)]
    t = time.process_time()
    for key in keys:
        ring.owner(key)
    print(f"(b) Ring.owner: {(time.process_time() - t) / len(keys) * 1e6:.2f} us per key (8 collectors)")


TRAINER = """
import json, time, rtrace
rtrace.configure()
rows = {rows}
t0, c0 = time.perf_counter(), time.process_time()
rtrace.annotate_batch(step=1, sample_index=list(range(rows)), rollout_n=[0] * rows,
                      advantage=[i / 2 for i in range(rows)], returns=[float(i) for i in range(rows)])
t1 = time.perf_counter()
ok = rtrace.flush(600)
t2 = time.perf_counter()
s = rtrace.stats()
print(json.dumps({{"call_s": t1 - t0, "flush_s": t2 - t1, "cpu_s": time.process_time() - c0, "ok": ok,
                  "sent": s.get("sink.collector.sent", 0)}}))
"""


def part_c(rows: int) -> None:
    import rtrace

    with tempfile.TemporaryDirectory() as tmp:
        collector = rtrace.start_collector(exporter="jsonl", jsonl_path=os.path.join(tmp, "t.jsonl"))
        try:
            c0 = time.process_time()
            proc = subprocess.run([sys.executable, "-c", TRAINER.format(rows=rows)], capture_output=True, text=True,
                                  env={**os.environ, **collector.env, "HF_HUB_OFFLINE": "1"}, timeout=1200)
            if proc.returncode:
                raise SystemExit(proc.stderr)
            out = json.loads(proc.stdout.strip().splitlines()[-1])
            collector.flush(120)
            stats = collector.stats()
            cpu = time.process_time() - c0
        finally:
            collector.stop()
    print(f"(c) one annotate_batch of {rows:,} rows from a trainer process into a collector:")
    print(f"    the call on the trainer's thread {out['call_s']:.2f} s, flush {out['flush_s']:.2f} s, "
          f"trainer CPU {out['cpu_s']:.2f} s ({out['cpu_s'] / rows * 1e6:.0f} us a row), flushed {out['ok']}")
    print(f"    collector CPU {cpu:.2f} s ({cpu / rows * 1e6:.0f} us a row), {stats.get('receiver.requests')} requests, "
          f"{stats.get('collector_spans_received', 0):,} of {rows:,} rows arrived (sent: {out['sent']:,})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000, help="(c): rows of the annotate_batch call")
    parser.add_argument("--parts", default="a,b,c", help="which measurements: a, b, c (comma list)")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    print(reference_line())
    if "a" in parts:
        part_a()
    if "b" in parts:
        part_b()
    if "c" in parts:
        part_c(args.rows)


if __name__ == "__main__":
    main()
