"""The collector: one per training job, fed over OTLP by every rollout worker.

::

    workers (RTRACE_EXPORTER=collector)          this process (or `rtrace collect`)
    spans leave ~0.5 s after they end  --OTLP-->  OtlpReceiver (gRPC; HTTP optional)
    rtrace.annotate*(...) (driver)     --OTLP-->  -> bounded queue (full: RESOURCE_EXHAUSTED, the
                                                     sender retries) -> worker thread:
                                                  spans grouped by trace id across processes;
                                                  the root (rtrace.root) completes a trajectory
                                                  after settle_s (spans of other processes may
                                                  still be in flight); annotations joined;
                                                  job-wide sample per step (StepSelector);
                                                  token2text; messages; the sinks (one run each)

The assembly is the one of a single process (:class:`~rtrace.pipeline.worker.Pipeline`):
the same registry, the same ``finish``, annotations, orphan timeout (a trajectory whose
root never arrives, because its worker died, is written ``partial`` with every span
that did arrive), token2text and sinks. What differs: spans arrive as OTLP protos (the
inverse of the one OTel conversion), a trajectory waits ``settle_s`` after its root,
and ``max_traces_per_step`` is exact across the whole job and independent of arrival
order (:class:`~rtrace.pipeline.sampling.StepSelector`).
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import deque
from typing import Any

from .. import _stats
from ..config import ConfigError, Settings, load_settings
from ..exporters.otel import RECORD_ATTR
from ..trajectory import RL_FIELDS, SpanRecord
from . import annotations as _annotations
from .annotations import Annotation, coord_key
from .builder import SpanConverter
from .fanout import Fanout
from .otlp_receiver import Backpressure, OtlpReceiver, attributes, count_spans, spans_of
from .records import TrajectoryState
from .sampling import selector_for
from .stream import ANNOTATION_SPAN
from .token2text import Token2Text, check_tokenizer
from .worker import Pipeline

__all__ = ["Collector", "start_collector", "unpack"]
_POPPED = frozenset(("rtrace.kind", "rtrace.input", "rtrace.output", "rtrace.prompt_ids", "rtrace.response_ids",
                     "rtrace.root"))


class CollectorPipeline(Pipeline):
    """The assembly of :class:`Pipeline`, over spans that arrive as OTLP protos."""

    refuse_new_at_shutdown = False

    def __init__(self, settings: Settings, fanout: Fanout, postprocessors: list, settle_s: float,
                 health_tokenizer: Any = lambda: None) -> None:
        self.settle_s = settle_s
        self.metrics_linger_s = settings.step_linger_s
        self._requests: deque[tuple[Any, int]] = deque()
        self._queued = 0
        self._qlock = threading.Lock()
        super().__init__(settings, fanout, postprocessors, health_tokenizer)
        self.selector = selector_for(settings, linger_s=settings.step_linger_s, on_drop=self.dropped)

    # ------------------------------------------------------------------ receiver threads
    def on_request(self, request: Any) -> None:
        """OtlpReceiver callback: queue the request, or push back when full."""
        n = count_spans(request)
        with self._qlock:
            if self._queued + n > self._max_queue:
                _stats.incr("collector_backpressure_spans", n)
                raise Backpressure(f"rtrace collector queue full ({self._max_queue} spans)", retry_after_s=1.0)
            self._requests.append((request, n))
            self._queued += n
            wake = self._queued >= self._wake_at
        if wake:
            with self._cond:
                self._cond.notify()

    def gauges(self) -> dict[str, int]:
        out = super().gauges()
        out["queued_spans"] = self._queued
        out["held_for_sampling"] = self.selector.held()
        return out

    # ------------------------------------------------------------------ worker thread
    def _assemble(self, spans: list, conv: SpanConverter) -> list[TrajectoryState]:
        arrived: list[TrajectoryState] = []
        registry = self.registry
        max_children = self.settings.max_spans_per_trajectory - 1
        for _ in range(len(self._requests)):
            request, n = self._requests.popleft()
            with self._qlock:
                self._queued -= n
            _stats.incr("collector_spans_received", n)
            for _resource, _scope, span in spans_of(request):
                trace_id = int.from_bytes(span.trace_id, "big")
                attrs, record_data = unpack(span)
                if span.name == ANNOTATION_SPAN and "rtrace.annotation.values" in attrs:
                    self.annotations.add(_annotation(attrs))
                    continue
                state = registry.open_or_get(trace_id, lambda: TrajectoryState(trace_id, None, "rollout",
                                                                                "rollout", {}))
                if state is None:
                    _stats.incr("spans_dropped_open_limit")
                    continue
                is_root = bool(attrs.get("rtrace.root")) and registry.claim_root(state, int.from_bytes(
                    span.span_id, "big"))
                if not state.coords or is_root:
                    state.coords = _coords(attrs) or state.coords  # workers stamp some spans only
                if len(state.records) >= max_children and not is_root:
                    state.dropped_spans += 1
                    _stats.incr("spans_dropped_trajectory_limit")
                    continue
                record = _record(span, attrs, record_data)
                if is_root:
                    state.name, state.kind = record.name, record.kind
                    if "rl.reward" in attrs:
                        state.reward, state.has_reward = attrs["rl.reward"], True
                    state.outcome = {k[len("rl.outcome."):]: v for k, v in attrs.items()
                                     if k.startswith("rl.outcome.")}
                    arrived.append(state)
                state.records.append(record)
        return arrived



def unpack(span: Any) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """An OTLP span's attributes, with rtrace's compact record (``RECORD_ATTR``, see
    :func:`rtrace.exporters.otel.encode_compact`) unpacked: its attributes merged in,
    the record returned (None for a span in the full attribute form)."""
    key_values = span.attributes
    if len(key_values) == 1:  # a worker's non-root span: the record alone (2x faster than the loop)
        kv = key_values[0]
        if kv.key == RECORD_ATTR and kv.value.WhichOneof("value") == "string_value":
            record_data = _record_json(kv.value.string_value)
            if type(record_data) is dict:
                attrs = record_data.get("attributes")
                if attrs is None:
                    return {}, record_data
                if type(attrs) is dict:
                    return attrs, record_data
    attrs = attributes(key_values)
    packed = attrs.pop(RECORD_ATTR, None)
    record_data = _record_json(packed) if packed is not None else None
    if not isinstance(record_data, dict):
        return attrs, None
    attrs.update(record_data.get("attributes") or {})
    return attrs, record_data


def _coords(attrs: dict[str, Any]) -> dict[str, Any]:
    coords: dict[str, Any] = {k: attrs[f"rl.{k}"] for k in RL_FIELDS if f"rl.{k}" in attrs}
    extra = {k[len("rl.extra."):]: v for k, v in attrs.items() if k.startswith("rl.extra.")}
    if extra:
        coords["extra"] = extra
    return coords


try:  # installed with trackio; reads the workers' records 3x faster than the json module
    from orjson import loads as _fast_loads
except ImportError:  # pragma: no cover - the json module reads them the same, slower
    _fast_loads = None


def _record_json(text: Any) -> Any:
    """A worker's compact record (JSON text) as data, as the json module reads it.

    orjson, when installed, reads the same values (floats bit for bit), except integers
    outside [-2**63, 2**64): it returns those as floats. A record's converted values stay
    within (-2**64, 2**64) (larger ones are strings), so only a negative number of 19 or
    20 digits, which starts ``-9`` or ``-1``, or a token id (not converted) can be one:
    such text goes to the json module, and so do ids that came back as anything but ints.
    """
    if _fast_loads is not None and isinstance(text, str) and "-1" not in text and "-9" not in text:
        try:
            data = _fast_loads(text)
        except ValueError:  # lone surrogates, non-finite numbers ...: the json module decides
            data = None
        if type(data) is dict:
            prompt_ids, response_ids = data.get("prompt_ids"), data.get("response_ids")
            if ((not prompt_ids or set(map(type, prompt_ids)) == _INT)
                    and (not response_ids or set(map(type, response_ids)) == _INT)):
                return data
    return _json(text)


_INT = {int}


def _json(text: Any) -> Any:
    if not isinstance(text, str):
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text  # truncated JSON text stays the bounded string it is


def _record(span: Any, attrs: dict[str, Any], packed: dict[str, Any] | None) -> SpanRecord:
    """A SpanRecord from an OTLP span: rtrace's compact form (``packed``), else the full
    attribute form of the one OTel conversion (``rtrace.kind``, ``rtrace.input`` ...)."""
    if packed is not None:
        get = packed.get
        kind, inp, out = get("kind", "span"), get("input"), get("output")
        prompt_ids, response_ids = get("prompt_ids"), get("response_ids")
    else:
        kind = attrs.get("rtrace.kind", "span")
        inp, out = _json(attrs.get("rtrace.input")), _json(attrs.get("rtrace.output"))
        prompt_ids, response_ids = _json(attrs.get("rtrace.prompt_ids")), _json(attrs.get("rtrace.response_ids"))
    status = span.status
    if status.code == 2:  # STATUS_CODE_ERROR
        outcome, error = "error", status.message or None
    else:
        outcome, error = "ok", None
    if not _POPPED.isdisjoint(attrs):
        attrs = {k: v for k, v in attrs.items() if k not in _POPPED}
    events = span.events
    # positional: the dataclass's keyword call costs twice as much, once per span
    return SpanRecord(
        span.span_id.hex(), span.parent_span_id.hex() or None, span.name, kind,
        span.start_time_unix_nano, span.end_time_unix_nano, outcome, error, attrs, inp, out,
        [{"name": e.name, "time_ns": e.time_unix_nano, "attributes": attributes(e.attributes)}
         for e in events] if events else [],
        _ids(prompt_ids), _ids(response_ids))


def _ids(value: Any) -> list | None:
    if type(value) is list:  # decoded JSON: a list of its own
        return value
    return list(value) if isinstance(value, tuple) else None


def _annotation(attrs: dict[str, Any]) -> Annotation:
    values = _json(attrs.get("rtrace.annotation.values")) or {}
    trace_hex = attrs.get("rtrace.annotation.trace_id")
    trace_id = int(trace_hex, 16) if isinstance(trace_hex, str) else None
    return Annotation(coord_key(_coords(attrs)), trace_id, values if isinstance(values, dict) else {})


class Collector:
    """An rtrace collector running in this process: an OTLP receiver, the assembly and
    the sinks, on rtrace's own threads. Use :func:`rtrace.start_collector`.

    Attributes:
        endpoint: ``"host:port"`` of the OTLP/gRPC receiver (what workers send to).
        env: the environment variables for workers (``RTRACE_EXPORTER=collector``,
            ``RTRACE_COLLECTOR_ENDPOINT``, ``RTRACE_PROJECT``, ``RTRACE_EXPERIMENT``,
            ``RTRACE_JOB_ID``, ...): pass them to Ray's ``runtime_env``, SLURM or torchrun.
    """

    def __init__(self, settings: Settings, host: str = "127.0.0.1", port: int = 0, http_port: int | None = None,
                 settle_s: float = 2.0) -> None:
        from ..exporters import create_sink

        names = [n for n in settings.exporter if n != "collector"]
        if not names and not settings.sinks:
            raise ConfigError("start_collector(exporter=...) (env RTRACE_EXPORTER): the collector needs at least "
                              "one sink; accepted values: comma list of console, jsonl, trackio, mlflow, otlp")
        self.settings = settings
        self.job_id = settings.job_id or uuid.uuid4().hex[:16]
        sinks = [create_sink(name, settings) for name in names] + list(settings.sinks)
        self.mlflow_run_id: str | None = None
        for sink in sinks:  # one MLflow run per job, created now so workers can be told its id
            ensure_run = getattr(sink, "ensure_run", None)
            if callable(ensure_run):
                self.mlflow_run_id = ensure_run(settings.experiment, {"rtrace.job_id": self.job_id})
        self._tokenizer = check_tokenizer(settings.tokenizer) if settings.tokenizer is not None else None
        post = [Token2Text(lambda: self._tokenizer, settings.token2text_skip_special_tokens,
                           settings.token2text_keep_ids)] if settings.token2text else []
        fanout = Fanout(sinks, settings.max_export_batch_size, settings.sink_queue_size, settings.sink_timeout_s)
        self.pipeline = CollectorPipeline(settings, fanout, post, settle_s, lambda: self._tokenizer)
        self.receiver = OtlpReceiver(self.pipeline.on_request, host=host, port=port, http_port=http_port)
        try:
            self.receiver.start()
        except Exception:
            self.pipeline.shutdown(1.0)
            raise
        self._stopped = False

    @property
    def endpoint(self) -> str:
        return self.receiver.endpoint

    @property
    def env(self) -> dict[str, str]:
        s = self.settings
        env = {"RTRACE_EXPORTER": "collector", "RTRACE_COLLECTOR_ENDPOINT": self.endpoint,
               "RTRACE_PROJECT": s.project, "RTRACE_JOB_ID": self.job_id,
               "RTRACE_SAMPLE_SEED": str(s.sample_seed), "RTRACE_SAMPLE_GROUPS": "1" if s.sample_groups else "0",
               "RTRACE_CAPTURE": "1" if s.capture else "0"}
        if s.experiment:
            env["RTRACE_EXPERIMENT"] = s.experiment
        if self.mlflow_run_id:
            env["RTRACE_MLFLOW_RUN_ID"] = self.mlflow_run_id
        if s.pre_sample_rate < 1.0:
            env["RTRACE_PRE_SAMPLE_RATE"] = repr(s.pre_sample_rate)
        return env

    def set_tokenizer(self, tokenizer: Any) -> None:
        """The tokenizer token2text decodes with, in the collector."""
        self._tokenizer = check_tokenizer(tokenizer)

    def annotate(self, annotations: list[Annotation]) -> None:
        self.pipeline.annotate(annotations)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Export everything received so far (steps held for the job-wide sample are
        released) and wait until every sink wrote it. True when all of it was written."""
        return self.pipeline.force_flush(int(max(0.0, min(float(timeout_s), 604800.0)) * 1000))

    def stats(self) -> dict[str, Any]:
        """rtrace's counters (this process), the receiver's and the collector's gauges."""
        out: dict[str, Any] = dict(_stats.snapshot())
        out.update(self.pipeline.gauges())
        out.update({f"receiver.{k}": v for k, v in self.receiver.stats().items()})
        return out

    def stop(self, timeout_s: float | None = None) -> None:
        """Stop receiving, write what is open (partial) and held, close the sinks."""
        if self._stopped:
            return
        self._stopped = True
        if _annotations.local_target == self.annotate:
            _annotations.local_target = None
        self.receiver.stop(grace_s=2.0)
        self.pipeline.shutdown(timeout_s)

    def __enter__(self) -> "Collector":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def start_collector(*, host: str = "127.0.0.1", port: int = 0, http_port: int | None = None,
                    settle_s: float = 2.0, **settings: Any) -> Collector:
    """Start an rtrace collector in this process (its own threads, no subprocess).

    ``settings`` are those of ``rtrace.configure`` (``exporter="trackio,mlflow"``,
    ``project``, ``experiment``, ``max_traces_per_step``, ``token2text``, ``tokenizer``
    ...), read from the environment the same way; in collector mode
    ``max_traces_per_step`` is job-wide. Workers started with ``collector.env`` stream
    their spans here; ``rtrace.annotate*`` in this process reach it directly.

    Args:
        host: the address to bind (127.0.0.1 unless told otherwise).
        port: the gRPC port (0: a free one; read ``collector.endpoint``).
        http_port: also serve OTLP/HTTP ``/v1/traces`` there (0: a free port).
        settle_s: how long a trajectory waits after its root arrived, for spans of other
            processes still in flight.

    Returns:
        The running :class:`Collector` (also a context manager: ``stop()`` on exit).

    Raises:
        ConfigError: a bad setting, or no sink.
    """
    collector = Collector(load_settings(settings), host=host, port=port, http_port=http_port, settle_s=settle_s)
    _annotations.local_target = collector.annotate
    return collector
