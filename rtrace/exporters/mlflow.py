"""MLflow sink: each trajectory becomes one MLflow trace with the full span tree.

MLflow's own tracing exporter refuses spans it did not create, so this sink writes
through the API MLflow itself uses to ingest OTLP: the trajectory's spans come from
rtrace's one OTel conversion (:mod:`rtrace.exporters.otel`: ids, parents — a segment's
remote parent included, so a trajectory that crossed processes is one trace with one
root —, status, events, attributes) with MLflow's attributes added on top, encoded by
rtrace's OTLP writer (the bytes the OTel SDK's encoder makes, exporters/otlp_wire.py) and
read as ``opentelemetry-proto`` messages; ``mlflow.entities.Span.from_otel_proto`` turns each
protobuf into an MLflow span, and one ``TracingClient.log_spans(experiment_id, spans)``
call writes a whole batch of trajectories (against a ``mlflow server`` the same encoded
request goes in one POST to ``/v1/traces``). The traces are then linked to the training
run with ``MlflowClient.link_traces_to_run`` (100 per call, MLflow's limit). These are
MLflow APIs without a stability promise: :func:`check_mlflow_version` holds the sink to
the tested version range. The few private MLflow names the sink needs live in
:mod:`rtrace.exporters._mlflow_private`, and nowhere else.

What MLflow shows (see docs/mlflow.md):

* span types: the root and ``agent`` spans AGENT, ``generation`` LLM, ``tool`` TOOL, the
  rest CHAIN; inputs / outputs as captured, except generations: their prompt as chat
  messages (``{"messages": [...]}``, which MLflow renders as a chat) and the decoded
  response (``rtrace.response_text``) when token2text is on;
* trace tags on the root (``mlflow.traceTag.<k>``): step, sample_index, rollout_n,
  validate, experiment_name, group_id, policy_version, reward (plus ``extra.<k>``), as
  normalised strings (veRL's names and values where they overlap), so
  ``search_traces(filter_string="tags.step = '1'")`` works;
* the trace's request / response previews: the first user message and the final
  assistant message of the trajectory;
* the reward terms as MLflow assessments (``reward``, ``verdict``, each outcome
  component: :mod:`rtrace.exporters.mlflow_assessments`), written after the spans;
* with ``RTRACE_SEMCONV=both``, the GenAI conventions' names and attributes too
  (docs/semconv.md): MLflow's own span type and inputs, set here, take precedence over its
  reading of them.

Everything here runs in the sink thread; ``import mlflow`` happens on the first export.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import math
import os
import re
import sys
import threading
import time
from typing import Any, Sequence

from .. import _stats
from .._serialize import bidi_visible_messages, finite_or_str
from ..config import ConfigError, Settings, uri_scheme
from ..trajectory import MESSAGE_INDEX, SpanRecord, StepMetrics, Trajectory, chat_argument
from . import _mlflow_private
from .base import Sink
from .mlflow_assessments import feedbacks
from .otel import DEFAULT_MAX_VALUE_CHARS, DEFAULT_SEMCONV, otlp_spans, to_otlp_request

__all__ = ["MlflowSink", "check_mlflow_version", "trace_tags", "tag_value", "MLFLOW_VERSION_RANGE"]

#: The MLflow versions the sink is tested against (pyproject's ``mlflow`` extra).
MLFLOW_VERSION_RANGE = ((3, 16), (3, 19))  # >= 3.16, < 3.19

_SPAN_TYPES = {"rollout": "AGENT", "agent": "AGENT", "generation": "LLM", "tool": "TOOL"}
#: Trace tags from the trajectory's fields: (tag, field). The names and values veRL's MLflow
#: backend writes where they overlap (step, sample_index, rollout_n, validate as 'True' /
#: 'False', experiment_name), so the same searches work on both.
_TAG_FIELDS = (("step", "step"), ("sample_index", "sample_index"), ("rollout_n", "rollout_n"),
               ("validate", "validate"), ("experiment_name", "experiment"), ("group_id", "group_id"),
               ("policy_version", "policy_version"), ("reward", "reward"))
#: MLflow accepts at most 100 trace ids per link_traces_to_run call.
_LINK_CHUNK = 100
#: Spans per store call: large batches amortise the ~26 ms a call costs, and stay a
#: reasonable HTTP body against a server.
_MAX_SPANS_PER_CALL = 5000


def check_mlflow_version() -> str:
    """Check, without importing it, that MLflow is installed in the tested range (and
    ``opentelemetry-proto``, whose messages MLflow reads the spans from).

    Returns:
        The installed version.

    Raises:
        ConfigError: MLflow is missing or outside :data:`MLFLOW_VERSION_RANGE`, or
            ``opentelemetry-proto`` is.
    """
    lo, hi = MLFLOW_VERSION_RANGE
    wanted = f"mlflow>={lo[0]}.{lo[1]},<{hi[0]}.{hi[1]}"
    version = None
    if importlib.util.find_spec("mlflow") is not None:
        for dist in ("mlflow", "mlflow-skinny"):
            try:
                version = importlib.metadata.version(dist)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    if version is None:
        raise ConfigError(f"RTRACE_EXPORTER=mlflow needs {wanted}, which is not installed; "
                          "install it with: pip install 'rtrace[mlflow]'")
    release = tuple(int(x) for x in re.findall(r"\d+", version)[:2])
    if not lo <= release < hi:
        raise ConfigError(
            f"RTRACE_EXPORTER=mlflow needs {wanted}, found mlflow {version}: the sink writes through "
            "MLflow's span ingestion APIs (Span.from_otel_proto, TracingClient.log_spans), which change between "
            "minor versions; install a tested version with: pip install 'rtrace[mlflow]'")
    try:
        proto = importlib.util.find_spec("opentelemetry.proto.collector.trace.v1.trace_service_pb2")
    except ImportError:  # a parent package is missing
        proto = None
    if proto is None:
        raise ConfigError("RTRACE_EXPORTER=mlflow needs opentelemetry-proto (the OTLP messages MLflow reads "
                          "spans from), which is not installed; install it with: pip install 'rtrace[mlflow]'")
    return version


def tag_value(value: Any) -> str:
    """A trace tag value as a normalised string: ``'true'``/``'false'``, integers (also
    integral floats) without ``.0``, ``'NaN'`` / ``'Infinity'`` / ``'-Infinity'``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(finite_or_str(value))
        return str(int(value)) if value.is_integer() else repr(value)
    return str(value)


