"""Rollouts recorded as summaries only vs recorded in full (issue 40), against baselines
measured in the same run.

Two rollouts (``benchmarks/_agent.py``): the toy one (6 spans: root, agent, 2 generations of
4-id responses, 2 tool calls answering 2 characters; ``toy20``: the same with 9 turns) and a
realistic one (20 spans: 9 generations whose prompt starts at 512 ids and grows by each
turn's 256-id response and 128 ids of tool result, extended in place as veRL's ToolAgentLoop
does (``realcopy``: a new list each turn), dict outputs as vLLM adapters return, 9 tool calls
answering 500 characters): the toy one makes a full recording unrealistically cheap, so both
are reported.

(a) Rollout-worker CPU per rollout in collector mode (``RTRACE_EXPORTER=collector``, to a
    real collector in another process): recorded in full
    (``RTRACE_PRE_SAMPLE_RATE=1``) and recorded as a summary only (rate 0: every rollout
    tallied, its summary sent), each minus the same loop undecorated (the program's own
    work). Measured as the worker process's CPU time (``time.process_time``: the traced
    program's thread, rtrace's worker thread, its sink thread and gRPC's, loop + flush),
    each set-up in a fresh process. Target: summary-only <= 10% of full. Also the share of
    the worker process's CPU spent in Python's garbage collector (``gc.callbacks``: thread
    CPU time between each collection's start and stop) and its collections per generation.
(b) The collector's CPU per rollout (its process's CPU time, ``time.process_time`` in the
    collector's own process, set up as ``rtrace collect`` sets up its process), from the
    first rollout sent to everything written, when the worker records 100% vs 5% of its
    rollouts in full (``RTRACE_PRE_SAMPLE_RATE`` 1.0 / 0.05), 64 rollouts per step, the
    collector keeping 8 per step and computing the step metrics (a sink that takes them).
    Target: falls >= 10x. Also with the parquet sink, which writes a row per rollout.

Each set-up runs ``--repeat`` times in turn (default 3) and the median is printed: a noisy
machine slows the set-ups alike instead of one of them.

Run: ``.venv/bin/python benchmarks/bench_summaries.py [--n 3000] [--parts a,b] [--rollouts toy,real]
[--per-step 64]``. With ``BENCH_PY_SPY=<folder>`` (py-spy installed) the collector's measured part is
sampled into that folder.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _agent import make_agent, make_realistic_agent  # noqa: E402
from _machine import reference_line  # noqa: E402

#: rollouts each worker runs (and flushes) before it is measured
WARM_UP = 300
#: rollouts per step (the collector keeps CAP of them; --per-step, passed to the spawned processes)
PER_STEP = int(os.environ.get("BENCH_PER_STEP", "64"))
CAP = 8
CTX = mp.get_context("spawn")


class _Untraced:
    """The rtrace API as no-ops: the same agent loop, undecorated (the baseline)."""

    @staticmethod
    def _same(func):
        return func

    traced_generation = traced_tool = traced_rollout = _same

    @staticmethod
    def rollout_context(**coords):
        return contextlib.nullcontext()

    @staticmethod
    def record_reward(value, **outcome):
        pass


#: the rollouts measured: name -> (spans, how to make it)
ROLLOUTS = {"toy": 6, "toy20": 20, "real": 20, "realcopy": 20}


def grpo_coordinates(spec: tuple[int, int, int, int] | None) -> tuple[Any, int]:
    """Rollout ``i``'s coordinates and a worker's rollouts per step: ``PER_STEP`` prompts of one
    rollout a step (``spec`` None), or, for ``spec = (w, workers, groups, n)``, worker ``w``'s
    share of a GRPO job of ``groups`` groups of ``n`` a step (groups ``w, w + workers, ...``)."""
    if spec is None:
        return (lambda i: {"step": i // PER_STEP, "sample_index": i % PER_STEP, "rollout_n": 0}), PER_STEP
    w, workers, groups, n = spec
    per_step = len(range(w, groups, workers)) * n

    def coords(i: int) -> dict:
        k = i % per_step
        return {"step": i // per_step, "sample_index": w + workers * (k // n), "rollout_n": k % n}

    return coords, per_step


def _make(api, rollout: "str | int", coords):
    """The rollout ``rollout`` names (a number: the toy agent with that many turns)."""
    if isinstance(rollout, int):
        return make_agent(api, coords, rollout)
    if rollout.startswith("real"):
        return make_realistic_agent(api, coords, in_place=rollout == "real")
    return make_agent(api, coords, 2 if rollout == "toy" else 9)


def _thread_cpu() -> dict[str, float]:
    """CPU seconds of each of the process's Python threads, by name (rtrace's worker and sinks)."""
    import threading

    out: dict[str, float] = {}
    for t in threading.enumerate():
        try:
            cpu = time.clock_gettime(time.pthread_getcpuclockid(t.ident))
        except (OSError, TypeError, AttributeError):  # ended meanwhile, or no such clock here
            continue
        name = "program" if t is threading.main_thread() else t.name.split(":")[0]  # (not the port)
        out[name] = out.get(name, 0.0) + cpu
    return out


class _GCTime:
    """CPU time in Python's garbage collector (gc.callbacks) and collections per generation."""

    def __init__(self) -> None:
        self.cpu = 0.0
        self.counts = [0, 0, 0]
        self.by_generation = [0.0, 0.0, 0.0]
        self._start = 0.0

    def __call__(self, phase, info) -> None:
        if phase == "start":
            self._start = time.thread_time()
        else:
            spent = time.thread_time() - self._start
            self.cpu += spent
            self.counts[info["generation"]] += 1
            self.by_generation[info["generation"]] += spent


