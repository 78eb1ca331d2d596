"""configure / flush / shutdown / stats: wiring settings, sinks, pipeline and hot path.

This is the composition root, the one module that knows every layer: it builds the
sinks (exporters), the pipeline and the :class:`~rtrace.instrumentation._state.Runtime`
the decorators read. Nothing below it imports it.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
from typing import Any

from opentelemetry import trace as otel_trace

from . import _stats
from .config import ConfigError, Settings, load_settings
from .instrumentation import _state

__all__ = ["configure", "flush", "shutdown", "stats", "is_enabled", "current_settings", "set_tokenizer",
           "get_tokenizer", "offer_tokenizer", "start_collector"]

_lock = threading.RLock()
_pipeline: Any = None
_settings: Settings | None = None
#: the keyword arguments of the last configure(): a forked child configures with them again
_last_kwargs: dict[str, Any] = {}
#: set in a forked child: its first traced call configures with these (else: the environment)
_fork_kwargs: dict[str, Any] | None = None
_atexit_registered = False
#: the process that registered shutdown() with multiprocessing's exit finalizers
_mp_finalizer_pid: int | None = None
#: provider -> the one ProcessorBridge rtrace added to it (a provider cannot drop one)
_bridges: dict[int, Any] = {}
#: the key of the bridge rtrace's own SpanTracer ends its spans into (no provider)
_OWN = 0
#: the tokenizer token2text decodes with (configure(tokenizer=...) or set_tokenizer())
_tokenizer: Any = None
#: the trainer's tokenizer a trainer adapter (rtrace.compat) handed in (offer_tokenizer):
#: with token2text unset, rtrace decodes once there is one
_offered: Any = None
_sigterm_installed = False


def configure(**kwargs: Any) -> Settings:
    """Turn tracing on (or off) and choose the sinks. Keyword arguments override env vars.

    Every setting is listed in docs/configuration.md (and ``rtrace.config.PARAMS``); the
    common ones::

        rtrace.configure(exporter="trackio", project="gsm8k-grpo", experiment="run-7",
                         token2text=True, tokenizer=tok, max_traces_per_step=32)

    Calling it again replaces the previous configuration (flushing it first). With no
    exporter (``RTRACE_EXPORTER`` unset or ``none``) tracing is off and decorated calls
    cost one check. ``sinks=[...]`` adds custom :class:`rtrace.Sink` instances. If the
    new configuration cannot be built (a bad value, a missing extra), the previous one
    keeps running.

    Returns:
        The validated settings.

    Raises:
        ConfigError: a bad value, naming the variable and the accepted values, or a sink
            whose optional dependency is missing.
    """
    global _last_kwargs, _tokenizer
    settings = load_settings(kwargs)  # warns about RTRACE_* variables that are not settings
    with _lock:
        if not settings.enabled:
            _shutdown_locked()
            _install(None, settings)
            _last_kwargs = dict(kwargs)
            return settings
        built, tokenizer = _build(settings)  # raises before anything running is touched
        _shutdown_locked()
        if tokenizer is not None:
            _tokenizer = tokenizer
        _install(built, settings)
        _last_kwargs = dict(kwargs)
        return settings


def _build(settings: Settings) -> tuple[tuple[Any, Any], Any]:
    """The new pipeline and tracer, and the checked tokenizer (or None). Changes nothing
    that is running: on any error the previous configuration stays in force."""
    from .exporters import create_sink
    from .pipeline.fanout import Fanout
    from .pipeline.token2text import Token2Text, check_tokenizer

    sinks = [create_sink(name, settings) for name in settings.exporter] + list(settings.sinks)
    tokenizer = None
    if settings.tokenizer is not None:
        try:
            tokenizer = check_tokenizer(settings.tokenizer)
        except TypeError as exc:
            raise ConfigError(f"configure(tokenizer=...) (env RTRACE_TOKENIZER): {exc}; accepted values: "
                              "an object with batch_decode/decode, or a tokenizer name / local path") from None
    # Collector mode: the worker waits for room in a sink's queue (as the collector does)
    # rather than drop a trainer's burst of annotations: the collector sink's export only
    # routes and encodes (its own threads send, one per endpoint), so the wait is the
    # encoding's, never a collector's. The traced program's thread never waits either way.
    fanout = Fanout(sinks, settings.max_export_batch_size, settings.sink_queue_size, settings.sink_timeout_s,
                    hold_back="collector" in settings.exporter)
    try:
        if "collector" in settings.exporter:
            # Collector mode: spans stream to the job's collector, which decodes and writes.
            from .pipeline.stream import StreamPipeline

            stream = StreamPipeline(settings, fanout)
            stream.tokenizer_name = _offered_name  # the collector may load it (docs/token2text.md)
            return (stream, _tracer(settings)), tokenizer
        # token2text: on (True), off (False), or unset (None): on once a trainer adapter
        # handed in its tokenizer (offer_tokenizer), silently nothing until then
        post = [Token2Text(get_tokenizer if settings.token2text else _auto_tokenizer,
                           settings.token2text_skip_special_tokens, settings.token2text_keep_ids,
                           required=bool(settings.token2text))] if settings.token2text is not False else []
        from .pipeline.worker import Pipeline

        return (Pipeline(settings, fanout, post, health_tokenizer=get_tokenizer), _tracer(settings)), tokenizer
    except BaseException:
        fanout.stop(0.0)  # no sink thread of a configuration that never ran is left behind
        raise


def _tracer(settings: Settings) -> Any:
    """rtrace's tracer, on the application's SDK provider if it set one globally (rtrace
    adds to it, never replaces it, and the application's processors see rtrace's spans);
    else rtrace's own :class:`~rtrace.instrumentation.spans.SpanTracer`, whose light spans
    go straight to rtrace's pipeline (docs/architecture.md, "Where spans become OTel spans")."""
    from opentelemetry.sdk.trace import TracerProvider

    from ._ids import UrandomIdGenerator

    provider = otel_trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        from .instrumentation.spans import SpanTracer
        from .pipeline.worker import ProcessorBridge

        bridge = _bridges.get(_OWN)
        if bridge is None:
            bridge = _bridges[_OWN] = ProcessorBridge()
        return SpanTracer(bridge.on_end)
    tracer = provider.get_tracer("rtrace")
    # On an application's provider, rtrace's own tracer still draws its ids from its
    # private generator (rtrace._ids, seeded from os.urandom): the SDK's default draws from
    # the seeded global `random` (the program's state would move, seeded workers would
    # repeat trace ids). Each
    # get_tracer() returns a new SDK Tracer; the application's tracers keep its generator.
    if not isinstance(getattr(tracer, "id_generator", None), UrandomIdGenerator) and hasattr(tracer, "id_generator"):
        tracer.id_generator = UrandomIdGenerator()
    return tracer


