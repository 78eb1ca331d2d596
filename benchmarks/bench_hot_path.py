"""Hot-path cost of rtrace, as ratios against baselines measured in the same run.

(a) tracing off: a decorated call vs a bare pass-through wrapper (target <= 1.1x);
(b) tracing on: one trajectory (root + agent + 2 generations + 2 tools) through rtrace into
    its JSONL sink writing to /dev/null, vs the same six spans made by hand with the OTel SDK (rl.* and gen_ai.* attributes,
    inputs/outputs as JSON attributes) and a BatchSpanProcessor, against two exporters:
    one that JSON-encodes each span (``span.to_json()``, kept in memory) and the SDK's own
    ``ConsoleSpanExporter`` writing the JSON to /dev/null (target <= 0.25x, loop + flush,
    against both);
(c) the same trajectory with MLflow's ``@mlflow.trace`` (target: rtrace <= 0.25x), if
    mlflow is installed.

Run: ``.venv/bin/python benchmarks/bench_hot_path.py [--n 2000] [--repeats 5]``.
Times are of the traced program's thread (the loop), with every exporter running in
its own background thread as in production; each figure is the median of alternating
repeats. Absolute times move with the machine; the ratios are the result.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Callable

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import rtrace  # noqa: E402
from rtrace.exporters.base import Sink  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _agent import decorated_agent, make_agent  # noqa: E402
from _machine import reference_line  # noqa: E402


def devnull_sink() -> Sink:
    """rtrace's own JSONL sink writing to /dev/null: every trajectory encoded as its JSONL
    line (orjson when installed, as it is with the trackio and otlp extras; else the json
    module) and written, like the baselines' JSON to /dev/null."""
    from rtrace.config import load_settings
    from rtrace.exporters.jsonl import JsonlSink

    return JsonlSink(load_settings({"jsonl_path": os.devnull}, environ={}))


# ----------------------------------------------------------------------------- (a)
def bench_off(n: int) -> tuple[float, float]:
    rtrace.configure(exporter="none")

    def f(x):
        return x

    def passthrough(func):
        def wrapper(*args, **kwargs):
            return func(*args, **kwargs)
        return wrapper

    bare = passthrough(f)
    traced = rtrace.traced(f)

    def loop(fn: Callable) -> float:
        t0 = time.perf_counter()
        for i in range(n):
            fn(i)
        return time.perf_counter() - t0

    return loop(bare), loop(traced)


# ----------------------------------------------------------------------------- (b)
def make_rtrace_agent():
    return make_agent(rtrace, lambda i: {"step": i // 64, "sample_index": i % 64, "rollout_n": 0, "validate": False,
                                         "group_id": f"g{i % 64}", "policy_version": 1})


