"""The pipeline: sampling caps, bounded memory, failing and slow sinks, JSONL round trip."""

from __future__ import annotations

import asyncio
import io
import json
import threading
import time

import pytest

import rtrace
from rtrace.exporters.console import ConsoleSink, format_trajectory
from rtrace.exporters.jsonl import read_jsonl
from tests.conftest import read_back
from tests.doubles import BlockingTokenizer


@rtrace.traced_tool
def tool(x):
    return x * 2


@rtrace.traced_generation
def generate(prompt_ids):
    return {"response_ids": [1, 2, 3], "finish_reason": "length"}


class Collect(rtrace.Sink):
    """A sink that keeps what it receives (the sink contract, not a backend mock)."""

    name = "collect"

    def __init__(self, settings=None):
        super().__init__(settings)
        self.trajectories = []
        self.batches = 0

    def export(self, trajectories):
        self.batches += 1
        self.trajectories.extend(trajectories)


class Raising(rtrace.Sink):
    name = "raising"

    def export(self, trajectories):
        raise ConnectionError("backend down")


class Sleeping(rtrace.Sink):
    name = "sleeping"

    def export(self, trajectories):
        time.sleep(1.0)


def run_agent(step, sample_index, rollout_n=0, validate=False, group_id=None, site=0):
    with rtrace.rollout_context(step=step, sample_index=sample_index, rollout_n=rollout_n,
                                validate=validate, group_id=group_id, call_site=site):
        tool(sample_index)
        rtrace.record_reward(1.0)
    return sample_index * 2


class TestSampling:
    def test_cap_per_step_across_groups_and_call_sites(self):
        """max_traces_per_step holds per step, across many groups and several call sites."""
        sink = Collect()
        rtrace.configure(sinks=[sink], max_traces_per_step=5)

        @rtrace.traced_rollout
        def other_site(i):
            return tool(i)

        for step in (1, 2):
            for group in range(10):
                for n in range(4):
                    run_agent(step, group, n, group_id=f"g{group}", site=group % 3)
            with rtrace.rollout_context(step=step, sample_index=99):
                other_site(1)  # a second call site shares the step's counter
        assert rtrace.flush(10)
        per_step = {}
        for t in sink.trajectories:
            per_step[t.step] = per_step.get(t.step, 0) + 1
        assert per_step == {1: 5, 2: 5}
        stats = rtrace.stats()
        assert stats["trajectories_started"] == 10
        assert stats["trajectories_sampled_out"] == 2 * 41 - 10

    def test_validation_counted_separately(self):
        """Validation trajectories have their own per-step counter (and optional cap)."""
        sink = Collect()
        rtrace.configure(sinks=[sink], max_traces_per_step=3, max_val_traces_per_step=2)
        for i in range(10):
            run_agent(1, i)
            run_agent(1, i, validate=True)
        assert rtrace.flush(10)
        train = [t for t in sink.trajectories if not t.validate]
        val = [t for t in sink.trajectories if t.validate]
        assert (len(train), len(val)) == (3, 2)

    def test_whole_groups_kept_together(self):
        """sample_groups keeps every rollout of an admitted group, and no rollout of the others."""
        sink = Collect()
        rtrace.configure(sinks=[sink], max_traces_per_step=4, sample_groups=True)
        for n in range(3):  # rollouts of 5 groups interleaved, as in async GRPO
            for group in range(5):
                run_agent(1, group, n, group_id=f"g{group}")
        assert rtrace.flush(10)
        kept = sorted((t.group_id, t.rollout_n) for t in sink.trajectories)
        # the cap admits groups while fewer than 4 trajectories were kept at their first arrival
        assert kept == [(f"g{g}", n) for g in range(4) for n in range(3)]

    def test_sampled_out_calls_still_run(self):
        """A sampled-out trajectory's calls run normally and produce nothing."""
        sink = Collect()
        rtrace.configure(sinks=[sink], max_traces_per_step=0)
        assert [run_agent(1, i) for i in range(3)] == [0, 2, 4]
        assert rtrace.flush(10)
        assert sink.trajectories == []
        assert rtrace.stats()["trajectories_sampled_out"] == 3

    def test_same_decision_for_every_sink(self, tmp_path):
        """Two sinks receive exactly the same sampled trajectories."""
        a, b = Collect(), Collect()
        rtrace.configure(sinks=[a, b], max_traces_per_step=7)
        for i in range(30):
            run_agent(i % 2, i)
        assert rtrace.flush(10)
        assert sorted(t.trace_id for t in a.trajectories) == sorted(t.trace_id for t in b.trajectories)
        assert len(a.trajectories) == 14


