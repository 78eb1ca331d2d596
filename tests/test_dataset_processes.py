"""Many writers, one dataset, with real processes: two `rtrace collect --exporter parquet` processes
(the shards behind an OpenTelemetry Collector's load-balancing exporter) and their worker
processes write one run's dataset with no coordination; and a run on a real S3-compatible
server (moto_server) written and read through s3:// URLs, then its bucket revoked."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter

import pytest

pytest.importorskip("pyarrow")
pytest.importorskip("duckdb")

import rtrace  # noqa: E402
from rtrace.dataset import layout  # noqa: E402
from tests import collector_workers as workers  # noqa: E402
from tests.servers import start_rtrace_collect  # noqa: E402

SPAWN = mp.get_context("spawn")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _collect(env):
    """`rtrace collect --exporter parquet` as a process, and the worker environment it printed."""
    proc, worker_env = start_rtrace_collect(env, "parquet")
    assert "RTRACE_COLLECTOR_ENDPOINT" in worker_env, "rtrace collect printed no endpoint"
    return proc, worker_env


@pytest.mark.integration
def test_two_collector_processes_write_one_dataset(tmp_path):
    """Two collectors, each fed by its own worker process (disjoint prompts, as trace-id routing splits
    them), write into one run: every rollout once, two writer ids, no file name twice, and after
    SIGTERM each partition is one file per collector."""
    env = dict(os.environ, RTRACE_PARQUET_PATH=str(tmp_path / "ds"), RTRACE_EXPERIMENT="shared",
               HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    procs = [_collect(env) for _ in range(2)]
    try:
        runners = []
        for i, (_, worker_env) in enumerate(procs):
            p = SPAWN.Process(target=workers.rollouts, args=(worker_env, i, 2, 3, 8, 4))
            p.start()
            runners.append(p)
        for p in runners:
            p.join(120)
            assert p.exitcode == 0
    finally:
        for proc, _ in procs:
            proc.send_signal(signal.SIGTERM)
        for proc, _ in procs:
            proc.wait(60)
    assert [proc.returncode for proc, _ in procs] == [0, 0]
    run_path = tmp_path / "ds" / "shared"
    names = [os.path.relpath(os.path.join(d, f), run_path) for d, _, fs in os.walk(run_path) for f in fs]
    writers = Counter(layout.parse_name(os.path.basename(n)).writer for n in names)
    assert len(writers) == 2 and len(names) == len(set(names))
    per_partition = Counter((os.path.dirname(n), layout.parse_name(os.path.basename(n)).writer) for n in names)
    assert set(per_partition.values()) == {1}
    run = rtrace.open_run(run_path)
    rows = run.sql("SELECT step, sample_index, rollout_n FROM trajectories").fetchall()
    assert sorted(rows) == sorted((s, p, r) for s in range(3) for p in range(8) for r in range(4))
    assert run.sql("SELECT count(*) FROM spans").fetchall()[0][0] == 3 * len(rows)  # root, loop, tool each
    assert run.skipped == []


# ----------------------------------------------------------------------------- object storage
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def s3_server(tmp_path):
    """A real S3-compatible server process on 127.0.0.1 (moto_server), stopped by pid."""
    pytest.importorskip("moto.server", reason="moto[server] is not installed (the dev extra)")
    port = _free_port()
    log = open(tmp_path / "moto.log", "wb")
    # this Python's moto (a `moto_server` on PATH may be another interpreter's, of another version)
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], stdout=log,
                            stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 1).close()
            break
        except OSError:
            time.sleep(0.2)
    else:
        proc.kill()
        pytest.fail("moto_server did not start in 60 s")
    yield port
    proc.terminate()
    proc.wait(30)
    log.close()


@pytest.mark.integration
def test_a_run_on_s3(s3_server, monkeypatch):
    """RTRACE_PARQUET_PATH=s3://bucket/prefix?endpoint_override=...: the sink uploads whole files, the
    reader lists and reads them through pyarrow's S3 filesystem; revoking the bucket loses only what
    is written after, counted."""
    import pyarrow.fs as pafs

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    query = f"?endpoint_override=127.0.0.1:{s3_server}&scheme=http&region=us-east-1"
    fs = pafs.S3FileSystem(endpoint_override=f"127.0.0.1:{s3_server}", scheme="http", region="us-east-1",
                           access_key="testing", secret_key="testing", allow_bucket_creation=True,
                           allow_bucket_deletion=True)
    fs.create_dir("runs")  # the bucket
    rtrace.configure(exporter="parquet", parquet_path=f"s3://runs/rl{query}", experiment="exp-1",
                     export_interval_s=0.02)

    def step(n):
        for i in range(6):
            with rtrace.rollout_context(step=n, sample_index=i // 2, rollout_n=i % 2):
                rtrace.record_reward(float(i % 2))
        return rtrace.flush(60)

    assert step(0) and step(1)
    run = rtrace.open_run(f"s3://runs/rl/exp-1{query}")
    assert run.sql("SELECT step, count(*), avg(reward) FROM trajectories GROUP BY step ORDER BY step").fetchall() == [
        (0, 6, 0.5), (1, 6, 0.5)]
    assert run.steps() == [(False, 0), (False, 1)]
    assert run.cursor().sql("SELECT count(*) FROM spans").fetchall() == [(12,)]  # a thread's cursor reads it too
    # revoke the bucket: every object and the bucket itself gone
    fs.delete_dir_contents("runs")
    fs.delete_dir("runs")
    assert step(2) is False
    stats = rtrace.stats()
    assert stats["sink.parquet.failed_trajectories"] == 6 and stats["sink.parquet.write_errors"] >= 1
    assert stats["sink.parquet.exported"] == 12
    rtrace.shutdown()
