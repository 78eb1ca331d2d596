"""Backends' private APIs: quarantined in one module per backend, checked against the installed versions.

* the canary: every name listed in ``_trackio_private.PRIVATE_NAMES`` /
  ``_mlflow_private.PRIVATE_NAMES`` still exists in the installed trackio / MLflow
  (instance attributes on a real instance), and each wrapper still does its job against
  the real backend; a failure names the private name that moved;
* the quarantine: no other rtrace module touches a trackio or MLflow private name.
"""

from __future__ import annotations

import ast
import importlib
import re
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from rtrace.compat import _areal_private, _skyrl_private, _trl_private
from rtrace.exporters import _mlflow_private, _trackio_private

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "rtrace"
QUARANTINE = {PACKAGE / "exporters" / "_trackio_private.py", PACKAGE / "exporters" / "_mlflow_private.py",
              PACKAGE / "compat" / "_trl_private.py", PACKAGE / "compat" / "_skyrl_private.py",
              PACKAGE / "compat" / "_areal_private.py", PACKAGE / "compat" / "_open_instruct_private.py"}
#: Modules that handle backend / trainer objects: no private attribute of anything but themselves.
SINK_MODULES = [PACKAGE / "exporters" / name for name in ("trackio.py", "mlflow.py", "otlp.py", "otel.py")]
#: The trainer adapters: no private attribute of a foreign object either (their listed names are
#: as generic as `workflow` or `get`: those are not searched for by name).
ADAPTER_MODULES = [PACKAGE / "compat" / name for name in ("trl.py", "skyrl.py", "areal.py", "open_instruct.py")]
BACKENDS = ("trackio", "mlflow", "trl", "skyrl_train", "skyrl", "areal", "open_instruct")
#: The quarantine modules' own names: calling their functions is how the others get there.
WRAPPERS = ("_trackio_private", "_mlflow_private", "_trl_private", "_skyrl_private", "_areal_private",
            "_open_instruct_private")
#: The last step of every listed private name (``_stop_flag``, ``current_run``,
#: ``ManagedSessionMaker``...): internal names without an underscore are caught too.
LISTED = {name.rpartition(":")[2].split(".")[-1]
          for name in (*_trackio_private.PRIVATE_NAMES, *_mlflow_private.PRIVATE_NAMES)}
#: The trainers' patched / private names: checked by each framework's canary test
#: (tests/frameworks), kept out of the other modules by the underscore checks.
ADAPTER_NAMES = (*_trl_private.PRIVATE_NAMES, *_skyrl_private.PRIVATE_NAMES, *_areal_private.PRIVATE_NAMES)


def resolve(name: str, instances: dict[str, object]) -> object:
    """The object a ``"module:attr.path"`` name points at. A step missing on a class is
    looked up on the real instance given for that class in ``instances``; a step into a
    dict is a key.

    Raises:
        AssertionError: naming the private name that moved and the installed version.
    """
    module_name, _, path = name.partition(":")
    top = module_name.split(".")[0]
    version = getattr(sys.modules.get(top) or importlib.import_module(top), "__version__", "?")
    try:
        obj: object = importlib.import_module(module_name)
    except ImportError as exc:
        raise AssertionError(f"private API moved: {name} (module {module_name} not found in {top} {version}: "
                             f"{exc})") from None
    done: list[str] = []
    for step in path.split("."):
        owner = f"{module_name}:{'.'.join(done)}"
        if isinstance(obj, dict):
            if step not in obj:
                raise AssertionError(f"private API moved: {name} (no key {step!r} in {top} {version})")
            obj = obj[step]
        elif hasattr(obj, step):
            obj = getattr(obj, step)
        elif isinstance(obj, type) and owner in instances and hasattr(instances[owner], step):
            obj = getattr(instances[owner], step)
        else:
            raise AssertionError(f"private API moved: {name} (no attribute {step!r} in {top} {version})")
        done.append(step)
    return obj


