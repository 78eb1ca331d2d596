"""The one conversion from trajectories to OTel spans (rtrace/exporters/otel.py), and what it buys:
the MLflow and OTLP sinks show a trajectory the same way, and a trajectory that crossed
processes is one MLflow trace with one root."""

from __future__ import annotations

import json
import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import pytest

import rtrace
from rtrace._serialize import Converter
from rtrace.exporters import otel
from rtrace.trajectory import SpanRecord, Trajectory
from tests.otlp_receiver import OtlpHttpReceiver

TRACE = "0af7651916cd43dd8448eb211c80319c"
REMOTE_SPAN = "b7ad6b7169203331"
UNSET, OK, ERROR = 0, 1, 2  # OTLP status codes


def _resource():
    from opentelemetry.sdk.resources import Resource

    return Resource.get_empty()


def _traj(*spans, **kw):
    return Trajectory(TRACE, spans[0].name, list(spans), **kw)


# ----------------------------------------------------------------------------- unit
class TestConversion:
    def test_status_policy(self):
        """error -> ERROR with its description; ok and unset (a stand-in root) -> UNSET, never OK."""
        root = SpanRecord("a" * 16, None, "rollout", "rollout", 1, 9, status="unset")
        ok = SpanRecord("b" * 16, "a" * 16, "tool", "tool", 2, 3, status="ok")
        bad = SpanRecord("c" * 16, "a" * 16, "tool", "tool", 4, 5, status="error", error="ValueError: no")
        protos = otel.to_otlp_protos(_traj(root, ok, bad), _resource())
        assert [(p.status.code, p.status.message) for p in protos] == [
            (UNSET, ""), (UNSET, ""), (ERROR, "ValueError: no")]

    def test_ids_parents_and_the_remote_parent_of_a_segment_root(self):
        """Ids come from the hex strings; a segment root's rtrace.remote_parent becomes its remote parent."""
        seg = SpanRecord("a" * 16, None, "worker", "segment", 1, 9, attributes={"rtrace.remote_parent": REMOTE_SPAN})
        child = SpanRecord("b" * 16, "a" * 16, "grade", "chain", 2, 3)
        spans = otel.to_readable_spans(_traj(seg, child), _resource())
        assert [(s.context.trace_id, s.context.span_id) for s in spans] == [
            (int(TRACE, 16), int("a" * 16, 16)), (int(TRACE, 16), int("b" * 16, 16))]
        assert (spans[0].parent.span_id, spans[0].parent.is_remote) == (int(REMOTE_SPAN, 16), True)
        assert (spans[1].parent.span_id, spans[1].parent.is_remote) == (int("a" * 16, 16), False)
        protos = otel.to_otlp_protos(_traj(seg, child), _resource())
        assert [p.parent_span_id.hex() for p in protos] == [REMOTE_SPAN, "a" * 16]
        is_remote = 0x200  # SPAN_FLAGS_CONTEXT_IS_REMOTE_MASK
        assert [bool(p.flags & is_remote) for p in protos] == [True, False]

    def test_a_plain_root_has_no_parent(self):
        """A root without rtrace.remote_parent (a rollout_context) has no parent."""
        [span] = otel.to_readable_spans(_traj(SpanRecord("a" * 16, None, "rollout", "rollout", 1, 2)), _resource())
        assert span.parent is None

    def test_attributes_input_output_ids_and_root_flags(self):
        """Own attributes (checked), rtrace.kind, input/output as JSON text, token ids, partial and dropped_spans."""
        root = SpanRecord("a" * 16, None, "rollout", "rollout", 1, 9, attributes={"rl.step": 3, "odd": {"k": 1}})
        gen = SpanRecord("b" * 16, "a" * 16, "gen", "generation", 2, 3, input={"n": float("nan")}, output="hi",
                         prompt_ids=[1, 2], response_ids=[3])
        spans = otel.to_readable_spans(_traj(root, gen, partial=True, dropped_spans=2), _resource(), semconv="rtrace")
        assert dict(spans[0].attributes) == {"rl.step": 3, "odd": '{"k": 1}', "rtrace.kind": "rollout",
                                             "rtrace.partial": True, "rtrace.dropped_spans": 2}
        assert dict(spans[1].attributes) == {"rtrace.kind": "generation", "rtrace.input": '{"n": "NaN"}',
                                             "rtrace.output": '"hi"', "rtrace.prompt_ids": [1, 2],
                                             "rtrace.response_ids": [3]}

    def test_one_truncation_marker(self):
        """rtrace.input is bounded with the marker Converter.bound writes: '…[truncated, N chars]'."""
        text = "x" * 50
        rec = SpanRecord("a" * 16, None, "tool", "tool", 1, 2, input=text)
        [span] = otel.to_readable_spans(_traj(rec), _resource(), max_value_chars=10)
        assert span.attributes["rtrace.input"] == otel.bounded(f'"{text}"', 10) == '"xxxxxxxxx…[truncated, 52 chars]'
        assert Converter(10, ()).bound(text) == otel.bounded(text, 10) == "x" * 10 + "…[truncated, 50 chars]"

    def test_events_and_extra_attributes(self):
        """Events keep name, time (the span's start when unknown) and checked attributes; extras ride on top."""
        rec = SpanRecord("a" * 16, None, "tool", "tool", 5, 9, input={"a": 1}, events=[
            {"name": "exception", "time_ns": 7, "attributes": {"exception.type": "E", "ctx": [1, "x"]}},
            {"name": "mark", "attributes": {}}])
        extra = lambda traj, span, is_root: {"backend.inputs": {"a": [1, 2**70]}, "backend.none": None}  # noqa: E731
        [proto] = otel.to_otlp_protos(_traj(rec), _resource(), extra=extra, semconv="rtrace")
        assert [(e.name, e.time_unix_nano) for e in proto.events] == [("exception", 7), ("mark", 5)]
        assert {kv.key: kv.value.string_value for kv in proto.events[0].attributes} == {
            "exception.type": "E", "ctx": '[1, "x"]'}
        attrs = {kv.key: kv.value for kv in proto.attributes}
        assert set(attrs) == {"rtrace.kind", "rtrace.input", "backend.inputs"}
        [kv] = attrs["backend.inputs"].kvlist_value.values  # a map, as OTLP allows
        assert [v.WhichOneof("value") for v in kv.value.array_value.values] == ["int_value", "string_value"]

    def test_values_protobuf_refuses_are_kept_in_a_defined_form(self):
        """Lone surrogates (name, error, attributes, captured values) become '?', big ints text: nothing is dropped."""
        rec = SpanRecord("a" * 16, None, "tool\udcff", "tool", 1, 2, status="error", error="bad\udcff",
                         attributes={"s": "x\udcff", "l": ["y\udcff"], "big": 2**70},
                         input={"s": "z\udcff", "n": float("nan")}, output=2**70)
        [proto] = otel.to_otlp_protos(_traj(rec), _resource(), semconv="rtrace")
        from tests.otlp_receiver import any_value

        assert (proto.name, proto.status.message) == ("tool?", "bad?")
        assert {kv.key: any_value(kv.value) for kv in proto.attributes} == {
            "s": "x?", "l": ["y?"], "big": str(2**70), "rtrace.kind": "tool",
            "rtrace.input": '{"s": "z?", "n": "NaN"}', "rtrace.output": str(2**70)}

    @pytest.mark.parametrize("value, valid", [
        ("s", True), (True, True), (1, True), (1.5, True),
        (2**63 - 1, True), (2**63, False),          # int64 only
        ([], True), (["a", "b"], True), ((1, 2), True),
        ([1, "a"], False), ([1, 1.5], False),       # lists: one primitive type
        ([2**64], False), ([[1]], False),
        ({"k": 1}, False), (None, False), (b"x", False),
    ])
    def test_attribute_validity(self, value, valid):
        """is_valid_attribute accepts what the OTel attribute API accepts, nothing else."""
        assert otel.is_valid_attribute(value) is valid

    @pytest.mark.parametrize("value, expected", [
        ({1: (2, 3)}, {"1": [2, 3]}),               # keys: str; tuples: lists
        (2**70, str(2**70)),                        # beyond int64: str
        ("bad\udcff", "bad?"),                      # lone surrogate: '?' (as MLflow's encoder)
        (float("inf"), float("inf")),               # OTLP has doubles
        (object, str(object)),
        ({}, {}), ([], []),                         # empty maps and lists stay maps and lists
        ({"k": [None, True, 1.5]}, {"k": [None, True, 1.5]}),
    ])
    def test_any_value(self, value, expected):
        """any_value gives a form OTLP can hold without dropping the attribute; set_any_value writes that form."""
        from opentelemetry.proto.common.v1.common_pb2 import AnyValue

        from tests.otlp_receiver import any_value as decode

        assert otel.any_value(value) == expected
        pb = AnyValue()
        otel.set_any_value(pb, value)
        assert decode(pb) == expected