class TestBounds:
    def test_spans_per_trajectory_cap(self):
        """Spans beyond max_spans_per_trajectory are dropped and counted; the root is always kept."""
        sink = Collect()
        rtrace.configure(sinks=[sink], max_spans_per_trajectory=5)
        with rtrace.rollout_context(step=1):
            for i in range(20):
                tool(i)
        assert rtrace.flush(10)
        (traj,) = sink.trajectories
        assert len(traj.spans) == 5 and traj.root.kind == "rollout"
        assert traj.dropped_spans == 16
        assert rtrace.stats()["spans_dropped_trajectory_limit"] == 16

    def test_open_trajectory_cap(self):
        """Beyond max_open_trajectories, new trajectories are not traced (counted), the program runs on."""
        sink = Collect()
        rtrace.configure(sinks=[sink], max_open_trajectories=3)
        contexts = [rtrace.rollout_context(step=1, sample_index=i) for i in range(5)]
        for ctx in contexts:
            ctx.__enter__()
        traced = [ctx.traced for ctx in contexts]
        for ctx in reversed(contexts):
            ctx.__exit__(None, None, None)
        assert traced == [True, True, True, False, False]
        assert rtrace.flush(10)
        assert len(sink.trajectories) == 3
        assert rtrace.stats()["trajectories_dropped_open_limit"] == 2

    def test_queue_limit_drops_and_counts(self):
        """A full span queue drops spans instead of growing or blocking; every span is kept or counted,
        and a dropped root frees its trajectory at once (partial), not after the orphan timeout."""
        sink = Collect()
        tokenizer = BlockingTokenizer()  # holds the worker thread inside token2text
        rtrace.configure(sinks=[sink], max_queue_size=10, export_interval_s=0.05, orphan_timeout_s=600,
                         token2text=True, tokenizer=tokenizer)

        @rtrace.traced_generation
        def gen(prompt_ids):
            return [1]

        with rtrace.rollout_context(step=0):
            gen([1, 2])
        assert tokenizer.entered.wait(10)  # the worker is busy: nothing drains the queue now
        with rtrace.rollout_context(step=1):
            for i in range(50):
                tool(i)
        tokenizer.release.set()
        deadline = time.monotonic() + 10
        while len(sink.trajectories) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        traj = next(t for t in sink.trajectories if t.step == 1)
        dropped = rtrace.stats()["spans_dropped_queue"]
        assert dropped == 51 - 10  # the queue held 10 spans; the root (last to end) was dropped
        assert traj.partial  # the lost root did not wait for the 600 s orphan timeout
        kept = len(traj.spans) - 1  # a partial root is a stand-in
        assert kept + dropped == 51
        assert rtrace.stats()["open_trajectories"] == 0

    def test_orphan_written_as_partial(self):
        """A trajectory whose root never ends is written as partial after the orphan timeout."""
        sink = Collect()
        rtrace.configure(sinks=[sink], orphan_timeout_s=0.2, export_interval_s=0.05)
        ctx = rtrace.rollout_context(step=4, sample_index=1)
        ctx.__enter__()
        tool(21)
        deadline = time.monotonic() + 10
        while not sink.trajectories and time.monotonic() < deadline:
            time.sleep(0.05)
        (traj,) = sink.trajectories
        assert traj.partial and traj.step == 4
        assert [s.kind for s in traj.spans] == ["rollout", "tool"]
        assert traj.spans[0].status == "unset" and traj.spans[1].output == 42
        # the tool span got its rl.* stamp when converted, the stand-in root when made
        assert [s.attributes.get("rl.step") for s in traj.spans] == [4, 4]
        assert traj.spans[0].attributes["rtrace.partial"] is True
        assert list(traj.spans[0].attributes)[:2] == ["rl.step", "rl.sample_index"]
        assert rtrace.stats()["trajectories_partial"] == 1
        ctx.__exit__(None, None, None)


