"""One GRPO job over 1, 2 and 4 `rtrace collect` processes gives the same run (issue 40).

Real processes on this machine: N ``rtrace collect --exporter parquet`` processes writing one
dataset, 4 worker processes and a trainer process (one ``annotate_batch`` of advantages per
step; the collectors await them) given the list of collectors; then ``rtrace publish --once``
into trackio (this session's TRACKIO_DIR) and MLflow (SQLite), read back through trackio's and
MLflow's own APIs. The job is tests/scale_out_job.py: rollouts whose rewards, errors,
truncations, turns and tokens are functions of their coordinates.

The size here is the issue's but for the steps (4, not 50: the integration suite's budget);
``python -m tests.scale_out_job DIR 50 64 8`` runs the issue's size by hand.
"""

from __future__ import annotations

import time
from collections import Counter

import pytest

pytest.importorskip("pyarrow")
pytest.importorskip("duckdb")

from tests import scale_out_job as job  # noqa: E402

STEPS, GROUPS, N = 4, 64, 8
SIZES = (1, 2, 4)
PRE_RATE = 0.05


@pytest.fixture(scope="module")
def jobs(trackio_mod, tmp_path_factory):
    """The job at N = 1, 2, 4 and, pre-sampled at 5 %, at N = 2; each published to trackio (a
    project per job) and, but the pre-sampled one, to MLflow (an experiment per job, one SQLite
    store); read back."""
    from trackio import utils

    base = tmp_path_factory.mktemp("scale-out")
    uri = f"sqlite:///{base}/mlflow.db"
    out = {}
    for name, size, rate in [(f"n{s}", s, 1.0) for s in SIZES] + [("pre", 2, PRE_RATE)]:
        done = job.run_job(str(base / name), size, STEPS, GROUPS, N, pre_sample_rate=rate)
        project = f"{base.name}-{name}"
        exporter = "trackio" if name == "pre" else "trackio,mlflow"
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


def _nothing_lost(done):
    for ok, stats, _ in done.workers + [done.trainer]:
        assert ok
        lost = {k: v for k, v in stats.items() if any(w in k for w in ("dropped", "failed", "abandoned"))}
        assert lost == {}, lost


@pytest.mark.integration
class TestOneRunWhateverN:
    def test_the_sample_metrics_and_annotations_are_the_same_for_1_2_4_collectors(self, jobs):
        """The kept trajectories (by coordinates), every row of the dataset, every step metric that
        does not depend on wall time and every annotation are identical across N = 1, 2, 4; the
        sample is 32 a step of whole groups; the spans view holds the kept rows' spans only; trackio
        and MLflow each hold one run with the same traces and metrics."""
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
            per_group = Counter(c[:3] for c in data["kept"])
            assert set(per_group.values()) == {N}  # whole groups
            assert Counter(c[1] for c in data["kept"]) == {s: job.CAP for s in range(STEPS)}
            assert data["span_traces"] == {data["rows"][c]["trace_id"] for c in data["kept"]}
            tr, ml = got["trackio"], got["mlflow"]
            assert len(tr["runs"]) == 1 and len(ml["runs"]) == 1
            assert set(tr["traces"]) == set(ml["traces"]) == data["kept"]
            assert all(adv == job.advantage(*c[1:], N) for c, adv in tr["traces"].items())
            assert all(adv == job.advantage(*c[1:], N) for c, adv in ml["traces"].items())
            assert tr["metrics"] == ml["metrics"] and sorted(tr["metrics"]) == list(range(STEPS))
            for step, values in tr["metrics"].items():
                assert _expected_metrics(step).items() <= values.items(), step
            view = {"rows": {c: {k: v for k, v in row.items() if k != "trace_id"} for c, row in data["rows"].items()},
                    "metrics": job.timeless(tr["metrics"]), "keys": {s: set(v) for s, v in tr["metrics"].items()}}
            if reference is None:
                reference = view
            else:
                assert view == reference, f"N = {size} differs from N = 1"

    def test_pre_sampled_at_5_percent_the_step_metrics_equal_recording_everything(self, jobs):
        """RTRACE_PRE_SAMPLE_RATE=0.05 (2 collectors): every rollout is counted from its summary, and
        the step metrics equal those of the run that recorded everything, to the last digit, but for
        the times (each run's own); the sample is chosen among the ~26 rollouts a step recorded in
        full (fewer than the cap of 32): whole groups, the full run's lowest-priority ones."""
        pre, full = jobs["pre"], jobs["n1"]
        _nothing_lost(pre["job"])
        assert job.timeless(pre["trackio"]["metrics"]) == job.timeless(full["trackio"]["metrics"])
        assert {s: set(v) for s, v in pre["trackio"]["metrics"].items()} == {
            s: set(v) for s, v in full["trackio"]["metrics"].items()}
        rows, kept = pre["dataset"]["rows"], pre["dataset"]["kept"]
        assert set(rows) == set(full["dataset"]["rows"])
        assert all(row["advantage"] == job.advantage(*c[1:], N) for c, row in rows.items())
        recorded = {c for c, row in rows.items() if row["recorded"]}
        assert kept == recorded and kept <= full["dataset"]["kept"]  # among the full run's lowest-priority groups
        assert set(Counter(c[:3] for c in kept).values()) == {N}
        assert all(0 < k <= job.CAP for k in Counter(c[1] for c in kept).values())
        assert set(pre["trackio"]["traces"]) == kept
        summaries = sum(w[1].get("rollouts_summarized", 0) for w in pre["job"].workers)
        print(f"pre-sampled: {len(kept)} of {len(rows)} rollouts recorded in full; workers' CPU "
              f"{sum(w[2] for w in pre['job'].workers):.2f} s vs {sum(w[2] for w in full['job'].workers):.2f} s "
              f"recording everything; rollouts_summarized in the workers: {summaries}")
