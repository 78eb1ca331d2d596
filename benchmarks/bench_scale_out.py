"""N rtrace collectors (issue 40), measured against baselines in the same run.

(a) Collector CPU per span as N goes 1 -> 2 -> 4: 4 sender processes replay pre-encoded OTLP
    requests (bench_collector.py's 6-span trajectories, the shape rtrace's workers send; each
    trajectory to the collector that owns its key, rtrace/placement.py) to N collectors, each
    in a process of its own set up as `rtrace collect` sets up its process, writing JSONL with
    no cap (bench_collector.py's (a)). Measured per collector: its process's CPU time
    (``time.process_time`` there, every thread) from the first request sent to everything
    written (a flush), over the spans it received. On 2 cores, N processes share them: CPU
    time, not wall time, is the figure. Targets: CPU-seconds per 10^6 spans per collector
    within 10% of N = 1's; spans per collector CPU-second >= 30,000.
(b) The collectors' CPU per rollout when the workers record 100%, 5% or 0% of their rollouts
    in full (``RTRACE_PRE_SAMPLE_RATE`` 1.0 / 0.05 / 0): 4 real rtrace worker processes in
    collector mode (a GRPO job: 64 groups of 8 a step), 2 collectors writing the run's dataset
    (parquet: a row per rollout), a cap of 32 a step with whole groups, the step metrics
    computed. Summed over both collectors' processes, from the first measured rollout to
    everything written. Target: falls >= 10x at 5%. Also the 20-span rollout at 100%, for the
    cost per span of a rollout recorded in full.
(c) From (a) and (b): the collector cores a step of 10^6 rollouts x 200 spans needs to be
    taken within 10 minutes at 1% full recording (the arithmetic, with its inputs). Target:
    <= 8.

Each set-up runs ``--repeat`` times in turn (default 3) and the median is printed: a noisy
machine slows the set-ups alike instead of one of them.

Run: ``.venv/bin/python benchmarks/bench_scale_out.py [--n 6000] [--parts a,b] [--repeat 3]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _agent import SPANS_PER_TRAJECTORY  # noqa: E402
from _machine import reference_line  # noqa: E402
from _send import send_routed  # noqa: E402
from bench_collector import worker_trajectory  # noqa: E402
from bench_summaries import CTX, WARM_UP, collector, worker  # noqa: E402

#: (b)'s job: groups of GROUP_SIZE a step, spread over WORKERS processes, CAP kept a step
GROUPS, GROUP_SIZE, WORKERS, CAP = 64, 8, 4, 32


def routed_requests(worker_id: int, n: int, endpoints: list[str], per_request: int = 64) -> list[tuple[str, bytes]]:
    """Sender ``worker_id``'s ``n`` trajectories, each to the collector that owns its key, as
    encoded OTLP requests of ``per_request`` (in turn over the collectors)."""
    from rtrace.exporters.otel import encode_compact
    from rtrace.placement import Ring, route_key

    ring = Ring(endpoints)
    owned: dict[str, list] = {e: [] for e in endpoints}
    for i in range(n):
        t = worker_trajectory(worker_id, i)
        root = t.spans[0].attributes
        owned[ring.owner(route_key("", False, root["rl.step"], root["rl.sample_index"]))].append(t)
    resource = {"service.name": f"worker-{worker_id}"}
    batches = {e: [encode_compact(ts[k:k + per_request], resource).SerializeToString()
                   for k in range(0, len(ts), per_request)] for e, ts in owned.items()}
    out = []
    for k in range(max(len(b) for b in batches.values())):
        out += [(e, b[k]) for e, b in batches.items() if k < len(b)]
    return out


def sender(worker_id: int, n: int, endpoints: list[str], ready, go, out) -> None:
    out.put(send_routed(routed_requests(worker_id, n, endpoints), ready, go))
    out.close()
    out.join_thread()
    os._exit(0)


class Collectors:
    """N collectors, each in its own process (bench_summaries.collector), on their own ports."""

    def __init__(self, n: int, settings: dict, metrics: bool = True) -> None:
        self.conns, self.procs, self.envs = [], [], []
        for i in range(n):
            parent, child = CTX.Pipe()
            own = dict(settings)
            if "jsonl_path" in own:  # a file each (a dataset is shared: one writer id each)
                own["jsonl_path"] = f"{own['jsonl_path']}.{i}"
            proc = CTX.Process(target=collector, args=(own, child, metrics), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        self.envs = [conn.recv() for conn in self.conns]
        self.endpoints = [env["RTRACE_COLLECTOR_ENDPOINT"] for env in self.envs]

    def cpu(self) -> list[float]:
        """Each collector's process CPU seconds, after a flush (everything received written)."""
        for conn in self.conns:
            conn.send("cpu")
        out = []
        for conn in self.conns:
            seconds, ok = conn.recv()
            assert ok, "a collector's flush timed out"
            out.append(seconds)
        return out

    def stop(self) -> list[dict]:
        for conn in self.conns:
            conn.send("stop")
        stats = [conn.recv() for conn in self.conns]
        for proc in self.procs:
            proc.join(60)
        return stats


