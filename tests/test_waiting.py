"""Finished trajectories that wait are held apart from the running ones (issue 40).

A trajectory whose root arrived but that waits — for an awaited annotation (a trainer's
advantage) or, in the collector, for the rest of ``settle_s`` — sits in the registry's
waiting table, not in the open one: it never takes a running rollout's room
(``max_open_trajectories``, the collector's held bytes), and the collector's push-back
never evicts a running rollout because of it. The waiting table is bounded on its own
(``max_waiting_trajectories``, ``RTRACE_COLLECTOR_MAX_WAITING_BYTES``): when full, its
oldest is written at once, complete, without what it waited for
(``trajectories_written_early``). Spans and annotations that come for a waiting
trajectory still join it.

Real parts: the collector (its gRPC receiver, admission, worker) in this process, JSONL
read back; in one process rtrace's pipeline with a memory sink.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import time
from collections import Counter

import grpc
import pytest

import rtrace
from rtrace import _stats
from rtrace.exporters.jsonl import read_jsonl
from rtrace.pipeline.annotations import Annotation, coord_key
from rtrace.trajectory import Trajectory
from tests import collector_workers as workers
from tests.doubles import MetricsSink
from tests.test_collector_admission import export
from tests.test_collector_security import honest, request_of, written

SPAWN = mp.get_context("spawn")


def parts(trace: int, index: int, step: int = 1) -> tuple[Trajectory, Trajectory]:
    """A worker's trajectory in two requests, as when a round of its exporter cuts a rollout
    in the middle: its tool span (the rollout still running), then its root."""
    whole = honest(trace, step, index, 1.0)
    return (Trajectory(whole.trace_id, "rollout", whole.spans[1:]),
            Trajectory(whole.trace_id, "rollout", whole.spans[:1]))


def advantages(c, indices, step: int = 1) -> None:
    """The trainer's advantages (sample index / 100) for ``indices`` of ``step``."""
    c.annotate([Annotation(coord_key({"step": step, "sample_index": i, "rollout_n": 0}), None,
                           {"advantage": i / 100}) for i in indices])


def send(endpoint: str, *trajs: Trajectory) -> grpc.StatusCode:
    """One request, sent again after push-back as every OTLP sender does (at most 20 times)."""
    for _ in range(20):
        code = export(endpoint, request_of(*trajs))[0]
        if code != grpc.StatusCode.RESOURCE_EXHAUSTED:
            return code
        time.sleep(0.2)
    return code