# ----------------------------------------------------------------------------- both sinks
@rtrace.traced_generation(model="tiny-chat")
def generate(prompt_ids):
    return {"response_ids": [7, 8, 9], "finish_reason": "stop"}


@rtrace.traced_tool(tool_name="calculator")
def calculate(expression):
    if expression == "1/0":
        raise ZeroDivisionError("division by zero")
    return {"value": 4}


@rtrace.traced_rollout
def agent(question_ids):
    generate(question_ids)
    calculate("2+2")
    try:
        calculate("1/0")
    except ZeroDivisionError:
        pass
    return "4"


_STATUS = {"UNSET": UNSET, "OK": OK, "ERROR": ERROR}


def as_mlflow_reads(attrs):
    """Attribute values as MLflow 3.17's store gives them back: a string holding the JSON
    text of a string, list or object is stored with one JSON layer stripped
    (``mlflow.tracing.otel.translation.sanitize_attributes``), so it reads back parsed.
    MLflow 3.18 no longer does that: it gives back the string sent."""
    out = {}
    for key, value in attrs.items():
        if isinstance(value, str):
            try:
                parsed = json.loads(value)
            except ValueError:
                parsed = None
            if isinstance(parsed, (str, list, dict)):
                value = parsed
        out[key] = value
    return out


