"""Collector mode, measured against baselines in the same run.

(a) Collector throughput: 4 worker processes send trajectories (6 spans each, the
    attributes rtrace's workers send) to one collector in this process, which assembles
    them and writes JSONL; spans/s from the first request sent to the last trajectory
    written, and spans lost (target >= 30,000 spans/s, 0 lost). The workers encode their
    OTLP requests before the clock starts (the compact form rtrace's workers send), so
    what is measured is the collector, not the senders; (b) measures the senders.
(b) Rollout-worker CPU per trajectory (process CPU of the worker, loop + flush) in
    three set-ups, each in a fresh process, same agent loop:
      one-process mode (rtrace assembling and writing JSONL itself),
      collector mode (rtrace streaming to the collector),
      the OTel SDK with its own OTLP/gRPC exporter (BatchSpanProcessor), same spans.
    The streaming set-ups send to an OTLP receiver that counts the spans (all must
    arrive) and does nothing else: the collector's work is (a), and on a 2-core machine
    it would compete with the measured worker for the cores.
    Target: collector mode below one-process mode. The three run in turn ``--repeat``
    times (default 3) and the median of each is printed: a noisy machine slows the
    set-ups alike instead of one of them.

(c) Sustained rate from 16 clients: 16 processes each send trajectories (the same 6-span
    requests, 64 per request) at a fixed rate for ``--seconds``, open loop (a request is due
    at its time whether or not the previous one was answered late), into a collector set up
    as `rtrace collect` with its defaults (20,000 open trajectories, each settling 2 s). A
    pushed-back request (RESOURCE_EXHAUSTED) is sent again after the delay its RetryInfo
    names, within 10 s (OTEL_EXPORTER_OTLP_TIMEOUT's default), as rtrace's workers do. For
    each offered rate: spans/s written (first request sent to last trajectory written),
    push-backs, and what was lost (requests that failed after their retries). The largest
    rate written with nothing lost, and the rate at which push-back starts, are printed.

Run: ``.venv/bin/python benchmarks/bench_collector.py [--n 3000] [--parts a,b,c]``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _agent import SPANS_PER_TRAJECTORY, make_agent  # noqa: E402
from _machine import reference_line  # noqa: E402
from _send import EXPORT, send_requests  # noqa: E402

#: trajectories each set-up of (b) runs (and flushes) before it is measured
WARM_UP = 200


def rtrace_worker(env, n, worker, out):
    os.environ.update(env)
    import rtrace

    traj = make_agent(rtrace, lambda i: {"step": i // 64, "sample_index": i % 64 + worker * 64, "rollout_n": 0})
    for i in range(WARM_UP):  # steady state: imports, the sink's set-up and connection are done
        traj(i)
    rtrace.flush(120)
    c0 = time.process_time()
    for i in range(n):
        traj(i)
    ok = rtrace.flush(120)
    out.put((time.process_time() - c0, ok, rtrace.stats()))
    out.close()
    out.join_thread()
    os._exit(0)


def sdk_worker(endpoint, n, out):
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=True),
                                                   max_queue_size=65536))
    tracer = provider.get_tracer("by-hand")

    def coords(i):
        return {"rl.step": i // 64, "rl.sample_index": i % 64, "rl.rollout_n": 0, "rl.validate": False}

    def span(name, i, **attrs):
        return tracer.start_as_current_span(name, attributes={**coords(i), **attrs})

    def one(i):
        with span("rollout", i, **{"rtrace.root": True}) as root:
            with span("agent", i, input=json.dumps({"prompt_ids": [1, 2, 3, 4, 5, 6, 7, 8]})):
                for call in ("c1", "c2"):
                    with span("generate", i, **{"gen_ai.operation.name": "chat", "gen_ai.usage.input_tokens": 8,
                                                "gen_ai.usage.output_tokens": 4,
                                                "output": json.dumps({"finish_reason": "stop"})}):
                        pass
                    with span("calculator", i, **{"gen_ai.tool.name": "calculator", "gen_ai.tool.call.id": call,
                                                  "input": json.dumps({"expression": "6*7"}),
                                                  "output": json.dumps("42")}):
                        pass
            root.set_attribute("rl.reward", 1.0)

    for i in range(WARM_UP):  # steady state, as for rtrace
        one(i)
    provider.force_flush(120_000)
    c0 = time.process_time()
    for i in range(n):
        one(i)
    ok = provider.force_flush(120_000)
    out.put((time.process_time() - c0, ok, {}))
    out.close()
    out.join_thread()
    os._exit(0)


def worker_trajectory(worker, i):
    """Trajectory ``i`` of sender ``worker``: 6 spans, the attributes rtrace's workers send."""
    from rtrace import _ids
    from rtrace.trajectory import SpanRecord, Trajectory

    coords = {"rl.step": i // 256, "rl.sample_index": i % 256 + worker * 256, "rl.rollout_n": 0,
              "rl.validate": False}
    root, agent = f"{_ids.span_id():016x}", f"{_ids.span_id():016x}"
    spans = [SpanRecord(root, None, "rollout", "rollout", 1, 100, attributes={
                 **coords, "rtrace.root": True, "rl.reward": 1.0}),
             SpanRecord(agent, root, "agent", "agent", 2, 99, attributes=coords, input={"prompt_ids": "8 ids"},
                        output={"finish_reason": "stop"})]
    for k in range(2):
        spans.append(SpanRecord(f"{_ids.span_id():016x}", agent, "generate", "generation", 3 + k, 4 + k,
                                attributes={"gen_ai.operation.name": "chat", "gen_ai.usage.input_tokens": 8,
                                            "gen_ai.usage.output_tokens": 4},
                                output={"finish_reason": "stop"}, prompt_ids=[1, 2, 3, 4, 5, 6, 7, 8],
                                response_ids=[1, 2, 3, 4]))
        spans.append(SpanRecord(f"{_ids.span_id():016x}", agent, "calculator", "tool", 5 + k, 6 + k,
                                attributes={"gen_ai.operation.name": "execute_tool",
                                            "gen_ai.tool.name": "calculator", "gen_ai.tool.call.id": f"c{k}"},
                                input={"expression": "6*7"}, output="42"))
    return Trajectory(f"{_ids.trace_id():032x}", "rollout", spans)