def worker(env: dict | None, rollout: "str | int", n: int, ready, go, out, grpo: tuple | None = None) -> None:
    """Runs WARM_UP rollouts (flushed), says ready, waits for go, then runs ``n`` rollouts and
    flushes: reports (process CPU seconds of those, flush ok, rtrace.stats(), GC CPU seconds,
    GC collections per generation, CPU per thread). ``grpo``: the coordinates
    (:func:`grpo_coordinates`)."""
    if env is None:
        api, flush, stats = _Untraced(), lambda: True, dict
    else:
        os.environ.update(env)
        import rtrace

        api, flush, stats = rtrace, lambda: rtrace.flush(300), rtrace.stats
    coords, per_step = grpo_coordinates(grpo)
    traj = _make(api, rollout, coords)
    for i in range(WARM_UP):  # steady state: imports, connections, the first steps done
        traj(i)
    flush()
    ready.set()
    go.wait()
    # the measured rollouts begin a new step (one step left out after the warm-up)
    start = WARM_UP + PER_STEP if grpo is None else (WARM_UP // per_step + 2) * per_step
    import gc

    gc_time = _GCTime()
    gc.callbacks.append(gc_time)
    t0 = _thread_cpu()
    c0 = time.process_time()
    for i in range(start, start + n):
        traj(i)
    ok = flush()
    cpu = time.process_time() - c0
    t1 = _thread_cpu()
    gc.callbacks.remove(gc_time)
    threads = {name: t1[name] - t0.get(name, 0.0) for name in t1}
    threads["other (gRPC's C threads ...)"] = cpu - sum(threads.values())
    counts = [f"{n} ({ms * 1e3:.0f} ms)" for n, ms in zip(gc_time.counts, gc_time.by_generation)]
    out.put((cpu, ok, stats(), gc_time.cpu, counts, threads))
    out.close()
    out.join_thread()
    os._exit(0)


def _py_spy(running, what: str):
    """With BENCH_PY_SPY=<folder>, the measured part of this process sampled by py-spy (when
    installed): started at the first call, stopped (its file written) at the second."""
    folder = os.environ.get("BENCH_PY_SPY")
    if not folder:
        return None
    import signal
    import subprocess

    if running is None:
        path = os.path.join(folder, f"{what}-{os.getpid()}.txt")
        return subprocess.Popen(["py-spy", "record", "--pid", str(os.getpid()), "--format", "raw", "--rate", "1000",
                                 "--output", path, "--nonblocking"], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    running.send_signal(signal.SIGINT)
    running.wait(60)
    return None


def collector(settings: dict, conn, metrics: bool = True) -> None:
    """A collector in a process of its own, set up as `rtrace collect` sets up its process;
    answers "cpu" (its process CPU seconds, after a flush) and "stop" (its stats). ``metrics``:
    with a sink that takes the step metrics (so the collector computes them)."""
    import rtrace
    from rtrace.pipeline.collector import tune_gc, tune_malloc

    class Metrics(rtrace.Sink):
        """Takes the step metrics (so the collector computes them) and drops them."""

        name = "metrics"

        def export(self, trajectories):
            pass

        def export_step_metrics(self, metrics):
            pass

    tune_gc()
    tune_malloc()
    c = rtrace.start_collector(sinks=[Metrics(None)] if metrics else [], **{"settle_s": 0.2, **settings})
    conn.send(c.env)
    spy = None
    while True:
        msg = conn.recv()
        if msg == "cpu":
            ok = c.flush(600)
            conn.send((time.process_time(), ok))
            spy = _py_spy(spy, "collector")
        else:
            stats = c.stats()
            c.stop()
            conn.send(stats)
            return


def one_run(env_extra: dict | None, rollout: str, n: int, collector_settings: dict) -> tuple:
    """One worker (``env_extra`` over the collector's env; None: untraced, no collector):
    (worker CPU s, collector CPU s for the measured rollouts, worker stats, collector stats,
    worker GC CPU s, worker GC collections per generation, worker CPU s per thread)."""
    ready, go, out = CTX.Event(), CTX.Event(), CTX.Queue()
    coll = None
    env = None
    if env_extra is not None:
        parent, child = CTX.Pipe()
        coll = CTX.Process(target=collector, args=(collector_settings, child), daemon=True)  # (ends with a failed run)
        coll.start()
        env = {**parent.recv(), **env_extra}
    proc = CTX.Process(target=worker, args=(env, rollout, n, ready, go, out), daemon=True)
    proc.start()
    assert ready.wait(600)
    if coll is not None:
        parent.send("cpu")
        c0, _ = parent.recv()  # the warm-up's rollouts written
    go.set()
    cpu, ok, worker_stats, gc_cpu, gc_counts, threads = out.get(timeout=900)
    assert ok, worker_stats
    proc.join(60)
    coll_cpu, coll_stats = 0.0, {}
    if coll is not None:
        parent.send("cpu")
        c1, flushed = parent.recv()
        assert flushed
        coll_cpu = c1 - c0
        parent.send("stop")
        coll_stats = parent.recv()
        coll.join(60)
    return cpu, coll_cpu, worker_stats, coll_stats, gc_cpu, gc_counts, threads


def part_a(n: int, repeat: int, tmp: str, rollouts: list[str]) -> None:
    settings = {"exporter": "jsonl", "jsonl_path": os.path.join(tmp, "a.jsonl"), "max_traces_per_step": CAP}
    for rollout in rollouts:
        setups = {"untraced": None, "full (rate 1)": {"RTRACE_PRE_SAMPLE_RATE": "1.0"},
                  "summary only (rate 0)": {"RTRACE_PRE_SAMPLE_RATE": "0.0"}}
        cpus: dict[str, list[float]] = {name: [] for name in setups}
        gcs: dict[str, list[tuple[float, list[int]]]] = {name: [] for name in setups}
        per_thread: dict[str, dict[str, list[float]]] = {name: {} for name in setups}
        for _ in range(repeat):
            for name, extra in setups.items():
                cpu, _, stats, _, gc_cpu, gc_counts, threads = one_run(extra, rollout, n, settings)
                if name.startswith("summary"):
                    assert stats.get("rollouts_summarized", 0) == n + WARM_UP, stats
                cpus[name].append(cpu / n * 1e6)
                gcs[name].append((gc_cpu / cpu, gc_counts))
                for thread, seconds in threads.items():
                    per_thread[name].setdefault(thread, []).append(seconds / n * 1e6)
        med = {name: statistics.median(v) for name, v in cpus.items()}
        base = med["untraced"]
        full, summary = med["full (rate 1)"] - base, med["summary only (rate 0)"] - base
        print(f"(a) worker CPU per {rollout} rollout ({ROLLOUTS[rollout]} spans), collector mode, {n} rollouts, "
              f"median of {repeat} (process CPU, loop + flush):")
        print(f"    untraced loop {base:7.1f} us; full {med['full (rate 1)']:7.1f} us (rtrace {full:6.1f}); "
              f"summary only {med['summary only (rate 0)']:7.1f} us (rtrace {summary:6.1f}): summary / full = "
              f"{summary / full:.3f} (target <= 0.10)")
        for name, runs in gcs.items():
            share = statistics.median(s for s, _ in runs)
            counts = runs[len(runs) // 2][1]
            print(f"    GC, {name}: {share:.1%} of the process's CPU; collections gen0/1/2 {counts}")
        for name in ("full (rate 1)", "summary only (rate 0)"):
            print(f"    per thread, {name} (us per rollout, medians): " + ", ".join(
                f"{thread} {statistics.median(v):.1f}" for thread, v in per_thread[name].items()))


def part_b(n: int, repeat: int, tmp: str, rollouts: list[str]) -> None:
    for rollout in rollouts:
        for label, settings in (("JSONL + step metrics", {"exporter": "jsonl",
                                                          "jsonl_path": os.path.join(tmp, "b.jsonl")}),
                                ("parquet (a row per rollout) + step metrics",
                                 {"exporter": "parquet", "parquet_path": os.path.join(tmp, "dataset")})):
            settings = {**settings, "max_traces_per_step": CAP}
            cpus: dict[str, list[float]] = {"1.0": [], "0.05": []}
            for _ in range(repeat):
                for rate in cpus:
                    _, coll_cpu, _, stats, _, _, _ = one_run({"RTRACE_PRE_SAMPLE_RATE": rate}, rollout, n, settings)
                    cpus[rate].append(coll_cpu / n * 1e6)
            med = {rate: statistics.median(v) for rate, v in cpus.items()}
            print(f"(b) collector CPU per {rollout} rollout ({ROLLOUTS[rollout]} spans; {label}; {PER_STEP} per step, "
                  f"{CAP} kept), {n} rollouts, median of {repeat}: rate 1.0 {med['1.0']:6.1f} us, rate 0.05 "
                  f"{med['0.05']:6.1f} us: falls {med['1.0'] / med['0.05']:.1f}x (target >= 10x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=3000, help="rollouts per measured worker")
    parser.add_argument("--repeat", type=int, default=3, help="rounds; the median is printed")
    parser.add_argument("--parts", default="a,b", help="which measurements: a, b (comma list)")
    parser.add_argument("--rollouts", default="toy,real", help=f"which rollouts: {', '.join(ROLLOUTS)} (comma list)")
    parser.add_argument("--per-step", type=int, default=PER_STEP, help="rollouts per step (64)")
    args = parser.parse_args()
    os.environ["BENCH_PER_STEP"] = str(args.per_step)  # the spawned processes read it
    globals()["PER_STEP"] = args.per_step
    parts = set(args.parts.split(","))
    rollouts = args.rollouts.split(",")
    if not set(rollouts) <= ROLLOUTS.keys():
        parser.error(f"--rollouts: one of {', '.join(ROLLOUTS)}")
    print(reference_line())
    with tempfile.TemporaryDirectory() as tmp:
        if "a" in parts:
            part_a(args.n, args.repeat, tmp, rollouts)
        if "b" in parts:
            part_b(args.n, args.repeat, tmp, rollouts)
    print(reference_line())


if __name__ == "__main__":
    main()
