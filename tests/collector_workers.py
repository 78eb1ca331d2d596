"""Worker-process bodies for the collector tests (importable by `spawn` children).

Each function runs in a fresh process configured only through the environment the
collector handed out (``collector.env``), as a Ray actor or a SLURM task would be.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from typing import Any

SPAWN = mp.get_context("spawn")


def start(target, *args) -> Any:
    """``target(*args)`` in a new spawned process, started."""
    proc = SPAWN.Process(target=target, args=args)
    proc.start()
    return proc


def join_all(procs, timeout_s: float = 120) -> None:
    """Wait for each of ``procs`` (``timeout_s`` each); each must have exited 0."""
    for proc in procs:
        proc.join(timeout_s)
        assert proc.exitcode == 0, f"process exit code {proc.exitcode}"


def _apply(env: dict[str, str]) -> None:
    os.environ.update(env)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def rollouts(env: dict[str, str], worker: int, workers: int, steps: int, prompts: int, n: int,
             validate_prompts: int = 0, linger_s: float = 2.0, step_pause_s: float = 0.0) -> None:
    """Prompts ``worker, worker + workers, ...`` of every step, ``n`` rollouts each (with
    ``step_pause_s`` between steps); then ends without flush or shutdown (what Ray does to
    an actor)."""
    _apply(env)
    import rtrace

    @rtrace.traced_tool(tool_name="calculator")
    def calc(x: int) -> int:
        return x * 2

    @rtrace.traced_rollout
    def loop(i: int) -> int:
        return calc(i)

    for step in range(steps):
        for p in range(worker, prompts, workers):
            for r in range(n):
                with rtrace.rollout_context(step=step, sample_index=p, rollout_n=r, group_id=f"p{p}"):
                    loop(p)
                    rtrace.record_reward(float(r))
        for p in range(worker, validate_prompts, workers):
            with rtrace.rollout_context(step=step, sample_index=p, rollout_n=0, validate=True):
                loop(p)
        time.sleep(step_pause_s)
    time.sleep(linger_s)  # spans leave ~0.5 s after they end: no flush, no atexit needed
    os._exit(0)


def hop_worker(env: dict[str, str], carrier: dict[str, str], server_port: int, out: Any) -> None:
    """The middle process of driver -> worker -> tool server: continues the driver's
    trajectory, calls the tool server over HTTP with the context injected."""
    _apply(env)
    import json
    import urllib.request

    import rtrace

    @rtrace.traced(kind="chain", name="worker.plan")
    def plan(x: int) -> int:
        req = urllib.request.Request(f"http://127.0.0.1:{server_port}/tool", data=json.dumps({"x": x}).encode(),
                                     headers=rtrace.inject({}), method="POST")
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.loads(resp.read())["y"]

    with rtrace.extract(carrier, name="worker"):
        out.put(plan(21))
    out.close()
    out.join_thread()
    time.sleep(2.0)
    os._exit(0)


def tool_server(env: dict[str, str], port_out: Any, stop: Any) -> None:
    """A tool server process: each request continues the caller's trajectory."""
    _apply(env)
    import json
    from http.server import BaseHTTPRequestHandler, HTTPServer

    import rtrace

    @rtrace.traced_tool(tool_name="doubler")
    def double(x: int) -> int:
        return x * 2

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with rtrace.extract(dict(self.headers), name="tool-server"):
                y = double(body["x"])
            payload = json.dumps({"y": y}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args: Any) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    server.timeout = 0.2
    port_out.put(server.server_address[1])
    while not stop.is_set():
        server.handle_request()
    time.sleep(2.0)
    os._exit(0)


def finish_then_hang(env: dict[str, str], finished: int, ready: Any) -> None:
    """Finishes ``finished`` rollouts, waits for them to leave, then opens one more whose
    tool span ends but whose root never does (the test SIGKILLs this process)."""
    _apply(env)
    import rtrace

    @rtrace.traced_tool(tool_name="calculator")
    def calc(x: int) -> int:
        return x + 1

    for i in range(finished):
        with rtrace.rollout_context(step=0, sample_index=i, rollout_n=0):
            calc(i)
    with rtrace.rollout_context(step=0, sample_index=finished, rollout_n=0):
        calc(-1)
        time.sleep(2.5)  # the tool span and the finished rollouts have left the process
        ready.set()
        time.sleep(600)


def against_dead_collector(env: dict[str, str], n: int, out: Any) -> None:
    """Runs ``n`` traced rollouts against a collector that is not there."""
    _apply(env)
    import rtrace

    @rtrace.traced_tool
    def calc(x: int) -> int:
        return x * 3

    results = []
    for i in range(n):
        with rtrace.rollout_context(step=0, sample_index=i, rollout_n=0):
            results.append(calc(i))
    ok = rtrace.flush(5)
    out.put((results, ok, rtrace.stats()))
    out.close()
    out.join_thread()  # os._exit would kill the queue's feeder thread before it wrote
    os._exit(0)


