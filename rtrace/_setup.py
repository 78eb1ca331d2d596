"""configure / flush / shutdown / stats: wiring settings, sinks, pipeline and hot path.

This is the one module that knows both sides: it builds the exporters' pipeline and
installs a :class:`~rtrace.instrumentation._state.Runtime` for the decorators. The
instrumentation never imports an exporter, and no exporter imports the instrumentation.
"""

from __future__ import annotations

import atexit
import threading
from typing import Any

from opentelemetry import trace as otel_trace

from . import _stats
from .config import Settings, load_settings
from .instrumentation import _state

__all__ = ["configure", "flush", "shutdown", "stats", "is_enabled", "current_settings"]

_lock = threading.RLock()
_pipeline: Any = None
_settings: Settings | None = None
_atexit_registered = False


def configure(**kwargs: Any) -> Settings:
    """Turn tracing on (or off) and choose the sinks. Keyword arguments override env vars.

    Every setting is listed in docs/configuration.md (and ``rtrace.config.PARAMS``); the
    common ones::

        rtrace.configure(exporter="trackio", project="gsm8k-grpo", experiment="run-7",
                         token2text=True, tokenizer=tok, max_traces_per_step=32)

    Calling it again replaces the previous configuration (flushing it first). With no
    exporter (``RTRACE_EXPORTER`` unset or ``none``) tracing is off and decorated calls
    cost one check. ``sinks=[...]`` adds custom :class:`rtrace.Sink` instances.

    Returns:
        The validated settings.

    Raises:
        ConfigError: a bad value, naming the variable and the accepted values, or a sink
            whose optional dependency is missing.
    """
    settings = load_settings(kwargs)
    with _lock:
        _shutdown_locked()
        if not settings.enabled:
            _install(None, settings)
            return settings
        pipeline, tracer = _build(settings)
        _install(pipeline, settings, tracer)
        return settings


def _build(settings: Settings) -> tuple[Any, Any]:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider

    from .exporters import create_sink
    from .exporters.builder import TrajectoryBuilder
    from .exporters.pipeline import Pipeline

    sinks = [create_sink(name, settings) for name in settings.exporter] + list(settings.sinks)
    postprocessors = []
    if settings.token2text:
        from .exporters.token2text import Token2Text

        postprocessors.append(Token2Text.from_settings(settings))
    pipeline = Pipeline(settings, sinks, TrajectoryBuilder(settings, postprocessors))
    provider = otel_trace.get_tracer_provider()
    if isinstance(provider, TracerProvider):
        # The application set its own SDK provider: add to it, never replace it.
        provider.add_span_processor(pipeline)
    else:
        provider = TracerProvider(resource=Resource.create({"service.name": settings.service_name}))
        provider.add_span_processor(pipeline)
    return pipeline, provider.get_tracer("rtrace")


def _install(pipeline: Any, settings: Settings, tracer: Any = None) -> None:
    global _pipeline, _settings, _atexit_registered
    from .exporters.sampling import StepSampler

    _pipeline, _settings = pipeline, settings
    if pipeline is None:
        _state.set_runtime(None)
        return
    sampler = StepSampler(settings.max_traces_per_step, settings.val_cap, settings.sample_groups)
    _state.set_runtime(_state.Runtime(tracer, pipeline, sampler, settings.capture, settings.experiment))
    if not _atexit_registered:
        atexit.register(shutdown)
        _atexit_registered = True


def _autoconfigure() -> None:
    with _lock:
        if _state.runtime is _state.UNSET:
            configure()


_state.autoconfigure = _autoconfigure


def flush(timeout_s: float = 30.0) -> bool:
    """Export every trajectory that has finished, and wait until every sink wrote it.

    Returns:
        True when everything was written within ``timeout_s``; False otherwise (or when
        tracing is off).
    """
    pipeline = _pipeline
    if pipeline is None:
        return False
    return pipeline.force_flush(int(timeout_s * 1000))


def _shutdown_locked() -> None:
    global _pipeline
    pipeline, _pipeline = _pipeline, None
    if pipeline is not None:
        _state.set_runtime(None)
        pipeline.shutdown()


def shutdown() -> None:
    """Flush, write still-open trajectories as partial, close the sinks; tracing is off
    afterwards until the next ``configure()``. Registered with ``atexit``."""
    with _lock:
        _shutdown_locked()
        if _state.runtime is _state.UNSET:
            _state.set_runtime(None)


def stats() -> dict[str, int]:
    """Counters of what rtrace kept, sampled out, dropped and failed, by name.

    ``trajectories_started`` / ``trajectories_sampled_out`` / ``trajectories_completed`` /
    ``trajectories_partial``, ``spans_dropped_queue``, ``spans_dropped_trajectory_limit``,
    ``trajectories_dropped_open_limit``, ``sink.<name>.exported`` /
    ``.failed_batches`` / ``.dropped_batches``, ``values_truncated``, ``values_redacted``,
    ``internal_errors`` ... plus the gauges ``open_trajectories`` and ``queued_spans``.
    The full list is in docs/stats.md.
    """
    out = _stats.snapshot()
    pipeline = _pipeline
    out["open_trajectories"] = len(pipeline.open) if pipeline is not None else 0
    out["queued_spans"] = len(pipeline._queue) if pipeline is not None else 0
    return out


def is_enabled() -> bool:
    """True when tracing is configured on."""
    return _state.get_runtime() is not None


def current_settings() -> Settings | None:
    """The settings of the last ``configure()`` (None before any)."""
    return _settings

