"""``rtrace serve``: a live view of whole runs in a browser (docs/serve.md).

One read-only web app over one or more runs (a run's Parquet dataset, or JSONL files),
refreshed while they are written: the rollouts of every step in one sortable, filterable,
searchable table with histograms whose bars filter it; the step table and curves across
steps (each reward component too); a step's GRPO groups side by side; prompts across
steps; failures and unhealthy rollouts with why in words; a rollout's tokens coloured by
any per-token array; two runs compared. Every page is also JSON.

The same app runs inside a collector (``rtrace collect --serve-port``,
``rtrace.start_collector(serve_port=...)``) over what the collector writes.

Modules: ``sources`` (the runs, their refresh, time-limited queries), ``app`` (the routes),
``pages`` (the server's own pages; the views are :mod:`rtrace.report.views`, shared with
``rtrace report --html``), ``security`` (loopback, the token, the headers), ``server``
(uvicorn). Needs the ``serve`` extra (starlette, uvicorn; pyarrow and duckdb).
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

__all__ = ["start_viewer", "viewer_for_collector", "DEFAULT_PORT"]

logger = logging.getLogger("rtrace")

#: ``rtrace serve``'s port unless ``--port`` says otherwise
DEFAULT_PORT = 8765


def _imports() -> None:
    try:
        import duckdb  # noqa: F401
        import pyarrow  # noqa: F401
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"rtrace serve needs {exc.name}: pip install 'rtrace[serve]'") from None


def start_viewer(sources: Any, host: str = "127.0.0.1", port: int = 0, token: str | None = None,
                 tls_cert: str | None = None, tls_key: str | None = None, time_limit_ms: float | None = None,
                 refresh: bool = True) -> Any:
    """Serve ``sources`` (:class:`rtrace.serve.sources.Sources`, or paths for
    :func:`~rtrace.serve.sources.sources_from_paths`) on a thread of its own; returns the
    running :class:`~rtrace.serve.server.ViewerServer` (``url``, ``port``, ``stop()``).

    Beyond loopback ``token`` is required (the collector's): a request without it is
    refused. Raises ValueError when ``host`` is not loopback and there is no token."""
    _imports()
    from ..pipeline.collector import is_loopback
    from .app import TIME_LIMIT_MS, create_app
    from .server import ViewerServer
    from .sources import Sources, sources_from_paths

    if not isinstance(sources, Sources):
        sources = sources_from_paths(list(sources))
    loopback = is_loopback(host)
    if not loopback and not token:
        raise ValueError(f"rtrace serve: serving beyond loopback ({host}) needs a token (RTRACE_COLLECTOR_TOKEN)")
    if refresh:
        sources.refresh()
        sources.start()
    app = create_app(sources, token=token, loopback=loopback, secure=tls_cert is not None,
                     time_limit_ms=time_limit_ms or TIME_LIMIT_MS)
    return ViewerServer(app, host, port, tls_cert, tls_key, sources=sources).start()


def viewer_for_collector(collector: Any, host: str, port: int) -> Any:
    """The viewer over what ``collector`` writes: its parquet sink's run (preferred) or its
    jsonl sink's file; bound like the collector (its token beyond loopback, its TLS)."""
    from .sources import RunSource, Sources

    sinks = [w.sink for w in collector.pipeline.fanout.workers]
    parquet = [s for s in sinks if getattr(s, "name", None) == "parquet"]
    jsonl = [s for s in sinks if getattr(s, "name", None) == "jsonl"]
    if parquet:
        source = RunSource(parquet[0].run, dataset=parquet[0].path)
        cache = None
    elif jsonl:
        import tempfile

        cache = tempfile.mkdtemp(prefix="rtrace-serve-")
        from ..dataset.layout import run_name

        source = RunSource(run_name(collector.settings.experiment), jsonl=[jsonl[0].path], cache_dir=cache)
    else:
        from ..config import ConfigError

        raise ConfigError("serve_port (rtrace collect --serve-port) shows what the collector writes: add the parquet "
                          "(or jsonl) exporter, e.g. exporter=trackio,parquet; accepted values: an exporter list "
                          "with parquet or jsonl")
    s = collector.settings
    token = str(collector.token) if collector.token else None
    return start_viewer(Sources([source], cache_dir=cache), host=host, port=port, token=token,
                        tls_cert=s.collector_tls_cert, tls_key=s.collector_tls_key)


def serve_paths(paths: Sequence[str], host: str, port: int, time_limit_ms: float, refresh_s: float,
                tls_cert: str | None, tls_key: str | None, out: Any) -> int:
    """The ``rtrace serve`` command: serve ``paths`` on this thread until SIGINT/SIGTERM."""
    import time

    from ..config import ConfigError, env_setting
    from ..pipeline.collector import is_loopback
    from .app import create_app
    from .server import ViewerServer
    from .sources import sources_from_paths

    try:
        _imports()
    except ImportError as exc:
        out.write(f"{exc}\n")
        return 2
    loopback = is_loopback(host)
    try:
        token = env_setting("collector_token")
    except ConfigError as exc:
        out.write(f"rtrace serve: {exc}\n")
        return 2
    if not loopback:
        if token is None:
            out.write(f"rtrace serve: --host {host} serves beyond this machine: set RTRACE_COLLECTOR_TOKEN (a shared "
                      "secret of 16 or more characters) and sign in with it; RTRACE_COLLECTOR_TOKEN=none serves "
                      "without one, to anyone who reaches the port\n")
            return 2
        if not token:
            logger.warning("rtrace serve: listening on %s with no token (RTRACE_COLLECTOR_TOKEN=none): anyone who "
                           "can reach the port reads every prompt and answer of the runs", host)
        if tls_cert is None:
            logger.warning("rtrace serve: listening on %s without TLS: the token, prompts and answers cross the "
                           "network in clear text (--tls-cert / --tls-key)", host)
    if (tls_cert is None) != (tls_key is None):
        out.write("rtrace serve: --tls-cert and --tls-key go together\n")
        return 2
    sources = sources_from_paths(paths, refresh_s=refresh_s)
    t0 = time.perf_counter()
    sources.refresh()
    for name, run in sources.runs.items():
        snap = run.snapshot
        state = snap.problem or f"{snap.trajectories:,} trajectories, {len(snap.partitions):,} steps"
        out.write(f"run {name}: {run.shown_path}: {state}\n")
    out.write(f"read in {time.perf_counter() - t0:.1f} s\n")
    sources.start()
    try:
        server = ViewerServer(create_app(sources, token=token or None, loopback=loopback, secure=tls_cert is not None,
                                         time_limit_ms=time_limit_ms), host, port, tls_cert, tls_key, sources=sources)
    except OSError as exc:
        sources.close()
        out.write(f"rtrace serve: cannot listen on {host}:{port}: {exc.strerror or exc}\n")
        return 2
    import signal
    import threading

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # a clean stop and exit code 0, as rtrace collect
        signal.signal(sig, lambda *_: stop.set())
    server.start()
    out.write(f"rtrace serve: {server.url}" + ("  (sign in with RTRACE_COLLECTOR_TOKEN)" if token else "") + "\n")
    out.flush()
    while not stop.wait(1.0):
        pass
    server.stop()
    out.write("rtrace serve: stopped\n")
    return 0
