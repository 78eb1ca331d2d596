"""One GRPO job over 1, 2 and 4 `rtrace collect` processes gives the same run (issue 40).

Real processes on this machine: N ``rtrace collect --exporter parquet`` processes writing one
dataset, 4 worker processes and a trainer process (one ``annotate_batch`` of advantages per
step; the collectors await them) given the list of collectors; then ``rtrace publish --once``
into trackio (this session's TRACKIO_DIR) and MLflow (SQLite), read back through trackio's and
MLflow's own APIs. The job is tests/scale_out_job.py: rollouts whose rewards, errors,
truncations, turns and tokens are functions of their coordinates.

The size here is the issue's but for the steps (4, not 50: the integration suite's budget, ~70 s
for this file on a quiet 2-core VM); ``SCALE_OUT_STEPS=50`` runs the issue's size by hand.
"""

from __future__ import annotations

import os
import time

import pytest

pytest.importorskip("pyarrow")
pytest.importorskip("duckdb")

from tests import scale_out_job as job  # noqa: E402

#: the issue's size but for the steps; ``SCALE_OUT_STEPS=50 pytest tests/test_scale_out_job.py`` runs
#: the issue's 50 by hand (25,600 rollouts a job)
STEPS, GROUPS, N = int(os.environ.get("SCALE_OUT_STEPS", "4")), 64, 8
SIZES = (1, 2, 4)
PRE_RATE = 0.05


@pytest.fixture(scope="module")
def jobs(trackio_mod, tmp_path_factory):
    """The job at N = 1, 2, 4 and, pre-sampled at 5 %, at N = 2; each published to trackio (a
    project per job), and N = 4 to MLflow too (SQLite; each MLflow publish costs ~20 s here, and
    what it writes is the trackio run's inputs: the test checks the two runs are equal); read
    back."""
    from trackio import utils

    base = tmp_path_factory.mktemp("scale-out")
    uri = f"sqlite:///{base}/mlflow.db"
    out = {}
    for name, size, rate in [(f"n{s}", s, 1.0) for s in SIZES] + [("pre", 2, PRE_RATE)]:
        done = job.run_job(str(base / name), size, STEPS, GROUPS, N, pre_sample_rate=rate)
        project = f"{base.name}-{name}"
        exporter = "trackio,mlflow" if name == "n4" else "trackio"
        started = time.monotonic()
        job.publish(done.path, project, str(utils.TRACKIO_DIR), uri, exporter, cwd=str(base))
        published = time.monotonic()
        out[name] = {"job": done, "dataset": job.dataset_view(done.path), "trackio": job.trackio_view(project),
                     "mlflow": job.mlflow_view(uri, project) if "mlflow" in exporter else None}
        print(f"{name}: {size} collectors, job {done.wall_s:.1f} s, publish {published - started:.1f} s, read back "
              f"{time.monotonic() - published:.1f} s; collectors' CPU {[round(c, 2) for c in done.collector_cpu_s]} s, "
              f"workers' CPU {sum(w[2] for w in done.workers):.2f} s")
    return out


def _coords(step, p, r):
    return (False, step, p, r)


def _expected_metrics(step):
    """What the step metrics must say, from the rollouts' definitions."""
    every = [(p, r) for p in range(GROUPS) for r in range(N)]
    rewards = [job.reward(step, p, r) for p, r in every]
    return {"rollout/trajectories": float(len(every)), "rollout/reward_mean": sum(rewards) / len(rewards),
            "rollout/error_rate": sum(job.fails(step, p, r) for p, r in every) / len(every),
            "rollout/truncated_rate": sum(job.truncated(step, p, r) for p, r in every) / len(every),
            "rollout/turns_mean": sum(job.turns(step, p, r) for p, r in every) / len(every),
            "rollout/zero_variance_groups_frac": 8 / GROUPS, "rollout/advantage_mean": 0.0,
            "rollout/partial_rate": 0.0}


#: a collector's counters of something lost, cut short or left without its annotation
COLLECTOR_LOSSES = ("trajectories_evicted", "trajectories_partial", "trajectories_written_early",
                    "trajectories_missing_annotations", "collector_spans_late", "trajectories_dropped_open_limit",
                    "spans_dropped_open_limit", "annotations_unmatched", "annotations_late", "collector_spans_refused")


def _nothing_lost(done):
    for ok, stats, _ in done.workers + [done.trainer]:
        assert ok
        lost = {k: v for k, v in stats.items() if any(w in k for w in ("dropped", "failed", "abandoned"))}
        assert lost == {}, lost
    for stats in done.collector_stats:
        lost = {k: stats[k] for k in COLLECTOR_LOSSES if k in stats}
        assert lost == {}, lost


