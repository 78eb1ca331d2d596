"""A real vLLM on CPU for the gateway's tests (``make test-gateway``, its own venv: .venv-gateway).

The session fixture ``vllm`` writes the model folder (tests/gateway/model.py: the demo's
trained tool-calling Qwen2 and its tokenizer, made offline) and starts
``python -m vllm.entrypoints.openai.api_server`` on a free port of 127.0.0.1 with the
``hermes`` tool parser, float32, ``VLLM_CPU_KVCACHE_SPACE=1``; it waits for ``/v1/models``
(bounded) and stops the server's process group by pid at the end. ``job`` starts an rtrace
collector that serves the gateway in front of it and makes this process one of the job's
workers; ``read()`` flushes both and returns the JSONL trajectories.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import rtrace
from tests.servers import free_port, stop_server, wait_http

#: vLLM on this 2-core machine: ~60 s when idle, several minutes when the machine is busy
START_TIMEOUT_S = 600.0


@pytest.fixture(scope="session")
def vllm(tmp_path_factory):
    """The OpenAI base URL of a real vLLM serving the test model."""
    pytest.importorskip("vllm")
    from tests.gateway.model import MODEL_NAME, write_model

    work = tmp_path_factory.mktemp("vllm")
    model = write_model(work / "model")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RTRACE_", "OTEL_"))}
    env.update(VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--served-model-name",
           MODEL_NAME, "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "1024", "--dtype", "float32",
           "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--seed", "0"]
    log_path = work / "vllm.log"
    with open(log_path, "wb") as log:
        popen = subprocess.Popen(cmd, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        wait_http(f"{url}/models", START_TIMEOUT_S, popen)
    except RuntimeError as exc:
        stop_server(popen)
        raise RuntimeError(f"{exc}\n--- vLLM log tail ---\n{log_path.read_text(errors='replace')[-4000:]}") from None
    yield url
    stop_server(popen, timeout_s=30)


class Job:
    """A collector serving the gateway, with this process as a worker of the job."""

    def __init__(self, collector, path: Path) -> None:
        self.collector = collector
        self.path = path

    @property
    def gateway_url(self) -> str:
        return self.collector.gateway.url

    def read(self) -> list[dict]:
        assert rtrace.flush(60)
        assert self.collector.flush(60)
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines()]


@pytest.fixture
def job(vllm, tmp_path, monkeypatch):
    path = tmp_path / "traces.jsonl"
    collector = rtrace.start_collector(exporter="jsonl", jsonl_path=str(path), gateway_upstream=vllm, settle_s=1.0)
    for key, value in collector.env.items():
        monkeypatch.setenv(key, value)
    rtrace.configure(export_interval_s=0.05)
    yield Job(collector, path)
    rtrace.shutdown()
    collector.stop()
