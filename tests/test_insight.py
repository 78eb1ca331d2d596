"""Rewards from the trainer, tail keeping, prompt-following sampling, step metrics, rtrace report."""

from __future__ import annotations

import multiprocessing as mp
import subprocess
import sys
import time

import pytest

import rtrace
import rtrace.testing
from rtrace.exporters.jsonl import read_jsonl
from rtrace.pipeline.health import DEFAULT_CHECKS
from rtrace.pipeline.metrics import StepMetricsTracker, StepStats
from tests import collector_workers as workers
from tests.doubles import MetricsSink


@rtrace.traced_tool(tool_name="calculator")
def calc(x):
    if x < 0:
        raise ValueError("negative")
    return x * 2


def rollout(step, i, r, reward, fail=False, validate=False, **extra):
    with rtrace.rollout_context(step=step, sample_index=i, rollout_n=r, group_id=f"p{i}", validate=validate,
                                **extra):
        try:
            calc(-1 if fail else i)
        except ValueError:
            pass
        rtrace.record_reward(reward)


class TestTailKeeping:
    def test_cap_plus_error_best_and_worst_marked(self):
        """With a cap of 4 per step, 1 error trajectory and the best and worst are kept in addition, and
        each says why it was kept."""
        with rtrace.testing.capture(max_traces_per_step=4, keep_errors=2, keep_extremes=1, sample_seed=3) as got:
            for i in range(16):
                reward = {5: 100.0, 9: -100.0}.get(i, float(i % 3))
                try:
                    with rtrace.rollout_context(step=1, sample_index=i, rollout_n=0):
                        calc(i)
                        rtrace.record_reward(reward)
                        if i == 12:
                            raise RuntimeError("the episode crashed")
                except RuntimeError:
                    pass
            trajs = got.trajectories
            stats = got.stats()
        sampled = [t for t in trajs if "sampled" in t.kept]
        assert len(sampled) == 4
        by_index = {t.sample_index: t for t in trajs}
        assert "best" in by_index[5].kept and "worst" in by_index[9].kept
        assert "error" in by_index[12].kept and by_index[12].status == "error"
        assert all(t.kept for t in trajs)  # every exported trajectory says why
        extra = {5, 9, 12} - {t.sample_index for t in sampled}
        assert len(trajs) == 4 + len(extra)
        assert stats["trajectories_kept_best"] == 1 and stats["trajectories_kept_worst"] == 1
        assert stats["trajectories_kept_error"] == 1 and stats["trajectories_kept_sampled"] == 4
        assert stats["trajectories_sampled_out"] == 16 - len(trajs)

    def test_best_and_worst_by_an_annotated_key(self):
        """keep_by names an annotation: the extremes follow it, not the reward."""
        with rtrace.testing.capture(max_traces_per_step=1, keep_extremes=1, keep_by="advantage",
                                    await_annotations="advantage", sample_seed=1) as got:
            for i in range(6):
                with rtrace.rollout_context(step=2, sample_index=i, rollout_n=0):
                    calc(i)
                    rtrace.record_reward(1.0)
            rtrace.annotate_batch(step=2, sample_index=list(range(6)), rollout_n=[0] * 6,
                                  advantage=[0.1, 3.0, -2.0, 0.0, 0.5, 0.2])
            trajs = got.trajectories
        by_index = {t.sample_index: t.kept for t in trajs}
        assert "best" in by_index[1] and "worst" in by_index[2]

    def test_zero_variance_groups(self):
        """keep_zero_variance_groups keeps whole groups whose rewards are all equal."""
        with rtrace.testing.capture(max_traces_per_step=0, keep_zero_variance_groups=2) as got:
            for g, rewards in enumerate([(1, 1, 1), (0, 1, 0), (0, 0, 0), (1, 0, 1), (1, 1, 1)]):
                for r, reward in enumerate(rewards):
                    rollout(3, g, r, float(reward))
            trajs = got.trajectories
        groups = {t.group_id for t in trajs}
        assert len(groups) == 2 and groups <= {"p0", "p2", "p4"}
        assert all(t.kept == ["zero_variance"] for t in trajs) and len(trajs) == 6


class TestPromptSampling:
    def test_the_same_prompts_are_kept_at_every_step(self):
        """sample_prompts: the kept sample indices are the same at each step where they recur."""
        with rtrace.testing.capture(max_traces_per_step=3, sample_prompts=True, keep_errors=0) as got:
            for step in range(3):
                for i in reversed(range(10)) if step % 2 else range(10):  # arrival order must not matter
                    rollout(step, i, 0, 0.0)
            trajs = got.trajectories
        kept = [sorted(t.sample_index for t in trajs if t.step == s) for s in range(3)]
        assert len(kept[0]) == 3 and kept[0] == kept[1] == kept[2]


