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

import gc
import ipaddress
import json
import logging
import re
import secrets
import time
import uuid
from collections import OrderedDict
from typing import Any

from .. import _stats
from .._serialize import only_ints
from ..config import ConfigError, Secret, Settings, load_settings
from ..events import worker_of_resource
from ..exporters.otel import RECORD_ATTR
from ..summary import RolloutSummary
from ..trajectory import RL_FIELDS, SpanRecord, read_token_field
from . import annotations as _annotations
from . import fleet as _fleet
from .annotations import Annotation, coord_key
from .builder import SpanConverter
from .fanout import Fanout
from .admission import Admission
from .otlp_receiver import OtlpReceiver, PartialSuccess, TlsFiles, attributes
from .records import TrajectoryState
from .sampling import selector_for
from .stream import (ANNOTATION_SPAN, ANNOTATIONS_ATTR, MESSAGES_ATTR, PROMOTED_ATTR, SUMMARIES_ATTR, SUMMARIES_SPAN,
                     TOKENIZER_ATTR)
from .summaries import summary_state
from .token2text import Token2Text, check_tokenizer, load_tokenizer
from .tokens import TOKENS_KEY, TokenBatch, TokenRow, as_float32
from .worker import Pipeline

__all__ = ["Collector", "start_collector", "unpack", "is_loopback", "tune_gc", "tune_malloc", "release_memory"]
_log = logging.getLogger("rtrace")
_POPPED = frozenset(("rtrace.kind", "rtrace.input", "rtrace.output", "rtrace.prompt_ids", "rtrace.response_ids",
                     "rtrace.root"))


#: trace ids the collector remembers after their trajectory left its table, to count a
#: span that comes after it as late (``collector_spans_late``) instead of writing the
#: trace a second time: ~150 bytes each (a 128-bit int in an OrderedDict), ~15 MB at the
#: bound; a span later than 100,000 trajectories is written as a trajectory of its own
#: (partial)
FINISHED_TRACE_IDS = 100_000


