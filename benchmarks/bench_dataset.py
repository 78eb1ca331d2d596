"""The run as a dataset (the parquet sink and DuckDB), measured against baselines in the same run.

(a) Collector -> Parquet: 4 processes send OTLP requests of 6-span trajectories with ~2 KB
    of text each (a 7-message conversation captured on the agent span, the generations'
    texts) to one collector in this process (its GC set up as `rtrace collect` does), which
    assembles them and writes the run's dataset; trajectories/s from the first request to
    the last file renamed into place. Baseline in the same run: the same collector writing
    JSONL. Target >= 5,000 trajectories/s with flat memory (RSS before and after).
(b) The sink alone: ``prepare`` (the pipeline's thread) + ``export`` of ready trajectories,
    CPU per trajectory, against the JSONL sink on the same trajectories (16,384 of them, 32 steps:
    the sink's shutdown merges the 32 finished steps into a file of steps/).
(c) Growth to 1,000,000 trajectories (1,000 steps x 1,000 rollouts, GRPO groups of 8) written
    through the sink; at 10^4, 10^5 and 10^6: the write rate of the last stretch, the files
    on disk (and how many hold 32 finished steps each, in steps/), and through DuckDB
    (``rtrace.open_run``): opening the run, "per-step reward mean and zero-variance group
    fraction for all steps" (target <= 1 s) and "the 50 worst rollouts of step k with their
    conversation" (target <= 300 ms), each cold (a new ``open_run``) and warm (the same run
    again).

Run: ``.venv/bin/python benchmarks/bench_dataset.py [--n 5000] [--total 1000000]``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _machine import reference_line  # noqa: E402
from _rollouts import make_trajectory  # noqa: E402
from _send import send_requests  # noqa: E402

STEP_SQL = """
WITH g AS (SELECT step, group_key, count(reward) AS n, sum(reward) AS s, min(reward) AS lo, max(reward) AS hi
           FROM trajectories WHERE NOT validate GROUP BY ALL)
SELECT step, sum(s) / sum(n) AS reward_mean,
       avg(CASE WHEN lo = hi THEN 1.0 ELSE 0.0 END) FILTER (WHERE n >= 2) AS zero_variance_groups_frac