def tag_safe(value: Any) -> Any:
    """A table cell MLflow's JSON writer takes: non-finite floats as strings."""
    return finite_or_str(value) if isinstance(value, float) else value


def trace_tags(traj: Trajectory) -> dict[str, str]:
    """The searchable trace tags of a trajectory (None values left out). ``validate`` is
    ``'True'`` / ``'False'``, as veRL writes it (``str(validate)``)."""
    tags = {tag: tag_value(getattr(traj, field)) for tag, field in _TAG_FIELDS if getattr(traj, field) is not None}
    tags["validate"] = str(bool(traj.validate))
    # correct / wrong / truncated / error / partial / ok: `tags.verdict = 'wrong'` finds the failures
    tags["verdict"] = traj.verdict()
    for key, value in traj.extra.items():
        if isinstance(value, (str, int, float, bool)):
            tags[f"extra.{key}"] = tag_value(value)
    if traj.partial:
        tags["partial"] = "true"
    if traj.kept:
        tags["kept"] = ",".join(traj.kept)
    if traj.health:  # `tags.health LIKE '%token_continuity%'` finds the broken ones
        tags["health"] = ",".join(sorted({f["check"] for f in traj.health}))
    for key, value in traj.annotations.items():  # advantage, returns ... (never over a standard tag)
        if isinstance(value, (str, int, float, bool)) and key not in tags:
            tags[key] = tag_value(value)
    return tags


# ----------------------------------------------------------------------------- conversion


