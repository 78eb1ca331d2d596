"""Every trajectory is written or counted; sinks never hold up the program or each other
(issue #13, items 6, 9, 10, 11, 14)."""

from __future__ import annotations

import json
import os
import threading
import time

from opentelemetry import trace as otel_trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import rtrace
from rtrace.exporters.jsonl import JsonlSink
from rtrace.testing import MemorySink
from tests.doubles import BlockingTokenizer


@rtrace.traced_tool
def tool(x):
    return x


def rollouts(n, step=1):
    for i in range(n):
        with rtrace.rollout_context(step=step, sample_index=i):
            tool(i)


def wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.01)


# ----------------------------------------------------------------------------- item 6
class TestApplicationProvider:
    def test_provider_keeps_flushing_and_later_processors_run(self):
        """After rtrace shuts down or is reconfigured, the application's provider.force_flush() is True
        and a processor the application added after rtrace's still sees every span (0.1.0: rtrace's
        stopped processor made force_flush False)."""
        provider = TracerProvider()
        old = otel_trace._TRACER_PROVIDER
        otel_trace._TRACER_PROVIDER = provider  # set_tracer_provider only works once per process
        try:
            first = MemorySink()
            rtrace.configure(sinks=[first])
            later = InMemorySpanExporter()
            provider.add_span_processor(SimpleSpanProcessor(later))  # added after rtrace's
            rollouts(1)
            assert rtrace.flush(10) and len(first.trajectories) == 1
            second = MemorySink()
            rtrace.configure(sinks=[second])  # reconfigure: the same bridge, a new pipeline
            rollouts(1)
            assert rtrace.flush(10) and len(second.trajectories) == 1 and len(first.trajectories) == 1
            rtrace.shutdown()
            assert provider.force_flush(5_000) is True
            tracer = provider.get_tracer("app")
            with tracer.start_as_current_span("after-shutdown"):
                pass
            names = [s.name for s in later.get_finished_spans()]
            assert names.count("rollout") == 2 and names[-1] == "after-shutdown"
            # one rtrace processor for the life of the provider, whatever the number of configures
            bridges = [p for p in provider._active_span_processor._span_processors
                       if type(p).__name__ == "ProcessorBridge"]
            assert len(bridges) == 1
        finally:
            rtrace.shutdown()
            otel_trace._TRACER_PROVIDER = old


    def test_roots_the_applications_sampler_drops_are_counted(self):
        """A trajectory whose root the application's sampler does not record is counted
        (trajectories_dropped_provider_sampler), so started = completed + dropped still holds."""
        from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

        provider = TracerProvider(sampler=ALWAYS_OFF)
        old = otel_trace._TRACER_PROVIDER
        otel_trace._TRACER_PROVIDER = provider
        try:
            rtrace.configure(sinks=[MemorySink()])
            rollouts(3)
            assert rtrace.flush(10)
            stats = rtrace.stats()
            assert stats["trajectories_started"] == 3 == stats["trajectories_dropped_provider_sampler"]
        finally:
            rtrace.shutdown()
            otel_trace._TRACER_PROVIDER = old