def wait_until(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


class TestRunningTrajectoriesKeepTheirRoom:
    def test_waiting_for_an_advantage_never_evicts_a_running_rollout_in_the_collector(self, collector, tmp_path):
        """Issue 40's defect at a small table: 20 rollouts running (their tool span arrived, their
        root not yet) and 30 finished ones waiting for their advantage fill max_open_trajectories=50;
        10 more finished rollouts arrive. They are taken without push-back, and once the running
        ones end and the advantages come, all 60 are written whole with their advantage. Before,
        the waiting ones counted in the open table: the request was pushed back and the push-back
        evicted running rollouts, written partial (their roots then dropped as late)."""
        c = collector(max_open_trajectories=50, await_annotations="advantage", annotation_timeout_s=3600)
        running = [parts(1000 + i, i) for i in range(20)]
        assert send(c.endpoint, *[tool for tool, _ in running]) == grpc.StatusCode.OK
        assert send(c.endpoint, *[honest(2000 + i, 1, 100 + i, 1.0) for i in range(30)]) == grpc.StatusCode.OK
        assert c.flush(30)  # assembled: the 30 wait for their advantage
        stats = c.stats()
        assert (stats["open_trajectories"], stats["waiting_trajectories"]) == (20, 30)
        assert stats["held_bytes"] > 0 and stats["waiting_bytes"] > 0
        assert send(c.endpoint, *[honest(3000 + i, 1, 200 + i, 1.0) for i in range(10)]) == grpc.StatusCode.OK
        assert send(c.endpoint, *[root for _, root in running]) == grpc.StatusCode.OK
        advantages(c, list(range(20)) + list(range(100, 130)) + list(range(200, 210)))
        trajs = written(c, tmp_path)
        assert sorted(t.sample_index for t in trajs) == list(range(20)) + list(range(100, 130)) + list(range(200, 210))
        assert all(not t.partial and len(t.spans) == 2 for t in trajs)
        assert all(t.annotations == {"advantage": t.sample_index / 100} for t in trajs)
        stats = c.stats()
        for lost in ("trajectories_evicted", "trajectories_partial", "collector_spans_late",
                     "collector_backpressure_spans", "trajectories_written_early", "trajectories_missing_annotations"):
            assert lost not in stats, (lost, stats)

    def test_waiting_for_an_advantage_never_takes_a_new_rollouts_room_in_one_process(self):
        """One process, max_open_trajectories=3: three finished rollouts waiting for their advantage
        leave room for three more, which are traced (before: not traced, trajectories_dropped_open_limit)."""
        with rtrace.testing.capture(max_open_trajectories=3, await_annotations="advantage",
                                    annotation_timeout_s=3600) as got:
            for i in range(3):
                with rtrace.rollout_context(step=1, sample_index=i, rollout_n=0):
                    rtrace.record_reward(1.0)
            assert rtrace.flush(30)  # the three wait for their advantage
            assert (got.stats()["open_trajectories"], got.stats()["waiting_trajectories"]) == (0, 3)
            contexts = [rtrace.rollout_context(step=1, sample_index=i, rollout_n=0) for i in range(3, 6)]
            for ctx in contexts:  # three running at once, beside the three waiting
                ctx.__enter__()
            traced = [ctx.traced for ctx in contexts]
            for ctx in reversed(contexts):
                ctx.__exit__(None, None, None)
            assert traced == [True, True, True]
            for i in range(6):
                rtrace.annotate(step=1, sample_index=i, rollout_n=0, advantage=i / 100)
            trajs = got.trajectories
            assert sorted(t.sample_index for t in trajs) == list(range(6))
            assert all(t.annotations == {"advantage": t.sample_index / 100} and not t.partial for t in trajs)
            stats = got.stats()
        assert "trajectories_dropped_open_limit" not in stats and "trajectories_written_early" not in stats
        assert stats["waiting_trajectories"] == 0


class TestWhatReleasesAWaitingTrajectory:
    """The worker checks the waiting trajectories something happened to (an annotation came, the
    settle time or the timeout passed), not the whole table, each part of a round: no flush here."""

    def test_its_annotation(self, collector, tmp_path):
        c = collector(settle_s=0, await_annotations="advantage", annotation_timeout_s=3600)
        assert send(c.endpoint, *[honest(100 + i, 1, i, 1.0) for i in range(3)]) == grpc.StatusCode.OK
        wait_until(lambda: c.stats()["waiting_trajectories"] == 3 and c.stats()["open_trajectories"] == 0)
        advantages(c, [1])
        wait_until(lambda: c.stats()["waiting_trajectories"] == 2)
        c.stop()
        (traj, *rest) = sorted(read_jsonl(tmp_path / "traces.jsonl"), key=lambda t: bool(t.annotations), reverse=True)
        assert (traj.sample_index, traj.annotations) == (1, {"advantage": 0.01})
        assert [t.annotations for t in rest] == [{}, {}]  # still waiting at the stop: written, counted
        assert c.stats()["trajectories_missing_annotations"] == 2

    def test_its_settle_time(self, collector, tmp_path):
        c = collector(settle_s=0.3)
        assert send(c.endpoint, *[honest(100 + i, 1, i, 1.0) for i in range(3)]) == grpc.StatusCode.OK
        wait_until(lambda: c.stats().get("trajectories_completed") == 3)
        assert c.stats()["waiting_trajectories"] == 0
        c.stop()
        assert sorted(t.sample_index for t in read_jsonl(tmp_path / "traces.jsonl")) == [0, 1, 2]

    def test_its_annotation_in_one_process(self):
        with rtrace.testing.capture(await_annotations="advantage", annotation_timeout_s=3600) as got:
            for i in range(2):
                with rtrace.rollout_context(step=1, sample_index=i, rollout_n=0):
                    rtrace.record_reward(1.0)
            wait_until(lambda: got.stats()["waiting_trajectories"] == 2)
            rtrace.annotate(step=1, sample_index=0, rollout_n=0, advantage=0.5)
            wait_until(lambda: len(got.sink.trajectories) == 1)
            (traj,) = got.sink.trajectories
            assert (traj.sample_index, traj.annotations) == (0, {"advantage": 0.5})
            assert got.stats()["waiting_trajectories"] == 1


class TestAFullWaitingTable:
    def test_its_oldest_is_written_now_without_its_annotation_and_counted(self):
        """max_waiting_trajectories=3, five finished rollouts waiting for their advantage: the two
        oldest are written at once, whole and without it (trajectories_written_early), the other
        three wait and get theirs; the advantages of the two written early come late (counted)."""
        with rtrace.testing.capture(max_waiting_trajectories=3, await_annotations="advantage",
                                    annotation_timeout_s=3600) as got:
            for i in range(5):
                with rtrace.rollout_context(step=1, sample_index=i, rollout_n=0):
                    rtrace.record_reward(1.0)
                assert rtrace.flush(30)  # one at a time: they wait in the order they finished
            early = got.trajectories
            assert [(t.sample_index, t.annotations, t.partial) for t in early] == [(0, {}, False), (1, {}, False)]
            assert got.stats()["trajectories_written_early"] == 2 and got.stats()["waiting_trajectories"] == 3
            for i in range(5):
                rtrace.annotate(step=1, sample_index=i, rollout_n=0, advantage=i / 100)
            trajs = got.trajectories
            assert [(t.sample_index, t.annotations) for t in trajs[2:]] == [(i, {"advantage": i / 100})
                                                                            for i in (2, 3, 4)]
            stats = got.stats()
        assert stats["trajectories_written_early"] == 2 and stats["annotations_late"] == 2
        assert "trajectories_missing_annotations" not in stats and "trajectories_partial" not in stats

    def test_the_collectors_waiting_bytes_are_bounded_too(self, collector, tmp_path):
        """RTRACE_COLLECTOR_MAX_WAITING_BYTES=1 MiB, four finished trajectories of ~450 kB on the
        wire waiting for their advantage: two fit, the two oldest are written at once without it
        (trajectories_written_early); the bytes of running rollouts are not touched."""
        c = collector(collector_max_waiting_bytes=1 << 20, await_annotations="advantage", annotation_timeout_s=3600)
        big = []
        for i in range(4):
            traj = honest(100 + i, 1, i, 1.0)
            traj.spans[1].output = "x" * 450_000
            big.append(traj)
        assert send(c.endpoint, *big) == grpc.StatusCode.OK
        assert c.flush(30)
        stats = c.stats()
        assert stats["trajectories_written_early"] == 2 and stats["waiting_trajectories"] == 2
        assert 2 * 450_000 < stats["waiting_bytes"] <= 1 << 20 and stats["held_bytes"] == 0
        advantages(c, range(4))
        trajs = sorted(written(c, tmp_path), key=lambda t: t.sample_index)
        assert [(t.sample_index, t.annotations, t.partial) for t in trajs] == [
            (0, {}, False), (1, {}, False), (2, {"advantage": 0.02}, False), (3, {"advantage": 0.03}, False)]
        assert c.stats()["annotations_late"] == 2


class TestTheWaitTimesOut:
    def test_written_without_the_annotation_and_counted_once(self, collector, tmp_path):
        """annotation_timeout_s=0.5 and no advantage ever sent: the three waiting trajectories are
        written whole without it, each counted once in trajectories_missing_annotations (the
        timeout, not a full table), and the waiting table is empty again."""
        c = collector(await_annotations="advantage", annotation_timeout_s=0.5)
        assert send(c.endpoint, *[honest(100 + i, 1, i, 1.0) for i in range(3)]) == grpc.StatusCode.OK
        wait_until(lambda: c.stats().get("trajectories_missing_annotations") == 3)
        stats = c.stats()
        assert (stats["waiting_trajectories"], stats["waiting_bytes"], stats["open_trajectories"]) == (0, 0, 0)
        trajs = written(c, tmp_path)
        assert sorted((t.sample_index, len(t.spans), t.partial) for t in trajs) == [(i, 2, False) for i in range(3)]
        assert all(t.annotations == {} for t in trajs)
        stats = c.stats()
        assert stats["trajectories_missing_annotations"] == 3 and "trajectories_written_early" not in stats

    def test_one_still_waiting_at_shutdown_is_written_and_counted(self):
        """A stop writes what still waits, with the annotations that came: one without its
        advantage is counted in trajectories_missing_annotations too (before: written uncounted)."""
        with rtrace.testing.capture(await_annotations="advantage", annotation_timeout_s=3600) as got:
            for i in range(2):
                with rtrace.rollout_context(step=1, sample_index=i, rollout_n=0):
                    rtrace.record_reward(1.0)
            assert rtrace.flush(30) and got.stats()["waiting_trajectories"] == 2
            rtrace.annotate(step=1, sample_index=1, rollout_n=0, advantage=0.5)
            rtrace.shutdown()
            trajs = sorted(got.sink.trajectories, key=lambda t: t.sample_index)
            assert [(t.sample_index, t.annotations, t.partial) for t in trajs] == [
                (0, {}, False), (1, {"advantage": 0.5}, False)]
            assert rtrace.stats()["trajectories_missing_annotations"] == 1


class TestLateSpansJoinAWaitingTrajectory:
    def test_in_the_collector_while_it_settles_or_waits_for_an_annotation(self, collector, tmp_path):
        """A root arrives first and its trajectory waits (settle_s, or an awaited advantage) in the
        waiting table; another process's span of it that comes afterwards joins it (one trajectory,
        two spans), neither opening a new trajectory nor counted late; so does its advantage."""
        for wait in ({"settle_s": 3600}, {"await_annotations": "advantage", "annotation_timeout_s": 3600}):
            path = tmp_path / f"{len(wait)}.jsonl"
            c = collector(jsonl_path=str(path), **wait)
            _stats.reset()
            tool, root = parts(7, 3)
            assert send(c.endpoint, root) == grpc.StatusCode.OK
            wait_until(lambda: c.stats()["waiting_trajectories"] == 1)
            assert send(c.endpoint, tool) == grpc.StatusCode.OK
            wait_until(lambda: c.stats()["collector_spans_received"] == 2)
            stats = c.stats()
            assert (stats["open_trajectories"], stats["waiting_trajectories"]) == (0, 1), wait
            advantages(c, [3])
            assert c.flush(30)
            c.stop()
            (traj,) = read_jsonl(path)
            assert len(traj.spans) == 2 and not traj.partial, wait
            assert traj.annotations == {"advantage": 0.03}, wait  # it came while it waited
            assert "collector_spans_late" not in c.stats(), wait

    def test_in_one_process_a_span_that_ends_after_its_root(self):
        """A traced generator left unfinished when its rollout ends: its span ends after the root,
        while the trajectory waits for its advantage, and joins it."""
        @rtrace.traced_tool
        def stream():
            yield 1
            yield 2

        with rtrace.testing.capture(await_annotations="advantage", annotation_timeout_s=3600) as got:
            with rtrace.rollout_context(step=1, sample_index=0, rollout_n=0):
                gen = stream()
                next(gen)
            assert rtrace.flush(30)
            assert got.stats()["waiting_trajectories"] == 1
            assert list(gen) == [2]  # its span ends now
            rtrace.annotate(step=1, sample_index=0, rollout_n=0, advantage=0.5)
            (traj,) = got.trajectories
            assert [s.kind for s in traj.spans] == ["rollout", "tool"] and traj.annotations == {"advantage": 0.5}
            assert "spans_late" not in got.stats()


@pytest.mark.integration
class TestAtTheIssuesSize:
    def test_rtrace_collect_with_four_workers_and_a_trainer_awaiting_advantages(self, tmp_path):
        """Issue 40's run: one `rtrace collect` (RTRACE_AWAIT_ANNOTATIONS=advantage, a job-wide cap of 32
        a step with whole groups), 4 worker processes running 50 steps x 64 groups x 8 rollouts, a
        trainer process whose annotate_batch gives each step its advantages 14 steps later. About 7,000
        to 7,700 finished trajectories wait for their advantage at once, beside the running ones,
        against a table of 6,000 (the issue saw it at 20,000 with advantages that came late). Every kept
        trajectory is whole with its advantage, and the collector evicted, cut short or lost nothing.
        Before: the waiting ones filled the table, and its push-back evicted running rollouts
        (written partial, their roots dropped as late)."""
        from tests.servers import start_rtrace_collect, stop_server

        steps, groups, n, workers_n, lag = 50, 64, 8, 4, 14
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        path = tmp_path / "traces.jsonl"
        env = dict(os.environ, RTRACE_JSONL_PATH=str(path), HF_HUB_OFFLINE="1", RTRACE_AWAIT_ANNOTATIONS="advantage",
                   RTRACE_SAMPLE_GROUPS="1", RTRACE_MAX_OPEN_TRAJECTORIES="6000",
                   # queued requests reserve room for at most ~5,500 new trajectories (3 spans each): a full
                   # queue pushes back without evicting, so only finished trajectories that wait could crowd
                   # running ones out of the table. A trainer's merged annotation request (4 MiB, ~12,000
                   # spans) still fits the queue whole
                   RTRACE_MAX_QUEUE_SIZE="16384",
                   PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
        proc, worker_env = start_rtrace_collect(env, "jsonl", "--max-traces-per-step", "32")
        try:
            assert "RTRACE_COLLECTOR_ENDPOINT" in worker_env, "rtrace collect printed no endpoint"
            worker_env["OTEL_EXPORTER_OTLP_TIMEOUT"] = "120000"  # a batch pushed back is sent again within it
            barrier = SPAWN.Barrier(workers_n + 1)
            outs = [SPAWN.Queue() for _ in range(workers_n + 1)]
            procs = [SPAWN.Process(target=workers.advantage_rollouts,
                                   args=(worker_env, w, workers_n, steps, groups, n, barrier, outs[w]))
                     for w in range(workers_n)]
            procs.append(SPAWN.Process(target=workers.advantage_trainer,
                                       args=(worker_env, steps, groups, n, lag, barrier, outs[-1])))
            for p in procs:
                p.start()
            reports = [q.get(timeout=600) for q in outs]
            for p in procs:
                p.join(60)
                assert p.exitcode == 0
        finally:
            proc.send_signal(signal.SIGTERM)
            out, _ = proc.communicate(timeout=120)
            stop_server(proc)
        assert proc.returncode == 0
        for flushed, sender in reports:  # every batch the workers and the trainer sent was taken
            assert flushed, sender
            for lost in ("failed_batches", "dropped_batches", "rejected_spans"):
                assert sender.get(f"sink.collector.{lost}", 0) == 0, (lost, sender)
        stats = json.loads(out.split("# rtrace stats: ", 1)[1].splitlines()[0])
        lost = {k: stats[k] for k in ("trajectories_evicted", "trajectories_partial", "trajectories_written_early",
                                      "trajectories_missing_annotations", "collector_spans_late",
                                      "trajectories_dropped_open_limit", "spans_dropped_open_limit",
                                      "annotations_unmatched", "annotations_late", "collector_spans_refused")
                if k in stats}
        assert lost == {}
        assert stats["collector_spans_received"] == steps * groups * n * 4  # 3 spans and an annotation each
        trajs = read_jsonl(path)
        assert Counter(t.step for t in trajs) == {step: 32 for step in range(steps)}
        for step in range(steps):
            kept = Counter(t.sample_index for t in trajs if t.step == step)
            assert len(kept) == 4 and set(kept.values()) == {n}, (step, kept)  # whole groups
        for t in trajs:
            assert not t.partial and [s.kind for s in t.spans] == ["rollout", "tool", "tool"], t.trace_id
            assert t.annotations == {"advantage": workers.advantage(t.step, t.sample_index, t.rollout_n)}


class TestSummariesWaitApart:
    """Rollouts recorded as summaries only wait for their annotations in a table of their own
    (``max_waiting_summaries``): a step of them waiting for the trainer's advantages neither
    fills the trajectories' waiting table nor is written early because of it."""

    @staticmethod
    def _run(max_summaries: int):
        sink = MetricsSink()
        rtrace.configure(exporter="none", sinks=[sink], max_traces_per_step=1, await_annotations="advantage",
                         annotation_timeout_s=60, max_waiting_trajectories=2, max_waiting_summaries=max_summaries,
                         export_interval_s=0.02)

        @rtrace.traced_tool
        def tool(x):
            return x

        for i in range(50):
            with rtrace.rollout_context(step=1, sample_index=i, rollout_n=0):
                tool(i)
                rtrace.record_reward(1.0)
        time.sleep(0.3)  # the worker takes them: 49 summaries and 1 trajectory now wait
        for i in range(50):
            rtrace.annotate(step=1, sample_index=i, rollout_n=0, advantage=i / 100)
        assert rtrace.flush(30)
        stats = rtrace.stats()
        rtrace.shutdown()
        (m,) = sink.metrics
        return m.values, stats

    def test_a_step_of_summaries_waits_whole(self):
        """50 rollouts, 1 recorded in full, a trajectories' waiting table of 2: every advantage
        joins (the step's advantage_mean is that of all 50), nothing is written early."""
        values, stats = self._run(1000)
        assert values["rollout/trajectories"] == 50
        assert values["rollout/advantage_mean"] == pytest.approx(sum(i / 100 for i in range(50)) / 50)
        assert stats.get("trajectories_written_early", 0) == 0

    def test_past_its_bound_the_oldest_summaries_are_counted_early(self):
        """A summaries' table of 10: the 39 oldest of the 49 summaries are counted without their
        advantage (trajectories_written_early), the rest wait for it."""
        values, stats = self._run(10)
        assert values["rollout/trajectories"] == 50
        assert stats["trajectories_written_early"] == 39
        assert values["rollout/advantage_mean"] != pytest.approx(sum(i / 100 for i in range(50)) / 50)