# ----------------------------------------------------------------------------- quarantine
def _private(attr: str) -> bool:
    return attr.startswith("_") and not (attr.startswith("__") and attr.endswith("__"))


def _backend_private_module(module: str) -> bool:
    parts = module.split(".")
    return parts[0] in BACKENDS and any(_private(p) for p in parts[1:])


def violations(path: Path, strict: bool, listed: bool = True) -> list[str]:
    """Where ``path`` touches a backend private name: imports of private backend modules
    or names, strings naming them (``sys.modules.get(...)``); with ``strict`` (sink
    modules) also any ``obj._name`` or ``getattr(obj, "_name")`` on an object that is not
    ``self`` / ``cls``, and any use of a name listed in a quarantine module (as an
    attribute, a variable, an imported name or a string)."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    where = lambda node: (node.lineno, f"{shown}:{node.lineno}")  # noqa: E731
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] in BACKENDS and (
                    _backend_private_module(node.module) or any(_private(a.name) for a in node.names)):
                found.append((*where(node), f"from {node.module} import {', '.join(a.name for a in node.names)}"))
        elif isinstance(node, ast.Import):
            found += [(*where(node), f"import {a.name}") for a in node.names if _backend_private_module(a.name)]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if re.fullmatch(r"(trackio|mlflow|trl|skyrl_train|skyrl|areal|open_instruct)(\.\w+)+", node.value) and \
                    _backend_private_module(node.value):
                found.append((*where(node), repr(node.value)))
        if not strict:
            continue
        wrapper = (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                   and node.value.id in WRAPPERS)  # the quarantine's own API
        used = None if wrapper else (node.attr if isinstance(node, ast.Attribute)
                                     else node.id if isinstance(node, ast.Name)
                                     else node.value if isinstance(node, ast.Constant)
                                     and isinstance(node.value, str) else None)
        if listed and (used in LISTED or (isinstance(node, ast.ImportFrom) and any(a.name in LISTED for a in node.names))):
            found.append((*where(node), f"{ast.unparse(node)} (listed as private)"))
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append((*where(node), ast.unparse(node)))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and _private(node.args[1].value)):
            found.append((*where(node), ast.unparse(node)))
    return [f"{place}: {what}" for _, place, what in sorted(found)]


def test_no_backend_private_name_outside_the_quarantine():
    """No rtrace module but _trackio_private / _mlflow_private imports, names or reads a trackio or MLflow private name."""
    modules = sorted(p for p in PACKAGE.rglob("*.py") if p not in QUARANTINE)
    assert set(SINK_MODULES) <= set(modules)
    assert set(ADAPTER_MODULES) <= set(modules)
    found = [v for p in modules for v in violations(p, strict=p in SINK_MODULES or p in ADAPTER_MODULES,
                                                     listed=p in SINK_MODULES)]
    assert found == [], "backend private names outside the quarantine modules:\n" + "\n".join(found)


def test_the_quarantine_check_finds_what_it_must(tmp_path):
    """The check flags the forms a private access takes (so a passing check means something)."""
    bad = tmp_path / "bad.py"
    bad.write_text("\n".join([
        "from mlflow.tracing.utils.otlp import _set_otel_proto_anyvalue",
        "from mlflow.tracking._tracking_service import utils",
        "import mlflow.tracking._tracking_service.utils",
        "m = sys.modules.get('mlflow.tracking._tracking_service.utils')",
        "store = client._tracking_client.store",
        "flag = getattr(run, '_stop_flag', None)",
        "run = trackio.context_vars.current_run.get()",
        "with store.ManagedSessionMaker() as session: pass",
        "ok = self._lock",
    ]))
    lines = {int(v.split(":")[1]) for v in violations(bad, strict=True)}
    assert lines == {1, 2, 3, 4, 5, 6, 7, 8}  # every line but the last


@pytest.mark.parametrize("module", [_trackio_private, _mlflow_private])
def test_private_names_are_declared(module):
    """Each quarantine module lists its private names at the top, once each, as "module:attribute.path"."""
    names = module.PRIVATE_NAMES
    assert names and len(set(names)) == len(names)
    for name in names:
        mod, _, path = name.partition(":")
        assert mod.split(".")[0] in (*BACKENDS, "threading") and path, name


# ----------------------------------------------------------------------------- trackio canary
@pytest.fixture(scope="module")
def trackio_mod(tmp_path_factory):
    """trackio imported with TRACKIO_DIR in a temporary directory (HF_HUB_OFFLINE=1)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        if "trackio" not in sys.modules:
            mp.setenv("TRACKIO_DIR", str(tmp_path_factory.mktemp("trackio")))
        trackio = pytest.importorskip("trackio")
        from trackio import utils

        if not str(utils.TRACKIO_DIR).startswith(tempfile.gettempdir()):
            pytest.fail(f"trackio was imported before this module with TRACKIO_DIR={utils.TRACKIO_DIR}")
        yield trackio


