"""Shared fixtures: a clean rtrace and environment per test, and a JSONL-backed setup.

rtrace's own pytest plugin (``rtrace.testing``) resets rtrace around every test; the
integration fixtures (``tests/servers.py``) start real MLflow servers. Real backends
only: no mocks of trackio, MLflow or OTLP receivers.
"""

from __future__ import annotations

import os

import pytest

import rtrace

pytest_plugins = ["rtrace.testing", "tests.servers", "tests.backends"]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    """No RTRACE_* / OTEL_* / backend variables leak in from the machine or an earlier test,
    and each test runs in its own directory: what lands in the working directory (MLflow's
    default artifact root ./mlruns, the default rtrace_traces.jsonl) never lands in the
    checkout."""
    for key in list(os.environ):
        if key.startswith("RTRACE_") or key.startswith("OTEL_") or key in ("MLFLOW_TRACKING_URI", "TRACKIO_SPACE_ID"):
            monkeypatch.delenv(key, raising=False)
    monkeypatch.chdir(tmp_path)
    yield


@pytest.fixture(scope="session")
def tok():
    """The demo's offline tokenizer (a real PreTrainedTokenizerFast; imports transformers)."""
    from rtrace.demo import build_tokenizer

    return build_tokenizer()


@pytest.fixture
def jsonl_path(tmp_path):
    """Tracing on with the JSONL sink in a temporary file; yields the path."""
    path = tmp_path / "traces.jsonl"
    rtrace.configure(exporter="jsonl", jsonl_path=str(path), export_interval_s=0.05)
    return path


def read_back(path):
    """Flush and read every trajectory written to ``path``."""
    from rtrace.exporters.jsonl import read_jsonl

    assert rtrace.flush(60)  # bounded; a cold MLflow store on a busy machine takes a while
    return read_jsonl(path) if os.path.exists(path) else []


@pytest.fixture
def collector(tmp_path):
    """``collector(**settings)`` starts an rtrace collector in this process (JSONL at
    ``tmp_path / "traces.jsonl"`` unless told otherwise); every one is stopped after the test."""
    made = []

    def start(**settings):
        settings.setdefault("exporter", "jsonl")
        settings.setdefault("jsonl_path", str(tmp_path / "traces.jsonl"))
        settings.setdefault("settle_s", 0.5)
        c = rtrace.start_collector(**settings)
        made.append(c)
        return c

    yield start
    for c in made:
        c.stop()