def part_a_once(n_collectors: int, n: int, tmp: str) -> list[tuple[float, int]]:
    """(CPU seconds, spans) of each of ``n_collectors`` collectors taking 4 senders x ``n``."""
    cs = Collectors(n_collectors, {"exporter": "jsonl", "jsonl_path": os.path.join(tmp, "a.jsonl"),
                                   "settle_s": 0.5, "max_open_trajectories": 200_000}, metrics=False)
    go = CTX.Event()
    senders = []
    for w in range(4):
        ready, q = CTX.Event(), CTX.Queue()
        p = CTX.Process(target=sender, args=(w, n, cs.endpoints, ready, go, q), daemon=True)
        p.start()
        senders.append((p, q, ready))
    for _, _, ready in senders:
        assert ready.wait(900)
    c0 = cs.cpu()
    go.set()
    for p, q, _ in senders:
        q.get(timeout=900)
        p.join(60)
    c1 = cs.cpu()
    stats = cs.stop()
    for i in range(n_collectors):
        os.remove(os.path.join(tmp, f"a.jsonl.{i}"))
    spans = [s.get("collector_spans_received", 0) for s in stats]
    assert sum(spans) == 4 * n * SPANS_PER_TRAJECTORY, spans
    lost = {k: v for s in stats for k, v in s.items() if v and ("dropped" in k or "evicted" in k or "partial" in k)}
    assert not lost, lost
    return [(b - a, k) for a, b, k in zip(c0, c1, spans)]


def part_a(n: int, repeat: int, tmp: str) -> float:
    """Prints (a); returns N = 1's collector CPU microseconds per span (for (c))."""
    per_million: dict[int, list[float]] = {1: [], 2: [], 4: []}
    spread: dict[int, list[tuple[float, float]]] = {k: [] for k in per_million}
    for _ in range(repeat):
        for k in per_million:
            runs = part_a_once(k, n, tmp)
            each = [cpu / spans * 1e6 for cpu, spans in runs]  # CPU-s per 10^6 spans, per collector
            per_million[k].append(statistics.mean(each))
            spread[k].append((min(each), max(each)))
    med = {k: statistics.median(v) for k, v in per_million.items()}
    print(f"(a) 4 senders x {n} trajectories x {SPANS_PER_TRAJECTORY} spans -> N collectors (JSONL, no cap), "
          f"collector process CPU per 10^6 spans, mean over the N collectors, median of {repeat}:")
    for k, value in med.items():
        lo = min(s[0] for s in spread[k])
        hi = max(s[1] for s in spread[k])
        print(f"    N = {k}: {value:6.2f} CPU-s per 10^6 spans ({1e6 / value:,.0f} spans per collector CPU-second; "
              f"{value / med[1]:.3f}x N = 1; single collectors {lo:.2f}-{hi:.2f}; every run {per_million[k]})")
    print(f"    target: within 10% of N = 1 (N = 2: {med[2] / med[1] - 1:+.1%}, N = 4: {med[4] / med[1] - 1:+.1%}); "
          f">= 30,000 spans per collector CPU-second")
    return med[1]  # microseconds per span: CPU-s per 10^6 spans


def part_b_once(rate: str, turns: int, n: int, settings: dict) -> tuple[float, dict, list[dict]]:
    """(collectors' CPU seconds for the 4 workers' ``n`` measured rollouts each, the workers'
    summed counters, the collectors' counters)."""
    cs = Collectors(2, settings)
    env = {**cs.envs[0], "RTRACE_COLLECTOR_ENDPOINT": ",".join(cs.endpoints), "RTRACE_PRE_SAMPLE_RATE": rate}
    go = CTX.Event()
    workers = []
    for w in range(WORKERS):
        ready, q = CTX.Event(), CTX.Queue()
        p = CTX.Process(target=worker, args=(env, turns, n, ready, go, q, (w, WORKERS, GROUPS, GROUP_SIZE)),
                        daemon=True)
        p.start()
        workers.append((p, q, ready))
    for _, _, ready in workers:
        assert ready.wait(900)
    c0 = cs.cpu()  # the warm-up's rollouts written
    go.set()
    counters: dict = {}
    for p, q, _ in workers:
        _, ok, stats = q.get(timeout=900)[:3]
        assert ok, stats
        p.join(60)
        for key, value in stats.items():
            if isinstance(value, (int, float)):
                counters[key] = counters.get(key, 0) + value
    c1 = cs.cpu()
    return sum(c1) - sum(c0), counters, cs.stop()