def generations(env: dict[str, str], prompt: list[int], response: list[int]) -> None:
    """One trajectory with a generation span: token ids only (no tokenizer here)."""
    _apply(env)
    import rtrace

    @rtrace.traced_generation(model="toy")
    def generate(prompt_ids: list[int]) -> dict:
        return {"response_ids": response, "finish_reason": "stop"}

    with rtrace.rollout_context(step=0, sample_index=0, rollout_n=0):
        generate(prompt)
    time.sleep(2.0)
    os._exit(0)


def steady(env: dict[str, str], n: int, pause_s: float, out: Any) -> None:
    """``n`` rollouts, one every ``pause_s``; reports its counters at the end."""
    _apply(env)
    import rtrace

    @rtrace.traced_tool
    def calc(x: int) -> int:
        return x + 1

    for i in range(n):
        with rtrace.rollout_context(step=0, sample_index=i, rollout_n=0):
            calc(i)
        time.sleep(pause_s)
    ok = rtrace.flush(30)
    out.put((ok, rtrace.stats()))
    out.close()
    out.join_thread()
    os._exit(0)


def health_job(worker: int) -> None:
    """Worker ``worker``'s part of a job with rollout-health findings (call with rtrace
    configured): per step, prompts ``worker, worker + 2, ...`` of 6 with 2 rollouts; some
    without reward, some stale, and sample 0 rollout 0 of step 1 made by both workers (a
    duplicate only the whole job shows)."""
    import rtrace

    @rtrace.traced_generation
    def gen(prompt_ids):
        return {"response_ids": [7, 8], "finish_reason": "stop"}

    for step in range(3):
        for p in range(worker, 6, 2):
            for r in range(2):
                with rtrace.rollout_context(step=step, sample_index=p, rollout_n=r, group_id=f"p{p}",
                                            policy_version=step - (2 if p == 4 else 0)):
                    gen([1, 2, 3])
                    gen([1, 2, 3, 7, 8] if (p + r) % 3 else [1, 2, 9])  # a continuity break
                    # each worker's first rollout has a reward: until the run has one, a missing
                    # reward is counted, not flagged (and arrival order across workers varies)
                    if (p + r + step + 1) % 4:
                        rtrace.record_reward(float(r))
        if step == 1 and worker == 1:
            with rtrace.rollout_context(step=1, sample_index=0, rollout_n=0, group_id="p0", policy_version=1):
                gen([1, 2, 3])
                rtrace.record_reward(0.0)


def health_worker(env: dict[str, str], worker: int) -> None:
    """:func:`health_job` in a fresh process configured by the collector's env; ends
    without flush (as Ray ends an actor)."""
    _apply(env)
    health_job(worker)
    time.sleep(1.5)
    os._exit(0)


def load_client(endpoint: str, client: int, n: int, per_request: int, timeout_s: float, ready: Any, go: Any,
                out: Any) -> None:
    """``n`` whole trajectories (a root and two tool spans each) of trace ids ``client * n + 1
    ...``, sent ``per_request`` at a time by rtrace's worker sink (``CollectorSink``, with its
    retries on push-back) once ``go`` is set. Reports (trajectories in batches that failed,
    spans the collector refused, push-back retries)."""
    from rtrace import _stats
    from rtrace.config import load_settings
    from rtrace.exporters.collector import CollectorSink
    from rtrace.trajectory import SpanRecord, Trajectory

    def trajectory(i: int) -> Trajectory:
        trace = client * n + i + 1
        attrs = {"rl.step": i // 400, "rl.sample_index": client * n + i, "rl.rollout_n": 0, "rl.validate": False,
                 "rtrace.root": True, "rl.reward": 1.0}
        root = SpanRecord(f"{trace:016x}", None, "rollout", "rollout", 10, 100, attributes=attrs)
        kids = [SpanRecord(f"{trace:08x}{c + 1:08x}", f"{trace:016x}", "calculator", "tool", 20 + c, 30 + c,
                           input={"expression": "6*7"}, output="42") for c in range(2)]
        return Trajectory(f"{trace:032x}", "rollout", [root] + kids)

    batches = [[trajectory(i) for i in range(start, min(n, start + per_request))] for start in range(0, n, per_request)]
    sink = CollectorSink(load_settings({"exporter": "collector", "collector_endpoint": endpoint,
                                        "otlp_timeout_s": timeout_s}))
    ready.set()
    go.wait()
    for batch in batches:
        sink.export(batch)  # routed and queued: the collector's lane sends, retrying on push-back
    sink.flush(2 * timeout_s * len(batches))
    sink.shutdown()
    counts = _stats.snapshot()
    failed = sum(counts.get(f"sink.collector.{what}_trajectories", 0) for what in ("failed", "dropped", "abandoned"))
    out.put((failed, counts.get("sink.collector.rejected_spans", 0), counts.get("sink.collector.backpressure_retries", 0)))
    out.close()
    out.join_thread()
    os._exit(0)