class TestStepMetrics:
    def test_computed_only_when_a_sink_writes_them(self, tmp_path):
        """With sinks that write no step metrics (JSONL, OTLP, console, the base Sink) the
        pipeline computes none (a fifth of its time); with one that does, every step
        reaches it, and the JSONL lines are the same either way."""
        from rtrace import _setup

        def run(sinks, path):
            rtrace.configure(exporter="jsonl", jsonl_path=str(path), sinks=sinks)
            for i in range(12):
                with rtrace.rollout_context(step=i // 4, sample_index=i % 4, rollout_n=0):
                    rtrace.record_reward(float(i % 2))
            tracker = _setup._pipeline.metrics
            assert rtrace.flush(30)
            rtrace.shutdown()
            return tracker, [(t.step, t.sample_index, t.reward) for t in read_jsonl(path)]

        class Plain(rtrace.Sink):
            name = "plain"

            def export(self, trajectories):
                pass

        tracker, lines = run([Plain(None)], tmp_path / "a.jsonl")
        assert tracker is None
        sink = MetricsSink()
        tracker, lines_with = run([sink], tmp_path / "b.jsonl")
        assert tracker is not None and lines_with == lines
        assert sorted(m.step for m in sink.metrics) == [0, 1, 2]
        assert [m.values["rollout/trajectories"] for m in sorted(sink.metrics, key=lambda m: m.step)] == [4.0] * 3

    @pytest.mark.integration
    def test_job_of_four_workers_equals_one_process(self, tmp_path):
        """The step metrics the collector computed for a 4-worker job equal those computed in one
        process over the same trajectories, value for value."""
        sink = MetricsSink()
        c = rtrace.start_collector(exporter="jsonl", jsonl_path=str(tmp_path / "t.jsonl"), sinks=[sink],
                                   settle_s=0.3)
        try:
            spawn = mp.get_context("spawn")
            procs = [spawn.Process(target=workers.rollouts, args=(c.env, w, 4, 3, 12, 4, 4)) for w in range(4)]
            for p in procs:
                p.start()
            for p in procs:
                p.join(120)
            assert c.flush(30)
        finally:
            c.stop()
        trajs = read_jsonl(tmp_path / "t.jsonl")
        whole: dict = {}  # one process, every trajectory of a step at once, in another order
        for t in sorted(trajs, key=lambda t: t.trace_id):
            whole.setdefault((t.validate, t.step), StepStats()).add(t)
        # the collector's default health checks, a rate each; no cap, so every group is whole
        expected = {(v, s): (st.values("eval" if v else "rollout", DEFAULT_CHECKS, whole_groups=True), st.slowest[1])
                    for (v, s), st in whole.items()}
        got = {(m.validate, m.step): (m.values, m.slowest_trace_id) for m in sink.metrics}
        assert set(got) == {(False, 0), (False, 1), (False, 2), (True, 0), (True, 1), (True, 2)} == set(expected)
        for key, (values, slowest) in expected.items():
            assert got[key][1] == slowest
            assert got[key][0] == pytest.approx(values, rel=1e-12, abs=1e-12)
        assert got[(False, 1)][0]["rollout/trajectories"] == 48
        assert got[(False, 1)][0]["rollout/reward_mean"] == pytest.approx(1.5)
        assert got[(False, 1)][0]["rollout/zero_variance_groups_frac"] == 0.0

    def test_every_step_reaches_the_sinks_without_a_flush(self):
        """Steps released while trajectories are exported (a later step began and the linger
        passed) reach the sinks: every step has its row, not only the ones released at flush."""
        sink = MetricsSink()
        rtrace.configure(exporter="none", sinks=[sink], step_linger_s=0.05, export_interval_s=0.02)
        for step in range(4):
            for i in range(3):
                rollout(step, i, 0, float(step))
            time.sleep(0.3)  # the worker exports this step; the next step then releases it
        assert rtrace.flush(30)
        got = {(m.validate, m.step): m.values["rollout/reward_mean"] for m in sink.metrics}
        assert got == {(False, 0): 0.0, (False, 1): 1.0, (False, 2): 2.0, (False, 3): 3.0}
        assert [m.step for m in sink.metrics] == [0, 1, 2, 3]  # in step order, each once

    def test_rollouts_table_groups_side_by_side_and_is_bounded(self):
        """Each step's rollouts table holds its trajectories ordered by group then rollout, the
        annotations as columns after the reward, the slowest marked; beyond step_table_rows the
        last row says how many were left out."""
        sink = MetricsSink()
        rtrace.configure(exporter="none", sinks=[sink], step_table_rows=5, export_interval_s=0.02,
                         await_annotations="advantage")
        for i in (2, 0, 1):
            for r in (1, 0):
                rollout(1, i, r, float(r))
                rtrace.annotate(step=1, sample_index=i, rollout_n=r, advantage=r - 0.5)
        assert rtrace.flush(30)
        (m,) = sink.metrics
        assert list(m.rows[0]) == ["step", "group", "sample_index", "rollout_n", "reward", "advantage", "outcome",
                                   "health", "prompt", "answer", "turns", "tool_calls", "tokens_in", "tokens_out", "finish_reason",
                                   "latency_ms", "kept", "note", "trace_id"]
        shown = [(r["group"], r["rollout_n"]) for r in m.rows[:5]]
        assert shown == sorted(shown) and len(set(shown)) == 5  # 5 of the 6, by group then rollout
        assert m.rows[5]["note"] == "1 more row left out (step_table_rows)" and m.rows[5]["trace_id"] is None
        assert [r["note"] for r in m.rows[:5]].count("slowest") <= 1
        assert all(r["advantage"] == r["rollout_n"] - 0.5 for r in m.rows[:5])

    def test_every_column_of_a_row(self):
        """A row holds the trajectory's values, column by column: tokens summed over its
        generations, turns, tool calls, the last finish reason, its verdict and health, its
        latency to 0.1 ms, the final answer bounded to 300 characters, the trace id."""
        from rtrace.pipeline.metrics import ANSWER_CHARS

        @rtrace.traced_generation
        def gen(prompt_ids):
            return {"response_ids": [5, 6, 7], "finish_reason": "length", "text": "The answer is 42. " * 40}

        sink = MetricsSink()
        with rtrace.testing.capture(sinks=[sink]) as got:
            with rtrace.rollout_context(step=3, sample_index=2, rollout_n=1, group_id="prompt-2"):
                gen([1, 2, 3, 4])
                calc(1)
                gen([1, 2, 3, 4, 5, 6, 7, 8])
                rtrace.record_reward(0.0, correct=False)
            rtrace.flush()
        (t,) = got.trajectories
        (m,) = sink.metrics
        (row,) = m.rows
        answer = row.pop("answer")
        assert row.pop("prompt") == "[4 tokens, not decoded: set RTRACE_TOKEN2TEXT]"  # the first turn's prompt
        assert row == {"step": 3, "group": "prompt-2", "sample_index": 2, "rollout_n": 1, "reward": 0.0,
                       "outcome": "truncated", "health": "generation", "turns": 2, "tool_calls": 1, "tokens_in": 12,
                       "tokens_out": 6, "finish_reason": "length", "latency_ms": round(t.duration_ms, 1), "kept": "",
                       "note": "slowest", "trace_id": t.trace_id}
        full = "The answer is 42. " * 40
        assert answer.startswith(full[:ANSWER_CHARS - 1]) and answer.endswith("[truncated, 720 chars]")

    def test_groups_in_natural_order(self):
        """Group ids sort as a person reads them: prompt-2 before prompt-10."""
        from rtrace.pipeline.metrics import _table

        rows = [{"group": g, "rollout_n": 0, "trace_id": g} for g in ("prompt-10", "prompt-2", "prompt-1")]
        assert [r["group"] for r in _table(rows, 0, "")] == ["prompt-1", "prompt-2", "prompt-10"]

    def test_merge_is_exact(self):
        """StepStats of four parts, merged, equal the StepStats of the whole (count-weighted)."""
        with rtrace.testing.capture() as got:
            for i in range(24):
                rollout(1, i // 4, i % 4, float(i % 5), fail=False)
            trajs = got.trajectories
        whole = StepStats()
        for t in trajs:
            whole.add(t)
        parts = [StepStats() for _ in range(4)]
        for k, t in enumerate(trajs):
            parts[k % 4].add(t)
        merged = parts[0]
        for p in parts[1:]:
            merged.merge(p)
        assert merged.values("rollout") == pytest.approx(whole.values("rollout"), rel=1e-12, abs=1e-12)
        assert merged.slowest == whole.slowest


class TestAnnotationsInOneProcess:
    def test_annotate_one_and_late_and_sampled_out(self):
        """annotate() joins one trajectory; a late annotation is counted and never blocks; one for a
        sampled-out trajectory is counted."""
        with rtrace.testing.capture(max_traces_per_step=2, keep_extremes=0, keep_errors=1,
                                    await_annotations="advantage", annotation_timeout_s=0.5) as got:
            for i in range(4):
                rollout(1, i, 0, 1.0)
            for i in range(4):
                rtrace.annotate(step=1, sample_index=i, rollout_n=0, advantage=i / 10)
            trajs = got.trajectories
            kept = {t.sample_index for t in trajs}
            assert all(t.annotations == {"advantage": t.sample_index / 10} for t in trajs)
            rtrace.annotate(step=1, sample_index=min(kept), rollout_n=0, advantage=9.0)  # after export
            dropped = min(set(range(4)) - kept)
            rtrace.annotate(step=1, sample_index=dropped, rollout_n=0, advantage=9.0)
            rtrace.flush(5)
            stats = got.stats()
        assert stats["annotations_late"] == 1 and stats["annotations_sampled_out"] >= 1

    def test_missing_annotation_times_out_and_is_counted(self):
        """A trajectory waiting for an annotation that never comes is exported after the timeout."""
        with rtrace.testing.capture(await_annotations="advantage", annotation_timeout_s=0.3) as got:
            rollout(1, 0, 0, 1.0)
            import time

            time.sleep(0.8)
            (traj,) = got.trajectories
            assert traj.annotations == {} and got.stats()["trajectories_missing_annotations"] == 1


class TestReport:
    def test_report_prints_the_step_table_and_writes_html(self, tmp_path):
        """rtrace report reads JSONL files (several merge) and prints the per-step table; --html writes a page."""
        paths = []
        for part in range(2):
            path = tmp_path / f"w{part}.jsonl"
            rtrace.configure(exporter="jsonl", jsonl_path=str(path), export_interval_s=0.02)
            for i in range(part * 3, part * 3 + 3):
                rollout(7, i, 0, float(i))
            assert rtrace.flush(10)
            rtrace.shutdown()
            paths.append(str(path))
        html = tmp_path / "r.html"
        out = subprocess.run([sys.executable, "-m", "rtrace", "report", *paths, "--html", str(html)],
                             capture_output=True, text=True, timeout=120, check=True).stdout
        assert "6 trajectories from 2 file(s)" in out
        row = next(line for line in out.splitlines() if line.strip().startswith("7 "))
        assert row.split()[:4] == ["7", "6", "2.500", "1.708"]  # step, n, reward mean, std
        page = html.read_text()
        assert "<svg" in page and "reward mean" in page and "<td>2.500</td>" in page


class TestInTheBackends:
    def test_kept_and_annotations_in_trackio_and_mlflow(self, tmp_path, trackio_mod):
        """trackio metadata and MLflow trace tags say why a trajectory was kept and carry its
        annotations; MLflow finds them with one filter."""
        import uuid

        from mlflow.tracking import MlflowClient
        from trackio.sqlite_storage import SQLiteStorage

        project = f"ins-{uuid.uuid4().hex[:8]}"
        uri = f"sqlite:///{tmp_path}/mlflow.db"
        rtrace.configure(exporter="trackio,mlflow", project=project, experiment="kept", mlflow_tracking_uri=uri,
                         max_traces_per_step=1, keep_extremes=1, await_annotations="advantage",
                         export_interval_s=0.05)
        for i in range(4):
            rollout(1, i, 0, float(i))
        rtrace.annotate_batch(step=1, sample_index=[0, 1, 2, 3], rollout_n=[0, 0, 0, 0],
                              advantage=[-1.5, -0.5, 0.5, 1.5])
        assert rtrace.flush(60)
        traces = SQLiteStorage.get_traces(project, run="kept")
        meta = {t["metadata"]["sample_index"]: t["metadata"] for t in traces}
        assert "best" in meta[3]["kept"] and "worst" in meta[0]["kept"]
        assert meta[3]["advantage"] == 1.5  # annotations are top-level keys of the trace header
        client = MlflowClient(tracking_uri=uri)
        exp = client.get_experiment_by_name(project)
        best = client.search_traces(locations=[exp.experiment_id], filter_string="tags.kept LIKE '%best%'")
        assert [(t.info.tags["sample_index"], t.info.tags["advantage"]) for t in best] == [("3", "1.5")]


class TestAwaitedKeysPerStream:
    def test_validation_does_not_wait_for_training_keys(self):
        """RTRACE_AWAIT_ANNOTATIONS holds training trajectories until their advantage comes; a
        validation trajectory is written at once (it waits only for RTRACE_AWAIT_EVAL_ANNOTATIONS)."""
        with rtrace.testing.capture(await_annotations="advantage", annotation_timeout_s=30,
                                    await_eval_annotations="score") as got:
            rollout(1, 0, 0, 1.0)
            rollout(1, 0, 0, 0.5, validate=True)
            rollout(1, 1, 0, 0.5, validate=True)
            time.sleep(0.5)  # several worker rounds: the validation ones without "score" wait
            assert got.trajectories == []
            rtrace.annotate(step=1, sample_index=0, rollout_n=0, advantage=0.25)
            rtrace.annotate(step=1, sample_index=0, rollout_n=0, validate=True, score=3.0)
            deadline = time.monotonic() + 10
            while len(got.trajectories) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            got_now = {(t.validate, t.sample_index): t.annotations for t in got.trajectories}
            stats = got.stats()
        assert got_now == {(False, 0): {"advantage": 0.25}, (True, 0): {"score": 3.0}}
        assert stats.get("trajectories_missing_annotations", 0) == 0