class CollectorPipeline(Pipeline):
    """The assembly of :class:`Pipeline`, over spans that arrive as OTLP protos."""

    refuse_new_at_shutdown = False
    #: called with the tokenizer name a worker's root carries (TOKENIZER_ATTR); the Collector sets it
    on_tokenizer_name: Any = staticmethod(lambda name: None)

    def __init__(self, settings: Settings, fanout: Fanout, postprocessors: list, settle_s: float,
                 health_tokenizer: Any = lambda: None) -> None:
        self.settle_s = settle_s
        self.metrics_linger_s = settings.step_linger_s
        super().__init__(settings, fanout, postprocessors, health_tokenizer)
        self.rollout_worker = None  # each rollout's is its sender's (the root's OTLP resource)
        self.selector = selector_for(settings, linger_s=settings.step_linger_s, on_drop=self.dropped)
        self._max_held_bytes = settings.collector_max_held_bytes
        #: set when the receiver pushed back because the table was full
        self._pressure = False
        #: what the receiver takes, checked and reserved before it answers (admission.py)
        self.admission = Admission(self.registry, self._max_queue, settings.collector_max_span_bytes,
                                   settings.collector_max_attributes, settings.collector_max_held_bytes,
                                   on_pressure=self._pushed_back)
        self._max_attributes = settings.collector_max_attributes
        #: trajectories evicted (least recently active, as partial) to make room
        self._evicted: list[TrajectoryState] = []
        #: trace ids the worker found no room for (counted once each; their later spans
        #: are dropped too, so a trajectory is never both dropped and written partial)
        self._dropped_traces: OrderedDict[int, None] = OrderedDict()
        # a span of a trajectory already written (or sampled out, evicted, expired) is
        # late, not the first span of a new one: written again, it would be a second
        # trajectory of the same trace id (a duplicate row in every sink and step metric)
        self.registry.remember_finished(FINISHED_TRACE_IDS)

    # ------------------------------------------------------------------ receiver threads
    def on_request(self, request: Any) -> PartialSuccess | None:
        """OtlpReceiver callback: check and queue the request (spans refused for good are
        answered as a partial success), or push back (``Backpressure``) when taking it
        would pass a limit once the requests queued before it are assembled."""
        answer = self.admission.admit(request)
        if self.admission.queued >= self._wake_at:
            with self._cond:
                self._cond.notify()
        return answer

    def _pushed_back(self) -> None:
        # the table is full: the worker evicts the least recently active trajectories still
        # waiting for their root (written partial) in its next round; the sender retries.
        # Finished ones that wait (settle_s, annotations) are not in it (registry.hold)
        self._pressure = True
        with self._cond:
            self._cond.notify()

    def _evict(self) -> list[TrajectoryState]:
        evicted, self._evicted = self._evicted, []
        return evicted

    def gauges(self) -> dict[str, int]:
        out = super().gauges()
        out["held_bytes"] = self.registry.held_bytes
        out["waiting_bytes"] = self.registry.waiting_bytes
        out["queued_spans"] = self.admission.queued
        out["reserved_trajectories"] = self.admission.reserved_open
        out["held_for_sampling"] = self.selector.held()
        return out

    # ------------------------------------------------------------------ worker thread
    def _assemble(self, spans: list, conv: SpanConverter) -> list[TrajectoryState]:
        """Every queued request's spans into their trajectories, one span at a time: a span
        that cannot be read is refused and counted (``collector_spans_refused``, and
        ``collector_refused.<why>``), never the request or the round it came in. Spans
        refused at the request (admission.py) are skipped."""
        arrived: list[TrajectoryState] = []
        registry = self.registry
        admission = self.admission
        if self._pressure:  # the receiver pushed back since the last round: free a tenth of the table
            self._pressure = False
            room = registry.max_open * 9 // 10 - admission.reserved_open
            room_bytes = self._max_held_bytes * 9 // 10 - admission.reserved_bytes
            self._evicted += registry.evict(max(0, room), max(0, room_bytes))
        for ticket in admission.take():
            _stats.incr("collector_spans_received", ticket.spans)
            sizes = ticket.sizes
            k = 0
            for resource_spans in ticket.request.resource_spans:
                worker = worker_of_resource(attributes(resource_spans.resource.attributes))
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        size = sizes[k]
                        k += 1
                        if size < 0:
                            continue
                        try:
                            self._span(span, size, arrived, worker)
                        except _Refused as why:
                            _refuse(str(why))
                        except Exception:  # noqa: BLE001 - a span this code did not foresee: refused alone
                            _refuse("unreadable")
                            _stats.warn_once("collector-span", "rtrace collector refused a span it could not "
                                             "read (counted in collector_spans_refused)", exc_info=True)
            admission.done(ticket)  # its trajectories are in the table now: its reservation is free
        return arrived

    def _span(self, span: Any, size: int, arrived: list[TrajectoryState], worker: str | None = None) -> None:
        """One span (its ids, size and attribute count checked at the request): converted
        first; the registry is touched only once nothing can fail, so a refused span
        leaves no trajectory half-changed."""
        attrs, record_data = unpack(span)
        if len(attrs) > self._max_attributes:
            raise _Refused("attributes")
        if span.name == ANNOTATION_SPAN and "rtrace.annotation.values" in attrs:
            self.annotations.add(_annotation(attrs))
            return
        if span.name == SUMMARIES_SPAN and SUMMARIES_ATTR in attrs:
            arrived.extend(self._summaries(attrs[SUMMARIES_ATTR], worker))
            return
        if span.name == _fleet.EVENT_SPAN and _fleet.EVENT_ATTR in attrs:
            try:
                event = _fleet.event_of(attrs)
            except (ValueError, TypeError):
                raise _Refused("event") from None
            if event.worker is None:
                event.worker = worker
            self.submit_events([event])  # taken in after this part's assembly (Pipeline._chunk)
            return
        coords = _coords(attrs)
        record = _record(span, attrs, record_data)
        if record.end_ns < record.start_ns:  # a clock step on the sender, or garbage: zero length
            record.end_ns = record.start_ns
            _stats.incr("collector_spans_repaired_times")
        registry = self.registry
        trace_id = int.from_bytes(span.trace_id, "big")
        state = registry.lookup(trace_id)
        if state is None:
            if registry.was_finished(trace_id):
                _stats.incr("collector_spans_late")
                return
            state = self._open(trace_id)
            if state is None:
                return
        seen = state.span_ids
        if seen is None:
            seen = state.span_ids = set()
        span_id = int.from_bytes(span.span_id, "big")
        if span_id in seen:
            _stats.incr("collector_spans_duplicate")
            return
        is_root = bool(attrs.get("rtrace.root")) and registry.claim_root(state, span_id)
        if not state.coords or is_root:
            state.coords = coords or state.coords  # workers stamp some spans only
        if len(state.records) >= self.settings.max_spans_per_trajectory - 1 and not is_root:
            registry.touch(state, 0)  # active, but holds nothing more
            state.dropped_spans += 1
            _stats.incr("spans_dropped_trajectory_limit")
            return
        registry.touch(state, size)
        seen.add(span_id)
        if is_root:
            state.name, state.kind = record.name, record.kind
            state.worker = worker
            if "rl.reward" in attrs:
                state.reward, state.has_reward = attrs["rl.reward"], True
            state.outcome = {k[len("rl.outcome."):]: v for k, v in attrs.items() if k.startswith("rl.outcome.")}
            state.promoted = attrs.get(PROMOTED_ATTR) is True
            if MESSAGES_ATTR in record.attributes or ANNOTATIONS_ATTR in record.attributes:
                _uncarry(state, record.attributes)
            tokenizer = record.attributes.pop(TOKENIZER_ATTR, None)
            if tokenizer is not None:
                self.on_tokenizer_name(tokenizer)
            arrived.append(state)
        state.add(record)

    def _summaries(self, items: Any, worker: str | None = None) -> list[TrajectoryState]:
        """A worker's rollout summaries (rtrace.summaries), each a summary-only state; one that
        cannot be read is refused and counted alone (``collector_refused.summary``)."""
        if not isinstance(items, list):
            raise _Refused("summary")
        out = []
        for item in items:
            try:
                summary = RolloutSummary.from_wire(item)
                trace_id = int(summary.trace_id, 16)
            except (ValueError, TypeError):
                _refuse("summary")
                continue
            if summary.worker is None:
                summary.worker = worker
            out.append(summary_state(summary, trace_id))
        _stats.incr("collector_summaries_received", len(out))
        return out

    def _open(self, trace_id: int) -> TrajectoryState | None:
        """A new trajectory for ``trace_id``. Admission reserved room for it; should the
        table still be full (a trace id that left the table longer ago than the collector
        remembers, or that several queued requests share), the least recently active
        trajectory waiting for its root is evicted (O(1)); with none, the span is dropped
        and its trajectory counted once (``trajectories_dropped_open_limit``)."""
        dropped = self._dropped_traces
        if trace_id in dropped:
            _stats.incr("spans_dropped_open_limit")
            return None
        registry = self.registry
        new = lambda: TrajectoryState(trace_id, None, "rollout", "rollout", {})  # noqa: E731
        state = registry.open_or_get(trace_id, new)
        if state is None:
            self._evicted += registry.evict(registry.max_open - 1, self._max_held_bytes)
            state = registry.open_or_get(trace_id, new)
        if state is None:  # every open trajectory's root arrived in this round (they wait apart after it)
            _stats.incr("spans_dropped_open_limit")
            _stats.incr("trajectories_dropped_open_limit")
            _stats.warn_once("collector-open-limit", "rtrace collector: no room for a new trajectory "
                             "(max_open_trajectories); it is dropped (counted)")
            dropped[trace_id] = None
            if len(dropped) > FINISHED_TRACE_IDS:
                dropped.popitem(last=False)
        return state


