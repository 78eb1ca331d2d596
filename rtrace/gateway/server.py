"""Running the gateway: in its own process (``rtrace gateway``), in this process on a thread
(:func:`start_gateway`), or inside the job's collector (:func:`attach_to_collector`); each
time on the gateway's own HTTP server (rtrace/gateway/http.py) in an event loop of its own
(uvloop's when installed).

Where the spans go follows from where it runs:

* ``rtrace gateway`` / :func:`start_gateway`: rtrace's configured runtime, so the sinks of
  ``RTRACE_EXPORTER`` (``collector``: the job's collector, which stitches each call into the
  trainer's trajectory);
* in the collector: a runtime of its own whose spans go, as a worker's would, through a
  :class:`~rtrace.pipeline.stream.StreamPipeline` into the collector's pipeline, in this
  process (no network hop): calls land in the job's trajectory table, with the job's
  sampling, annotations, health checks, token2text and sinks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import threading
import time
from typing import Any, Sequence

from .. import _stats
from ..config import ConfigError, Secret, load_settings
from ..exporters.base import Sink
from ..trajectory import Trajectory
from .app import Gateway
from .http import Server, new_loop

__all__ = ["GatewayServer", "start_gateway", "attach_to_collector", "serve_forever"]


async def _serve(gateway: Gateway, host: str, port: int, stop: asyncio.Event, on_listen: Any,
                 timeout_s: Any) -> None:
    """Serve ``gateway`` on this loop until ``stop`` is set; then the requests being answered
    get ``timeout_s()`` seconds, and the gateway shuts down (its sessions written partial)."""
    server = Server(gateway.handle, gateway.settings.gateway_max_request_bytes)
    bound = await server.listen(host, port)
    gateway.startup()
    try:
        on_listen(bound)
        await stop.wait()
    finally:
        await server.stop(timeout_s())
        await gateway.shutdown()


class GatewayServer:
    """A gateway serving on a thread of this process (see :func:`start_gateway`).

    Attributes:
        gateway: the :class:`~rtrace.gateway.app.Gateway` (its sessions, secret, app).
        url: ``http://host:port``, the gateway's base; OpenAI clients use ``url + "/v1"``.
    """

    def __init__(self, gateway: Gateway, host: str, port: int, on_stop: Sequence[Any] = ()) -> None:
        self.gateway = gateway
        self.host = host
        self._on_stop = list(on_stop)
        self._loop: Any = None
        self._stop: asyncio.Event | None = None
        self._stop_timeout = 10.0
        self._bound: Any = None
        self._failed: BaseException | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(host, port), name="rtrace-gateway", daemon=True)
        self._thread.start()
        if not self._ready.wait(30.0) or self._bound is None:
            raise RuntimeError(f"rtrace gateway: could not listen on {host}:{port}"
                               + (f": {self._failed}" if self._failed else ""))
        self.port = self._bound[1]
        self.url = f"http://{_url_host(host)}:{self.port}"
        gateway.url = self.url
        _stats.incr("gateway_started")

    def _run(self, host: str, port: int) -> None:
        loop = new_loop()
        asyncio.set_event_loop(loop)
        self._loop = loop

        def listening(bound: Any) -> None:
            self._bound = bound
            self._ready.set()

        async def main() -> None:
            self._stop = asyncio.Event()
            await _serve(self.gateway, host, port, self._stop, listening, lambda: self._stop_timeout)

        try:
            loop.run_until_complete(main())
        except BaseException as exc:
            self._failed = exc
        finally:
            self._ready.set()
            loop.close()

    @property
    def env(self) -> dict[str, str]:
        """What a trainer needs to mint rollout keys (``rtrace.gateway_access()``):
        ``RTRACE_GATEWAY_URL`` and ``RTRACE_GATEWAY_SECRET``."""
        return {"RTRACE_GATEWAY_URL": self.url, "RTRACE_GATEWAY_SECRET": Secret(self.gateway.secret)}

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Hand on what the gateway recorded: its own pipeline's spans (in a collector: to the
        collector's pipeline); True when nothing is left behind. Without a pipeline of its own
        (the configured runtime's), ``rtrace.flush()`` does it."""
        pipeline = getattr(self, "pipeline", None)
        return True if pipeline is None else pipeline.force_flush(int(max(0.0, timeout_s) * 1000))

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop serving (open streams get ``timeout_s`` to finish), then the hooks given."""
        from . import access

        if access.local is self:
            access.local = None
        self._stop_timeout = timeout_s
        if self._thread.is_alive() and self._stop is not None:
            try:
                self._loop.call_soon_threadsafe(self._stop.set)
            except RuntimeError:  # the loop has closed meanwhile
                pass
            self._thread.join(timeout_s + 5.0)
        for hook in self._on_stop:
            try:
                hook()
            except Exception:
                _stats.incr("internal_errors")

    def __enter__(self) -> "GatewayServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", "::", ""):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


def _token(settings: Any, host: str) -> str | None:
    """The collector's token rule: the configured token; beyond loopback, a fresh one when unset."""
    import secrets

    from ..pipeline.collector import is_loopback

    if settings.collector_token is not None:
        return settings.collector_token or None  # "none": no token
    return None if is_loopback(host) else Secret(secrets.token_urlsafe(32))