# ----------------------------------------------------------------------------- item 9
class TestDroppedRootFreesItsSlot:
    def test_open_trajectory_cap_full(self):
        """With the open-trajectory cap full, a trajectory whose root was dropped from the full span
        queue gives its slot back in the worker's next round (not after the orphan timeout), so the
        next trajectory is traced again."""
        sink = MemorySink()
        tokenizer = BlockingTokenizer()  # holds the worker thread inside token2text
        rtrace.configure(sinks=[sink], max_queue_size=2, max_open_trajectories=1, export_interval_s=0.02,
                         orphan_timeout_s=600, token2text=True, tokenizer=tokenizer)

        @rtrace.traced_generation
        def gen(prompt_ids):
            return [1]

        with rtrace.rollout_context(step=0):
            gen([1, 2])
        assert tokenizer.entered.wait(10)  # the worker is busy; the queue fills up
        with rtrace.rollout_context(step=1) as lost:
            tool(1)
            tool(2)  # queue full from here: the root that follows is dropped
        assert lost.traced and rtrace.stats()["spans_dropped_queue"] >= 1
        with rtrace.rollout_context(step=2) as refused:  # the one slot is held by the lost trajectory
            pass
        assert not refused.traced
        tokenizer.release.set()
        wait_for(lambda: rtrace.stats()["open_trajectories"] == 0)
        with rtrace.rollout_context(step=3) as again:
            tool(3)
        assert again.traced
        assert rtrace.flush(10)
        by_step = {t.step: t for t in sink.trajectories}
        assert sorted(by_step) == [0, 1, 3] and by_step[1].partial and not by_step[3].partial


# ----------------------------------------------------------------------------- item 10
class Gate(rtrace.Sink):
    """A sink whose export waits for ``release`` (a backend that stalls)."""

    name = "gate"

    def __init__(self):
        super().__init__(None)
        self.release = threading.Event()
        self.entered = threading.Event()
        self.exported = 0
        self.got = []

    def export(self, trajectories):
        self.entered.set()
        self.release.wait()
        self.exported += len(trajectories)
        self.got.extend(trajectories)


class HangsAtShutdown(rtrace.Sink):
    name = "hangs"

    def __init__(self):
        super().__init__(None)
        self.hang = threading.Event()

    def export(self, trajectories):
        pass

    def shutdown(self):
        self.hang.wait()  # until the test ends


class Recorder(rtrace.Sink):
    name = "recorder"

    def __init__(self):
        super().__init__(None)
        self.trajectories = []
        self.shut = False

    def export(self, trajectories):
        self.trajectories.extend(trajectories)

    def shutdown(self):
        self.shut = True


def shutdown_in_thread(limit_s=30.0):
    """rtrace.shutdown() in a thread; fails the test if it does not return within ``limit_s``."""
    t = threading.Thread(target=rtrace.shutdown, daemon=True)
    t.start()
    t.join(limit_s)
    assert not t.is_alive(), "rtrace.shutdown() did not return"


def _one(i):
    from rtrace.trajectory import SpanRecord, Trajectory

    return Trajectory(f"{i + 1:032x}", "rollout", [SpanRecord(f"{i + 1:016x}", None, "rollout", "rollout", 1, 2)],
                      step=1, sample_index=i)