def _uncarry(state: TrajectoryState, attrs: dict[str, Any]) -> None:
    """A prebuilt trajectory's conversation and annotations, carried on its root by the
    worker (pipeline/stream.py), back on the trajectory and off the span."""
    messages = _json(attrs.pop(MESSAGES_ATTR, None))
    if isinstance(messages, list) and all(isinstance(m, dict) for m in messages):
        state.messages = messages
    annotations = _json(attrs.pop(ANNOTATIONS_ATTR, None))
    if isinstance(annotations, dict):
        state.annotations.update(annotations)


class _Refused(Exception):
    """A span the collector does not take; the message is the reason's counter suffix."""


def _refuse(why: str) -> None:
    _stats.incr("collector_spans_refused")
    _stats.incr(f"collector_refused.{why}")


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
    inner = record_data.get("attributes")
    if inner is not None and type(inner) is not dict:
        raise _Refused("record")
    if inner:
        attrs.update(inner)
    return attrs, record_data


#: (coordinate, its attribute name)
_RL_ATTRS = tuple((k, f"rl.{k}") for k in RL_FIELDS)
#: coordinates that are counted, compared and keyed on: an int each (a bool is no step)
_INT_COORDS = ("step", "sample_index", "rollout_n", "policy_version")
_SCALAR = (str, int, float, bool)