def start_gateway(upstream: str | None = None, *, host: str = "127.0.0.1", port: int = 0, runtime: Any = None,
                  finished: Any = None, **settings: Any) -> GatewayServer:
    """Serve the capture gateway on a thread of this process.

    Calls are recorded with rtrace's configured runtime (``rtrace.configure``), so they go to
    its sinks; a call whose rollout is open in this very process joins that trajectory.
    ``rtrace.gateway_access()`` in this process uses this gateway.

    Args:
        upstream: the OpenAI-compatible server (default ``RTRACE_GATEWAY_UPSTREAM``).
        host: the address to bind (loopback unless told otherwise; beyond it the session API
            and ``traceparent``-only calls need the job's token, generated when unset).
        port: the port (0: a free one; read ``server.url``).
        **settings: ``gateway_*`` settings (docs/configuration.md), read from the environment
            the same way.

    Returns:
        The running :class:`GatewayServer` (``url``, ``env``, ``stop()``; a context manager).
    """
    from . import access

    if upstream is not None:
        settings["gateway_upstream"] = upstream
    s = load_settings(settings)
    gateway = Gateway(s, runtime=runtime, token=_token(s, host), finished=finished)
    server = GatewayServer(gateway, host, port)
    access.local = server
    return server


# ----------------------------------------------------------------------------- in the collector
class LocalCollectorSink(Sink):
    """The gateway's spans into the collector of this process: what a worker's collector sink
    sends over gRPC, handed to the collector's receiver callback directly (same encoding, same
    push-back: a full collector makes this sink wait, within ``OTEL_EXPORTER_OTLP_TIMEOUT``)."""

    name = "gateway"
    sample_when_behind = False  # segments, not trajectories (as the collector sink)

    def __init__(self, settings: Any, on_request: Any) -> None:
        super().__init__(settings)
        self._on_request = on_request
        self._resource = {"service.name": "rtrace-gateway", "process.pid": os.getpid()}
        if settings.job_id:
            self._resource["rtrace.job_id"] = settings.job_id

    def export(self, trajectories: Sequence[Trajectory]) -> None:
        from ..exporters.otel import encode_compact
        from ..pipeline.otlp_receiver import Backpressure

        request = encode_compact(trajectories, self._resource, self.settings.max_value_chars)
        deadline = time.monotonic() + self.settings.otlp_timeout_s
        while True:
            try:
                self._on_request(request)
                return
            except Backpressure as exc:
                wait = min(max(exc.retry_after_s, 0.05), 1.0)
                if time.monotonic() + wait > deadline:
                    raise ConnectionError(f"the collector did not take the gateway's spans: {exc.message}") from None
                time.sleep(wait)


def collector_runtime(collector: Any) -> tuple[Any, Any]:
    """A runtime whose spans stream into ``collector``'s pipeline in this process, and its
    pipeline (``(runtime, pipeline)``; stop the pipeline with ``pipeline.shutdown()``)."""
    from ..instrumentation._state import Runtime
    from ..instrumentation.spans import SpanTracer
    from ..pipeline.fanout import Fanout
    from ..pipeline.sampling import PreSampler
    from ..pipeline.stream import StreamPipeline

    # spans hand over every 50 ms: a call's span must reach the collector before the trainer's
    # root has waited its settle time (the worker's 0.5 s is for processes across a network)
    s = dataclasses.replace(collector.settings, job_id=collector.job_id, exporter=(), sinks=(),
                            export_interval_s=min(collector.settings.export_interval_s, 0.05))
    sink = LocalCollectorSink(s, collector.pipeline.on_request)
    pipeline = StreamPipeline(s, Fanout([sink], s.max_export_batch_size, s.sink_queue_size, s.sink_timeout_s))
    tracer = SpanTracer(pipeline.offer)
    runtime = Runtime(tracer, pipeline.registry, PreSampler(1.0, s.sample_seed, s.sample_groups), pipeline,
                      s.capture, s.experiment)
    return runtime, pipeline


def attach_to_collector(collector: Any, host: str = "127.0.0.1", port: int = 0) -> GatewayServer:
    """Serve the gateway beside ``collector`` (its settings' ``gateway_upstream``): calls
    land in the collector's trajectory table; a rollout key of a trajectory the collector
    has written is refused. ``collector.gateway`` is set, ``collector.env`` then carries
    ``RTRACE_GATEWAY_URL`` / ``RTRACE_GATEWAY_SECRET``, and ``collector.stop()`` stops it first."""
    from . import access

    runtime, pipeline = collector_runtime(collector)
    s = collector.settings
    registry = collector.pipeline.registry
    gateway = Gateway(s, runtime=lambda: runtime, token=collector.token, finished=registry.was_finished)
    try:
        server = GatewayServer(gateway, host, port,
                               on_stop=[lambda: pipeline.shutdown(s.sink_timeout_s)])
    except BaseException:
        pipeline.shutdown(1.0)
        raise
    server.pipeline = pipeline  # type: ignore[attr-defined]
    collector.gateway = server
    access.local = server
    return server


def serve_forever(gateway: Gateway, host: str, port: int) -> None:
    """Serve ``gateway`` in this thread until SIGINT / SIGTERM (``rtrace gateway``), then return
    (open streams get 10 s to finish; the caller then writes what rtrace holds)."""
    import signal
    import sys

    loop = new_loop()
    asyncio.set_event_loop(loop)

    async def main() -> None:
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await _serve(gateway, host, port, stop, lambda bound: None, lambda: 10.0)

    try:
        loop.run_until_complete(main())
    except OSError as exc:
        sys.stderr.write(f"rtrace gateway: cannot listen on {host}:{port}: {exc.strerror or exc}\n")
        raise SystemExit(1) from None
    finally:
        loop.close()


def check_upstream(url: str | None) -> str:
    if not url:
        raise ConfigError("rtrace gateway needs an upstream: --upstream URL or RTRACE_GATEWAY_UPSTREAM (an "
                          "http(s):// URL of an OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1)")
    return url
