"""trackio sink throughput vs logging equivalent ``trackio.Trace`` objects by hand.

Usage: ``HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_trackio.py [N] [ROUNDS]``

N trajectories (5 spans each: rollout, agent, generation, tool, generation; a short
chat; reward and RL coordinates) are made once with the real decorators and kept.
Then, in the same process and a temporary ``TRACKIO_DIR``, each variant logs them to
its own run until they are durable in trackio's SQLite storage (time to the end of the
final flush):

* ``by hand``: a user who already holds the Trace fields (messages, metadata, span
  dicts in trackio's format) calls ``run.log({"rollout/traces": Trace(...)}, step=s)``
  once per trajectory;
* ``by hand, batched``: the same, one ``run.log`` per step with a list of Traces;
* ``sink``: ``TrackioSink.export`` on batches of 256 trajectories (the pipeline's
  default batch), which converts Trajectory objects and logs per-step summaries too.

Ratios are throughputs relative to ``by hand`` (>= 0.8 is the target in DESIGN.md).
Rounds alternate the order of the variants; the median per variant is reported.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ["TRACKIO_DIR"] = tempfile.mkdtemp(prefix="rtrace-bench-trackio-")

import rtrace  # noqa: E402
from rtrace.exporters.trackio import TrackioSink, _drain, trace_payload  # noqa: E402

BATCH = 256


class Keep(rtrace.Sink):
    name = "keep"

    def __init__(self):
        super().__init__(None)
        self.trajectories = []

    def export(self, trajectories):
        self.trajectories.extend(trajectories)


@rtrace.traced_generation(model="bench-lm")
def generate(messages, prompt_ids):
    return {"content": "Let me call the calculator for 17*3." if len(messages) < 3 else "The answer is 51.",
            "response_ids": list(range(40)), "finish_reason": "stop"}


@rtrace.traced_tool(tool_name="calculator")
def calculator(expression, tool_call_id):
    return "51"


@rtrace.traced_rollout
def agent(question):
    messages = [{"role": "system", "content": "You are a careful math agent. " * 4},
                {"role": "user", "content": question}]
    generate(messages, prompt_ids=list(range(120)))
    calculator("17*3", tool_call_id="call_0")
    messages = messages + [{"role": "tool", "tool_call_id": "call_0", "name": "calculator", "content": "51"}]
    return generate(messages, prompt_ids=list(range(180)))


def make(n):
    keep = Keep()
    rtrace.configure(sinks=[keep], export_interval_s=0.05)
    for i in range(n):
        with rtrace.rollout_context(step=i // 500, sample_index=i, rollout_n=i % 8, group_id=f"g{i // 8}"):
            agent(f"Question {i}: what is 17*3?")
            rtrace.record_reward(float(i % 2), correct=bool(i % 2))
    rtrace.flush(60)
    rtrace.shutdown()
    return keep.trajectories


def new_run(trackio, project):
    return trackio.init(project=project, name="bench", auto_log_cpu=False, auto_log_gpu=False, embed=False)


def by_hand(trackio, payloads, project):
    run = new_run(trackio, project)
    t0 = time.perf_counter()
    for step, (messages, metadata, spans) in payloads:
        run.log({"rollout/traces": trackio.Trace(messages, metadata, spans)}, step=step)
    _drain(run, time.monotonic() + 600)
    elapsed = time.perf_counter() - t0
    run.finish()
    return elapsed


def by_hand_batched(trackio, payloads, project):
    run = new_run(trackio, project)
    t0 = time.perf_counter()
    by_step = {}
    for step, fields in payloads:
        by_step.setdefault(step, []).append(fields)
    for step, items in by_step.items():
        for i in range(0, len(items), BATCH):
            run.log({"rollout/traces": [trackio.Trace(*f) for f in items[i:i + BATCH]]}, step=step)
    _drain(run, time.monotonic() + 600)
    elapsed = time.perf_counter() - t0
    run.finish()
    return elapsed


def sink(trackio, trajectories, project):
    settings = rtrace.config.load_settings({"project": project, "experiment": "bench"})
    s = TrackioSink(settings)
    s._import()
    s._run()  # open the run outside the timed part, like the by-hand variants
    t0 = time.perf_counter()
    for i in range(0, len(trajectories), BATCH):
        s.export(trajectories[i:i + BATCH])
    s.flush(600)
    elapsed = time.perf_counter() - t0
    s.shutdown()
    return elapsed


def count(project):
    from trackio.sqlite_storage import SQLiteStorage

    return len(SQLiteStorage.get_traces(project, run="bench"))


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    trajectories = make(n)
    assert len(trajectories) == n, len(trajectories)
    import trackio

    # What a user logging by hand already holds: the fields in trackio's format.
    payloads = [(t.step, trace_payload(t)) for t in trajectories]
    variants = {"by hand": lambda p: by_hand(trackio, payloads, p),
                "by hand, batched": lambda p: by_hand_batched(trackio, payloads, p),
                "sink": lambda p: sink(trackio, trajectories, p)}
    times = {name: [] for name in variants}
    import contextlib
    import io

    for r in range(rounds):
        order = list(variants) if r % 2 == 0 else list(reversed(variants))
        for name in order:
            project = f"bench-{name.replace(' ', '').replace(',', '-')}-{r}"
            with contextlib.redirect_stdout(io.StringIO()):  # trackio's init/finish banners
                elapsed = variants[name](project)
            assert count(project) == n, (name, count(project))
            times[name].append(elapsed)
    base = n / statistics.median(times["by hand"])
    print(f"trackio {trackio.__version__}, {n} trajectories x 5 spans, {rounds} rounds, median:")
    for name, ts in times.items():
        rate = n / statistics.median(ts)
        print(f"  {name:18s} {rate:8.0f} traj/s   {rate / base:5.2f}x of by hand")


if __name__ == "__main__":
    main()