def make_by_hand_agent(devnull=None):
    """The six spans by hand; their exporter JSON-encodes each span, or (``devnull``, an
    open file) is the SDK's ConsoleSpanExporter writing that JSON to it."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import (BatchSpanProcessor, ConsoleSpanExporter, SpanExporter,
                                                SpanExportResult)

    class JsonExporter(SpanExporter):
        def export(self, spans):
            for s in spans:
                s.to_json()
            return SpanExportResult.SUCCESS

    exporter = ConsoleSpanExporter(out=devnull) if devnull is not None else JsonExporter()
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(exporter, max_queue_size=65536))
    tracer = provider.get_tracer("by-hand")

    def coords(i):
        return {"rl.step": i // 64, "rl.sample_index": i % 64, "rl.rollout_n": 0, "rl.validate": False,
                "rl.group_id": f"g{i % 64}", "rl.policy_version": 1}

    def generate(i, prompt_ids):
        with tracer.start_as_current_span("generate", attributes=coords(i)) as span:
            out = {"response_ids": [1, 2, 3, 4], "finish_reason": "stop"}
            span.set_attributes({"gen_ai.operation.name": "chat", "gen_ai.usage.input_tokens": len(prompt_ids),
                                 "gen_ai.usage.output_tokens": 4, "gen_ai.response.finish_reasons": ("stop",),
                                 "input": json.dumps({"prompt_ids": prompt_ids}), "output": json.dumps(out)})
            return out

    def calculator(i, call_id, expression):
        with tracer.start_as_current_span("calculator", attributes=coords(i)) as span:
            span.set_attributes({"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "calculator",
                                 "gen_ai.tool.call.id": call_id,
                                 "input": json.dumps({"expression": expression}), "output": json.dumps("42")})
            return "42"

    def trajectory(i: int) -> None:
        with tracer.start_as_current_span("rollout", attributes=coords(i)) as root:
            with tracer.start_as_current_span("agent", attributes=coords(i)) as agent:
                prompt_ids = [1, 2, 3, 4, 5, 6, 7, 8]
                agent.set_attribute("input", json.dumps({"prompt_ids": prompt_ids}))
                out = generate(i, prompt_ids)
                calculator(i, "c1", "6*7")
                out = generate(i, prompt_ids + out["response_ids"])
                calculator(i, "c2", "6*7")
                agent.set_attribute("output", json.dumps(out))
            root.set_attribute("rl.reward", 1.0)

    return trajectory, provider


def make_mlflow_agent(tmp: str):
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{tmp}/mlflow.db")
    mlflow.set_experiment("bench")

    run = decorated_agent(mlflow.trace(span_type="LLM"), mlflow.trace(span_type="TOOL"),
                          mlflow.trace(span_type="AGENT"))

    @mlflow.trace(name="rollout", span_type="CHAIN")
    def trajectory(i: int) -> None:
        mlflow.update_current_trace(tags={"step": str(i // 64), "sample_index": str(i % 64)})
        run([1, 2, 3, 4, 5, 6, 7, 8])

    return trajectory


def timed(fn: Callable[[int], None], n: int) -> float:
    t0 = time.perf_counter()
    for i in range(n):
        fn(i)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2000, help="trajectories per repeat")
    parser.add_argument("--calls", type=int, default=200_000, help="calls per repeat for (a)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-mlflow", action="store_true")
    args = parser.parse_args()

    print(reference_line())
    bare, off = [], []
    for _ in range(args.repeats):
        b, o = bench_off(args.calls)
        bare.append(b)
        off.append(o)
    mb, mo = statistics.median(bare), statistics.median(off)
    print(f"(a) tracing off: bare wrapper {mb / args.calls * 1e9:.0f} ns/call, "
          f"decorated {mo / args.calls * 1e9:.0f} ns/call -> ratio {mo / mb:.2f}x (target <= 1.1x)")

    devnull = open(os.devnull, "w")
    hands = {"JSON in memory": make_by_hand_agent(), "ConsoleSpanExporter to /dev/null": make_by_hand_agent(devnull)}
    ours_t, ours_all, ours_cpu = [], [], []
    hand_t = {k: [] for k in hands}
    hand_all = {k: [] for k in hands}
    hand_cpu = {k: [] for k in hands}
    for _ in range(args.repeats):
        rtrace.configure(sinks=[devnull_sink()])
        rt_traj = make_rtrace_agent()
        c0, t0 = time.process_time(), time.perf_counter()
        ours_t.append(timed(rt_traj, args.n))
        rtrace.flush(60)  # loop + flush: the work deferred to rtrace's threads counts too
        ours_all.append(time.perf_counter() - t0)
        ours_cpu.append(time.process_time() - c0)
        rtrace.shutdown()
        for name, (by_hand, provider) in hands.items():
            c0, t0 = time.process_time(), time.perf_counter()
            hand_t[name].append(timed(by_hand, args.n))
            provider.force_flush()
            hand_all[name].append(time.perf_counter() - t0)
            hand_cpu[name].append(time.process_time() - c0)
    med = statistics.median
    mo, ma, mc = med(ours_t), med(ours_all), med(ours_cpu)
    per = lambda t: t / args.n * 1e6  # noqa: E731
    from rtrace import _serialize

    print("(b) tracing on, 6 spans/trajectory, rtrace's JSONL sink to /dev/null (encoder: "
          f"{'orjson' if _serialize._orjson_dumps is not None else 'json module'}), vs by hand "
          "(OTel SDK + BatchSpanProcessor + a JSON exporter):")
    for name in hands:
        mh, mha, mhc = med(hand_t[name]), med(hand_all[name]), med(hand_cpu[name])
        print(f"  by hand with {name}:\n"
              f"    loop + flush (wall): by hand {per(mha):.0f} us, rtrace {per(ma):.0f} us -> ratio {ma / mha:.2f}x "
              f"(target <= 0.25x)\n"
              f"    loop + flush (process CPU): by hand {per(mhc):.0f} us, rtrace {per(mc):.0f} us -> ratio "
              f"{mc / mhc:.2f}x\n"
              f"    loop only (the traced program's thread): by hand {per(mh):.0f} us, rtrace {per(mo):.0f} us "
              f"-> ratio {mo / mh:.2f}x")
    for _, provider in hands.values():
        provider.shutdown()
    devnull.close()

    if not args.no_mlflow:
        try:
            import mlflow
        except ImportError:
            print("(c) skipped: mlflow not installed")
            return
        with tempfile.TemporaryDirectory() as tmp:
            ml = make_mlflow_agent(tmp)
            n = max(50, args.n // 10)
            ml_t = []
            for _ in range(max(1, args.repeats // 2)):
                ml_t.append(timed(ml, n) / n * args.n)
            mm = statistics.median(ml_t)
            try:
                mlflow.flush_trace_async_logging()
            except Exception:
                pass
            print(f"(c) MLflow @mlflow.trace (SQLite, loop only): {per(mm):.0f} us/trajectory -> rtrace/MLflow "
                  f"ratio {mo / mm:.2f}x (target <= 0.25x)")


if __name__ == "__main__":
    main()