class TestBoundedShutdown:
    def test_queued_batches_are_counted_as_abandoned(self):
        """A stalled sink at shutdown: the batches still queued for it and the one inside its export
        call are counted in sink.<name>.abandoned_trajectories, so for every sink the trajectories
        handed to it = exported + failed + dropped + abandoned; the other sink gets everything."""
        gate, other = Gate(), Recorder()
        rtrace.configure(sinks=[gate, other], export_interval_s=0.02, sink_timeout_s=0.5,
                         max_export_batch_size=2, sink_queue_size=4)
        rollouts(1)
        assert not rtrace.flush(0.3)  # the gate now holds the first batch inside export()
        rollouts(8)  # four batches of two: the gate's queue fills up
        shutdown_in_thread()
        gate.release.set()  # the stalled export returns after shutdown gave up on it
        time.sleep(0.2)
        stats = rtrace.stats()
        # queue slots also go to the flush marker and step metrics: some batches were dropped
        dropped = stats.get("sink.gate.dropped_trajectories", 0)
        assert "sink.gate.exported" not in stats
        assert stats["sink.gate.abandoned_trajectories"] == 9 - dropped >= 1  # queued + the 1 inside export
        assert stats["sink.gate.shutdown_timeouts"] == 1
        assert len(other.trajectories) == 9 and stats["sink.recorder.exported"] == 9
        assert stats["trajectories_completed"] == 9

    def test_a_batch_the_sinks_thread_takes_while_shutdown_drains_is_counted(self):
        """The interleaving of issue #37 item 4, forced with events: shutdown gives up on a stalled
        export and starts draining the queue; the stalled export returns and the sink's thread takes
        the next queued batch before the drain reaches it. That batch is counted as abandoned (before:
        dropped as "counted already" and in no counter), so handed = exported + failed + dropped +
        abandoned holds."""
        import queue as queue_mod

        from rtrace.pipeline.fanout import SinkWorker

        gate = Gate()
        abandoning, taken, handled, drained = (threading.Event() for _ in range(4))

        class Interleave(queue_mod.Queue):
            """The sink's queue, with the two threads' turns fixed: shutdown's drain (get_nowait)
            waits until the sink's thread has taken one batch (get), and that thread's next get
            waits until the drain is over."""

            def get(self, block=True, timeout=None):  # the sink's thread
                if taken.is_set():
                    handled.set()  # it came back for more: the batch it took is handled
                    assert drained.wait(10)
                item = super().get(block, timeout)
                if abandoning.is_set():
                    taken.set()
                return item

            def get_nowait(self):  # shutdown's drain
                if not abandoning.is_set():
                    abandoning.set()
                    gate.release.set()  # the stalled export returns now
                    assert taken.wait(10)
                try:
                    return super().get(block=False)  # Queue.get, not the sink thread's get above
                except queue_mod.Empty:
                    drained.set()
                    raise

        worker = SinkWorker(gate, queue_size=8, timeout_s=0.1, batch_size=2)
        batches = [[_one(i), _one(i + 100)] for i in range(4)]
        worker.submit(batches[0])
        assert gate.entered.wait(10)  # the first batch is inside export(), which stalls
        worker.queue = Interleave(maxsize=8)  # the thread reads it again at its next get
        for batch in batches[1:]:
            worker.submit(batch)
        worker.stop(0.05)  # gives up on the stalled sink: _abandon drains, interleaved
        assert handled.wait(10)
        stats = rtrace.stats()
        assert "sink.gate.exported" not in stats  # the stalled export returned after shutdown gave up on it
        # 8 handed = 0 exported + 0 failed + 0 dropped + 8 abandoned: 2 inside export(), 2 the
        # thread took, 4 drained (before the fix: 6, the thread's 2 in no counter)
        assert stats["sink.gate.abandoned_trajectories"] == 8
        assert stats["sink.gate.shutdown_timeouts"] == 1

    def test_a_hanging_sink_does_not_stop_the_next_ones_shutdown(self):
        """Sinks shut down in parallel, each within sink_timeout_s: the one after a hung sink is
        still flushed and shut down, and shutdown() returns."""
        hangs, rec = HangsAtShutdown(), Recorder()
        rtrace.configure(sinks=[hangs, rec], export_interval_s=0.02, sink_timeout_s=0.5)
        rollouts(3)
        try:
            shutdown_in_thread()
        finally:
            hangs.hang.set()
        assert rec.shut and len(rec.trajectories) == 3
        assert rtrace.stats()["sink.hangs.shutdown_timeouts"] == 1


# ----------------------------------------------------------------------------- item 11
class FailsToStore(rtrace.Sink):
    name = "fails"

    def __init__(self, mode):
        super().__init__(None)
        self.mode = mode
        self.healthy = False

    def export(self, trajectories):
        if self.mode == "export" and not self.healthy:
            raise OSError("read-only file system")

    def flush(self, timeout_s):
        return self.healthy or self.mode != "flush"


