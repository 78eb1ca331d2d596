"""Several collectors' samples read as one collector's (issue 40; rtrace/dataset/cut.py).

Real pipeline: rtrace collectors started in this process, writing one run's dataset with the
parquet sink, fed by a worker process configured by their environment (tests/scale_out_job.py's
rollouts: rewards that vary, zero-variance groups, errors and truncations, all functions of the
coordinates). The same job through one collector and through three gives the same dataset
through ``rtrace.open_run``: the same kept rows for the same reasons (the sample and the tail),
``recorded`` and ``in_sample`` alike, and a spans view that holds exactly the kept rows' spans.
"""

from __future__ import annotations

import multiprocessing as mp

import pytest

pytest.importorskip("pyarrow")
pytest.importorskip("duckdb")

import rtrace  # noqa: E402
from tests import scale_out_job as job  # noqa: E402

SPAWN = mp.get_context("spawn")
STEPS, GROUPS, N, CAP = 3, 16, 4, 8
TAIL = {"keep_errors": 2, "keep_extremes": 1}
ZERO_VARIANCE = {"keep_zero_variance_groups": 4}  # the 8 lowest-ranked groups of 16 are candidates


def _run(root, collectors, **tail):
    """The job through ``collectors`` collectors; what open_run shows, by coordinates."""
    made = [rtrace.start_collector(exporter="parquet", parquet_path=str(root), experiment=job.EXPERIMENT,
                                   job_id=job.JOB_ID, sample_seed=job.SEED, max_traces_per_step=CAP,
                                   sample_groups=True, settle_s=0.3, **tail) for _ in range(collectors)]
    try:
        env = dict(made[0].env, RTRACE_COLLECTOR_ENDPOINT=",".join(c.endpoint for c in made))
        out, barrier = SPAWN.Queue(), SPAWN.Barrier(1)  # held here until the child has it
        proc = SPAWN.Process(target=job.worker, args=(env, 0, 1, STEPS, GROUPS, N, barrier, out))
        proc.start()
        ok, stats, _ = out.get(timeout=120)[2:]
        proc.join(60)
        assert ok and proc.exitcode == 0 and stats["sink.collector.sent"] >= STEPS * GROUPS * N  # segments
        assert not [k for k in stats if any(w in k for w in ("dropped", "failed", "abandoned"))]
        for c in made:
            assert c.flush(60)
    finally:
        for c in made:
            c.stop()
    run = rtrace.open_run(root / job.EXPERIMENT)
    rows = {(v, s, p, r): (t, tuple(k), rec, ins)
            for v, s, p, r, t, k, rec, ins in run.sql(
                "SELECT validate, step, sample_index, rollout_n, trace_id, kept, recorded, in_sample "
                "FROM trajectories").fetchall()}
    spans = dict(run.sql("SELECT trace_id, count(*) FROM spans GROUP BY trace_id").fetchall())
    writers = run.sql("SELECT count(DISTINCT split_part(parse_filename(filename), '-', 1)) FROM read_parquet("
                      f"'{root / job.EXPERIMENT}/trajectories/**/*.parquet', filename = true)").fetchall()[0][0]
    run.close()
    return rows, spans, writers


@pytest.mark.parametrize("tail", [
    TAIL,
    # the zero-variance tail: the lowest-ranked zero-variance groups among the 2 * keep groups of
    # lowest rank, which no order of arrival changes, cut from three collectors' with every
    # group's rank (the collectors wrote the others' rows as summaries)
    ZERO_VARIANCE,
], ids=["sample+errors+extremes", "zero-variance"])
def test_three_collectors_read_as_one(tmp_path, tail):
    """One collector and three (each keeping its own groups' sample and tail) give, through open_run,
    the same rows: the same kept coordinates for the same reasons, recorded and in_sample alike;
    the spans view holds the kept rows' spans and no other's."""
    one, one_spans, one_writers = _run(tmp_path / "one", 1, **tail)
    three, three_spans, three_writers = _run(tmp_path / "three", 3, **tail)
    assert (one_writers, three_writers) == (1, 3)  # three writers' files, cut by the reader
    assert len(one) == STEPS * GROUPS * N

    def shown(rows):  # trace ids differ between the two jobs; the rest must not
        return {coords: row[1:] for coords, row in rows.items()}

    assert shown(three) == shown(one)
    kept = {c: row for c, row in one.items() if row[1]}
    reasons = {reason for row in kept.values() for reason in row[1]}
    expected = {"sampled"} | ({"error", "best", "worst"} if "keep_errors" in tail else set())
    assert reasons == expected | ({"zero_variance"} if "keep_zero_variance_groups" in tail else set())
    assert sum("sampled" in row[1] for row in kept.values()) == STEPS * CAP
    for rows, spans in ((one, one_spans), (three, three_spans)):
        assert set(spans) == {row[0] for row in rows.values() if row[1]}
        assert all(row[2] == bool(row[1]) for row in rows.values())  # recorded: kept
    # each kept rollout has the same spans either way (a rollout, one generation and tool call a turn)
    assert {c: one_spans[row[0]] for c, row in kept.items()} == {c: three_spans[three[c][0]] for c in kept}
    assert all(one_spans[row[0]] == 1 + 2 * job.turns(*c[1:]) for c, row in kept.items())