class TestTrackioCanary:
    def test_every_listed_name_exists(self, trackio_mod):
        """Every name in _trackio_private.PRIVATE_NAMES resolves in the installed trackio (on a real Run)."""
        run = trackio_mod.init(project=f"canary-{uuid.uuid4().hex[:8]}", name="names", auto_log_cpu=False,
                               auto_log_gpu=False, embed=False)
        try:
            instances = {"trackio.run:Run": run, "threading:Thread": threading.current_thread()}
            for name in _trackio_private.PRIVATE_NAMES:
                resolve(name, instances)
        finally:
            run.finish()

    def test_wrappers_do_their_job(self, trackio_mod, capsys):
        """current_run, runs_with_writer_threads, run_created_at, flush_run and run_is_finished work on a real run."""
        from trackio.sqlite_storage import SQLiteStorage

        project = f"canary-{uuid.uuid4().hex[:8]}"
        run = trackio_mod.init(project=project, name="wrappers", auto_log_cpu=False, auto_log_gpu=False,
                               embed=False)
        try:
            assert _trackio_private.current_run() is run
            assert run in _trackio_private.runs_with_writer_threads(trackio_mod.Run)
            assert re.match(r"\d{4}-\d\d-\d\dT", _trackio_private.run_created_at(run))
            assert not _trackio_private.run_is_finished(run)
            run.log({"canary/x": 1.0}, step=3)
            assert _trackio_private.flush_run(run, time.monotonic() + 30)
            # written when flush_run returns, not 0.5 s later by the writer thread
            rows = [r for r in SQLiteStorage.get_logs(project, "wrappers") if "canary/x" in r]
            assert [(r["step"], r["canary/x"]) for r in rows] == [(3, 1.0)]
        finally:
            trackio_mod.finish()
        assert _trackio_private.run_is_finished(run)
        assert _trackio_private.current_run() is None


# ----------------------------------------------------------------------------- MLflow canary
@pytest.fixture
def mlflow_app(tmp_path, monkeypatch):
    """MLflow with a SQLite tracking URI; the global state it sets is undone afterwards."""
    mlflow = pytest.importorskip("mlflow")
    from mlflow.tracking import fluent
    from mlflow.tracking._tracking_service import utils

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(utils, "_tracking_uri", None)
    monkeypatch.setattr(fluent, "_active_experiment_id", None)
    for key in ("MLFLOW_EXPERIMENT_ID", "MLFLOW_TRACKING_URI"):
        monkeypatch.setenv(key, "")  # so that monkeypatch removes what mlflow exports
        monkeypatch.delenv(key)
    uri = f"sqlite:///{tmp_path}/canary.db"
    mlflow.set_tracking_uri(uri)
    yield mlflow, uri
    while mlflow.active_run() is not None:
        mlflow.end_run()


