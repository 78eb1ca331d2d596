"""Real backend servers for integration tests, started and stopped by the tests.

``start_mlflow_server(workdir)`` runs a real ``mlflow server`` (SQLite backend in
``workdir``, one worker, a free port on 127.0.0.1) in its own process group, waits for
its health endpoint with a bounded wait, and returns its base URL and ``Popen``.
``stop_server(popen)`` stops it by pid (SIGTERM to the group, then SIGKILL).

The session-scoped ``mlflow_server`` fixture shares one server across a test session
(it takes up to ~40 s to start on a busy machine). Use it from a test module with::

    from tests.servers import mlflow_server  # noqa: F401  (makes the fixture available)

The MLflow server also accepts OTLP/HTTP at ``<base_url>/v1/traces`` (header
``x-mlflow-experiment-id``), so the same fixture serves as a real OTLP receiver.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

__all__ = ["free_port", "start_mlflow_server", "start_rtrace_collect", "rtrace_serve", "stop_server", "wait_http",
           "mlflow_server"]

#: Longest wait for a server to answer its health check (MLflow takes ~40 s on a busy box).
START_TIMEOUT_S = 120.0


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout_s: float, popen: subprocess.Popen | None = None) -> None:
    """Poll ``url`` until it answers 200, the process exits, or ``timeout_s`` passes.

    Raises:
        RuntimeError: the process exited or the deadline passed.
    """
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        if popen is not None and popen.poll() is not None:
            raise RuntimeError(f"server exited with code {popen.returncode} before answering {url}")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError) as exc:  # not up yet
            last = exc
        time.sleep(0.3)
    raise RuntimeError(f"{url} did not answer within {timeout_s:.0f} s (last error: {last})")


def start_mlflow_server(workdir: str | os.PathLike, timeout_s: float = START_TIMEOUT_S
                        ) -> tuple[str, subprocess.Popen]:
    """Start ``mlflow server`` on a free port of 127.0.0.1, SQLite backend in ``workdir``.

    Returns:
        ``(base_url, popen)``, e.g. ``("http://127.0.0.1:43817", <Popen>)``, once
        ``<base_url>/health`` answers. Stop it with :func:`stop_server`.

    Raises:
        RuntimeError: the server did not come up within ``timeout_s`` (it is stopped
            and its log tail is in the message).
    """
    workdir = Path(workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    mlflow_exe = Path(sys.executable).with_name("mlflow")
    cmd = [str(mlflow_exe) if mlflow_exe.exists() else "mlflow", "server",
           "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
           "--backend-store-uri", f"sqlite:///{workdir / 'mlflow.db'}",
           "--default-artifact-root", (workdir / "artifacts").as_uri()]
    env = dict(os.environ)
    # the server must not trace itself into the test's collector, nor inherit a client URI
    for key in list(env):
        if key.startswith(("RTRACE_", "OTEL_")) or key == "MLFLOW_TRACKING_URI":
            env.pop(key)
    log = open(workdir / "server.log", "wb")
    popen = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, start_new_session=True)
    log.close()  # the child holds its own descriptor
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{base_url}/health", timeout_s, popen)
    except RuntimeError as exc:
        stop_server(popen)
        tail = (workdir / "server.log").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"{exc}\n--- server log tail ---\n{tail}") from None
    return base_url, popen


def start_rtrace_collect(env: dict[str, str], exporter: str, *args: str, timeout_s: float = 60.0, port: int = 0
                         ) -> tuple[subprocess.Popen, dict[str, str]]:
    """``rtrace collect --exporter EXPORTER --port PORT *args`` as a process with ``env``, and the worker
    environment it printed: its ``export KEY=VALUE`` lines, read until ``RTRACE_CAPTURE`` has come and
    nothing more for 0.5 s (the variables after it, ``RTRACE_EXPERIMENT``, ``RTRACE_PRE_SAMPLE_RATE``
    ..., are printed in the same burst), or for up to ``timeout_s``."""
    import select

    proc = subprocess.Popen([sys.executable, "-m", "rtrace", "collect", "--exporter", exporter, "--port", str(port),
                             *args], env=env, stdout=subprocess.PIPE, text=True)
    fd = proc.stdout.fileno()  # read raw, below the text wrapper (untouched: communicate() reads the rest)
    text = b""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        seen = b"export RTRACE_CAPTURE=" in text
        ready, _, _ = select.select([fd], [], [], 0.5 if seen else max(0.0, deadline - time.monotonic()))
        if not ready:
            if seen:
                break
            continue
        chunk = os.read(fd, 65536)
        if not chunk:  # the process ended
            break
        text += chunk
    worker_env: dict[str, str] = {}
    for line in text.decode(errors="replace").splitlines():
        if line.startswith("export "):
            key, _, value = line[len("export "):].strip().partition("=")
            worker_env[key] = value
    return proc, worker_env


@contextlib.contextmanager
def rtrace_serve(sources: list[str], env: dict[str, str], timeout_s: float):
    """``rtrace serve SOURCES`` on a free port, waited for (its "rtrace serve: http" line, within
    ``timeout_s``); yields ``{"url", "lines"}`` (its output so far, read on a thread); stopped
    (SIGTERM, then SIGKILL) at the end."""
    port = free_port()
    cmd = [sys.executable, "-m", "rtrace", "serve", *sources, "--port", str(port), "--refresh-s", "1"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if line.startswith("rtrace serve: http"):
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert ready.wait(timeout_s), "".join(lines)[-3000:]
        yield {"url": f"http://127.0.0.1:{port}", "lines": lines}
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def stop_server(popen: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """Stop a server started here: SIGTERM to its process group, SIGKILL if it lingers."""
    if popen.poll() is not None:
        return
    try:
        # start_new_session=True made the server its own group leader: pgid == pid
        os.killpg(popen.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        popen.wait(timeout_s)
    except subprocess.TimeoutExpired:
        pass
    # gunicorn/uvicorn workers may outlive the parent; kill whatever is left in the group
    try:
        os.killpg(popen.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        popen.wait(5)
    except subprocess.TimeoutExpired:
        pass


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """A real ``mlflow server`` for the whole session; yields its base URL."""
    workdir = tmp_path_factory.mktemp("mlflow-server")
    base_url, popen = start_mlflow_server(workdir)
    try:
        yield base_url
    finally:
        stop_server(popen)