def _llm_inputs(traj: Trajectory, span: SpanRecord) -> Any:
    """A generation's inputs as chat messages, ``{"messages": [...], <other arguments>}``
    (the OpenAI request shape, which MLflow renders as a chat): the conversation the call
    was given; else the conversation up to the turn it produced; else its decoded prompt
    as one user message; else what it captured."""
    inputs = span.input
    chat = chat_argument(inputs)
    if chat is not None:
        key, msgs = chat
        return {**{k: v for k, v in inputs.items() if k != key}, "messages": msgs}
    rest = inputs if isinstance(inputs, dict) else {}
    index = span.attributes.get(MESSAGE_INDEX)
    if traj.turn_of(span) is not None and index > 0:
        return {**rest, "messages": traj.messages[:index]}
    prompt = span.attributes.get("rtrace.prompt_text")
    if isinstance(prompt, str):
        return {**rest, "messages": [{"role": "user", "content": prompt}]}
    return inputs


def span_io(traj: Trajectory, span: SpanRecord, is_root: bool) -> tuple[Any, Any]:
    """The (inputs, outputs) MLflow shows for ``span``.

    Generations show their prompt as chat messages (:func:`_llm_inputs`) and their
    decoded response when token2text produced it. The root shows what its call captured;
    when it captured nothing (a ``rollout_context`` root) it shows the conversation's
    opening and final messages in chat format, which MLflow also turns into the trace's
    request / response previews (their bidirectional controls written as ``⟨U+202E⟩``). A dict input gets a ``messages`` entry so the preview is
    the user's task rather than the raw arguments.
    """
    inputs, outputs = span.input, span.output
    attrs = span.attributes
    if span.kind == "generation":
        inputs = _llm_inputs(traj, span)
        outputs = attrs.get("rtrace.response_text", outputs)
    if is_root and traj.messages:
        # what MLflow shows as the trace's request and response: bidirectional controls visible
        opening = bidi_visible_messages(traj.task_messages())
        final = traj.final_answer()
        final = bidi_visible_messages([final])[0] if final is not None else None
        if inputs is None:
            inputs = {"messages": opening}
        elif isinstance(inputs, dict) and "messages" not in inputs:
            inputs = {**inputs, "messages": opening}
        if outputs is None and final is not None:
            outputs = {"messages": [final]}
    return inputs, outputs


def mlflow_attributes(traj: Trajectory, span: SpanRecord, is_root: bool, tag_attributes: bool = True
                      ) -> dict[str, Any]:
    """The MLflow attributes added on top of the shared OTel ones: span type, inputs,
    outputs and, on the root, the trace name and (with ``tag_attributes``) the trace
    tags as ``mlflow.traceTag.<k>`` (the store turns them into tags).

    Inputs and outputs go as structured values (OTLP maps and lists), which MLflow
    decodes and stores as JSON once. JSON text would be cheaper to encode, but MLflow
    stores a string attribute JSON-encoded again: 3.17 strips that extra layer when it
    stores a span, 3.18 no longer does, and the inputs would read back as text.
    """
    attrs: dict[str, Any] = {"mlflow.spanType": "AGENT" if is_root else _SPAN_TYPES.get(span.kind, "CHAIN")}
    inputs, outputs = span_io(traj, span, is_root)
    if inputs is not None:
        attrs["mlflow.spanInputs"] = inputs
    if outputs is not None:
        attrs["mlflow.spanOutputs"] = outputs
    if is_root:
        # MLflow reads trace tags from a span without parent only: on a segment root
        # (whose parent is remote) they are ignored, and the driver's root names the trace.
        attrs["mlflow.traceTag.mlflow.traceName"] = traj.name
        if tag_attributes:
            for key, value in trace_tags(traj).items():
                attrs[f"mlflow.traceTag.{key}"] = value
    return attrs