class TestMlflowCanary:
    def test_every_listed_name_exists(self, mlflow_app):
        """Every name in _mlflow_private.PRIVATE_NAMES resolves in the installed MLflow (on a real SQL store)."""
        from mlflow.tracing.client import TracingClient

        _, uri = mlflow_app
        store = TracingClient(tracking_uri=uri).store
        for name in _mlflow_private.PRIVATE_NAMES:
            resolve(name, {"mlflow.store.tracking.sqlalchemy_store:SqlAlchemyStore": store})

    def test_active_run_and_experiment_seen_from_another_thread(self, mlflow_app):
        """active_run_ids_by_thread and active_experiment_id see, from another thread, what the app set."""
        mlflow, _ = mlflow_app
        assert _mlflow_private.active_experiment_id() is None
        exp = mlflow.set_experiment("canary")
        with mlflow.start_run() as run:
            seen = {}
            worker = threading.Thread(target=lambda: seen.update(
                runs=_mlflow_private.active_run_ids_by_thread(), exp=_mlflow_private.active_experiment_id()))
            worker.start()
            worker.join()
        assert seen["runs"] == {threading.get_ident(): run.info.run_id}
        assert seen["exp"] == exp.experiment_id
        assert _mlflow_private.active_run_ids_by_thread() == {}

    def test_upsert_trace_tags_writes_and_validates(self, mlflow_app):
        """upsert_trace_tags writes tags readable with get_trace, overwrites, truncates long values, skips bad keys."""
        from mlflow.entities import Span
        from mlflow.tracing.client import TracingClient
        from mlflow.tracking import MlflowClient
        from opentelemetry.sdk.resources import Resource

        from rtrace.exporters.otel import to_otlp_protos
        from rtrace.trajectory import SpanRecord, Trajectory

        mlflow, uri = mlflow_app
        tracing = TracingClient(tracking_uri=uri)
        assert _mlflow_private.supports_bulk_tags(tracing.store)
        exp = MlflowClient(tracking_uri=uri).create_experiment("tags")
        traj = Trajectory(uuid.uuid4().hex, "root", [SpanRecord("ab" * 8, None, "root", "rollout", 1, 2)])
        protos = to_otlp_protos(traj, Resource.get_empty())
        tracing.log_spans(exp, [Span.from_otel_proto(p) for p in protos])
        tid = "tr-" + traj.trace_id
        skipped = _mlflow_private.upsert_trace_tags(tracing.store, [
            (tid, "step", "1"), (tid, "long", "x" * 10_000), (tid, "bad/../key", "v")])
        assert _mlflow_private.upsert_trace_tags(tracing.store, [(tid, "step", "2")]) == 0
        tags = MlflowClient(tracking_uri=uri).get_trace(tid).info.tags
        assert skipped == 1 and "bad/../key" not in tags
        assert tags["step"] == "2"
        assert 0 < len(tags["long"]) < 10_000 and tags["long"] == "x" * len(tags["long"])


    def test_insert_assessments_reads_back_as_log_feedback_writes(self, mlflow_app):
        """insert_assessments writes what mlflow.log_feedback would (read back through the public API,
        searchable), in one transaction; an assessment of an unknown trace is left out and counted."""
        from mlflow.entities import AssessmentSource, Feedback, Span
        from mlflow.store.tracking.dbmodels.models import SqlTraceInfo
        from mlflow.tracing.client import TracingClient
        from mlflow.tracking import MlflowClient
        from opentelemetry.sdk.resources import Resource

        from rtrace.exporters.otel import to_otlp_protos
        from rtrace.trajectory import SpanRecord, Trajectory

        mlflow, uri = mlflow_app
        for column in ("request_id", "experiment_id", "timestamp_ms"):  # read by insert_assessments
            assert hasattr(SqlTraceInfo, column), column
        tracing = TracingClient(tracking_uri=uri)
        assert _mlflow_private.supports_bulk_assessments(tracing.store)
        exp = MlflowClient(tracking_uri=uri).create_experiment("assessments")
        traj = Trajectory(uuid.uuid4().hex, "root", [SpanRecord("ab" * 8, None, "root", "rollout", 1, 2)])
        tracing.log_spans(exp, [Span.from_otel_proto(p) for p in to_otlp_protos(traj, Resource.get_empty())])
        tid, source = "tr-" + traj.trace_id, AssessmentSource(source_type="CODE", source_id="rtrace")
        missing = _mlflow_private.insert_assessments(tracing.store, [
            Feedback(name="reward", value=0.75, source=source, trace_id=tid),
            Feedback(name="verdict", value="wrong", source=source, trace_id=tid),
            Feedback(name="reward", value=1.0, source=source, trace_id="tr-" + "0" * 32)])
        assert missing == 1
        info = MlflowClient(tracking_uri=uri).get_trace(tid).info
        got = {a.name: (a.value, a.source.source_id, a.trace_id) for a in info.assessments}
        assert got == {"reward": (0.75, "rtrace", tid), "verdict": ("wrong", "rtrace", tid)}
        found = mlflow.search_traces(locations=[exp], filter_string="feedback.reward > 0.5", return_type="list")
        assert [t.info.trace_id for t in found] == [tid]