def part_b(n: int, repeat: int, tmp: str) -> dict[str, float]:
    """Prints (b); returns the collectors' CPU microseconds per rollout by set-up (for (c))."""
    import shutil

    settings = {"exporter": "parquet", "max_traces_per_step": CAP, "sample_groups": True, "experiment": "b",
                "job_id": "bench"}
    setups = {"6 spans, rate 1.0": ("1.0", 2), "6 spans, rate 0.05": ("0.05", 2), "6 spans, rate 0": ("0.0", 2),
              "20 spans, rate 1.0": ("1.0", 9)}
    cpus: dict[str, list[float]] = {name: [] for name in setups}
    last: dict[str, dict] = {}
    for _ in range(repeat):
        for name, (rate, turns) in setups.items():
            path = os.path.join(tmp, "dataset")  # a run's dataset each
            cpu, counters, coll = part_b_once(rate, turns, n, {**settings, "parquet_path": path})
            shutil.rmtree(path, ignore_errors=True)
            cpus[name].append(cpu / (WORKERS * n) * 1e6)
            last[name] = counters
            lost = {k: v for s in coll for k, v in s.items() if v
                    if any(w in k for w in ("dropped", "evicted", "partial", "failed", "written_early"))}
            assert not lost, (name, lost)
    med = {name: statistics.median(v) for name, v in cpus.items()}
    print(f"(b) 4 workers x {n} rollouts (a GRPO job: {GROUPS} groups of {GROUP_SIZE} a step, cap {CAP}, whole "
          f"groups) -> 2 collectors -> parquet (a row per rollout) + step metrics; both collectors' process CPU per "
          f"rollout, median of {repeat}:")
    for name, value in med.items():
        c = last[name]
        print(f"    {name:20}: {value:7.1f} us per rollout (every run {[round(v, 1) for v in cpus[name]]}; the workers "
              f"summarized {c.get('rollouts_summarized', 0):,}, promoted {c.get('summaries_promoted', 0):,})")
    print(f"    rate 1.0 / rate 0.05 = {med['6 spans, rate 1.0'] / med['6 spans, rate 0.05']:.1f}x (target >= 10x); "
          f"rate 1.0 / rate 0 = {med['6 spans, rate 1.0'] / med['6 spans, rate 0']:.1f}x")
    return med


def part_c(span_us: float | None, rollout: dict[str, float] | None) -> None:
    """The arithmetic of (c), from (a) and (b)'s medians."""
    rollouts, spans, seconds, full = 1_000_000, 200, 600.0, 0.01
    print(f"(c) a step of {rollouts:,} rollouts x {spans} spans in {seconds / 60:.0f} minutes, {full:.0%} recorded in "
          "full, the rest as summaries:")
    if rollout is not None:
        summary = rollout["6 spans, rate 0"]
        full6, full20 = rollout["6 spans, rate 1.0"], rollout["20 spans, rate 1.0"]
        per_span = (full20 - full6) / 14  # a recorded rollout's cost = a fixed part + a part per span
        fixed = full6 - 6 * per_span
        full200 = fixed + spans * per_span
        cpu = rollouts * full * full200 / 1e6 + rollouts * (1 - full) * summary / 1e6
        print(f"    from (b): a summary {summary:.1f} us; a rollout recorded in full {fixed:.1f} us + "
              f"{per_span:.1f} us a span (6 spans {full6:.1f}, 20 spans {full20:.1f}) = {full200:,.0f} us at {spans} spans")
        print(f"    {rollouts * full:,.0f} x {full200:,.0f} us + {rollouts * (1 - full):,.0f} x {summary:.1f} us = "
              f"{cpu:,.0f} collector CPU-seconds a step = {cpu / seconds:.1f} collector cores for {seconds:.0f} s "
              "(target <= 8)")
    if span_us is not None:
        cpu = rollouts * full * spans * span_us / 1e6
        print(f"    the full part alone at (a)'s rate ({span_us:.1f} us a span, JSONL): {cpu:,.0f} CPU-s = "
              f"{cpu / seconds:.1f} cores; every rollout in full: {cpu / full:,.0f} CPU-s = "
              f"{cpu / full / seconds:.0f} cores")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=6000, help="(a): trajectories per sender")
    parser.add_argument("--rollouts", type=int, default=2048, help="(b): measured rollouts per worker")
    parser.add_argument("--repeat", type=int, default=3, help="rounds; the median is printed")
    parser.add_argument("--parts", default="a,b", help="which measurements: a, b (comma list; c follows)")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    print(reference_line())
    print(f"load average {os.getloadavg()[0]:.1f} {os.getloadavg()[1]:.1f} {os.getloadavg()[2]:.1f}, "
          f"{os.cpu_count()} CPUs; warm-up {WARM_UP} rollouts per worker")
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        span_us = part_a(args.n, args.repeat, tmp) if "a" in parts else None
        rollout = part_b(args.rollouts, args.repeat, tmp) if "b" in parts else None
    part_c(span_us, rollout)
    print(f"({time.monotonic() - started:.0f} s; machine reference again: {reference_line()})")


if __name__ == "__main__":
    main()