class _Converter:
    """Trajectories -> OTel spans (the shared conversion) with MLflow's attributes."""

    def __init__(self, max_value_chars: int = DEFAULT_MAX_VALUE_CHARS, semconv: str = DEFAULT_SEMCONV,
                 provider: str | None = None) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope

        from .. import __version__

        # No resource attributes: MLflow would store each one as a tag on every trace
        # (one merge per tag and trace).
        self.resource = Resource.get_empty()
        self.scope = InstrumentationScope("rtrace", __version__)
        self.max_value_chars = max_value_chars
        self.semconv = semconv
        self.provider = provider

    def request(self, trajectories: Sequence[Trajectory], tag_attributes: bool = True) -> Any:
        """One OTLP request holding the spans of ``trajectories``, MLflow's attributes included."""
        def extra(traj: Trajectory, span: SpanRecord, is_root: bool) -> dict[str, Any]:
            return mlflow_attributes(traj, span, is_root, tag_attributes)

        return to_otlp_request(trajectories, self.resource, self.scope, self.max_value_chars, extra, self.semconv,
                               self.provider)

    def trajectory(self, traj: Trajectory, tag_attributes: bool = True) -> list[Any]:
        """The OTLP protobuf spans of one trajectory."""
        return otlp_spans(self.request([traj], tag_attributes))


#: What the first export imports beyond exporters.APP_THREAD_IMPORTS: the tracking
#: store of the URI's kind (SQLAlchemy, alembic... for a database) and the span
#: translation. Imported on the configuring thread (see APP_THREAD_IMPORTS for why); the
#: store itself, with its database I/O, is still made in the sink thread.
_FIRST_EXPORT_IMPORTS = ("mlflow.tracing.otel.translation", "mlflow.protos.internal_pb2",
                         "opentelemetry.proto.collector.trace.v1.trace_service_pb2")
_DB_STORE_IMPORTS = ("mlflow.store.tracking.sqlalchemy_store", "mlflow.store.db.utils",
                     "mlflow.store.tracking.sqlalchemy_workspace_store",
                     "mlflow.store.tracking.file_store", "mlflow.store.workspace.utils", "alembic.command",
                     "alembic.config", "netrc")


def _import_store_modules(uri: str | None) -> None:
    scheme = uri_scheme(uri)
    names = _FIRST_EXPORT_IMPORTS
    if scheme not in ("http", "https", "databricks", "file", ""):  # a database URI
        dialect = scheme.split("+", 1)[0]
        dialect = {"postgres": "postgresql"}.get(dialect, dialect)
        names += _DB_STORE_IMPORTS + (f"sqlalchemy.dialects.{dialect}",)
    for name in names:
        try:
            importlib.import_module(name)
        except Exception:  # imported (or failing, counted) at the first export instead
            pass


def _chunks(trajectories: Sequence[Trajectory], max_spans: int) -> list[Sequence[Trajectory]]:
    """Consecutive groups of whole trajectories of at most ``max_spans`` spans (a longer
    trajectory is a group of its own)."""
    groups: list[Sequence[Trajectory]] = []
    start, spans = 0, 0
    for i, traj in enumerate(trajectories):
        if spans and spans + len(traj.spans) > max_spans:
            groups.append(trajectories[start:i])
            start, spans = i, 0
        spans += len(traj.spans)
    if start < len(trajectories):
        groups.append(trajectories[start:])
    return groups


# ----------------------------------------------------------------------------- backends