def encoded_requests(worker, n, per_request):
    """``n`` trajectories of ``worker`` as encoded OTLP requests (what workers send)."""
    from rtrace.exporters.otel import encode_compact

    resource = {"service.name": f"worker-{worker}"}
    return [encode_compact([worker_trajectory(worker, i) for i in range(start, min(n, start + per_request))],
                           resource).SerializeToString() for start in range(0, n, per_request)]


def sender(endpoint, worker, n, per_request, ready, go, out):
    """Pre-encodes ``n`` worker-shaped trajectories into OTLP requests, then sends them
    (retrying on RESOURCE_EXHAUSTED, the collector's backpressure)."""
    out.put(send_requests(endpoint, encoded_requests(worker, n, per_request), ready, go))
    out.close()
    out.join_thread()
    os._exit(0)


def paced_sender(endpoint, worker, rate, seconds, per_request, ready, go, out):
    """(c): ``rate`` trajectories/s for ``seconds``, ``per_request`` per request, each request
    due at its own time (open loop). A push-back is retried after the delay the collector's
    RetryInfo names, within 10 s of the request's first try (rtrace's worker sink does the
    same); a request still refused then is lost. Reports (trajectories sent, lost,
    push-backs, seconds the last request started behind its time)."""
    import grpc
    from rtrace.exporters.collector import _retry_delay

    n = max(per_request, int(rate * seconds))
    requests = encoded_requests(worker, n, per_request)
    interval = per_request / rate
    export = grpc.insecure_channel(endpoint).unary_unary(EXPORT)
    ready.set()
    go.wait()
    t0 = time.monotonic() + worker * interval / 16  # the 16 clients spread over one interval
    lost = pushed = 0
    behind = 0.0
    for k, body in enumerate(requests):
        due = t0 + k * interval
        now = time.monotonic()
        if due > now:
            time.sleep(due - now)
        else:
            behind = now - due
        deadline = time.monotonic() + 10.0
        while True:
            try:
                export(body, timeout=max(0.05, deadline - time.monotonic()))
                break
            except grpc.RpcError as exc:
                delay = _retry_delay(exc) or 0.05
                if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() + delay >= deadline:
                    lost += min(per_request, n - k * per_request)
                    break
                pushed += 1
                time.sleep(delay)
    out.put((n, lost, pushed, behind))
    out.close()
    out.join_thread()
    os._exit(0)