@pytest.mark.integration
class TestOneRunWhateverN:
    def test_the_sample_metrics_and_annotations_are_the_same_for_1_2_4_collectors(self, jobs):
        """The kept trajectories (by coordinates), every row of the dataset, every step metric that
        does not depend on wall time and every annotation are identical across N = 1, 2, 4; the
        sample is the sampler's 4 whole groups a step; the spans view holds the kept rows' spans
        only; trackio holds one run of those traces and metrics, and at N = 4 MLflow one run with
        the same traces, advantages and metrics (every one, times included)."""
        expected_rows = {_coords(s, p, r) for s in range(STEPS) for p in range(GROUPS) for r in range(N)}
        reference = None
        for size in SIZES:
            got = jobs[f"n{size}"]
            _nothing_lost(got["job"])
            data = got["dataset"]
            assert data["skipped"] == [] and set(data["rows"]) == expected_rows  # every rollout, once
            for coords, row in data["rows"].items():
                assert row["advantage"] == job.advantage(*coords[1:], N) and not row["partial"]
                assert row["recorded"] == bool(row["kept"])
            assert data["kept"] == job.sample(STEPS, GROUPS, N)  # 4 whole groups a step, the lowest priorities
            assert data["span_traces"] == {data["rows"][c]["trace_id"] for c in data["kept"]}
            tr, ml = got["trackio"], got["mlflow"]
            assert len(tr["runs"]) == 1 and set(tr["traces"]) == data["kept"]
            assert sorted(tr["metrics"]) == list(range(STEPS))
            assert all(adv == job.advantage(*c[1:], N) for c, adv in tr["traces"].items())
            if ml is not None:  # the MLflow run is the trackio run: traces, advantages, every metric
                assert len(ml["runs"]) == 1 and ml["traces"] == tr["traces"] and ml["metrics"] == tr["metrics"]
            for step, values in tr["metrics"].items():
                assert _expected_metrics(step).items() <= values.items(), step
            view = {"rows": {c: {k: v for k, v in row.items() if k != "trace_id"} for c, row in data["rows"].items()},
                    "metrics": job.timeless(tr["metrics"]), "keys": {s: set(v) for s, v in tr["metrics"].items()}}
            if reference is None:
                reference = view
            else:
                assert view == reference, f"N = {size} differs from N = 1"

    def test_pre_sampled_at_5_percent_the_step_metrics_equal_recording_everything(self, jobs):
        """RTRACE_PRE_SAMPLE_RATE=0.05 (2 collectors): the workers record in full the groups of
        priority below 5 % and the failed or truncated rollouts they may promote (at most 4 a step
        each), every other rollout as a summary only; every rollout is counted, and the step metrics
        equal those of the run that recorded everything, to the last digit, but for the times (each
        run's own)."""
        pre, full = jobs["pre"], jobs["n1"]
        _nothing_lost(pre["job"])
        assert job.timeless(pre["trackio"]["metrics"]) == job.timeless(full["trackio"]["metrics"])
        assert {s: set(v) for s, v in pre["trackio"]["metrics"].items()} == {
            s: set(v) for s, v in full["trackio"]["metrics"].items()}
        rows = pre["dataset"]["rows"]
        assert set(rows) == set(full["dataset"]["rows"])
        assert all(row["advantage"] == job.advantage(*c[1:], N) for c, row in rows.items())
        counts = {key: sum(w[1].get(key, 0) for w in pre["job"].workers) for key in (
            "trajectories_sampled_out", "rollouts_summarized", "summaries_promoted", "summaries_promotion_skipped")}
        out = set(rows) - job.sample(STEPS, GROUPS, N, cap=GROUPS * N, rate=PRE_RATE)
        assert counts["trajectories_sampled_out"] == len(out)
        assert counts["summaries_promoted"] + counts["summaries_promotion_skipped"] == sum(
            job.fails(*c[1:]) or job.truncated(*c[1:]) for c in out)
        assert counts["rollouts_summarized"] == len(out) - counts["summaries_promoted"]
        print(f"pre-sampled: {len(rows) - len(out)} of {len(rows)} rollouts recorded in full, "
              f"{counts['summaries_promoted']} promoted, {counts['rollouts_summarized']} summaries only; workers' CPU "
              f"{sum(w[2] for w in pre['job'].workers):.2f} s vs {sum(w[2] for w in full['job'].workers):.2f} s "
              "recording everything")

    def test_pre_sampled_at_5_percent_the_sample_is_the_recorded_groups(self, jobs):
        """The sample is chosen among the ~26 rollouts a step recorded in full by rank (fewer than
        the cap of 32): whole groups, the full run's lowest-priority ones; the trackio run holds
        them. A rollout the workers promoted (sent in full for the tail: failed or truncated) is not
        one of them: it is kept only by the tail (keep_errors, 0 here), never as 'sampled'."""
        pre, full = jobs["pre"], jobs["n1"]
        kept = pre["dataset"]["kept"]
        assert kept == job.sample(STEPS, GROUPS, N, rate=PRE_RATE) <= full["dataset"]["kept"]
        assert set(pre["trackio"]["traces"]) == kept