class _StoreBackend:
    """Any tracking URI MLflow has a store for (SQLite, other SQL databases...).

    ``log_spans`` turns each ``mlflow.traceTag.<k>`` root attribute into its own
    ``session.merge`` (a SELECT and an INSERT per tag): with 8 tags that is most of the
    cost of a trace. On a SQL store the tags are written instead with one upsert per
    batch into the same table (:func:`_mlflow_private.upsert_trace_tags`).
    """

    def __init__(self, uri: str) -> None:
        from mlflow.tracing.client import TracingClient
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        self.tracing = TracingClient(tracking_uri=uri)
        self.bulk_tags = _mlflow_private.supports_bulk_tags(self.tracing.store)
        #: a batch's assessments in one transaction (RTRACE_MLFLOW_ASSESSMENTS=auto writes them then)
        self.bulk_assessments = _mlflow_private.supports_bulk_assessments(self.tracing.store)
        self.max_spans_per_call = _MAX_SPANS_PER_CALL

    def experiment_id(self, name: str) -> str:
        from mlflow.exceptions import MlflowException

        exp = self.client.get_experiment_by_name(name)
        if exp is not None:
            return exp.experiment_id
        try:
            return self.client.create_experiment(name)
        except MlflowException:  # another process created it first
            exp = self.client.get_experiment_by_name(name)
            if exp is None:
                raise
            return exp.experiment_id

    def run_experiment_id(self, run_id: str) -> str:
        return self.client.get_run(run_id).info.experiment_id

    def log(self, experiment_id: str, request: Any) -> None:
        """Write the spans of an OTLP request, converted by MLflow's own OTLP reader."""
        from mlflow.entities import Span

        self.tracing.log_spans(experiment_id, [Span.from_otel_proto(p) for p in otlp_spans(request)])

    def set_tags(self, tags: dict[str, dict[str, str]]) -> None:
        """Upsert ``{trace_id: {key: value}}`` in one statement."""
        rows = [(trace_id, key, value) for trace_id, kv in tags.items() for key, value in kv.items()]
        skipped = _mlflow_private.upsert_trace_tags(self.tracing.store, rows)
        if skipped:
            _stats.incr("sink.mlflow.invalid_tags", skipped)

    def link(self, trace_ids: list[str], run_id: str) -> None:
        self.client.link_traces_to_run(trace_ids, run_id)

    def log_assessments(self, assessments: list[Any]) -> int:
        """Write assessments of stored traces: one transaction on a SQL store
        (:func:`_mlflow_private.insert_assessments`), else MLflow's one call each.

        Returns:
            How many were not written (their trace was not found).
        """
        store = self.tracing.store
        if self.bulk_assessments:
            return _mlflow_private.insert_assessments(store, assessments)
        for assessment in assessments:
            self.tracing.log_assessment(assessment.trace_id, assessment)
        return 0


class _HttpBackend:
    """A ``mlflow server`` over HTTP, with bounded retries and timeouts.

    MLflow's client retries a failing request 7 times with exponential backoff and waits
    up to 120 s for each (``MLFLOW_HTTP_REQUEST_MAX_RETRIES`` / ``_TIMEOUT``): a batch
    sent to a server that is down would hold the sink for minutes. Changing those
    environment variables would also change the training job's own MLflow calls, so this
    backend makes its few requests itself with explicit, small limits.
    """

    MAX_RETRIES = 2
    BACKOFF_FACTOR = 1
    #: per-request timeout: the sink's timeout (RTRACE_SINK_TIMEOUT_S), kept within 10-60 s;
    #: a loaded server can take several seconds for a request of 1000 spans
    TIMEOUT_RANGE_S = (10, 60)
    #: spans per POST, so that one request stays well within the timeout
    max_spans_per_call = 1000
    #: the server turns mlflow.traceTag.<k> attributes into tags
    bulk_tags = False
    #: one request per assessment (no bulk endpoint): RTRACE_MLFLOW_ASSESSMENTS=auto leaves them out
    bulk_assessments = False

    def __init__(self, uri: str, timeout_s: float) -> None:
        from mlflow.tracing.client import TracingClient

        self.creds = TracingClient(tracking_uri=uri).store.get_host_creds()
        lo, hi = self.TIMEOUT_RANGE_S
        self.timeout = int(min(hi, max(lo, timeout_s)))

    def _request(self, endpoint: str, method: str, **kwargs: Any) -> Any:
        from mlflow.utils.rest_utils import http_request, verify_rest_response

        response = http_request(self.creds, endpoint, method, max_retries=self.MAX_RETRIES,
                                backoff_factor=self.BACKOFF_FACTOR, backoff_jitter=0.0, timeout=self.timeout,
                                **kwargs)
        return verify_rest_response(response, endpoint)

    def experiment_id(self, name: str) -> str:
        from mlflow.exceptions import RestException

        try:
            resp = self._request("/api/2.0/mlflow/experiments/get-by-name", "GET",
                                 params={"experiment_name": name})
            return resp.json()["experiment"]["experiment_id"]
        except RestException as exc:
            if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
        try:
            resp = self._request("/api/2.0/mlflow/experiments/create", "POST", json={"name": name})
            return resp.json()["experiment_id"]
        except RestException as exc:  # another process created it first
            if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
            resp = self._request("/api/2.0/mlflow/experiments/get-by-name", "GET",
                                 params={"experiment_name": name})
            return resp.json()["experiment"]["experiment_id"]

    def run_experiment_id(self, run_id: str) -> str:
        resp = self._request("/api/2.0/mlflow/runs/get", "GET", params={"run_id": run_id})
        return resp.json()["run"]["info"]["experiment_id"]

    def log(self, experiment_id: str, request: Any) -> None:
        # What RestStore.log_spans sends: one OTLP request.
        self._request("/v1/traces", "POST", data=request.SerializeToString(),
                      extra_headers={"Content-Type": "application/x-protobuf",
                                     "x-mlflow-experiment-id": experiment_id})

    def link(self, trace_ids: list[str], run_id: str) -> None:
        self._request("/api/2.0/mlflow/traces/link-to-run", "POST", json={"trace_ids": trace_ids, "run_id": run_id})

    def log_assessments(self, assessments: list[Any]) -> int:
        """One request per assessment: what ``RestStore.create_assessment`` sends (the
        server has no bulk endpoint for them)."""
        from mlflow.protos.service_pb2 import CreateAssessment
        from mlflow.utils.proto_json_utils import message_to_json

        for assessment in assessments:
            body = message_to_json(CreateAssessment(assessment=assessment.to_proto()))
            self._request(f"/api/3.0/mlflow/traces/{assessment.trace_id}/assessments", "POST", data=body,
                          extra_headers={"Content-Type": "application/json"})
        return 0