def trainer(env: dict[str, str], steps: int, prompts: int, n: int, out: Any) -> None:
    """The driver of a job with its own process: after the rollouts, one ``annotate_batch`` per
    step with every rollout's advantage (``step * 1000 + sample_index * 10 + rollout_n``),
    rows shuffled; then a flush. Reports (flushed, stats)."""
    _apply(env)
    import random

    import rtrace

    for step in range(steps):
        rows = [(p, r) for p in range(prompts) for r in range(n)]
        random.Random(step).shuffle(rows)
        rtrace.annotate_batch(step=step, sample_index=[p for p, _ in rows], rollout_n=[r for _, r in rows],
                              advantage=[float(step * 1000 + p * 10 + r) for p, r in rows])
    ok = rtrace.flush(60)
    out.put((ok, rtrace.stats()))
    out.close()
    out.join_thread()
    os._exit(0)


def big_annotate_batch(env: dict[str, str], rows: int, joined: list[int], out: Any) -> None:
    """A trainer's one ``annotate_batch`` for a step of ``rows`` rollouts (step 1, sample_index
    0..rows-1, advantage = sample_index / 2), flushed; then the rollouts ``joined`` (one tool
    span each), which pick up their advantage in the collector. Reports (flushed, stats)."""
    _apply(env)
    import rtrace

    @rtrace.traced_tool
    def calc(x: int) -> int:
        return x

    n = rtrace.annotate_batch(step=1, sample_index=list(range(rows)), rollout_n=[0] * rows,
                              advantage=[i / 2 for i in range(rows)])
    ok = rtrace.flush(300) and n == rows
    for i in joined:
        with rtrace.rollout_context(step=1, sample_index=i, rollout_n=0):
            calc(i)
    ok = rtrace.flush(60) and ok
    out.put((ok, rtrace.stats()))
    out.close()
    out.join_thread()
    os._exit(0)


def advantage_rollouts(env: dict[str, str], worker: int, workers: int, steps: int, groups: int, n: int,
                       barrier: Any, out: Any) -> None:
    """Groups ``worker, worker + workers, ...`` of every step, ``n`` rollouts each: two tool calls a
    millisecond apart (the exporter's rounds cut some rollouts in two: their first tool span reaches
    the collector before their root, a trajectory still running there). After each step, the
    trainer's ``barrier``. Reports (flushed, its counters) once its spans are sent."""
    _apply(env)
    import rtrace

    @rtrace.traced_tool(tool_name="calculator")
    def calc(x: int) -> int:
        return x * 2

    for step in range(steps):
        for g in range(worker, groups, workers):
            for r in range(n):
                with rtrace.rollout_context(step=step, sample_index=g, rollout_n=r, group_id=f"g{g}"):
                    calc(g)
                    time.sleep(0.001)
                    calc(r)
                    rtrace.record_reward(float(r % 2))
        barrier.wait()
    ok = rtrace.flush(300)
    out.put((ok, rtrace.stats()))
    out.close()
    out.join_thread()
    os._exit(0)


def advantage(step: int, group: int, rollout: int) -> float:
    """The advantage :func:`advantage_trainer` gives a rollout."""
    return float(step * 1000 + group * 10 + rollout)


def advantage_trainer(env: dict[str, str], steps: int, groups: int, n: int, lag: int, barrier: Any,
                      out: Any) -> None:
    """A trainer whose updates run ``lag`` steps behind its rollouts: once the rollouts of step
    ``s + lag`` ended (``barrier``), one ``annotate_batch`` gives every rollout of step ``s`` its
    advantage (:func:`advantage`), rows shuffled. Reports (flushed, its counters)."""
    _apply(env)
    import random

    import rtrace

    def annotate(step: int) -> None:
        rows = [(g, r) for g in range(groups) for r in range(n)]
        random.Random(step).shuffle(rows)
        sent = rtrace.annotate_batch(step=step, sample_index=[g for g, _ in rows], rollout_n=[r for _, r in rows],
                                     advantage=[advantage(step, g, r) for g, r in rows])
        assert sent == len(rows), sent

    for step in range(steps):
        barrier.wait()
        if step >= lag:
            annotate(step - lag)
    for step in range(max(0, steps - lag), steps):
        annotate(step)
    ok = rtrace.flush(300)
    out.put((ok, rtrace.stats()))
    out.close()
    out.join_thread()
    os._exit(0)
