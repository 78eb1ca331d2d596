"""Soak: a minute of concurrent traced rollouts into a JSONL sink and a deliberately slow sink.

Run with ``make soak`` (or ``pytest tests/soak -s``); the default test run skips this
directory (``norecursedirs`` in pyproject.toml). ``SOAK_SECONDS`` sets the duration.

What it checks:

* memory: RSS (``VmRSS`` of ``/proc/self/status``), sampled every few seconds, grows by
  less than ``RSS_GROWTH_BOUND_MIB`` between the end of the warm-up and the end of the
  run: queues, the open-trajectory table and the slow sink's backlog are bounded. The
  table of recent outcomes (for late annotations) is bounded too, but at this rate its
  default 100,000 trajectories (~30 MB) take ~100 s to fill, longer than the run: the
  soak shrinks it to 5,000 so that it is full by the end of the warm-up, and growth after
  it is a leak (a 180 s run at the default size levels off at ~130 s);
* accounting: every rollout the workload ran is counted as started; every started
  trajectory was completed or counted as dropped; for each sink, every completed
  trajectory was exported or counted (failed, dropped, abandoned); the JSONL file has
  exactly the exported lines, each one whole, strict JSON.

It prints the rate, the RSS series and the counters, for the record.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time

import pytest

import rtrace
from rtrace.pipeline import annotations

SECONDS = float(os.environ.get("SOAK_SECONDS", "60"))
WARMUP_S = min(15.0, SECONDS / 4)
SAMPLE_EVERY_S = 5.0
#: allowed RSS growth after warm-up (MiB): a leak of one trajectory's data per rollout
#: would grow by hundreds of MiB over a minute at this rate
RSS_GROWTH_BOUND_MIB = 25.0
THREADS = 3


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


class SlowSink(rtrace.Sink):
    """A backend that takes two seconds per batch: its queue fills up and batches are dropped."""

    name = "slow"

    def __init__(self):
        super().__init__(None)
        self.received = 0
        self.steps = []

    def export(self, trajectories):
        time.sleep(2.0)
        self.received += len(trajectories)

    def export_step_metrics(self, metrics):
        # a sink that writes step metrics: the pipeline computes them (and their tables)
        # under the load too, so their memory is soaked with the rest
        self.steps.extend((m.validate, m.step) for m in metrics)


@rtrace.traced_generation(model="soak-model")
def generate(prompt_ids, temperature=1.0):
    time.sleep(0.001)  # the model call: the GIL is released, as when waiting for an inference server
    return {"response_ids": list(range(48)), "finish_reason": "stop"}


@rtrace.traced_tool
def run_tool(tool_call_id, arguments):
    return {"result": sum(arguments["xs"]), "note": "ok " * 20}


@rtrace.traced_rollout
def agent_loop(prompt_ids):
    for turn in range(2):
        out = generate(prompt_ids, temperature=0.7)
        prompt_ids += out["response_ids"]
        run_tool(f"call-{turn}", {"xs": list(range(10)), "api_key": "sk-never-written"})
    return len(prompt_ids)


async def async_agent_loop(prompt_ids):
    await asyncio.sleep(0)
    return agent_loop(prompt_ids)


@pytest.mark.soak
def test_soak(tmp_path, monkeypatch):
    monkeypatch.setattr(annotations, "_RECENT", 10_000)  # two entries per trajectory
    path = tmp_path / "soak.jsonl"
    slow = SlowSink()
    rtrace.configure(exporter="jsonl", jsonl_path=str(path), sinks=[slow], export_interval_s=0.2,
                     sink_queue_size=8, sink_timeout_s=5)
    stop = threading.Event()
    ran = [0] * (THREADS + 1)

    def worker(k):
        i = 0
        while not stop.is_set():
            with rtrace.rollout_context(step=i // 64, sample_index=i % 64, rollout_n=k, group_id=f"g{i % 8}"):
                agent_loop(list(range(200)))
                rtrace.record_reward(float(i % 2), correct=bool(i % 2))
            i += 1
            ran[k] = i

    async def async_worker():
        i = 0
        while not stop.is_set():
            async def one(j):
                async with rtrace.rollout_context(step=j // 64, sample_index=j % 64, rollout_n=THREADS):
                    await async_agent_loop(list(range(200)))
                    rtrace.record_reward(1.0)
            await asyncio.gather(*(one(i + j) for j in range(8)))
            i += 8
            ran[THREADS] = i

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(THREADS)]
    threads.append(threading.Thread(target=lambda: asyncio.run(async_worker())))
    start = time.monotonic()
    for t in threads:
        t.start()
    series = [(0.0, rss_mib())]
    while time.monotonic() - start < SECONDS:
        time.sleep(SAMPLE_EVERY_S)
        series.append((time.monotonic() - start, rss_mib()))
    stop.set()
    for t in threads:
        t.join(60)
    elapsed = time.monotonic() - start
    flushed = rtrace.flush(60)
    rtrace.shutdown()
    stats = rtrace.stats()
    total = sum(ran)
    lines = path.read_text(encoding="utf-8").splitlines()
    after_warmup = [rss for t, rss in series if t >= WARMUP_S]
    growth = after_warmup[-1] - after_warmup[0]
    print(f"\nsoak: {elapsed:.0f} s, {total} rollouts ({total / elapsed:.0f}/s, 6 spans each), "
          f"{THREADS} threads + 1 asyncio loop x 8")
    print("RSS MiB every ~5 s: " + ", ".join(f"{t:.0f}s={rss:.1f}" for t, rss in series))
    print(f"RSS growth after {WARMUP_S:.0f} s warm-up: {growth:+.1f} MiB (bound {RSS_GROWTH_BOUND_MIB} MiB)")
    print("counters: " + json.dumps({k: v for k, v in stats.items() if v}, sort_keys=True))

    for line in lines:
        json.loads(line, parse_constant=lambda c: pytest.fail(f"non-strict constant {c}"))
    # the slow sink dropped batches since the last flush: flush() cannot say "all written"
    assert flushed is False

    # accounting: nothing lost without a counter
    started = stats["trajectories_started"]
    assert started == total and stats.get("trajectories_sampled_out", 0) == 0
    completed = stats.get("trajectories_completed", 0)
    assert started == completed + stats.get("trajectories_dropped_open_limit", 0) + stats.get(
        "trajectories_build_failed", 0)
    for sink in ("jsonl", "slow"):
        handed = sum(stats.get(f"sink.{sink}.{what}", 0)
                     for what in ("exported", "failed_trajectories", "dropped_trajectories",
                                  "abandoned_trajectories"))
        assert handed == completed, sink
    assert len(lines) == stats["sink.jsonl.exported"]
    assert slow.received >= stats.get("sink.slow.exported", 0)
    assert stats.get("sink.slow.dropped_trajectories", 0) > 0  # the slow sink did fall behind
    assert "sk-never-written" not in "".join(lines[:50])
    # the step metrics were computed: each released step reached the slow sink or was
    # counted as dropped behind its full queue (most are: it is full from the first
    # seconds); those it got came in step order, each step once
    assert len(slow.steps) + stats.get("sink.slow.dropped_step_metrics", 0) > 0
    assert slow.steps == sorted(set(slow.steps))
    print(f"step metrics: {len(slow.steps)} steps written, "
          f"{stats.get('sink.slow.dropped_step_metrics', 0)} dropped (counted)")

    assert growth < RSS_GROWTH_BOUND_MIB, series