class TestFailingSinks:
    def test_raising_sink_does_not_touch_the_program(self, tmp_path):
        """A sink that raises on every batch: results unchanged, other sinks still served, failures counted."""
        good = Collect()
        rtrace.configure(sinks=[Raising(None), good], export_interval_s=0.01)
        results = [run_agent(1, i) for i in range(20)]
        assert results == [i * 2 for i in range(20)]
        assert rtrace.flush(10) is False  # a sink failed batches since the last flush: reported
        assert len(good.trajectories) == 20
        assert rtrace.flush(10) is True  # nothing failed since
        stats = rtrace.stats()
        assert stats["sink.raising.failed_trajectories"] == 20
        assert stats["sink.collect.exported"] == 20

    async def test_sleeping_sink_never_blocks_the_program(self):
        """A sink that sleeps 1 s per batch: the traced program finishes, excess batches are dropped and counted."""
        rtrace.configure(sinks=[Sleeping(None)], export_interval_s=0.01, sink_queue_size=1,
                         max_export_batch_size=1, sink_timeout_s=0.5)

        async def rollout(i):
            with rtrace.rollout_context(step=1, sample_index=i):
                await asyncio.sleep(0.001)
                return tool(i)

        start = time.monotonic()
        results = await asyncio.gather(*(rollout(i) for i in range(100)))
        elapsed = time.monotonic() - start
        assert results == [i * 2 for i in range(100)]
        assert rtrace.flush(0.5) is False  # the sink cannot keep up; flush says so, bounded
        await asyncio.sleep(0.2)
        stats = rtrace.stats()
        assert stats["sink.sleeping.dropped_trajectories"] >= 90
        assert elapsed < 100  # sanity only: 100 batches x 1 s would be >= 100 s if we waited

    def test_shutdown_is_bounded_with_a_hung_sink(self):
        """shutdown() returns within sink_timeout_s even when a sink hangs."""
        release = threading.Event()

        class Hung(rtrace.Sink):
            name = "hung"

            def export(self, trajectories):
                release.wait(30)

        rtrace.configure(sinks=[Hung(None)], sink_timeout_s=0.3, export_interval_s=0.01)
        run_agent(1, 0)
        time.sleep(0.1)
        rtrace.flush(0.1)
        t0 = time.monotonic()
        rtrace.shutdown()
        took = time.monotonic() - t0
        release.set()
        assert took < 5


class TestJsonl:
    def test_round_trip_rebuilds_the_same_tree(self, jsonl_path):
        """Read the file back: same spans, parents, times, attributes, inputs and outputs."""
        sink = Collect()
        rtrace.configure(exporter="jsonl", jsonl_path=str(jsonl_path), sinks=[sink])

        @rtrace.traced_rollout
        def loop():
            out = generate([5, 6])
            return [tool(i) for i in out["response_ids"]]

        with rtrace.rollout_context(step=2, sample_index=3, rollout_n=1, group_id="g", policy_version=2):
            loop()
            rtrace.record_reward(0.25, correct=False)
        (back,) = read_back(jsonl_path)
        (orig,) = sink.trajectories
        assert back.to_dict() == json.loads(json.dumps(orig.to_dict()))
        assert [(s.name, s.kind) for s in back.spans] == [
            ("rollout", "rollout"), ("loop", "agent"), ("generate", "generation"),
            ("tool", "tool"), ("tool", "tool"), ("tool", "tool")]
        parents = {s.span_id: s.parent_id for s in back.spans}
        ids = [s.span_id for s in back.spans]
        assert parents[ids[1]] == ids[0] and all(parents[i] == ids[1] for i in ids[2:])
        assert back.num_turns == 1 and back.num_tool_calls == 3
        assert back.messages[-1]["role"] == "tool"

    def test_schema_fields(self, jsonl_path):
        """Each line has the documented top-level fields of rtrace.trajectory/1."""
        run_agent(1, 0)
        read_back(jsonl_path)
        line = json.loads(jsonl_path.read_text().splitlines()[0])
        assert list(line) == [
            "schema", "trace_id", "name", "step", "sample_index", "rollout_n", "validate", "experiment",
            "group_id", "policy_version", "extra", "reward", "outcome", "annotations", "kept", "status", "error", "partial",
            "dropped_spans", "start_ns", "end_ns", "duration_ms", "num_turns", "num_tool_calls",
            "messages", "health", "health_checks", "worker", "policy_version_end", "crossed_update", "spans"]
        assert list(line["spans"][0]) == [
            "span_id", "parent_id", "name", "kind", "start_ns", "end_ns", "duration_ms", "status", "error",
            "attributes", "input", "output", "events"]
        assert line["schema"] == "rtrace.trajectory/1" and len(line["trace_id"]) == 32


class TestConsole:
    def test_console_tree(self):
        """The console sink prints one readable tree per trajectory."""
        stream = io.StringIO()
        collect = Collect()
        rtrace.configure(sinks=[ConsoleSink(None, stream=stream), collect])

        @rtrace.traced_rollout
        def loop():
            generate([1])
            tool(2)

        with rtrace.rollout_context(step=1, sample_index=2, rollout_n=0):
            loop()
            rtrace.record_reward(1.0)
        assert rtrace.flush(10)
        lines = stream.getvalue().splitlines()
        assert lines[0].startswith("rollout  step=1 sample=2 n=0  reward=1.0  ok  ")
        assert lines[1].startswith("└─ agent loop  ")
        assert lines[2].startswith("   ├─ generation generate  ")
        assert lines[3].startswith("   └─ tool tool  ") and lines[3].endswith("-> 4")
        assert stream.getvalue() == format_trajectory(collect.trajectories[0]) + "\n\n"


def test_read_jsonl_rejects_foreign_lines(tmp_path):
    """read_jsonl refuses lines that are not rtrace.trajectory/1 records."""
    path = tmp_path / "x.jsonl"
    path.write_text('{"schema": "other"}\n')
    with pytest.raises(ValueError):
        read_jsonl(path)