def test_mlflow_and_otlp_sinks_show_the_same_spans(tmp_path):
    """One trajectory and one remote segment through both sinks: identical ids, parents, times, status, events and attributes."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    with OtlpHttpReceiver() as rx:
        rtrace.configure(exporter="mlflow,otlp", mlflow_tracking_uri=uri, otlp_endpoint=rx.base_url,
                         project="both", export_interval_s=0.05)
        with rtrace.rollout_context(step=1, sample_index=2, group_id="g") as rc:
            agent([1, 2, 3])
            rtrace.record_reward(0.5, detail={"k": 1})
        carrier = {"traceparent": f"00-{TRACE}-{REMOTE_SPAN}-01", "baggage": "rl.step=4"}
        with rtrace.extract(carrier, name="segment"):
            calculate("2+2")
        assert rtrace.flush(60)
        received = rx.wait_for_spans(5 + 2, 30)
    assert len(received) == 7
    client = MlflowClient(tracking_uri=uri)
    for trace_id in (rc.trace_id, TRACE):
        sent = {s.span_id: s for s in received if s.trace_id == trace_id}
        stored = {s.span_id: s for s in client.get_trace("tr-" + trace_id).data.spans}
        assert sorted(stored) == sorted(sent) and sent
        for span_id, theirs in stored.items():
            mine = sent[span_id]
            assert (theirs.name, theirs.parent_id, theirs.start_time_ns, theirs.end_time_ns) == (
                mine.name, mine.parent_span_id, mine.start_ns, mine.end_ns)
            assert (_STATUS[theirs.status.status_code], theirs.status.description or "") == (
                mine.status_code, mine.status_message)
            stored = {k: v for k, v in theirs.attributes.items() if not k.startswith("mlflow.")}
            assert stored in (mine.attributes, as_mlflow_reads(mine.attributes))
            assert [(e.name, e.timestamp, e.attributes) for e in theirs.events] == [
                (e["name"], e["time_ns"], e["attributes"]) for e in mine.events]
    statuses = sorted(s.status_code for s in received)
    assert statuses == [UNSET] * 6 + [ERROR]
    [segment] = [s for s in received if s.name == "segment"]
    assert segment.parent_span_id == REMOTE_SPAN


def test_odd_values_reach_mlflow(tmp_path):
    """NaN, ints beyond 64 bits, tuples and lone surrogates in captured values reach MLflow in a defined form."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    from rtrace.config import load_settings
    from rtrace.exporters.mlflow import MlflowSink

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    root = SpanRecord("a" * 16, None, "root", "rollout", 1_000, 2_000, status="error", error="boom",
                      input={"x": float("nan"), "big": 2**70, "s": "bad\udcffbyte", "t": (1, 2)}, output=2**70)
    sink = MlflowSink(load_settings({"mlflow_tracking_uri": uri, "project": "odd"}))
    sink.export([_traj(root, reward=float("inf"), status="error", error="boom")])
    trace = MlflowClient(tracking_uri=uri).get_trace("tr-" + TRACE)
    [span] = trace.data.spans
    assert span.inputs["big"] == str(2**70)  # beyond OTLP's int64: its text
    assert span.inputs["s"] == "bad?byte" and span.inputs["t"] == [1, 2]
    assert span.inputs["x"] != span.inputs["x"]  # NaN
    assert span.outputs == str(2**70)  # beyond OTLP int64: its text (MLflow reads JSON ints back as text)
    assert (span.status.status_code, span.status.description) == ("ERROR", "boom")
    assert trace.info.state.value == "ERROR" and trace.info.tags["reward"] == "Infinity"
    sent = span.attributes["rtrace.input"]  # JSON text; MLflow 3.17 reads it back parsed (as_mlflow_reads)
    assert (json.loads(sent) if isinstance(sent, str) else sent) == {
        "x": "NaN", "big": 2**70, "s": "bad?byte", "t": [1, 2]}