def sustained(rate: int, seconds: float, path: str, clients: int = 16, per_request: int = 64) -> dict:
    """(c) at one offered rate (trajectories/s, all clients together)."""
    import rtrace
    from rtrace import _stats
    from rtrace.exporters.jsonl import read_jsonl

    _stats.reset()  # this rate's counters only
    collector = rtrace.start_collector(exporter="jsonl", jsonl_path=path)  # `rtrace collect`'s defaults
    ctx = mp.get_context("spawn")
    go = ctx.Event()
    procs = []
    for w in range(clients):
        ready, q = ctx.Event(), ctx.Queue()
        p = ctx.Process(target=paced_sender, args=(collector.endpoint, w, rate / clients, seconds, per_request,
                                                   ready, go, q))
        p.start()
        procs.append((p, q, ready))
    for _, _, ready in procs:
        assert ready.wait(600)
    t0 = time.perf_counter()
    go.set()
    reports = [q.get(timeout=600) for _, q, _ in procs]
    collector.flush(600)  # False when the sink dropped (counted below)
    elapsed = time.perf_counter() - t0
    for p, _, _ in procs:
        p.join(60)
    stats = collector.stats()
    collector.stop()
    written = len(read_jsonl(path))
    os.remove(path)
    sent, lost = sum(r[0] for r in reports), sum(r[1] for r in reports)
    return {"rate": rate, "sent": sent, "written": written, "lost": lost, "pushed": sum(r[2] for r in reports),
            "behind": max(r[3] for r in reports), "spans_per_s": written * SPANS_PER_TRAJECTORY / elapsed,
            "dropped": stats.get("spans_dropped_open_limit", 0) + stats.get("trajectories_dropped_open_limit", 0),
            "sink_dropped": stats.get("sink.jsonl.dropped_trajectories", 0), "elapsed": elapsed}


def run(target, *args):
    q = mp.get_context("spawn").Queue()
    p = mp.get_context("spawn").Process(target=target, args=(*args, q))
    p.start()
    return p, q