def _install(built: tuple[Any, Any] | None, settings: Settings) -> None:
    global _pipeline, _settings, _atexit_registered
    from .pipeline.sampling import PreSampler, StepSampler

    _settings = settings
    if built is None:
        _pipeline = None
        _state.set_runtime(None)
        return
    pipeline, tracer = built
    from .instrumentation.spans import SpanTracer

    if isinstance(tracer, SpanTracer):  # rtrace's own spans: the bridge is the tracer's on_end
        bridge = _bridges[_OWN]
    else:
        provider = _provider_of(tracer)
        bridge = _bridges.get(id(provider))
        if bridge is None:
            from .pipeline.worker import ProcessorBridge

            bridge = _bridges[id(provider)] = ProcessorBridge()
            provider.add_span_processor(bridge)
    bridge.target = pipeline
    _pipeline = pipeline
    if "collector" in settings.exporter:
        # the per-step cap is job-wide, in the collector; here only the optional pre-sample
        sampler: Any = PreSampler(settings.pre_sample_rate, settings.sample_seed, settings.sample_groups)
    elif settings.selects_at_end:
        # tail keeping / prompt sampling: record every trajectory, choose at its end
        from .pipeline.sampling import selector_for

        sampler = PreSampler(1.0, settings.sample_seed, settings.sample_groups)
        pipeline.selector = selector_for(settings, linger_s=settings.step_linger_s, on_drop=pipeline.dropped)
    else:
        sampler = StepSampler(settings.max_traces_per_step, settings.val_cap, settings.sample_groups)
    _state.set_runtime(_state.Runtime(tracer, pipeline.registry, sampler, pipeline, settings.capture,
                                      settings.experiment, summaries=settings.summaries))
    if not _atexit_registered:
        atexit.register(shutdown)
        _atexit_registered = True
    _register_multiprocessing_exit()
    if settings.flush_on_sigterm:
        _install_sigterm()