class TestFailedStorage:
    def test_export_that_raises_is_not_counted_as_exported(self):
        """A failing export counts as failed_batches/failed_trajectories, never as exported, and
        flush() says False; once the backend works again flush() is True again."""
        sink, ok = FailsToStore("export"), MemorySink()
        rtrace.configure(sinks=[sink, ok], export_interval_s=0.02)
        rollouts(3)
        assert rtrace.flush(10) is False
        stats = rtrace.stats()
        assert "sink.fails.exported" not in stats and stats["sink.fails.failed_trajectories"] == 3
        assert stats["sink.memory.exported"] == 3
        sink.healthy = True
        rollouts(1)
        assert rtrace.flush(10) is True
        assert rtrace.stats()["sink.fails.exported"] == 1

    def test_flush_that_returns_false(self):
        """A sink whose flush() returns False (it could not make the data durable): rtrace.flush() is
        False."""
        sink = FailsToStore("flush")
        rtrace.configure(sinks=[sink], export_interval_s=0.02)
        rollouts(2)
        assert rtrace.flush(10) is False
        sink.healthy = True
        assert rtrace.flush(10) is True


    def test_dropped_batches_make_flush_false(self):
        """A sink that could not keep up (its queue was full, batches dropped and counted): flush()
        is False, since not everything was written (found by the soak test: it returned True)."""
        gate = Gate()
        rtrace.configure(sinks=[gate], export_interval_s=0.02, max_export_batch_size=1, sink_queue_size=1)
        rollouts(1)
        assert gate.entered.wait(10)  # the first batch is inside export()
        rollouts(4)  # one waits in the queue, the rest are dropped
        wait_for(lambda: rtrace.stats().get("sink.gate.dropped_trajectories", 0) == 3)
        gate.release.set()
        assert rtrace.flush(10) is False
        assert rtrace.stats()["sink.gate.exported"] == 2
        rollouts(1)
        assert rtrace.flush(10) is True  # nothing dropped since the previous flush


# ----------------------------------------------------------------------------- item 14
class TestJsonlWholeLines:
    def test_tailing_reader_sees_only_whole_lines(self, tmp_path):
        """Four JSONL sinks on one file (as four ranks would), many large batches, and a reader that
        tails the file: every newline-terminated line parses, none is lost or interleaved."""
        from rtrace.config import load_settings
        from rtrace.trajectory import SpanRecord, Trajectory

        path = tmp_path / "shared.jsonl"
        settings = load_settings({"jsonl_path": str(path)}, environ={})
        sinks = [JsonlSink(settings) for _ in range(4)]
        stop = threading.Event()
        seen: list[dict] = []
        bad: list[str] = []

        def tail():
            pos, rest = 0, b""
            while True:
                done = stop.is_set()
                if os.path.exists(path):
                    with open(path, "rb") as f:
                        f.seek(pos)
                        chunk = f.read()
                    pos += len(chunk)
                    lines = (rest + chunk).split(b"\n")
                    rest = lines.pop()  # an unterminated tail is not a line yet
                    for line in lines:
                        try:
                            seen.append(json.loads(line))
                        except ValueError:
                            bad.append(line[:80].decode("utf-8", "replace"))
                if done:
                    assert rest == b"", "the file ends in half a line"
                    return
                time.sleep(0.001)

        def trajectory(writer, i):
            span = SpanRecord(span_id="1" * 16, parent_id=None, name="rollout", kind="rollout",
                              start_ns=0, end_ns=1, output="é" * 3000)  # multi-byte, ~9 KB a line
            return Trajectory(trace_id=f"{writer:08x}{i:024x}", name="rollout", spans=[span], step=writer,
                              sample_index=i)

        def write(writer):
            for b in range(25):
                sinks[writer].export([trajectory(writer, b * 8 + k) for k in range(8)])

        reader = threading.Thread(target=tail)
        reader.start()
        writers = [threading.Thread(target=write, args=(w,)) for w in range(4)]
        for t in writers:
            t.start()
        for t in writers:
            t.join()
        stop.set()
        reader.join(30)
        for sink in sinks:
            sink.shutdown()
        assert bad == []
        assert len(seen) == 4 * 25 * 8
        assert sorted((d["step"], d["sample_index"]) for d in seen) == \
            sorted((w, i) for w in range(4) for i in range(200))


