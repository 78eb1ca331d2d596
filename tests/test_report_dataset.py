"""`rtrace report DATASET`: the same table, health check and page as from the JSONL of the same run,
computed by DuckDB over the files."""

from __future__ import annotations

import io
import os

import pytest

pytest.importorskip("pyarrow")
pytest.importorskip("duckdb")

from rtrace.report import run as report  # noqa: E402
from tests.dataset_run import make_run, records_as_read_back  # noqa: E402


@pytest.fixture
def both(tmp_path):
    # RTRACE_SUMMARIES=0: the dataset then holds what the JSONL file holds, the recorded
    # trajectories (with summaries on it also holds every sampled-out rollout's row, which a
    # JSONL file never has: tests/test_summaries.py)
    path, trajs, jsonl = make_run(tmp_path, max_traces_per_step=10, keep_extremes=2, summaries=False)
    return path, jsonl


def _report(*args, **kw):
    out = io.StringIO()
    code = report(list(args), out, **kw)
    return code, out.getvalue()


def test_the_table_is_the_jsonl_table(both):
    """The per-step table of the dataset equals the JSONL file's, line for line (a capped run with tail
    keeping: only the sample counts, as the step metrics count)."""
    path, jsonl = both
    code_j, text_j = _report(jsonl)
    code_d, text_d = _report(path)
    assert code_j == code_d == 0
    head_j, table_j = text_j.split("\n", 1)
    head_d, table_d = text_d.split("\n", 1)
    assert head_j.split()[0] == head_d.split()[0]  # the same number of trajectories
    assert table_d == table_j
    assert "training" in table_d and "validation" in table_d


def test_the_health_check_is_the_jsonl_check(both):
    """--check on the dataset prints what it prints on the JSONL file, example traces included."""
    path, jsonl = both
    code_j, text_j = _report(jsonl, health_check=True, max_rates=["0"])
    code_d, text_d = _report(path, health_check=True, max_rates=["0"])
    assert (code_d, text_d) == (code_j, text_j)
    assert code_j == 1 and "FAIL" in text_j  # the run has truncated rollouts: a finding to report


def test_the_page_shows_the_same_trajectories(both, tmp_path):
    """--html on the dataset writes the page of the same trajectories (read back step by step)."""
    from rtrace.report.data import page_data
    from rtrace.report.dataset import load_records, open_dataset
    from rtrace.report.load import read_records

    path, jsonl = both
    code, text = _report(path, html_path=str(tmp_path / "page.html"))
    assert code == 0 and os.path.getsize(tmp_path / "page.html") > 0
    from_jsonl = records_as_read_back(read_records([jsonl])[0])  # the dataset's times (as_read_back)
    from_dataset = load_records(open_dataset(path))
    def same_order(records):  # the typed maps keep keys, not their order (docs/dataset.md)
        for r in records:
            for name in ("extra", "outcome", "annotations"):
                setattr(r.traj, name, dict(sorted(getattr(r.traj, name).items())))
        return sorted(records, key=lambda r: r.traj.trace_id)

    assert page_data(same_order(from_jsonl), 4000, 40) == page_data(same_order(from_dataset), 4000, 40)


def test_one_dataset_at_a_time(both, tmp_path):
    path, jsonl = both
    code, text = _report(path, jsonl)
    assert code == 2 and "give one dataset" in text