def _register_multiprocessing_exit() -> None:
    """A multiprocessing child started by fork (Pool and DataLoader workers too) leaves
    through ``os._exit``: ``atexit`` never runs there, multiprocessing's own exit
    finalizers do. Register shutdown() with them once per process, so such a child
    writes what it traced (bounded by sink_timeout_s). A no-op unless the program
    imported multiprocessing; a second shutdown() in the parent is a no-op."""
    global _mp_finalizer_pid
    util = sys.modules.get("multiprocessing.util")
    if util is None or _mp_finalizer_pid == os.getpid():
        return
    try:
        util.Finalize(None, shutdown, exitpriority=0)
    except Exception:
        _stats.warn_once("mp-finalizer", "rtrace could not register its exit hook with multiprocessing",
                         exc_info=True)
        return
    _mp_finalizer_pid = os.getpid()


def _provider_of(tracer: Any) -> Any:
    """The application's global SDK provider (rtrace's SDK tracer is on it)."""
    return otel_trace.get_tracer_provider()


# ----------------------------------------------------------------------------- environment-only start
_config_error: ConfigError | None = None


def _autoconfigure() -> None:
    """The first traced call with nobody having called configure(): configure from the
    environment. A bad value raises its ConfigError once, here; tracing then stays off
    and every later call is one check."""
    global _config_error, _fork_kwargs
    with _lock:
        if _state.runtime is not _state.UNSET:
            return
        kwargs, _fork_kwargs = _fork_kwargs or {}, None
        try:
            configure(**kwargs)
        except ConfigError as exc:
            _config_error = exc
            _state.set_runtime(None)
            raise


_state.autoconfigure = _autoconfigure


# ----------------------------------------------------------------------------- lifecycle
def flush(timeout_s: float = 30.0) -> bool:
    """Export every trajectory that has finished, and wait until every sink wrote it.

    Returns:
        True when everything was written (durably, as each sink defines it) within
        ``timeout_s``; False when a sink failed a batch since the last flush, the
        timeout passed, or tracing is off.
    """
    pipeline = _pipeline
    if pipeline is None:
        return False
    try:
        millis = int(min(max(float(timeout_s), 0.0), 7 * 24 * 3600.0) * 1000)
    except (TypeError, ValueError, OverflowError):
        millis = 30_000
    return pipeline.force_flush(millis)


def _shutdown_locked() -> None:
    global _pipeline
    pipeline, _pipeline = _pipeline, None
    if pipeline is not None:
        _state.set_runtime(None)
        for bridge in _bridges.values():
            if bridge.target is pipeline:
                bridge.target = None
        pipeline.shutdown()


def shutdown() -> None:
    """Flush, write still-open trajectories as partial, close the sinks; tracing is off
    afterwards until the next ``configure()``. Registered with ``atexit``; bounded by
    ``sink_timeout_s`` even if a sink hangs."""
    with _lock:
        _shutdown_locked()
        if _state.runtime is _state.UNSET:
            _state.set_runtime(None)


def stats() -> dict[str, int]:
    """Counters of what rtrace kept, sampled out, dropped and failed, by name.

    ``trajectories_started`` / ``trajectories_sampled_out`` / ``trajectories_completed`` /
    ``trajectories_partial``, ``spans_dropped_queue``, ``spans_dropped_trajectory_limit``,
    ``trajectories_dropped_open_limit``, ``sink.<name>.exported`` /
    ``.failed_batches`` / ``.dropped_batches`` / ``.abandoned_trajectories``,
    ``values_truncated``, ``values_redacted``, ``internal_errors`` ... plus the gauges
    ``open_trajectories``, ``waiting_trajectories`` and ``queued_spans``. The full list is in
    docs/stats.md.
    """
    out = _stats.snapshot()
    pipeline = _pipeline
    gauges = pipeline.gauges() if pipeline is not None else {"open_trajectories": 0, "waiting_trajectories": 0,
                                                             "queued_spans": 0}
    out.update(gauges)
    return out


def is_enabled() -> bool:
    """True when tracing is configured on."""
    try:
        return _state.get_runtime() is not None
    except ConfigError:
        return False


def current_settings() -> Settings | None:
    """The settings in force (None before any configure, or after a failed one that had
    nothing running)."""
    return _settings