class TestOtelCanary:
    """The OpenTelemetry API internals the hot path reads (rtrace/instrumentation/_otel_private.py)."""

    def test_every_listed_name_exists_and_the_fast_path_is_on(self):
        from rtrace.instrumentation import _otel_private

        for name in _otel_private.PRIVATE_NAMES:
            resolve(name, {})
        assert _otel_private.FAST  # the default runtime context: the ContextVar is used

    def test_the_functions_agree_with_the_public_api(self):
        from opentelemetry import context, trace
        from opentelemetry.trace import INVALID_SPAN, NonRecordingSpan, SpanContext, TraceFlags

        from rtrace.instrumentation import _otel_private as fast

        span = NonRecordingSpan(SpanContext(3, 4, False))
        outer = trace.get_current_span()
        token = fast.attach_span(span)
        try:
            assert trace.get_current_span() is span is fast.current_span() is fast.current_value()
            inner = NonRecordingSpan(SpanContext(3, 5, False))
            public = context.attach(trace.set_span_in_context(inner))
            assert fast.current_span() is inner
            context.detach(public)
            assert fast.current_span() is span
        finally:
            fast.detach(token)
        assert trace.get_current_span() is outer is fast.current_span()
        assert fast.current_span() is INVALID_SPAN or fast.current_value() is outer
        flags = TraceFlags(TraceFlags.SAMPLED)
        state = SpanContext(1, 1, False).trace_state
        made, public_made = fast.span_context(5, 6, flags, state), SpanContext(5, 6, False, flags, state)
        assert made == public_made and type(made) is SpanContext
        assert (made.trace_id, made.span_id, made.is_remote, made.trace_flags, made.trace_state, made.is_valid) == (
            5, 6, False, flags, state, True)

    def test_a_token_of_another_context_is_logged_not_raised(self, caplog):
        import contextvars

        from opentelemetry.trace import NonRecordingSpan, SpanContext

        from rtrace.instrumentation import _otel_private as fast

        token = contextvars.copy_context().run(fast.attach_span, NonRecordingSpan(SpanContext(3, 4, False)))
        fast.detach(token)  # made in another context: the API logs it
        assert "Failed to detach context" in caplog.text

    def test_no_other_module_reads_them(self):
        for path in PACKAGE.rglob("*.py"):
            if path.name == "_otel_private.py":
                continue
            text = path.read_text()
            for name in ("_RUNTIME_CONTEXT", "_current_context", "_SPAN_KEY", "tuple.__new__"):
                assert name not in text, f"{path.relative_to(ROOT)} uses {name}: only _otel_private may"