FROM g GROUP BY step ORDER BY step
"""
WORST_SQL = ("SELECT trace_id, sample_index, rollout_n, reward, messages FROM trajectories "
             "WHERE step = $step AND NOT validate ORDER BY reward, trace_id LIMIT 50")


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


# ----------------------------------------------------------------------------- (a)
def sender(endpoint, worker, n, per_request, ready, go, out, light=False):
    """Pre-encodes ``n`` trajectories (the spans a worker sends) into OTLP requests, then sends them.
    ``light``: without the text (no conversation, no outputs): the shape bench_collector.py sends."""

    from rtrace.exporters.otel import encode_compact

    resource_attrs = {"service.name": f"worker-{worker}"}
    requests = []
    for start in range(0, n, per_request):
        shells = []
        for i in range(start, min(n, start + per_request)):
            t = make_trajectory(i // 512, (i % 512) + worker * 512, seed=worker)
            t.messages = []  # the collector builds the conversation from the spans
            t.spans[0].attributes["rtrace.root"] = True  # what a worker's root span carries
            if light:
                for span in t.spans:
                    span.input = span.output = None
            shells.append(t)
        requests.append(encode_compact(shells, resource_attrs).SerializeToString())
    out.put(send_requests(endpoint, requests, ready, go)[0])
    out.close()
    out.join_thread()
    os._exit(0)


def collector_rate(n: int, exporter: str, tmp: str, light: bool = False) -> tuple[float, int, float, float]:
    """(trajectories/s, written, RSS before MB, RSS after MB) of 4 senders x n -> one collector -> exporter."""
    import rtrace
    from rtrace import _stats

    before = _stats.snapshot().get(f"sink.{exporter}.exported", 0)  # counters are the process's: a delta
    settings = {"jsonl_path": os.path.join(tmp, "a.jsonl")} if exporter == "jsonl" else {
        "parquet_path": os.path.join(tmp, "ds")}
    collector = rtrace.start_collector(exporter=exporter, settle_s=0.5, max_open_trajectories=200_000,
                                       experiment=f"bench-{exporter}", **settings)
    ctx = mp.get_context("spawn")
    go = ctx.Event()
    senders = []
    for w in range(4):
        ready, q = ctx.Event(), ctx.Queue()
        p = ctx.Process(target=sender, args=(collector.endpoint, w, n, 64, ready, go, q, light))
        p.start()
        senders.append((p, q, ready))
    for _, _, ready in senders:
        assert ready.wait(900)
    rss0 = rss_mb()
    t0 = time.perf_counter()
    go.set()
    for _, q, _ in senders:
        q.get(timeout=900)
    ok = collector.flush(900)
    elapsed = time.perf_counter() - t0
    rss1 = rss_mb()
    for p, _, _ in senders:
        p.join(60)
    stats = collector.stats()
    collector.stop()
    written = stats.get(f"sink.{exporter}.exported", 0) - before
    assert ok and written == 4 * n, (ok, written, {k: v for k, v in stats.items() if exporter in k})
    return written / elapsed, written, rss0, rss1


# ----------------------------------------------------------------------------- (b)
def sink_cpu(n: int, tmp: str) -> tuple[float, float]:
    """CPU µs per trajectory: (parquet sink, jsonl sink), prepare + export, batches of 256."""
    from rtrace.config import load_settings
    from rtrace.exporters.jsonl import JsonlSink
    from rtrace.exporters.parquet import ParquetSink

    trajs = [make_trajectory(i // 512, i % 512) for i in range(n)]
    warm = [make_trajectory(10_000, i) for i in range(256)]
    out = []
    for sink in (ParquetSink(load_settings({"parquet_path": os.path.join(tmp, "b"), "experiment": "b"})),
                 JsonlSink(load_settings({"jsonl_path": os.path.join(tmp, "b.jsonl")}))):
        sink.prepare(warm)  # imports and first-call set-up are not measured
        sink.export(warm)
        c0 = time.process_time()
        for i in range(0, n, 256):
            batch = trajs[i:i + 256]
            sink.prepare(batch)
            sink.export(batch)
        sink.shutdown()
        out.append((time.process_time() - c0) / n * 1e6)
    return out[0], out[1]


# ----------------------------------------------------------------------------- (c)
def timed(fn, repeat: int = 1) -> tuple[float, object]:
    best, result = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t0)
    return best, result


def queries(path: str, step: int) -> dict[str, float]:
    import rtrace

    out = {}
    t_open, run = timed(lambda: rtrace.open_run(path))
    out["open"] = t_open
    out["steps_cold"], rows = timed(lambda: run.sql(STEP_SQL).fetchall())
    out["worst_cold"], worst = timed(lambda: run.sql(WORST_SQL, {"step": step}).fetchall())
    assert len(worst) == 50 and all(len(r[4]) == 7 for r in worst)
    out["steps_warm"], _ = timed(lambda: run.sql(STEP_SQL).fetchall(), 3)
    out["worst_warm"], _ = timed(lambda: run.sql(WORST_SQL, {"step": step}).fetchall(), 3)
    out["steps"] = len(rows)
    run.close()
    return out


def growth(total: int, per_step: int, tmp: str, checkpoints: list[int]) -> list[dict]:
    from rtrace.config import load_settings
    from rtrace.exporters.parquet import ParquetSink

    sink = ParquetSink(load_settings({"parquet_path": os.path.join(tmp, "c"), "experiment": "big"}))
    sink.writer.idle_s = 2.0  # the steps of this benchmark go by in a fraction of a second each
    path = sink.path
    results = []
    written, t_mark, written_mark = 0, time.perf_counter(), 0
    rss_start = rss_mb()
    batch: list = []
    for i in range(total):
        batch.append(make_trajectory(i // per_step, i % per_step))
        if len(batch) == 256 or i == total - 1:
            sink.prepare(batch)
            sink.export(batch)
            written += len(batch)
            batch = []
            if checkpoints and written >= checkpoints[0]:
                checkpoints.pop(0)
                elapsed = time.perf_counter() - t_mark
                sink.flush(30)  # merge idle partitions, as a trainer's flush would
                rate = (written - written_mark) / elapsed
                files = sum(len(f) for _, _, f in os.walk(path))
                many = sum(len(f) for d, _, f in os.walk(path) if os.path.basename(d) == "steps")
                q = queries(path, step=(written // per_step) // 2)
                results.append({"n": written, "rate": rate, "files": files, "rss": rss_mb() - rss_start, **q})
                print(f"    {written:>9,}: write {rate:,.0f} traj/s (generation included), {files:,} files "
                      f"({many} of them of steps/), "
                      f"RSS +{rss_mb() - rss_start:.0f} MB; open_run {q['open'] * 1e3:.0f} ms; "
                      f"per-step mean + 0-var ({q['steps']} steps) cold {q['steps_cold'] * 1e3:.0f} ms, warm "
                      f"{q['steps_warm'] * 1e3:.0f} ms; 50 worst of a step cold {q['worst_cold'] * 1e3:.0f} ms, "
                      f"warm {q['worst_warm'] * 1e3:.0f} ms", flush=True)
                t_mark, written_mark = time.perf_counter(), written
    sink.shutdown()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=5000, help="trajectories per sender in (a)")
    parser.add_argument("--total", type=int, default=1_000_000, help="trajectories of (c)")
    parser.add_argument("--per-step", type=int, default=1000, help="rollouts per step in (c)")
    parser.add_argument("--skip", default="", help="comma list of parts to skip: a,b,c")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    args = parser.parse_args()
    skip = set(args.skip.split(",")) - {""}
    tmp = args.dir or tempfile.mkdtemp(prefix="bench-dataset-")
    print(reference_line())
    try:
        if "a" not in skip:
            from rtrace.pipeline.collector import tune_gc

            tune_gc()  # what `rtrace collect` does to its own process
            for light in (False, True):
                for exporter in ("jsonl", "parquet", "jsonl", "parquet"):
                    rate, written, r0, r1 = collector_rate(args.n, exporter, os.path.join(tmp, f"a-{exporter}"), light)
                    shutil.rmtree(os.path.join(tmp, f"a-{exporter}"), ignore_errors=True)
                    shape = "no text (bench_collector's shape)" if light else "~2 KB text"
                    print(f"(a) collector -> {exporter:7}: {rate:,.0f} trajectories/s ({written:,} of 6 spans, {shape}; "
                          f"RSS {r0:.0f} -> {r1:.0f} MB)", flush=True)
        if "b" not in skip:
            runs = [sink_cpu(16384, tmp) for _ in range(3)]  # 32 steps of 512: shutdown merges them into steps/
            p, j = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
            print(f"(b) sink alone, prepare + export, CPU per trajectory: parquet {p:.0f} us, jsonl {j:.0f} us "
                  f"({p / j:.2f}x); parquet {1e6 / p:,.0f} trajectories per CPU-second", flush=True)
        if "c" not in skip:
            marks = [m for m in (10_000, 100_000, 1_000_000) if m <= args.total] or [args.total]
            print(f"(c) growth to {args.total:,} trajectories, {args.per_step} per step:", flush=True)
            growth(args.total, args.per_step, tmp, marks)
        print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")
    finally:
        if args.dir is None:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
