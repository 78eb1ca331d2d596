"""What the rollout-health checks cost, where they run: the worker thread's CPU per trajectory.

The same traced agent (benchmarks/_agent.py: 6 spans, 2 generations with token ids, 2
tool calls, a reward) runs N times in one process into an in-memory sink, with the
health checks off, with the default checks, and with every check (retokenization
included, with the demo's tokenizer and token2text on in all three). The traced call's
cost (the program's thread) and the worker thread's CPU (read from /proc for that
thread) are printed per trajectory, each as a ratio to "off" measured in the same run.

    .venv/bin/python benchmarks/bench_health.py [N] [ROUNDS]
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import rtrace  # noqa: E402
import rtrace._setup  # noqa: E402
import rtrace.testing  # noqa: E402
from _agent import make_agent  # noqa: E402

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def thread_cpu_s(native_id: int) -> float:
    """utime + stime of one thread of this process, in seconds (/proc)."""
    with open(f"/proc/self/task/{native_id}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def run(checks: str, n: int, tok) -> tuple[float, float]:
    """(µs of the program's thread per trajectory, µs of the worker thread's CPU per trajectory)."""
    sink = rtrace.testing.MemorySink()
    rtrace.configure(sinks=[sink], health_checks=checks, token2text=True, tokenizer=tok, export_interval_s=0.05,
                     summary_metrics=True, max_queue_size=1_000_000)
    worker = rtrace._setup._pipeline._worker
    agent = make_agent(rtrace, lambda i: {"step": i // 64, "sample_index": (i // 4) % 16, "rollout_n": i % 4,
                                          "group_id": f"g{(i // 4) % 16}", "policy_version": i // 64})
    before = thread_cpu_s(worker.native_id)
    start = time.perf_counter()
    for i in range(n):
        agent(i)
    traced = time.perf_counter() - start
    assert rtrace.flush(120)
    cpu = thread_cpu_s(worker.native_id) - before
    assert len(sink.trajectories) == n
    rtrace.shutdown()
    return traced / n * 1e6, cpu / n * 1e6


def checks_alone(n: int, tok) -> dict[str, float]:
    """µs per trajectory of the check functions themselves (phase 1 on the worker's state,
    phases 2 and 3 on the finished trajectory), on the agent's trajectories: a measure
    that the machine's other load disturbs less than thread CPU."""
    import copy

    from rtrace.pipeline.health import HealthChecker
    from rtrace.pipeline.records import TrajectoryState

    sink = rtrace.testing.MemorySink()
    rtrace.configure(sinks=[sink], health_checks="none", token2text=True, tokenizer=tok, token2text_keep_ids=True,
                     max_queue_size=1_000_000)
    agent = make_agent(rtrace, lambda i: {"step": i // 64, "sample_index": (i // 4) % 16, "rollout_n": i % 4,
                                          "group_id": f"g{(i // 4) % 16}", "policy_version": i // 64})
    for i in range(n):
        agent(i)
    assert rtrace.flush(120)
    rtrace.shutdown()
    trajs = sink.trajectories
    states = []
    for t in trajs:
        s = TrajectoryState(int(t.trace_id, 16), int(t.root.span_id, 16), t.name, "rollout", t.coordinates)
        s.records, s.reward, s.has_reward = t.spans, t.reward, True
        states.append(s)
    out = {}
    for name, checks in (("default", ("token_continuity", "reward", "generation", "staleness", "coordinates")),
                         ("all", ("token_continuity", "retokenization", "reward", "generation", "staleness",
                                  "coordinates"))):
        checker = HealthChecker(checks, 1, lambda: tok)
        copies = copy.deepcopy(trajs)
        for t in copies:
            t.health = []
        start = time.perf_counter()
        for s in states:
            s.health = []
            checker.check_state(s)
        checker.check_ids(copies)
        checker.check_text(copies)
        out[name] = (time.perf_counter() - start) / n * 1e6
    return out


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    from rtrace.demo import build_tokenizer

    tok = build_tokenizer()
    setups = {"off": "none", "default": "token_continuity,reward,generation,staleness,coordinates", "all": "all"}
    got: dict[str, list[tuple[float, float]]] = {name: [] for name in setups}
    run("none", 300, tok)  # warm-up
    for _ in range(rounds):
        for name, checks in setups.items():  # in turn, so a slow moment of the machine hits all
            got[name].append(run(checks, n, tok))
    base_call = statistics.median(c for c, _ in got["off"])
    base_cpu = statistics.median(w for _, w in got["off"])
    print(f"rollout health, {n} trajectories of 6 spans x {rounds} rounds (median), token2text on:")
    for name in setups:
        call = statistics.median(c for c, _ in got[name])
        cpu = statistics.median(w for _, w in got[name])
        print(f"  checks {name:<8} traced call {call:7.1f} µs ({call / base_call:.2f}x)   "
              f"worker CPU {cpu:7.1f} µs/trajectory ({cpu / base_cpu:.2f}x, +{cpu - base_cpu:.1f} µs)")
    alone = checks_alone(n, tok)
    print(f"  the checks alone, per trajectory: default {alone['default']:.1f} µs, all {alone['all']:.1f} µs "
          f"(retokenization: one tokenizer encode per generation)")


if __name__ == "__main__":
    main()
