"""What the command line says when it is given something wrong: the flag the user typed,
not the environment variable behind it; an empty input is said, not a silent success."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def _rtrace(*args, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "rtrace", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})


ACCEPTED = "accepted values: comma list of none, console, jsonl, trackio, mlflow, otlp, collector, parquet"


@pytest.mark.parametrize("command", ["demo", "collect"])
def test_a_bad_exporter_flag_is_named_as_the_flag(command, tmp_path):
    """--exporter bogus: the message names --exporter (no traceback), exit 2, before anything runs."""
    proc = _rtrace(command, "--exporter", "bogus", env={"RTRACE_EXPORTER": ""}, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith(f"rtrace {command}: --exporter bogus: unknown exporter "
                                                           f"'bogus'; {ACCEPTED}")
    assert "Traceback" not in proc.stderr and "RTRACE_EXPORTER" not in proc.stderr


def test_a_bad_exporter_variable_is_named_as_the_variable(tmp_path):
    proc = _rtrace("demo", env={"RTRACE_EXPORTER": "bogus"}, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().endswith(f"rtrace demo: RTRACE_EXPORTER=bogus: unknown exporter 'bogus'; {ACCEPTED}")


def test_report_on_an_empty_file_says_so(tmp_path):
    """An empty JSONL file: exit 1 and a sentence that says there is nothing, and why that may be."""
    empty = tmp_path / "t.jsonl"
    empty.write_text("")
    proc = _rtrace("report", empty)
    assert proc.returncode == 1
    assert proc.stdout.startswith(f"rtrace report: no trajectory in {empty}")