# ----------------------------------------------------------------------------- #25: a sink behind samples fewer per step
def _traj(step, i, kept=(), status="ok"):
    from rtrace.trajectory import SpanRecord, Trajectory

    span = SpanRecord(f"{step:08x}{i:08x}", None, "rollout", "rollout", 1, 2)
    return Trajectory(trace_id=f"{step:016x}{i:016x}", name="rollout", spans=[span], step=step, sample_index=i,
                      kept=list(kept), status=status)


class TestBehindSamplesPerStep:
    def test_full_queue_thins_every_step_evenly_and_keeps_failures(self):
        """Queue of 2 batches of 4, the sink stalled: step 1 and 2 fill it, step 3 arrives. Its 4
        trajectories cost 4, taken one at a time from the step with the most (3, 2, 1, then 3 on the tie),
        never the failed one while a plain one is left: every step is written, 3 + 3 + 2."""
        from rtrace.pipeline.fanout import SinkWorker

        sink = Gate()
        worker = SinkWorker(sink, queue_size=2, timeout_s=5, batch_size=4)
        worker.submit([_traj(0, 0)])
        assert sink.entered.wait(10)  # in export(), stalled: the queue is empty again
        step1 = [_traj(1, i, kept=("error",) if i == 3 else ("sampled",), status="error" if i == 3 else "ok")
                 for i in range(4)]
        step1_batch = list(step1)
        worker.submit(step1_batch)
        worker.submit([_traj(2, i) for i in range(4)])
        incoming = [_traj(3, i) for i in range(4)]
        before = list(incoming)
        stats0 = rtrace.stats()
        worker.submit(incoming)
        assert incoming == before and step1_batch == step1  # lists other sinks may hold are not changed
        sink.release.set()
        worker.stop(10)
        got = [(t.step, t.sample_index) for t in sink.got]
        assert got[0] == (0, 0)
        by_step = {s: sorted(i for st, i in got if st == s) for s in (1, 2, 3)}
        assert by_step == {1: [0, 1, 3], 2: [0, 1, 2], 3: [0, 1]}  # the last plain one goes first
        stats = rtrace.stats()
        assert stats.get("sink.gate.dropped_trajectories", 0) - stats0.get(
            "sink.gate.dropped_trajectories", 0) == 4
        assert stats.get("sink.gate.exported", 0) - stats0.get("sink.gate.exported", 0) == 9

    def test_room_in_queued_batches_is_used_before_anything_is_dropped(self):
        """Small batches (a worker round with few finished trajectories) merge into the queued ones up
        to the batch size: a queue "full" of 2 small batches takes 6 more trajectories, losing none."""
        from rtrace.pipeline.fanout import SinkWorker

        sink = Gate()
        worker = SinkWorker(sink, queue_size=2, timeout_s=5, batch_size=4)
        worker.submit([_traj(0, 0)])
        assert sink.entered.wait(10)
        stats0 = rtrace.stats()
        for i in range(8):
            worker.submit([_traj(1, i)])
        sink.release.set()
        worker.stop(10)
        assert sorted(t.sample_index for t in sink.got if t.step == 1) == list(range(8))
        assert rtrace.stats().get("sink.gate.dropped_trajectories", 0) == stats0.get(
            "sink.gate.dropped_trajectories", 0)

    def test_the_collector_sink_drops_whole_batches(self):
        """Segments are not trajectories to sample: a full queue drops the incoming batch whole."""
        from rtrace.exporters.collector import CollectorSink
        from rtrace.pipeline.fanout import SinkWorker

        class StalledCollector(Gate):
            name = "stalled"
            sample_when_behind = CollectorSink.sample_when_behind

        assert CollectorSink.sample_when_behind is False
        sink = StalledCollector()
        worker = SinkWorker(sink, queue_size=1, timeout_s=5, batch_size=4)
        worker.submit([_traj(0, 0)])
        assert sink.entered.wait(10)
        worker.submit([_traj(1, 0)])
        worker.submit([_traj(2, 0), _traj(2, 1)])
        sink.release.set()
        worker.stop(10)
        assert [(t.step, t.sample_index) for t in sink.got] == [(0, 0), (1, 0)]

    def test_end_to_end_a_stalled_sink_still_shows_every_step(self):
        """Through configure(): 6 steps of 8 rollouts into a sink stalled behind a queue of 2 batches of
        4. Once it recovers, every step is there, and what it lacks is exactly what was counted."""
        sink = Gate()
        rtrace.configure(sinks=[sink], export_interval_s=0.02, max_export_batch_size=4, sink_queue_size=2)
        rollouts(1, step=0)
        assert sink.entered.wait(10)
        for step in range(1, 7):
            rollouts(8, step=step)
        wait_for(lambda: rtrace.stats().get("sink.gate.dropped_trajectories", 0) == 48 + 1 - 1 - 8)
        sink.release.set()
        assert rtrace.flush(10) is False  # trajectories were dropped since the last flush
        steps = [t.step for t in sink.got]
        assert set(steps) == {0, 1, 2, 3, 4, 5, 6}
        assert len(steps) == 1 + 8
        counts = [steps.count(s) for s in range(1, 7)]
        assert max(counts) - min(counts) <= 1, counts

    def test_a_slow_sink_under_load_loses_only_what_it_counts(self):
        """A sink that takes 2 ms per batch, fed 3,000 trajectories over 30 steps in batches of 1-7 as
        fast as one thread can: each trajectory is written once or counted as dropped, never both and
        never twice, and every step is written (the thinning races the sink's thread for the queue)."""
        import random

        from rtrace.pipeline.fanout import SinkWorker

        class Slow(MemorySink):
            name = "slowthin"

            def export(self, trajectories):
                time.sleep(0.002)
                super().export(trajectories)

        sink = Slow()
        worker = SinkWorker(sink, queue_size=4, timeout_s=30, batch_size=8)
        stats0 = rtrace.stats().get("sink.slowthin.dropped_trajectories", 0)
        rng = random.Random(7)
        sent, i = [], 0
        while i < 3000:
            n = rng.randint(1, 7)
            batch = [_traj(j // 100, j) for j in range(i, min(3000, i + n))]
            sent.extend(batch)
            worker.submit(batch)
            i += n
        worker.stop(30)
        got = sink.trajectories
        ids = [id(t) for t in got]
        assert len(ids) == len(set(ids))  # none written twice
        assert set(ids) <= {id(t) for t in sent}
        dropped = rtrace.stats().get("sink.slowthin.dropped_trajectories", 0) - stats0
        assert dropped > 0  # it did fall behind
        assert len(got) + dropped == len(sent)
        assert {t.step for t in got} == set(range(30))


# ----------------------------------------------------------------------------- #25: sinks encode while hot
class TestPrepare:
    def test_prepare_runs_on_the_worker_thread_and_export_on_the_sinks(self):
        """Sink.prepare is called on the pipeline's worker thread with each batch before it
        is queued, export later on the sink's own thread with the same objects, which a
        sink without prepare gets too."""
        calls: list[tuple[str, str, list[int]]] = []

        class Preparing(MemorySink):
            name = "preparing"

            def prepare(self, trajectories):
                calls.append(("prepare", threading.current_thread().name, [id(t) for t in trajectories]))

            def export(self, trajectories):
                calls.append(("export", threading.current_thread().name, [id(t) for t in trajectories]))
                super().export(trajectories)

        sink, plain = Preparing(), MemorySink()
        rtrace.configure(sinks=[sink, plain])
        rollouts(5)
        assert rtrace.flush(10)
        prepared = [i for what, _, ids in calls if what == "prepare" for i in ids]
        exported = [i for what, _, ids in calls if what == "export" for i in ids]
        assert len(exported) == 5 and prepared == exported
        assert {thread for what, thread, _ in calls if what == "prepare"} == {"rtrace-worker"}
        assert {thread for what, thread, _ in calls if what == "export"} == {"rtrace-sink-preparing"}
        assert [id(t) for t in plain.trajectories] == exported  # the same objects, untouched for the other sink

    def test_a_prepare_that_raises_is_counted_and_export_still_writes(self):
        """prepare failing costs nothing but its own work: counted, logged once, every
        trajectory exported."""
        class Broken(MemorySink):
            name = "broken"

            def prepare(self, trajectories):
                raise RuntimeError("no")

        sink = Broken()
        rtrace.configure(sinks=[sink])
        rollouts(3)
        assert rtrace.flush(10)
        assert len(sink.trajectories) == 3
        assert rtrace.stats()["sink.broken.prepare_errors"] >= 1
        assert rtrace.stats()["sink.broken.exported"] == 3

    def test_jsonl_lines_encoded_in_prepare_are_exports_lines_and_let_go(self, tmp_path):
        """The JSONL sink's lines made in prepare (the worker thread) are byte for byte
        the lines export makes itself; export lets each go once written, and a trajectory
        prepare could not encode is counted by export as before."""
        from rtrace.config import load_settings
        from rtrace.exporters.jsonl import _LINE, encode_line

        memory = MemorySink()
        rtrace.configure(sinks=[memory])
        rollouts(4)
        assert rtrace.flush(10)
        trajs = memory.trajectories
        expected = b"".join(encode_line(t)[0] for t in trajs)

        path = tmp_path / "out.jsonl"
        sink = JsonlSink(load_settings({"jsonl_path": str(path)}, environ={}))
        sink.prepare(trajs)
        assert all(_LINE in t.__dict__ for t in trajs)
        sink.export(trajs)
        sink.shutdown()
        assert path.read_bytes() == expected
        assert not any(_LINE in t.__dict__ for t in trajs)

        class Unencodable:  # what encode_line cannot write, prepared or not
            def to_dict(self):
                raise ValueError("no")

        bad = Unencodable()
        before = rtrace.stats().get("sink.jsonl.unwritable_trajectories", 0)
        sink = JsonlSink(load_settings({"jsonl_path": str(path)}, environ={}))
        sink.prepare([bad])
        sink.export([bad])
        sink.shutdown()
        assert rtrace.stats()["sink.jsonl.unwritable_trajectories"] == before + 1
        assert path.read_bytes() == expected

    def test_a_sink_that_is_behind_is_not_prepared_for(self):
        """While a sink's queue is full, the worker does not prepare batches for it (it
        thins them; its export encodes what it keeps): every trajectory is still written
        or counted as dropped, and those prepared are among the written."""
        class SlowPreparing(Gate):
            name = "slow"

            def __init__(self):
                super().__init__()
                self.prepared: list[int] = []

            def prepare(self, trajectories):
                self.prepared.extend(id(t) for t in trajectories)

        sink = SlowPreparing()
        rtrace.configure(sinks=[sink], sink_queue_size=1, max_export_batch_size=1, export_interval_s=0.01)
        rollouts(1, step=0)
        assert sink.entered.wait(10)  # the sink's thread holds one batch; its queue takes one more
        for step in range(1, 6):
            rollouts(1, step=step)
            wait_for(lambda s=step: rtrace.stats()["trajectories_completed"] == s + 1)
        sink.release.set()
        assert rtrace.flush(10) is False  # it dropped some: flush says not everything was written
        dropped = rtrace.stats()["sink.slow.dropped_trajectories"]
        assert dropped > 0 and sink.exported + dropped == 6
        assert len(sink.prepared) == 2  # the batch it was exporting and the one that filled its queue
        assert set(sink.prepared) <= {id(t) for t in sink.got}