# ----------------------------------------------------------------------------- processes
def _worker(carriers):
    """Runs in a spawned process, configured from the environment (RTRACE_EXPORTER=mlflow, ...)."""
    import rtrace as rt

    @rt.traced_tool
    def sandbox(code):
        return len(code)

    @rt.traced(kind="chain")
    def grade(n):
        return sandbox("x" * n) > 2

    for i, carrier in enumerate(carriers):
        with rt.extract(carrier, name="worker"):
            grade(i)
    ok = rt.flush(120)
    stats = rt.stats()
    rt.shutdown()
    return ok, stats


@pytest.mark.integration
def test_cross_process_trajectory_is_one_mlflow_trace_with_one_root(tmp_path, monkeypatch):
    """Driver spans (rollout, dispatch) and a spawned worker's segment land in MLflow as ONE trace whose ONE root is the rollout."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    @rtrace.traced_tool
    def dispatch():
        return rtrace.inject({})

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    for key, value in {"RTRACE_EXPORTER": "mlflow", "MLFLOW_TRACKING_URI": uri, "RTRACE_PROJECT": "xproc",
                       "RTRACE_EXPORT_INTERVAL_S": "0.05"}.items():
        monkeypatch.setenv(key, value)  # the spawned worker configures itself from these
    rtrace.configure()
    carriers, ids = [], []
    for i in range(3):
        with rtrace.rollout_context(step=7, sample_index=i, group_id="g") as rc:
            carriers.append(dispatch())
        ids.append(rc.trace_id)
    assert rtrace.flush(120)
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        [(ok, stats)] = list(pool.map(_worker, [carriers]))
    assert ok and stats["sink.mlflow.exported"] == 3 and stats["segments_started"] == 3

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("xproc").experiment_id
    assert sorted(t.info.trace_id for t in client.search_traces(locations=[exp])) == sorted("tr-" + t for t in ids)
    found = client.search_traces(locations=[exp], filter_string="tags.step = '7' AND tags.sample_index = '1'")
    assert [t.info.trace_id for t in found] == ["tr-" + ids[1]]
    for trace_id in ids:
        trace = client.get_trace("tr-" + trace_id)
        spans = {s.name: s for s in trace.data.spans}
        assert sorted(spans) == ["dispatch", "grade", "rollout", "sandbox", "worker"]
        roots = [s for s in trace.data.spans if s.parent_id is None]
        assert [r.name for r in roots] == ["rollout"]
        assert spans["worker"].parent_id == spans["dispatch"].span_id
        assert spans["grade"].parent_id == spans["worker"].span_id
        assert trace.info.tags["mlflow.traceName"] == "rollout" and trace.info.state.value == "OK"