# ----------------------------------------------------------------------------- collector
def start_collector(*, host: str = "127.0.0.1", port: int = 0, http_port: int | None = None,
                    settle_s: float = 2.0, gateway_port: int = 0, serve_port: int | None = None,
                    serve_host: str | None = None, **settings: Any) -> Any:
    """Start an rtrace collector in this process (its own threads, no subprocess).

    ``settings`` are those of :func:`configure` (``exporter="trackio,mlflow"``,
    ``project``, ``experiment``, ``max_traces_per_step``, ``token2text``, ``tokenizer``
    ...), read from the environment the same way; in collector mode
    ``max_traces_per_step`` is exact across the whole job. Workers started with
    ``collector.env`` (``RTRACE_EXPORTER=collector`` ...) stream their spans here;
    ``rtrace.annotate`` / ``annotate_batch`` in this process reach it directly. See
    docs/collector.md and docs/multi-process.md.

    Args:
        host: the address to bind (127.0.0.1 unless told otherwise).
        port: the OTLP/gRPC port (0: a free one; read ``collector.endpoint``).
        http_port: also serve OTLP/HTTP ``/v1/traces`` there (0: a free port).
        settle_s: how long a finished trajectory waits for spans of other processes
            still in flight.
        serve_port: also serve the live viewer (``rtrace serve``, docs/serve.md) over what
            the collector writes (its ``parquet`` sink's run, else its ``jsonl`` file) on
            this port (0: a free one; ``collector.viewer.url``). It binds ``serve_host``
            (default: ``host``) and, beyond loopback, requires the collector's token.
            Needs the ``serve`` extra.

    Security (docs/collector.md): ``collector_token=...`` (``RTRACE_COLLECTOR_TOKEN``)
    makes the receiver refuse requests without it (UNAUTHENTICATED / 401, counted); bound
    beyond loopback, a token is generated when none is given (``none``: no token, with a
    warning). ``collector_tls_cert`` / ``collector_tls_key`` (and
    ``collector_tls_client_ca`` for mutual TLS) make it speak TLS only. ``collector.env``
    carries the token, the ``https://`` endpoint and ``collector_tls_ca`` (as
    ``OTEL_EXPORTER_OTLP_CERTIFICATE``) to the workers; ``collector.write_env(path)``
    writes it mode 0600.

    Capture gateway (docs/gateway.md): with ``gateway_upstream="http://127.0.0.1:8000/v1"``
    (``RTRACE_GATEWAY_UPSTREAM``) the collector also serves the gateway's OpenAI-compatible
    routes on ``host:gateway_port`` (0: a free port); agents' model calls then land in the
    job's trajectories. ``collector.gateway.url`` is its address, and ``collector.env``
    carries ``RTRACE_GATEWAY_URL`` / ``RTRACE_GATEWAY_SECRET`` for ``rtrace.gateway_access()``.

    Returns:
        The running :class:`rtrace.Collector`: ``endpoint``, ``env``, ``token``,
        ``write_env(path)``, ``flush()``, ``stats()``, ``stop()``, ``gateway``; also a
        context manager.

    Raises:
        ConfigError: a bad setting, or no sink.
    """
    from .pipeline.collector import start_collector as start

    collector = start(host=host, port=port, http_port=http_port, settle_s=settle_s,
                      trainer_tokenizer=_auto_tokenizer, **settings)
    if collector.settings.gateway_upstream:
        from .gateway.server import attach_to_collector

        try:
            attach_to_collector(collector, host, gateway_port)
        except BaseException:
            collector.stop()
            raise
    if serve_port is not None:
        try:
            from .serve import viewer_for_collector

            viewer = viewer_for_collector(collector, serve_host or host, serve_port)
        except BaseException:
            collector.stop()
            raise
        collector.viewer = viewer
        collector.on_stop(viewer.stop)
    return collector


# ----------------------------------------------------------------------------- tokenizer
def set_tokenizer(tokenizer: Any) -> None:
    """Set the tokenizer token2text decodes with (before or after configure).

    Args:
        tokenizer: anything with ``batch_decode(list_of_id_lists, skip_special_tokens=...)``
            or ``decode(ids, ...)`` (a transformers tokenizer, or a plain object); a name
            or local path (loaded with ``AutoTokenizer``, offline); or None to clear.

    Raises:
        TypeError: the object has neither ``batch_decode`` nor ``decode``.
        ConfigError: a name or path that cannot be loaded.

    Decoding happens when token2text is on (``configure(token2text=True)`` or
    ``RTRACE_TOKEN2TEXT=1``), or unset while a trainer adapter handed in its tokenizer
    (:func:`offer_tokenizer`), in rtrace's worker thread (the collector's in collector mode).
    """
    global _tokenizer
    from .pipeline.token2text import check_tokenizer

    try:
        _tokenizer = check_tokenizer(tokenizer)
    except TypeError as exc:
        raise TypeError(f"set_tokenizer: {exc}") from None