def _wait_for_rows(path, step, rows, timeout_s=120.0):
    """Until the dataset at ``path`` holds ``rows`` rows of ``step`` (both collectors wrote it)."""
    import rtrace

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if os.path.isdir(os.path.join(path, "trajectories")):
            run = rtrace.open_run(path)
            found = run.sql("SELECT count(*) FROM trajectories WHERE step = ?", [step]).fetchall()[0][0]
            run.close()
            if found == rows:
                return
        time.sleep(0.5)
    raise AssertionError(f"step {step}: {rows} rows not written within {timeout_s} s")


@pytest.mark.integration
def test_a_collector_killed_mid_step_costs_its_own_groups_counted_and_takes_them_again(tmp_path):
    """Two collectors; one is SIGKILLed while step 2 waits there for its advantages (the trainer is
    sending them), and restarted on its port after step 4. The other collector's steps are whole, every one; the
    workers and the trainer count what they could not send to the dead one (never sending it
    elsewhere); from step 5 the restarted collector writes its groups again, whole and joined,
    and those steps' sample is the one-collector sample again."""
    import signal

    from rtrace.placement import Ring, route_key
    from tests.servers import start_rtrace_collect

    steps, groups, n, cap, kill_after, restart_after = 8, 16, 4, 16, 2, 4
    events = {}

    def between(step, procs, endpoints, env):
        if step == 1:  # step 0 is written once step 1's rollouts are done (2 s after their root: settle_s)
            _wait_for_rows(os.path.join(str(tmp_path / "ds"), job.EXPERIMENT), 0, groups * n)
        elif step == kill_after:  # step 2 waits there for its advantages (the trainer is sending them)
            procs[1].send_signal(signal.SIGKILL)
            procs[1].wait(30)
            events["killed"] = time.monotonic()
        elif step == restart_after:
            time.sleep(5.0)  # the lanes gave up on what they held for it (OTEL_EXPORTER_OTLP_TIMEOUT=2 s)
            port = int(endpoints[1].rsplit(":", 1)[1])
            procs[1], printed = start_rtrace_collect(env, "parquet", port=port)
            assert printed["RTRACE_COLLECTOR_ENDPOINT"] == endpoints[1]
            events["restarted"] = time.monotonic()

    done = job.run_job(str(tmp_path / "ds"), 2, steps, groups, n, workers=2, cap=cap, between=between,
                       OTEL_EXPORTER_OTLP_TIMEOUT="2000")
    alive, dead = done.endpoints
    ring = Ring(done.endpoints)
    owner = {(s, p): ring.owner(route_key(job.EXPERIMENT, False, s, p)) for s in range(steps) for p in range(groups)}
    data = job.dataset_view(done.path)
    rows = data["rows"]
    every = {(False, s, p, r) for s in range(steps) for p in range(groups) for r in range(n)}
    theirs = {c for c in every if owner[c[1:3]] == dead}
    # the living collector's groups: every rollout of every step, whole, with its advantage
    mine = every - theirs
    assert mine <= set(rows)
    assert all(not rows[c]["partial"] and rows[c]["advantage"] == job.advantage(*c[1:], n) for c in mine)
    # the restarted collector's groups of steps 5-7: whole and joined; their sample is one collector's
    later = {c for c in theirs if c[1] > restart_after}
    assert later <= set(rows)
    assert all(not rows[c]["partial"] and rows[c]["advantage"] == job.advantage(*c[1:], n) for c in later)
    assert {c for c in data["kept"] if c[1] > restart_after} == {
        c for c in job.sample(steps, groups, n, cap) if c[1] > restart_after}
    # what the dead one wrote before it died stays: its groups of step 0 (step 1 waited for step 2)
    assert {c for c in theirs if c[1] == 0} <= set(rows)
    # what it never wrote: its groups of the steps around its death, counted by the senders
    lost = theirs - set(rows)
    counters = [stats for _, stats, _ in done.workers + [done.trainer]]
    failed = sum(s.get(f"collector_endpoint.{dead}.{what}", 0) for s in counters for what in ("failed", "dropped"))
    assert lost and {c[1] for c in lost} <= set(range(1, restart_after + 1))
    assert failed > 0 and not any(s.get(f"collector_endpoint.{alive}.failed") for s in counters)
    assert not any(s.get(f"collector_endpoint.{alive}.dropped") for s in counters)
    print(f"killed collector: {len(theirs)} of its rollouts, {len(lost)} not in the dataset (steps "
          f"{sorted({c[1] for c in lost})}), senders counted {failed} segments / rows failed or dropped for it: "
          f"{[{k: v for k, v in s.items() if dead in k} for s in counters]}")
