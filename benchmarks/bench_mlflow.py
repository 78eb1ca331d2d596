"""Throughput of the MLflow sink into SQLite, against writing the same traces by hand.

(a) rtrace's MlflowSink: trajectories of 5 spans (rollout root, 2 generations, 2 tools,
    with inputs/outputs and rl.* / gen_ai.* attributes) handed to ``export()`` in batches
    of ``max_export_batch_size`` (256 by default), as the pipeline's sink thread does,
    linked to a run, after one untimed batch (the first batch into a new database pays
    for SQLAlchemy's statement compilation, ~30% more); target >= 150 trajectories/s;
(b) the by-hand baseline: the same MLflow spans, one ``log_spans`` + one
    ``link_traces_to_run`` call per trajectory (what a per-trajectory exporter does);
(a') the same sink into a real ``mlflow server`` on 127.0.0.1 (SQLite backend, one worker,
    started by the benchmark; ``--no-server`` skips it);
(c) end to end: the same trajectories made with the decorators and ``rollout_context``
    and written through ``rtrace.flush()`` (span building + worker + sink).

Each variant writes to its own fresh SQLite database in a temporary folder. Rates are
given per wall-clock second and per CPU-second of this process (the second does not move
when other jobs share the machine). Run:
``.venv/bin/python benchmarks/bench_mlflow.py [--n 1000]``. The sink's throughput and
its ratio to the baseline are the result; absolute numbers move with the machine.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import uuid

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import rtrace  # noqa: E402
from rtrace.config import load_settings  # noqa: E402
from rtrace.trajectory import SpanRecord, Trajectory  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _machine import reference_line  # noqa: E402


def make_trajectory(i: int) -> Trajectory:
    """A 5-span trajectory like a two-turn tool-calling rollout."""
    t0 = time.time_ns()
    root = uuid.uuid4().hex[:16]
    msgs = [{"role": "system", "content": "You are a calculator."},
            {"role": "user", "content": f"What is {i} * 3?"}]
    spans = [SpanRecord(root, None, "rollout", "rollout", t0, t0 + 5_000_000)]
    for turn in range(2):
        g, t = uuid.uuid4().hex[:16], uuid.uuid4().hex[:16]
        s = t0 + turn * 2_000_000
        spans.append(SpanRecord(g, root, "generate", "generation", s, s + 1_000_000,
                                attributes={"gen_ai.operation.name": "chat", "gen_ai.usage.input_tokens": 40,
                                            "gen_ai.usage.output_tokens": 12},
                                input={"messages": msgs}, output={"role": "assistant", "content": f"calc({i}, 3)"}))
        spans.append(SpanRecord(t, root, "calc", "tool", s + 1_000_000, s + 1_500_000,
                                attributes={"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "calc"},
                                input={"a": i, "b": 3}, output=i * 3))
    for s in spans:
        s.attributes.update({"rl.step": i // 64, "rl.sample_index": i, "rl.validate": False})
    return Trajectory(trace_id=uuid.uuid4().hex, name="rollout", spans=spans, step=i // 64, sample_index=i,
                      rollout_n=0, group_id=f"g{i // 8}", policy_version=i // 64, reward=1.0,
                      outcome={"correct": True, "format": 0.5},
                      messages=msgs + [{"role": "assistant", "content": str(i * 3)}])


def new_run(uri: str) -> str:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment(f"bench-{uuid.uuid4().hex[:8]}")
    return client.create_run(exp).info.run_id


def bench_sink(n: int, uri: str, batch: int, **settings) -> tuple[float, float]:
    """The sink into ``uri`` (a SQLite URI or a server's URL); CPU-s are this process's."""
    from rtrace.exporters.mlflow import MlflowSink

    run_id = new_run(uri)
    sink = MlflowSink(load_settings({"exporter": "mlflow", "mlflow_tracking_uri": uri, "mlflow_run_id": run_id,
                                     **settings}))
    # open the store, resolve the experiment, fill SQLAlchemy's statement cache: steady state
    sink.export([make_trajectory(-1 - i) for i in range(batch)])
    trajs = [make_trajectory(i) for i in range(n)]
    start, cpu = time.perf_counter(), time.process_time()
    for i in range(0, n, batch):
        sink.export(trajs[i:i + batch])
    return n / (time.perf_counter() - start), n / (time.process_time() - cpu)


def bench_by_hand(n: int, folder: str) -> tuple[float, float]:
    from mlflow.entities import Span
    from mlflow.tracking import MlflowClient

    from rtrace.exporters.mlflow import _Converter

    uri = f"sqlite:///{folder}/hand.db"
    run_id = new_run(uri)
    client = MlflowClient(tracking_uri=uri)
    exp_id = client.get_run(run_id).info.experiment_id
    store = client._tracking_client.store
    conv = _Converter()
    trajs = [make_trajectory(i) for i in range(n)]
    start, cpu = time.perf_counter(), time.process_time()
    for traj in trajs:
        store.log_spans(exp_id, [Span.from_otel_proto(p) for p in conv.trajectory(traj)])
        client.link_traces_to_run(["tr-" + traj.trace_id], run_id)
    return n / (time.perf_counter() - start), n / (time.process_time() - cpu)


def bench_end_to_end(n: int, folder: str) -> float:
    uri = f"sqlite:///{folder}/e2e.db"
    run_id = new_run(uri)
    rtrace.configure(exporter="mlflow", mlflow_tracking_uri=uri, mlflow_run_id=run_id, export_interval_s=0.05)

    @rtrace.traced_generation
    def generate(messages):
        return {"role": "assistant", "content": "calc(2, 3)"}

    @rtrace.traced_tool
    def calc(a, b):
        return a * b

    def rollout(i):
        with rtrace.rollout_context(step=i // 64, sample_index=i, group_id=f"g{i // 8}"):
            msgs = [{"role": "user", "content": f"What is {i} * 3?"}]
            for _ in range(2):
                generate(msgs)
                calc(i, 3)
            rtrace.record_reward(1.0)

    rollout(-1)
    assert rtrace.flush(120)
    start = time.perf_counter()
    for i in range(n):
        rollout(i)
    assert rtrace.flush(600)
    rate = n / (time.perf_counter() - start)
    stats = rtrace.stats()
    rtrace.shutdown()
    assert stats.get("sink.mlflow.failed_batches", 0) == 0, stats
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1000, help="trajectories per variant")
    parser.add_argument("--batch", type=int, default=256, help="trajectories per export() call")
    parser.add_argument("--no-server", action="store_true", help="skip the real `mlflow server` variant")
    parser.add_argument("--only-sink", action="store_true", help="only the sink variants (SQLite, server)")
    args = parser.parse_args()
    import mlflow  # noqa: F401  (import cost outside the timings)
    import logging

    logging.getLogger("mlflow").setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory() as folder:
        # the sink before this round (no assessments), the defaults (SQLite: 4 assessments per
        # trajectory in one transaction per batch), and the GenAI conventions on top
        variants = {"no assessments (the sink before)": {"mlflow_assessments": False},
                    "defaults": {},
                    "RTRACE_SEMCONV=both": {"semconv": "both"}}
        sinks = {name: bench_sink(args.n, f"sqlite:///{folder}/sink-{i}.db", args.batch, **kw)
                 for i, (name, kw) in enumerate(variants.items())}
        sink = sinks["defaults"]
        servers = {}
        if not args.no_server:
            sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
            from servers import start_mlflow_server, stop_server

            base_url, popen = start_mlflow_server(os.path.join(folder, "server"))
            try:  # against a server the defaults write no assessments (one request each)
                for name, kw in (("defaults (no assessments)", {}),
                                 ("RTRACE_MLFLOW_ASSESSMENTS=true", {"mlflow_assessments": True}),
                                 ("RTRACE_SEMCONV=both", {"semconv": "both"})):
                    servers[name] = bench_sink(args.n, base_url, args.batch, **kw)
            finally:
                stop_server(popen)
        hand = bench_by_hand(max(100, args.n // 4), folder) if not args.only_sink else None
        e2e = bench_end_to_end(args.n, folder) if not args.only_sink else None
    print(reference_line())
    print(f"mlflow {mlflow.__version__}, SQLite, trajectories of 5 spans, linked to a run "
          f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    print("                                               wall traj/s   traj per CPU-s")
    print(f"  rtrace MlflowSink.export, {args.batch} per call, into SQLite (target >= 150):")
    for name, (wall, cpu) in sinks.items():
        print(f"    {name:<44} {wall:10.1f} {cpu:14.1f}")
    if servers:
        print("  the same into a real `mlflow server` (SQLite; CPU-s of the client only; target >= 150):")
        for name, (wall, cpu) in servers.items():
            print(f"    {name:<44} {wall:10.1f} {cpu:14.1f}")
    if hand is not None:
        print(f"  by hand, one log_spans + link per trajectory: {hand[0]:10.1f} {hand[1]:14.1f}")
        print(f"  ratio sink / by hand                        : {sink[0] / hand[0]:9.2f}x {sink[1] / hand[1]:13.2f}x")
    if e2e is not None:
        print(f"  end to end (decorators -> flush -> sink)    : {e2e:10.1f}")


if __name__ == "__main__":
    main()