def throughput(n: int, path: str, label: str) -> None:
    """(a): 4 senders x ``n`` trajectories -> one collector in this process -> JSONL."""
    import rtrace
    from rtrace.exporters.jsonl import read_jsonl

    collector = rtrace.start_collector(exporter="jsonl", jsonl_path=path, settle_s=0.5, max_open_trajectories=200_000)
    ctx = mp.get_context("spawn")
    go = ctx.Event()
    senders = []
    for w in range(4):
        ready, q = ctx.Event(), ctx.Queue()
        p = ctx.Process(target=sender, args=(collector.endpoint, w, n, 64, ready, go, q))
        p.start()
        senders.append((p, q, ready))
    for _, _, ready in senders:
        assert ready.wait(600)
    c0 = time.process_time()
    t0 = time.perf_counter()
    go.set()
    sent_by = [q.get(timeout=600) for _, q, _ in senders]
    retries, sender_cpu = sum(r for r, _ in sent_by), sum(c for _, c in sent_by)
    assert collector.flush(600)
    elapsed = time.perf_counter() - t0
    cpu = time.process_time() - c0
    for p, _, _ in senders:
        p.join(60)
    collector.stop()
    written = len(read_jsonl(path))
    spans = written * SPANS_PER_TRAJECTORY
    sent = 4 * n * SPANS_PER_TRAJECTORY
    print(f"(a) collector {label}: 4 senders x {n} trajectories x {SPANS_PER_TRAJECTORY} spans -> JSONL: "
          f"{spans / elapsed:,.0f} spans/s ({written:,} trajectories in {elapsed:.1f} s; collector CPU "
          f"{spans / cpu:,.0f} spans per CPU-second), lost {sent - spans} of {sent} spans "
          f"(backpressure retries {retries}; the 4 senders used {sender_cpu:.1f} CPU-s; target >= 30,000 "
          "spans/s, 0 lost)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=3000, help="trajectories per worker")
    parser.add_argument("--repeat", type=int, default=3, help="rounds of (b); the median is printed")
    parser.add_argument("--parts", default="a,b,c", help="which measurements: a, b, c (comma list)")
    parser.add_argument("--rates", default="2000,3000,4000,5000,6000,7000",
                        help="(c): offered rates, trajectories/s from the 16 clients together")
    parser.add_argument("--seconds", type=float, default=10.0, help="(c): how long each rate is offered")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    import rtrace
    from rtrace.pipeline.otlp_receiver import OtlpReceiver, count_spans

    with tempfile.TemporaryDirectory() as tmp:
        print(reference_line())
        # (a) throughput: 4 senders -> one collector -> JSONL; first inside this process
        # with Python's GC as it is (start_collector in an application's process), then
        # with the GC set up as `rtrace collect` sets up its own process (tune_gc)
        from rtrace.pipeline.collector import tune_gc

        if "a" in parts:
            throughput(args.n, os.path.join(tmp, "a.jsonl"), "in an application's process (GC untouched)")
        tune_gc()
        if "a" in parts:
            throughput(args.n, os.path.join(tmp, "a2.jsonl"), "as `rtrace collect` (tune_gc)")
        if "c" in parts:
            print(f"(c) 16 clients, {args.seconds:g} s at each offered rate, into a collector as `rtrace collect` "
                  "(defaults: 20,000 open trajectories, settle 2 s):")
            results = []
            for rate in (int(r) for r in args.rates.split(",")):
                r = sustained(rate, args.seconds, os.path.join(tmp, "c.jsonl"))
                results.append(r)
                print(f"    offered {rate:6,} traj/s ({rate * SPANS_PER_TRAJECTORY:7,} spans/s): written "
                      f"{r['spans_per_s']:7,.0f} spans/s ({r['written']:,} of {r['sent']:,} trajectories in "
                      f"{r['elapsed']:.1f} s), push-backs {r['pushed']:,}, lost at the senders {r['lost']:,}, "
                      f"dropped in the collector {r['dropped']}, by the JSONL sink behind (counted) "
                      f"{r['sink_dropped']:,}, last request {r['behind']:.1f} s behind its time")
            clean = [r for r in results if r["lost"] == 0 and r["written"] == r["sent"] and not r["sink_dropped"]]
            pushed = [r["rate"] for r in results if r["pushed"]]
            smooth = [r["rate"] for r in clean if not r["pushed"]]
            if clean:
                best = max(clean, key=lambda r: r["spans_per_s"])
                print(f"    largest rate written with nothing lost: {best['spans_per_s']:,.0f} spans/s "
                      f"(offered {best['rate']:,} traj/s)")
            if smooth:
                print(f"    largest offered rate taken as offered (no push-back, nothing lost): {max(smooth):,} traj/s "
                      f"({max(smooth) * SPANS_PER_TRAJECTORY:,} spans/s)")
            print(f"    push-back starts at: {min(pushed):,} traj/s offered "
                  f"({min(pushed) * SPANS_PER_TRAJECTORY:,} spans/s)" if pushed else "    no push-back at these rates")
        if "b" not in parts:
            return

        # (b) worker CPU per trajectory, one process at a time, the set-ups in turn. The
        # senders' spans go to a receiver that counts them: the collector's own work (a)
        # would otherwise take this 2-core machine's other core from the measured worker.
        n = args.n
        results: dict[str, list[float]] = {}
        received = [0]
        receiver = OtlpReceiver(lambda request: received.__setitem__(0, received[0] + count_spans(request)))
        receiver.start()
        endpoint = f"127.0.0.1:{receiver.port}"
        setups = [("one-process (rtrace -> JSONL)", rtrace_worker,
                   ({"RTRACE_EXPORTER": "jsonl", "RTRACE_JSONL_PATH": os.path.join(tmp, "b.jsonl")}, n, 0), 0),
                  ("collector mode (rtrace -> collector)", rtrace_worker,
                   ({"RTRACE_EXPORTER": "collector", "RTRACE_COLLECTOR_ENDPOINT": endpoint}, n, 0),
                   SPANS_PER_TRAJECTORY),
                  ("OTel SDK + OTLP gRPC exporter", sdk_worker, (endpoint, n), SPANS_PER_TRAJECTORY)]
        for _ in range(args.repeat):
            for name, target, target_args, spans_each in setups:
                received[0] = 0
                p, q = run(target, *target_args)
                results.setdefault(name, []).append(q.get(timeout=600)[0])
                p.join(60)
                want = (WARM_UP + n) * spans_each
                assert received[0] == want, f"{name}: {received[0]} spans received, {want} sent"
        receiver.stop()
        results = {name: statistics.median(cpus) for name, cpus in results.items()}
        base = results["one-process (rtrace -> JSONL)"]
        print(f"(b) rollout-worker CPU per trajectory (loop + flush), {n} trajectories, median of "
              f"{args.repeat}:")
        for name, cpu in results.items():
            print(f"    {name:40} {cpu / n * 1e6:7.0f} us  ({cpu / base:.2f}x one-process)")


if __name__ == "__main__":
    main()