def get_tokenizer() -> Any:
    """The tokenizer set by :func:`set_tokenizer` / ``configure(tokenizer=...)``, or None."""
    return _tokenizer


def offer_tokenizer(tokenizer: Any) -> bool:
    """A trainer adapter (``rtrace.compat``) hands in its trainer's tokenizer.

    It becomes the tokenizer token2text decodes with unless one is set already (the
    user's wins), and with ``token2text`` unset rtrace decodes from then on: the one-line
    adapters write readable text without ``RTRACE_TOKEN2TEXT``. ``token2text=False`` (or
    ``RTRACE_TOKEN2TEXT=0``) still turns decoding off. In collector mode the worker tells
    the collector the tokenizer's ``name_or_path`` and the collector loads it (offline)
    when it has no tokenizer of its own (docs/token2text.md).

    Never raises (an adapter must not break training): an object that cannot decode is
    ignored, counted in ``token2text_tokenizer_refused``; a name is ignored (loading it
    would be I/O on the trainer's thread). Returns True when it was taken.
    """
    global _offered, _tokenizer
    if tokenizer is None or tokenizer is _offered or isinstance(tokenizer, str):
        return False  # adapters offer at every batch: the same object costs one check; a name is not loaded here
    if not (callable(getattr(tokenizer, "batch_decode", None)) or callable(getattr(tokenizer, "decode", None))):
        _stats.incr("token2text_tokenizer_refused")
        _stats.warn_once("offer-tokenizer", "rtrace: a trainer's tokenizer (%s) has neither batch_decode nor "
                         "decode; token2text does not use it", type(tokenizer).__name__)
        return False
    _offered = tokenizer
    if _tokenizer is None:
        _tokenizer = tokenizer
    return True


def _auto_tokenizer() -> Any:
    """What token2text decodes with when it is unset: the tokenizer in force, once a
    trainer adapter offered one; else None (no decoding)."""
    return _tokenizer if _offered is not None else None


def _offered_name() -> str | None:
    """In collector mode, the name or local path of the tokenizer a trainer adapter offered
    (for the collector to load): ``""`` for one made in code (no name, but the collector
    then knows a trainer gave one), None when none was offered."""
    if _offered is None:
        return None
    name = getattr(_tokenizer, "name_or_path", None)
    return name if isinstance(name, str) else ""


# ----------------------------------------------------------------------------- fork and SIGTERM
def _after_fork_in_child() -> None:
    """A forked child (multiprocessing, DataLoader workers, Ray) has none of the parent's
    threads: drop the inherited pipeline without touching it (the parent exports what
    it holds), renew the locks, and configure again on the child's first traced call
    with the same arguments, as the OTel SDK's BatchProcessor does."""
    global _lock, _pipeline, _fork_kwargs
    _lock = threading.RLock()
    _stats.after_fork()
    if _pipeline is not None:
        _fork_kwargs = dict(_last_kwargs)
        for bridge in _bridges.values():
            bridge.target = None
        _pipeline = None
        _state.set_runtime(_state.UNSET)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _install_sigterm() -> None:
    """On SIGTERM (SLURM, Kubernetes, torchrun), write what rtrace holds, then do what
    SIGTERM did before: call the previous Python handler, or, with the default
    disposition, shut rtrace down (open trajectories written as partial) and terminate
    by re-raising the signal with the default handler. Not installed when SIGTERM is
    ignored, from a thread other than the main one, or with ``flush_on_sigterm=False``."""
    global _sigterm_installed
    if _sigterm_installed or threading.current_thread() is not threading.main_thread():
        return
    try:
        previous = signal.getsignal(signal.SIGTERM)
    except (ValueError, OSError):
        return
    if previous is signal.SIG_IGN or previous is None:
        return

    def on_sigterm(signum: int, frame: Any) -> None:
        settings = _settings
        if settings is not None and settings.flush_on_sigterm:
            try:
                if callable(previous):
                    flush(settings.sink_timeout_s)
                else:
                    shutdown()
            except Exception:
                _stats.incr("internal_errors")
        if callable(previous):
            previous(signum, frame)
            return
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    try:
        signal.signal(signal.SIGTERM, on_sigterm)
    except (ValueError, OSError):
        return
    _sigterm_installed = True