def _coords(attrs: dict[str, Any]) -> dict[str, Any]:
    """The ``rl.*`` coordinates of a span's attributes; refuses (:class:`_Refused`) a span
    whose step, sample index, rollout number or policy version is not an int, whose
    ``validate`` is not a bool, or whose group id or experiment is not a scalar: such a
    value would break the job-wide sample, the step metrics and the annotation keys."""
    coords: dict[str, Any] = {k: attrs[a] for k, a in _RL_ATTRS if a in attrs}
    for key in _INT_COORDS:
        value = coords.get(key)
        if value is not None and (type(value) is not int):
            raise _Refused("coordinates")
    validate = coords.get("validate")
    if validate is not None and type(validate) is not bool:
        raise _Refused("coordinates")
    for key in ("group_id", "experiment"):
        value = coords.get(key)
        if value is not None and not isinstance(value, _SCALAR):
            raise _Refused("coordinates")
    extra = {k[len("rl.extra."):]: v for k, v in attrs.items() if k.startswith("rl.extra.")}
    if extra:
        coords["extra"] = extra
    return coords


try:  # installed with trackio; reads the workers' records 3x faster than the json module
    from orjson import loads as _fast_loads
except ImportError:  # pragma: no cover - the json module reads them the same, slower
    _fast_loads = None


#: a negative number of 19 digits or more: the only text orjson may read otherwise than json
_LONG_NEGATIVE = re.compile(r"-\d{19}")


def _record_json(text: Any) -> Any:
    """A worker's compact record (JSON text) as data, as the json module reads it.

    orjson, when installed, reads the same values (floats bit for bit), except integers
    outside [-2**63, 2**64): it returns those as floats. A record's converted values stay
    within (-2**64, 2**64) (larger ones are strings), so only a negative number of 19 or
    20 digits, which starts ``-9`` or ``-1``, or a token id (not converted) can be one:
    text with such a number goes to the json module (text with ``-1`` or ``-9`` is searched
    for one: a reward of -1 is common, and a summaries span carries a thousand rollouts),
    and so do ids that came back as anything but ints.
    """
    if _fast_loads is not None and isinstance(text, str) and (
            ("-1" not in text and "-9" not in text) or _LONG_NEGATIVE.search(text) is None):
        try:
            data = _fast_loads(text)
        except ValueError:  # lone surrogates, non-finite numbers ...: the json module decides
            data = None
        if type(data) is dict:
            prompt_ids, response_ids = data.get("prompt_ids"), data.get("response_ids")
            if (not prompt_ids or only_ints(prompt_ids)) and (not response_ids or only_ints(response_ids)):
                return data
    return _json(text)



def _json(text: Any) -> Any:
    if not isinstance(text, str):
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text  # truncated JSON text stays the bounded string it is
    except RecursionError:  # nesting deeper than the interpreter's stack: no worker sends that
        raise _Refused("record") from None


def _record(span: Any, attrs: dict[str, Any], packed: dict[str, Any] | None) -> SpanRecord:
    """A SpanRecord from an OTLP span: rtrace's compact form (``packed``), else the full
    attribute form of the one OTel conversion (``rtrace.kind``, ``rtrace.input`` ...)."""
    token_values = None
    if packed is not None:
        get = packed.get
        kind, inp, out = get("kind", "span"), get("input"), get("output")
        prompt_ids, response_ids = get("prompt_ids"), get("response_ids")
        if "token_values" in packed:
            token_values = _token_values(packed["token_values"])
        if type(kind) is not str:
            raise _Refused("record")
    else:
        kind = attrs.get("rtrace.kind", "span")
        if type(kind) is not str:
            raise _Refused("record")
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
        _ids(prompt_ids), _ids(response_ids), token_values)