# ----------------------------------------------------------------------------- the sink


def _mlflow_module(name: str) -> Any:
    """An MLflow module if the application already imported it (never imports it)."""
    return sys.modules.get(name)


class MlflowSink(Sink):
    """Writes each trajectory as one MLflow trace, linked to the training job's run.

    Where traces go, resolved on the first export (docs/mlflow.md):

    * tracking URI: ``MLFLOW_TRACKING_URI`` / ``configure(mlflow_tracking_uri=...)``; else
      the URI the application gave ``mlflow.set_tracking_uri()`` or uses for its active
      run; else ``sqlite:///<cwd>/.rtrace/mlflow.db``;
    * run: ``RTRACE_MLFLOW_RUN_ID``; else the application's active MLflow run (looked up
      across threads, since the sink runs in its own thread; the last one seen stays);
    * experiment: the run's experiment when there is a run (so the run's Traces tab and
      ``search_traces(run_id=...)`` find them); else the experiment the application set
      with ``mlflow.set_experiment()``; else ``RTRACE_PROJECT``, created if missing.
    """

    name = "mlflow"

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.mlflow_version = check_mlflow_version()
        self._lock = threading.Lock()
        self._backend: Any = None
        self._converter: _Converter | None = None
        self._uri: str | None = settings.mlflow_tracking_uri
        self._run_id: str | None = settings.mlflow_run_id
        self._explicit_run = settings.mlflow_run_id is not None
        self._experiments: dict[tuple[str, str], str] = {}
        # The active run and tracking URI are the application thread's; capture them now
        # when the application already imported mlflow (this never imports it).
        self._app_thread = threading.get_ident()
        if not self._explicit_run:
            self._run_id = self._active_run_id()
        if self._uri is None:
            self._uri = self._app_tracking_uri()
        _import_store_modules(self._uri)

    # ------------------------------------------------------------------ app state
    def _active_run_id(self) -> str | None:
        """The application's active run, whichever thread started it."""
        try:
            runs = _mlflow_private.active_run_ids_by_thread()
        except Exception:
            _stats.warn_once("mlflow-active-run", "rtrace could not look up the application's active MLflow run",
                             exc_info=True)
            return None
        main = threading.main_thread().ident
        for tid in (self._app_thread, main, *runs):
            if tid in runs:
                return runs[tid]
        return None

    def _app_tracking_uri(self) -> str | None:
        """The tracking URI the application chose (set_tracking_uri, or the one its
        active run lives in); None when it chose none."""
        tracking = _mlflow_module("mlflow.tracking")
        if tracking is None:
            return None
        try:
            if tracking.is_tracking_uri_set() or self._active_run_id() is not None:
                return str(tracking.get_tracking_uri())
        except Exception:
            return None
        return None

    def _app_experiment_id(self) -> str | None:
        try:
            return _mlflow_private.active_experiment_id()
        except Exception:
            _stats.warn_once("mlflow-experiment", "rtrace could not look up the application's MLflow experiment",
                             exc_info=True)
            return None

    # ------------------------------------------------------------------ setup
    def _default_uri(self) -> str:
        folder = os.path.join(os.path.abspath(os.getcwd()), ".rtrace")
        os.makedirs(folder, exist_ok=True)
        return "sqlite:///" + os.path.join(folder, "mlflow.db")

    def _ensure_backend(self) -> Any:
        if self._backend is not None:
            return self._backend
        if self._uri is None:
            self._uri = self._app_tracking_uri() or self._default_uri()
        uri = self._uri
        if uri.startswith(("http://", "https://")):
            backend: Any = _HttpBackend(uri, self.settings.sink_timeout_s)
        elif uri.startswith("sqlite:///"):
            # Several processes (ranks) may create the same database at once: MLflow's
            # schema migration is not safe against that, so the first open is serialised.
            with _file_lock(uri[len("sqlite:///"):] + ".lock"):
                backend = _StoreBackend(uri)
        else:
            backend = _StoreBackend(uri)
        self._converter = _Converter(self.settings.max_value_chars, self.settings.semconv,
                                     self.settings.genai_provider)
        self._backend = backend
        return backend

    def _experiment_for(self, run_id: str | None) -> str:
        backend = self._backend
        if run_id is not None:
            key = ("run", run_id)
            if key not in self._experiments:
                try:
                    self._experiments[key] = backend.run_experiment_id(run_id)
                except Exception as exc:
                    if getattr(exc, "error_code", None) != "RESOURCE_DOES_NOT_EXIST":
                        raise  # the store is unreachable: the batch fails and is counted
                    # A run of another tracking store: write the traces anyway, unlinked.
                    _stats.warn_once("mlflow-run", "rtrace: MLflow run %s is not in %s; traces are not "
                                     "linked to it", run_id, self._uri)
                    self._experiments[key] = ""
            if self._experiments[key]:
                return self._experiments[key]
        app_exp = self._app_experiment_id()
        if app_exp is not None:
            return app_exp
        key = ("name", self.settings.project)
        if key not in self._experiments:
            self._experiments[key] = backend.experiment_id(self.settings.project)
        return self._experiments[key]

    def ensure_run(self, run_name: str | None, tags: dict[str, str] | None = None) -> str:
        """The run traces are linked to: ``RTRACE_MLFLOW_RUN_ID``, else the application's
        active run, else a new run (named ``run_name``) in the project's experiment,
        created now with MLflow's public client. The collector calls it at start, so a
        job has one run and its id can travel in the workers' environment.

        Returns:
            The run id.
        """
        with self._lock:
            if not self._explicit_run:
                self._run_id = self._active_run_id() or self._run_id
            if self._run_id is None:
                self._ensure_backend()
                from mlflow.tracking import MlflowClient

                experiment_id = self._experiment_for(None)
                run = MlflowClient(tracking_uri=self._uri).create_run(experiment_id, run_name=run_name,
                                                                      tags=tags or {})
                self._run_id = run.info.run_id
                self._explicit_run = True
                _stats.incr("sink.mlflow.runs_created")
            return self._run_id

    # ------------------------------------------------------------------ export
    def export(self, trajectories: Sequence[Trajectory]) -> None:
        """Write the batch with as few store calls as possible, then link it to the run.

        Raises:
            Exception: the spans could not be written (the batch counts as failed).
                A failed link is counted (``sink.mlflow.failed_links``) but not raised:
                the traces are stored.
        """
        with self._lock:
            backend = self._ensure_backend()
            if not self._explicit_run:
                self._run_id = self._active_run_id() or self._run_id
            run_id = self._run_id
            experiment_id = self._experiment_for(run_id)
            bulk_tags = backend.bulk_tags
            trace_ids = ["tr-" + traj.trace_id for traj in trajectories]
            for chunk in _chunks(trajectories, backend.max_spans_per_call):
                backend.log(experiment_id, self._converter.request(chunk, tag_attributes=not bulk_tags))
                _stats.incr("sink.mlflow.store_calls")
            if bulk_tags:
                backend.set_tags({tid: trace_tags(t) for tid, t in zip(trace_ids, trajectories)})
                _stats.incr("sink.mlflow.store_calls")
            wanted = self.settings.mlflow_assessments
            if wanted is True or (wanted == "auto" and backend.bulk_assessments):
                self._log_assessments(backend, trajectories, trace_ids)
            if run_id is None or not self._experiments.get(("run", run_id)):
                return
            for i in range(0, len(trace_ids), _LINK_CHUNK):
                chunk = trace_ids[i:i + _LINK_CHUNK]
                try:
                    backend.link(chunk, run_id)
                except Exception:
                    _stats.incr("sink.mlflow.failed_links", len(chunk))
                    _stats.warn_once("mlflow-link", "rtrace could not link MLflow traces to run %s", run_id,
                                     exc_info=True)

    @staticmethod
    def _log_assessments(backend: Any, trajectories: Sequence[Trajectory], trace_ids: list[str]) -> None:
        """The batch's reward terms as assessments (:mod:`rtrace.exporters.mlflow_assessments`).
        A failure is counted (``sink.mlflow.failed_assessments``) but not raised: the
        traces are stored."""
        items = feedbacks(trajectories, trace_ids)
        if not items:
            return
        try:
            missing = backend.log_assessments(items)
        except Exception:
            missing = len(items)
            _stats.warn_once("mlflow-assessments", "rtrace could not log reward assessments to MLflow",
                             exc_info=True)
        _stats.incr("sink.mlflow.store_calls")
        if missing:
            _stats.incr("sink.mlflow.failed_assessments", missing)
        if len(items) - missing:
            _stats.incr("sink.mlflow.assessments", len(items) - missing)

    def export_step_metrics(self, metrics: Sequence[StepMetrics]) -> None:
        """Log each step's metrics on the linked run (``MlflowClient.log_batch``), at that
        step, and its rollouts table (``MlflowClient.log_table``, the run's artifact
        ``rtrace/<rollout|eval>_rollouts/step_<step>.json``: one row per trajectory, the
        slowest marked, each with its trace id). Without a run nothing is logged (counted
        as ``sink.mlflow.step_metrics_without_run``); a table that cannot be written is
        counted as ``sink.mlflow.failed_step_tables`` and the metrics still are."""
        from mlflow.entities import Metric
        from mlflow.tracking import MlflowClient

        with self._lock:
            self._ensure_backend()
            if not self._explicit_run:
                self._run_id = self._active_run_id() or self._run_id
            run_id = self._run_id
            if run_id is None:
                _stats.incr("sink.mlflow.step_metrics_without_run", len(metrics))
                return
            now = int(time.time() * 1000)
            rows = [Metric(key, float(value), now, int(m.step)) for m in metrics for key, value in m.values.items()
                    if isinstance(value, (int, float)) and math.isfinite(value)]
            client = MlflowClient(tracking_uri=self._uri)
            for i in range(0, len(rows), 1000):  # MLflow's log_batch limit
                client.log_batch(run_id, metrics=rows[i:i + 1000])
            for m in metrics:
                if not m.rows:
                    continue
                name = f"rtrace/{'eval' if m.validate else 'rollout'}_rollouts/step_{int(m.step):06d}.json"
                table = {key: [tag_safe(r.get(key)) for r in m.rows] for key in m.rows[0]}
                try:
                    client.log_table(run_id, data=table, artifact_file=name)
                except Exception:
                    _stats.incr("sink.mlflow.failed_step_tables")
                    _stats.warn_once("mlflow-table", "rtrace could not log a step's rollouts table to MLflow run "
                                     "%s", run_id, exc_info=True)

    def shutdown(self) -> None:
        self._backend = None


class _file_lock:
    """An exclusive advisory lock on ``path`` (POSIX; a no-op elsewhere)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd: int | None = None

    def __enter__(self) -> "_file_lock":
        try:
            import fcntl
        except ImportError:
            return self
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.fd is not None:
            import fcntl

            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None