def _token_values(data: Any) -> dict[str, Any] | None:
    """A worker's per-token values as float32 arrays: the compact field (base64 float32,
    :func:`rtrace.trajectory.token_field`), or JSON lists (None where not finite)."""
    if not isinstance(data, dict):
        raise _Refused("record")
    if data.get("encoding") is not None:
        try:
            return {k: as_float32(v) for k, v in read_token_field(data).items()} or None
        except (ValueError, TypeError, KeyError, AttributeError):
            raise _Refused("record") from None
    out = {}
    for name, values in data.items():
        arr = as_float32([float("nan") if v is None else v for v in values]) if isinstance(values, list) else None
        if arr is None:
            raise _Refused("record")
        out[name] = arr
    return out or None


def _ids(value: Any) -> list | None:
    if type(value) is list:  # decoded JSON: a list of its own
        return value
    return list(value) if isinstance(value, tuple) else None


#: the longest annotation values (JSON text) the collector holds: trainers annotate numbers
#: (reward, advantage, returns), a few per trajectory; pending ones wait in a table
MAX_ANNOTATION_CHARS = 4096


def _annotation(attrs: dict[str, Any]) -> Annotation:
    """An annotation span's values and target; refuses (:class:`_Refused`) values that are
    not a JSON object of at most :data:`MAX_ANNOTATION_CHARS`, or a trace id that is not
    32 hex digits (not all zero)."""
    text = attrs.get("rtrace.annotation.values")
    # per-token rows are bounded by the span size limit only (a 4k-token row is ~40 kB)
    if not isinstance(text, str) or (len(text) > MAX_ANNOTATION_CHARS and TOKENS_KEY not in text):
        raise _Refused("annotation")
    values = _json(text)
    if not isinstance(values, dict):
        raise _Refused("annotation")
    for key, value in values.items():
        if isinstance(value, dict) and TOKENS_KEY in value:  # a trainer's per-token row (pipeline/stream.py)
            row = _token_values(value[TOKENS_KEY])
            values[key] = TokenRow(TokenBatch({key: [row[key]]}), 0) if row else None
    trace_hex = attrs.get("rtrace.annotation.trace_id")
    trace_id = None
    if trace_hex is not None:
        if not isinstance(trace_hex, str) or len(trace_hex) != 32:
            raise _Refused("annotation")
        try:
            trace_id = int(trace_hex, 16)
        except ValueError:
            raise _Refused("annotation") from None
        if not trace_id:
            raise _Refused("annotation")
    return Annotation(coord_key(_coords(attrs)), trace_id, values)


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
                 settle_s: float = 2.0, trainer_tokenizer: Any = None) -> None:
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
        #: the tokenizer a trainer adapter handed in, in this process (rtrace._setup); and one
        #: loaded by the name workers' roots carry (their trainer's tokenizer), tried once per name
        self._trainer_tokenizer = trainer_tokenizer or (lambda: None)
        self._named: Any = None
        self._names_tried: set[str] = set()
        #: a worker's root said its trainer handed in a tokenizer (named or not)
        self._workers_offered = False
        # token2text on (True), off (False), or unset (None): on once a trainer handed in a tokenizer
        post = [Token2Text(self._decoder if settings.token2text else self._auto_decoder,
                           settings.token2text_skip_special_tokens, settings.token2text_keep_ids,
                           required=bool(settings.token2text))] if settings.token2text is not False else []
        # hold_back: a sink that is behind makes the worker wait, and the receiver push back,
        # instead of thinning trajectories the senders were told were taken
        fanout = Fanout(sinks, settings.max_export_batch_size, settings.sink_queue_size, settings.sink_timeout_s,
                        hold_back=True)
        #: the bearer token workers must send (generated when binding beyond loopback)
        self.token: str | None = settings.collector_token or None
        local = is_loopback(host)
        if settings.collector_token is None and not local:
            self.token = Secret(secrets.token_urlsafe(32))
        if not local and not self.token:
            _log.warning("rtrace collector: listening on %s with no token (RTRACE_COLLECTOR_TOKEN=none): anyone who "
                         "can reach the port can inject trajectories and overwrite the rewards and advantages of "
                         "this job", host)
        if not local and settings.collector_tls_cert is None:
            _log.warning("rtrace collector: listening on %s without TLS: the token, prompts and answers cross the "
                         "network in clear text (RTRACE_COLLECTOR_TLS_CERT / RTRACE_COLLECTOR_TLS_KEY)", host)
        tls = TlsFiles(settings.collector_tls_cert, settings.collector_tls_key, settings.collector_tls_client_ca) \
            if settings.collector_tls_cert is not None else None
        self.pipeline = CollectorPipeline(settings, fanout, post, settle_s, self._decoder)
        self.pipeline.on_tokenizer_name = self._tokenizer_named
        self.receiver = OtlpReceiver(self.pipeline.on_request, host=host, port=port, http_port=http_port,
                                     token=self.token, tls=tls)
        try:
            self.receiver.start()
        except Exception:
            self.pipeline.shutdown(1.0)
            raise
        self._stopped = False
        #: a capture gateway served beside the collector (``start_collector(gateway_upstream=...)``,
        #: rtrace/gateway/server.py): its ``env`` joins :attr:`env`; :meth:`stop` stops it first
        self.gateway: Any = None
        #: called first by stop(): what runs beside the collector (the live viewer, rtrace._setup)
        self._on_stop: list[Any] = []
        #: the live viewer serving what this collector writes (start_collector(serve_port=...)), or None
        self.viewer: Any = None

    def on_stop(self, callback: Any) -> None:
        """Call ``callback()`` when the collector stops (before it stops receiving)."""
        self._on_stop.append(callback)

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
        if self.token:
            # rtrace's own variable, not OTEL_EXPORTER_OTLP_HEADERS: that one goes with every
            # OTLP export of the worker (an otlp sink to Jaeger too), and would hand the token on
            env["RTRACE_COLLECTOR_TOKEN"] = self.token
        if s.collector_tls_ca is not None:
            env["OTEL_EXPORTER_OTLP_CERTIFICATE"] = s.collector_tls_ca
        if self.gateway is not None:  # RTRACE_GATEWAY_URL / _SECRET: workers mint rollout keys
            env.update(self.gateway.env)
        return env

    def write_env(self, path: str) -> str:
        """Write :attr:`env` as ``export KEY=VALUE`` lines (shell-quoted) to ``path``, created
        mode 0600 (it may hold the token); returns the absolute path."""
        import os
        import shlex

        path = os.path.abspath(path)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), 0o600)  # an existing file too
            for key, value in self.env.items():
                f.write(f"export {key}={shlex.quote(str(value))}\n")
        return path

    def set_tokenizer(self, tokenizer: Any) -> None:
        """The tokenizer token2text decodes with, in the collector."""
        self._tokenizer = check_tokenizer(tokenizer)

    # ------------------------------------------------------------------ token2text's tokenizer
    def _decoder(self) -> Any:
        """token2text on: the collector's own tokenizer, else a trainer's (this process's, or
        the one workers named)."""
        return self._tokenizer or self._trainer_tokenizer() or self._named

    def _auto_decoder(self) -> Any:
        """token2text unset: decode only once a trainer handed in a tokenizer (here or in a
        worker), with the collector's own if it has one."""
        if self._workers_offered or self._trainer_tokenizer() is not None:
            return self._decoder()
        return None

    def _tokenizer_named(self, name: Any) -> None:
        """A worker's trainer tokenizer, by name or local path (collector worker thread):
        loaded once, offline, when the collector decodes and has none of its own.
        A name that cannot be loaded is counted (``token2text_tokenizer_unloadable``)."""
        if self.settings.token2text is False or not isinstance(name, str):
            return
        self._workers_offered = True
        if (not name or self._named is not None or self._tokenizer is not None or name in self._names_tried
                or len(self._names_tried) >= 8):
            return  # made in code (no name), or nothing to load
        self._names_tried.add(name)
        try:
            self._named = load_tokenizer(name)
        except ConfigError as exc:
            _stats.incr("token2text_tokenizer_unloadable")
            _stats.warn_once("collector-tokenizer", "rtrace collector: cannot load the workers' tokenizer %r "
                             "(%s); hand one to start_collector(tokenizer=...)", name, exc)

    def annotate(self, annotations: list[Annotation]) -> None:
        self.pipeline.annotate(annotations)

    def submit_events(self, events: list[Any]) -> None:
        """``rtrace.mark_weight_update`` in this process (the trainer runs the collector)."""
        self.pipeline.submit_events(events)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Export everything received so far (steps held for the job-wide sample are
        released) and wait until every sink wrote it. True when all of it was written."""
        ok = self.gateway.flush(timeout_s) if self.gateway is not None else True  # its spans first
        return self.pipeline.force_flush(int(max(0.0, min(float(timeout_s), 604800.0)) * 1000)) and ok

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
        if self.gateway is not None:  # no new calls; its spans still in flight reach the pipeline
            self.gateway.stop()
        for callback in self._on_stop:
            try:
                callback()
            except Exception:  # what runs beside it never keeps the collector from stopping
                _log.exception("rtrace collector: stopping %r", callback)
        if _annotations.local_target == self.annotate:
            _annotations.local_target = None
        if _fleet.local_target == self.submit_events:
            _fleet.local_target = None
        self.receiver.stop(grace_s=2.0)
        self.pipeline.shutdown(timeout_s)

    def __enter__(self) -> "Collector":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


#: Python's cyclic GC thresholds in a process that is only a collector (``rtrace collect``).
#: Every trajectory the collector holds (settling, in a sink's queue) is a few dozen
#: containers that live about a second: long enough to reach the oldest generation, whose
#: full collections then walk every held trajectory again and again. With Python's default
#: (700, 10, 10) that took a third of the collector's CPU (bench_collector.py: 19,500 vs
#: 26,500 spans per CPU-second). rtrace's objects hold no reference cycles (reference
#: counting frees them), so collecting less often keeps memory where it was.
COLLECTOR_GC_THRESHOLD = (50_000, 20, 20)


def tune_gc() -> tuple[int, int, int]:
    """Set up Python's garbage collector for a process that runs only the collector:
    what was imported and started so far is frozen out of collections (``gc.freeze``)
    and the thresholds become :data:`COLLECTOR_GC_THRESHOLD`. ``rtrace collect`` calls
    it; :func:`start_collector` never does (the GC belongs to the application whose
    process it runs in). Returns the thresholds before."""
    before = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(*COLLECTOR_GC_THRESHOLD)
    return before


#: the smallest block glibc's malloc puts in a mapping of its own (returned to the system at
#: free) in a process that is only a collector (``rtrace collect``)
COLLECTOR_MMAP_THRESHOLD = 1 << 20


def tune_malloc() -> bool:
    """Set up glibc's malloc for a process that runs only the collector: every block of
    :data:`COLLECTOR_MMAP_THRESHOLD` or more (a large span, a request body, a JSONL line
    of it) gets a mapping of its own, given back to the system when it is freed. By
    default glibc raises that threshold to the largest block freed so far (up to 32 MiB),
    and then serves such blocks from the threads' heaps, which give memory back only from
    their top: after ten requests of sixteen 3 MiB spans had been written and freed, the
    collector stayed at ~620 MiB instead of ~180. ``rtrace collect`` calls it; returns
    False where there is no glibc ``mallopt`` (macOS, musl: nothing changed)."""
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    m_mmap_threshold = -3  # glibc's malloc.h; setting it also stops the dynamic adjustment
    return bool(mallopt(m_mmap_threshold, COLLECTOR_MMAP_THRESHOLD))


def release_memory() -> bool:
    """Give the free pages of glibc's heaps back to the system (``malloc_trim(0)``). The
    collector's threads (gRPC's, the receiver's, the worker, the sinks) each allocate from
    a heap of their own, and a heap returns memory only from its top: after a burst of
    large requests, ~100-200 MiB stayed free inside them. ``rtrace collect`` calls this
    once a second for the first ten seconds without a request. False without glibc."""
    import ctypes

    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim(0)
    return True


def is_loopback(host: str) -> bool:
    """``host`` binds this machine only (127.0.0.0/8, ::1, localhost)."""
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a name: resolved by the system, assume it reaches beyond
        return False


def start_collector(*, host: str = "127.0.0.1", port: int = 0, http_port: int | None = None,
                    settle_s: float = 2.0, trainer_tokenizer: Any = None, **settings: Any) -> Collector:
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
        trainer_tokenizer: returns the tokenizer a trainer adapter handed in, in this
            process (``rtrace.start_collector`` passes rtrace's), or None.

    Returns:
        The running :class:`Collector` (also a context manager: ``stop()`` on exit).

    Raises:
        ConfigError: a bad setting, or no sink.
    """
    collector = Collector(load_settings(settings), host=host, port=port, http_port=http_port, settle_s=settle_s,
                          trainer_tokenizer=trainer_tokenizer)
    _annotations.local_target = collector.annotate
    _fleet.local_target = collector.submit_events
    return collector
