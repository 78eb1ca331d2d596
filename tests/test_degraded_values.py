"""One bad value degrades only itself (issue #13, items 7, 12, 13, 17).

Shared and self-referential containers, huge tensors, unencodable strings, huge ints,
odd rewards and objects whose attribute lookup raises: the trajectory is still exported,
each bad value in its documented form (docs/capture.md), the rest intact; secrets are
redacted by key and by shape wherever captured values go.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import json
import tracemalloc

import pytest

import rtrace
import rtrace.testing
from rtrace._serialize import REDACTED
from rtrace.exporters.jsonl import read_jsonl

np = pytest.importorskip("numpy")


@rtrace.traced_tool
def tool(x):
    return "ok"


def exported_input(got, **kwargs):
    """Run ``tool`` in a trajectory and return the exported span's input."""
    with rtrace.rollout_context(step=1):
        tool(**kwargs)
    (traj,) = got.trajectories
    return traj.spans[1].input


def exported_input_and_peak(got, value):
    """:func:`exported_input` of ``x=value``, and the peak memory traced while it ran."""
    tracemalloc.start()
    try:
        data = exported_input(got, x=value)["x"]
        return data, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


# ----------------------------------------------------------------------------- item 7
class TestBoundedConversion:
    @pytest.mark.parametrize("make", [
        # a list holding itself 4 times: 4**12 paths to the depth limit without a budget
        lambda: (lambda a: (a.extend([a] * 4), a)[1])([]),
        # the same list 5 times in another list
        lambda: [(lambda a: (a.extend([a] * 4), a)[1])([])] * 5,
        # a million leaves through three levels of sharing
        lambda: [[list(range(100))] * 100] * 100,
        # a dict that contains itself under many keys
        lambda: (lambda d: (d.update({str(i): d for i in range(50)}), d)[1])({}),
    ], ids=["self_ref", "shared_self_ref", "shared_million", "self_ref_dict"])
    def test_shared_and_self_referential_containers(self, make):
        """Conversion stops after max_value_chars nodes/characters: the value is the truncated form,
        its JSON bounded, and the worker's peak memory small (0.1.0 walked every path: 4**12 for
        the first case)."""
        value = make()
        limit = 2000
        with rtrace.testing.capture(max_value_chars=limit) as got:
            data, peak = exported_input_and_peak(got, value)
            assert got.stats()["values_truncated"] >= 1
        assert isinstance(data, str) and "…[truncated, " in data
        assert len(data) <= limit + len("…[truncated, 1000000000 chars]")
        assert peak < 20 * 2**20, f"peak {peak / 2**20:.1f} MiB"

    @pytest.mark.parametrize("lib", ["numpy", "torch"])
    def test_ten_million_floats_are_summarised_without_copying(self, lib):
        """A 10M-element array/tensor becomes {shape, dtype, numel, preview}; no list of 10M Python
        floats is ever built (tracemalloc peak stays small: tolist() would allocate ~300 MB)."""
        if lib == "torch":
            torch = pytest.importorskip("torch")
            value = torch.arange(10_000_000, dtype=torch.float32)
        else:
            value = np.arange(10_000_000, dtype=np.float64)
        with rtrace.testing.capture() as got:
            data, peak = exported_input_and_peak(got, value)
        assert data["shape"] == [10_000_000] and data["numel"] == 10_000_000
        assert data["preview"] == [float(i) for i in range(16)]
        assert "float" in data["dtype"]
        assert peak < 20 * 2**20, f"peak {peak / 2**20:.1f} MiB"


# ----------------------------------------------------------------------------- item 12
class TestJsonlBatchSurvivesOneBadValue:
    """Values that reach the JSONL sink without the converter (span attributes set by the
    application, exception text, span names) cannot fail the batch they are in."""

    def run_batch(self, tmp_path, bad):
        path = tmp_path / "t.jsonl"
        rtrace.configure(exporter="jsonl", jsonl_path=str(path), export_interval_s=60,
                         max_export_batch_size=64)
        from opentelemetry import trace

        for i in range(5):
            with rtrace.rollout_context(step=1, sample_index=i):
                if i == 2:
                    trace.get_current_span().set_attribute("app.value", bad)
                    trace.get_current_span().set_attribute("app.ok", "fine")
                tool(i)
        assert rtrace.flush(10)  # one batch of five
        stats = rtrace.stats()
        assert stats["sink.jsonl.exported"] == 5 and "sink.jsonl.failed_batches" not in stats
        lines = path.read_text(encoding="utf-8").splitlines()
        assert len(lines) == 5
        for line in lines:
            json.loads(line)
        trajs = {t.sample_index: t for t in read_jsonl(path)}
        assert sorted(trajs) == [0, 1, 2, 3, 4]
        attrs = trajs[2].root.attributes
        assert attrs["app.ok"] == "fine" and trajs[2].spans[1].input == {"x": 2}
        return attrs["app.value"]

    def test_lone_surrogate(self, tmp_path):
        """A lone surrogate becomes a \\udXXX escape (0.1.0: UnicodeEncodeError lost the batch)."""
        assert self.run_batch(tmp_path, "a\ud800b") == "a\\ud800b"

    def test_int_beyond_the_digit_limit(self, tmp_path):
        """An int of 5000 digits becomes "<int of N bits>" (0.1.0: ValueError lost the batch)."""
        assert self.run_batch(tmp_path, 10**5000) == f"<int of {(10**5000).bit_length()} bits>"

    def test_self_referential_messages_given_as_they_are(self):
        """Messages handed over as they are (log_rollout_batch) may hold a cycle: the line is
        written degraded, the rest of the trajectory intact (JSONL encodes without its own
        cycle check)."""
        from rtrace.exporters.jsonl import encode_line
        from rtrace.trajectory import SpanRecord, Trajectory

        message = {"role": "user", "content": "hi"}
        message["self"] = message
        traj = Trajectory("0" * 31 + "1", "rollout", [SpanRecord("0" * 15 + "1", None, "rollout", "rollout", 1, 2)],
                          reward=0.5, messages=[message])
        line, degraded = encode_line(traj)
        data = json.loads(line)
        assert degraded and data["reward"] == 0.5 and data["spans"][0]["span_id"] == "0" * 15 + "1"
        assert data["messages"][0]["content"] == "hi"

    def test_surrogate_in_an_exception_message(self, tmp_path):
        """Exception text goes to the span's error and event attributes unconverted: it degrades too."""
        path = tmp_path / "t.jsonl"
        rtrace.configure(exporter="jsonl", jsonl_path=str(path), export_interval_s=60)

        @rtrace.traced_tool
        def bad():
            raise ValueError("bad \udcff byte")

        for i in range(3):
            with rtrace.rollout_context(step=1, sample_index=i):
                if i == 1:
                    with pytest.raises(ValueError):
                        bad()
        assert rtrace.flush(10)
        trajs = {t.sample_index: t for t in read_jsonl(path)}
        assert sorted(trajs) == [0, 1, 2]
        assert trajs[1].spans[1].error == "ValueError: bad \\udcff byte"


# ----------------------------------------------------------------------------- item 13
class Color(enum.Enum):
    RED = 1


class Num(int):
    pass


@dataclasses.dataclass
class Point:
    x: int


def nested(depth):
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


PLAIN = [1.5, 1e-7, 1e16, -0.0, 2**64 - 1, -(2**63), "naïve ☃ \u2028 \x00", None, True, [1, [2, {"a": 3}]],
         list(range(40)) + ["a", None, True],  # a long list: its element types checked at once
         nested(300)]  # orjson refuses nesting past 254: the json module writes it
NOT_PLAIN = [float("nan"), float("inf"), -float("inf"), (1, 2), Num(5), Color.RED, Point(1), {1: "a"},
             datetime.datetime(2026, 1, 2, 3, 4, 5), "a\ud800b", 2**64, -(2**63) - 1,
             list(range(40)) + [float("nan")], list(range(40)) + [Num(5)], list(range(40)) + [[float("inf")]]]


@pytest.mark.parametrize("value", PLAIN + NOT_PLAIN, ids=repr)
def test_fast_jsonl_encoding_writes_the_values_the_json_module_writes(value, monkeypatch):
    """With orjson installed, JSONL lines of plain data are written by it; everything else
    (NaN, subclasses, objects orjson would write its own way, ints and strings it refuses)
    by the json module, so a line reads back the same either way. Fails without the
    plain-data check (NaN would be null, Color.RED 1, the datetime ISO text)."""
    orjson = pytest.importorskip("orjson")
    from rtrace import _serialize
    from rtrace.exporters import jsonl
    from rtrace.trajectory import SpanRecord, Trajectory

    traj = Trajectory("0" * 31 + "1", "rollout", [SpanRecord("0" * 15 + "1", None, "rollout", "rollout", 1, 2)],
                      reward=0.5, messages=[{"role": "user", "content": value}])
    fast, fast_degraded = jsonl.encode_line(traj)
    monkeypatch.setattr(_serialize, "_orjson_dumps", None)
    slow, slow_degraded = jsonl.encode_line(traj)
    assert (json.loads(fast), fast_degraded) == (json.loads(slow), slow_degraded)
    try:
        by_orjson = orjson.dumps(traj.to_dict(), option=orjson.OPT_APPEND_NEWLINE)
    except TypeError:
        by_orjson = None
    assert (fast == by_orjson) is (value in PLAIN[:-1])  # the fast path was taken for plain data


class AttrDict(dict):
    """A dict whose attribute lookup raises KeyError (not AttributeError)."""

    __getattr__ = dict.__getitem__


class TestOddValues:
    def test_reward_beyond_float_range(self, rtrace_capture):
        """record_reward(10**400): exported, reward null, the value kept as outcome.reward_raw."""
        with rtrace.rollout_context(step=1):
            rtrace.record_reward(10**400, correct=True)
        (traj,) = rtrace_capture.trajectories
        assert traj.reward is None and traj.outcome["correct"] is True
        assert traj.outcome["reward_raw"].startswith("1000") and "truncated" in traj.outcome["reward_raw"]
        assert rtrace_capture.stats()["reward_errors"] == 1

    def test_reward_tensor_of_two(self, rtrace_capture):
        """record_reward(torch.tensor([1., 2.])): exported, the tensor's repr as reward_raw."""
        torch = pytest.importorskip("torch")
        with rtrace.rollout_context(step=1):
            rtrace.record_reward(torch.tensor([1.0, 2.0]))
        (traj,) = rtrace_capture.trajectories
        assert traj.reward is None and traj.outcome["reward_raw"] == "tensor([1., 2.])"

    def test_generation_returning_an_attrdict(self, rtrace_capture):
        """A generation output whose __getattr__ raises KeyError: ids and finish reason are still read
        (0.1.0: hasattr() raised KeyError and the trajectory was lost)."""

        @rtrace.traced_generation
        def gen(prompt_ids):
            return AttrDict(response_ids=[4, 5], finish_reason="stop", text="hi")

        with rtrace.rollout_context(step=1):
            out = gen([1, 2, 3])
        assert out.text == "hi"
        (traj,) = rtrace_capture.trajectories
        span = traj.spans[1]
        assert span.prompt_ids == [1, 2, 3] and span.response_ids == [4, 5]
        assert span.output == {"finish_reason": "stop", "text": "hi"}
        assert span.attributes["gen_ai.response.finish_reasons"] == ["stop"]

    def test_dict_keys_are_converted_like_strings(self, rtrace_capture):
        """A string key with a lone surrogate or a token shape is escaped / redacted like a string value
        (found by the property suite: the key reached the JSONL encoder as it was)."""
        data = exported_input(rtrace_capture, x={"\ud800": 1, f"key {SECRET}": 2})["x"]
        assert data == {"\\ud800": 1, f"key {REDACTED}": 2}

    def test_one_bad_element_does_not_wipe_the_argument(self, rtrace_capture):
        """A nested huge int and an object whose repr raises degrade alone; the rest of the argument stays."""

        class Nasty:
            def __repr__(self):
                raise RuntimeError("no repr")

        big = 10**5000
        data = exported_input(rtrace_capture, x={"a": [1, big, 3], "b": [Nasty(), "kept"], "c": 2**70})["x"]
        assert data == {"a": [1, f"<int of {big.bit_length()} bits>", 3],
                        "b": ["<unserialisable Nasty: RuntimeError>", "kept"], "c": str(2**70)}
        assert rtrace_capture.stats()["capture_errors"] == 1


# ----------------------------------------------------------------------------- item 17
@dataclasses.dataclass
class ClientConfig:
    model: str
    api_key: str
    hf_token: str


SECRET = "sk-proj-ABCDEFGHIJKLMNOPQRSTUVWX"
FRAGMENT_KEYS = ["x-api-key", "api-key", "x-goog-api-key", "hf_token", "api_token", "auth_token",
                 "github_token", "bearer", "private_key", "session_token", "Authorization", "X-Api-Key"]
VALUE_SHAPES = ["sk-" + "a" * 40, "sk-proj-" + "b" * 30, "sk-ant-" + "c" * 30, "hf_" + "d" * 34,
                "ghp_" + "e" * 36, "Bearer eyJhbGciOiJIUzI1NiJ9.payload.sig"]


class TestRedaction:
    def dump(self, got):
        return json.dumps([t.to_dict() for t in got.trajectories], ensure_ascii=False)

    def test_dataclass_fields(self, rtrace_capture):
        """Secret-looking dataclass fields are redacted like dict keys."""
        data = exported_input(rtrace_capture, x=ClientConfig("m", SECRET, "hf_" + "z" * 30))["x"]
        assert data == {"model": "m", "api_key": REDACTED, "hf_token": REDACTED}
        assert SECRET not in self.dump(rtrace_capture)

    def test_rollout_context_extra_and_outcome_values(self, rtrace_capture):
        """rollout_context(**extra) and record_reward(**outcome): by key and by value shape."""
        with rtrace.rollout_context(step=1, hf_token="hf_" + "q" * 30, note=f"used {SECRET} here"):
            rtrace.record_reward(1.0, api_key=SECRET, log=f"Authorization: Bearer {'t' * 20}")
        (traj,) = rtrace_capture.trajectories
        assert traj.extra == {"hf_token": REDACTED, "note": f"used {REDACTED} here"}
        assert traj.outcome == {"api_key": REDACTED, "log": f"Authorization: {REDACTED}"}
        assert traj.root.attributes["rl.extra.hf_token"] == REDACTED
        text = self.dump(rtrace_capture)
        assert SECRET not in text and "q" * 30 not in text and "t" * 20 not in text

    def test_key_fragments(self, rtrace_capture):
        """Every default fragment, with '-' and '_' alike and any case, redacts its value."""
        headers = {key: f"value-of-{i}" for i, key in enumerate(FRAGMENT_KEYS)}
        headers["content-type"] = "json"
        data = exported_input(rtrace_capture, x=headers)["x"]
        assert data == {**{k: REDACTED for k in FRAGMENT_KEYS}, "content-type": "json"}

    @pytest.mark.parametrize("secret", VALUE_SHAPES)
    def test_value_shapes_inside_strings(self, rtrace_capture, secret):
        """Token shapes are replaced inside any captured string, the text around them kept."""
        data = exported_input(rtrace_capture, x=[f"curl -H 'x: {secret}' host", {"nested": secret}])
        assert data["x"] == [f"curl -H 'x: {REDACTED}' host", {"nested": REDACTED}]
        assert secret not in self.dump(rtrace_capture)

    @pytest.mark.parametrize("text, expected", [
        # a query string
        ("GET /v1/models?api_key=abc123xyz&limit=5", f"GET /v1/models?api_key={REDACTED}&limit=5"),
        # the repr of a config object
        ("Client(api_key='abc 123', model='m')", f"Client(api_key='{REDACTED}', model='m')"),
        # JSON text
        ('{"password": "hunter 2", "user": "bob"}', f'{{"password": "{REDACTED}", "user": "bob"}}'),
        # a header line
        ("x-goog-api-key: 0123456789", f"x-goog-api-key: {REDACTED}"),
        # a shell line
        ("export GITHUB_TOKEN=abcdef0123", f"export GITHUB_TOKEN={REDACTED}"),
    ])
    def test_values_assigned_to_secret_keys_inside_strings(self, rtrace_capture, text, expected):
        """`key=value` / `key: value` with a secret-looking key is redacted inside any string."""
        assert exported_input(rtrace_capture, x=text)["x"] == expected

    def test_exception_text_and_application_attributes(self, rtrace_capture):
        """A secret in an exception message or in an attribute the application set is redacted in
        the span's error, its exception event (message and stack trace) and its attributes."""
        from opentelemetry import trace

        @rtrace.traced_tool
        def call_api(key):
            trace.get_current_span().set_attribute("http.request.header.authorization", f"Bearer {key}")
            trace.get_current_span().set_attribute("app.note", f"tried {key}")
            raise PermissionError(f"key {key} was refused")

        with rtrace.rollout_context(step=1):
            with pytest.raises(PermissionError, match="refused"):
                call_api(SECRET)
        (traj,) = rtrace_capture.trajectories
        span = traj.spans[1]
        assert span.error == f"PermissionError: key {REDACTED} was refused"
        assert span.attributes["app.note"] == f"tried {REDACTED}"
        assert span.attributes["http.request.header.authorization"] == REDACTED
        assert SECRET not in self.dump(rtrace_capture)


@pytest.mark.parametrize("value", [
    list(range(50)), [-(2**64) + 1, 0, 2**64 - 1], [2**64, 1], [1, -(2**64)], [True, 1, 2], [Num(3), 1],
    [1, 2.0, 3], [1, None], (4, 5, 6), list(range(3000)), list(range(5000)), [],
], ids=lambda v: repr(v)[:40])
@pytest.mark.parametrize("max_chars", [64, 4000, 100_000])
def test_a_list_of_plain_ints_converts_as_the_walk_converts_it(value, max_chars, monkeypatch):
    """Lists of plain ints take a shortcut through the converter (types and range checked
    in C): the result and the counters are the element-by-element walk's, at any budget."""
    from rtrace import _serialize

    fast = _serialize.Converter(max_chars, ["api_key"])
    got = fast(value), fast.truncated, fast.errors
    monkeypatch.setattr(_serialize, "_INT_SET", frozenset())  # no shortcut: every element walked
    slow = _serialize.Converter(max_chars, ["api_key"])
    assert got == (slow(value), slow.truncated, slow.errors)


def has_nonfinite(value):
    if isinstance(value, float):
        return value - value != 0
    return isinstance(value, (list, tuple)) and any(map(has_nonfinite, value))


@pytest.mark.parametrize("where", ["output", "attribute", "reward", "outcome"])
@pytest.mark.parametrize("value", PLAIN + NOT_PLAIN, ids=repr)
def test_a_vouched_trajectory_is_plain_and_written_as_the_checked_path_writes_it(value, where, rtrace_capture,
                                                                                  monkeypatch):
    """The worker vouches for a trajectory built from converted values that are all plain
    JSON data, and the JSONL sink then gives it to orjson without its plain-data check.
    Whatever a traced program puts where (a tool's output, an attribute on its span, the
    reward, an outcome): a vouched trajectory is plain, and its line is the line of the
    checked path (and of the json module). Plain outputs are vouched for (the fast path
    is taken); NaN or an infinity anywhere, or an attribute kept as it was, is not."""
    pytest.importorskip("orjson")
    from opentelemetry import trace

    from rtrace import _serialize
    from rtrace._serialize import is_plain_json, vouched
    from rtrace.exporters import jsonl

    @rtrace.traced_tool
    def answer():
        if where == "attribute":
            trace.get_current_span().set_attribute("odd", value)
        return value if where == "output" else "ok"

    with rtrace.rollout_context(step=1):
        answer()
        if where == "reward":
            rtrace.record_reward(value)
        elif where == "outcome":
            rtrace.record_reward(1.0, odd=value)
    (traj,) = rtrace_capture.trajectories
    line, degraded = jsonl.encode_line(traj)
    promised = vouched(traj)
    if promised:
        assert is_plain_json(traj.to_dict())
    if where == "output":
        assert promised is not has_nonfinite(value)
    if has_nonfinite(value) and not (where == "reward" and isinstance(value, list)):  # that one is its repr
        assert not promised
    traj.__dict__.pop(_serialize._VOUCHED, None)
    assert not vouched(traj)
    checked = jsonl.encode_line(traj)
    monkeypatch.setattr(_serialize, "_orjson_dumps", None)
    by_json_module = jsonl.encode_line(traj)
    assert (line, degraded) == checked
    assert (json.loads(line), degraded) == (json.loads(by_json_module[0]), by_json_module[1])


@pytest.mark.parametrize("where", ["output", "reward"])
@pytest.mark.parametrize("value", [1.5, "ok", [1, {"a": None}], float("nan"), float("inf"), (1, 2), Color.RED],
                         ids=repr)
def test_collector_mode_vouches_for_plain_segments_only(value, where, monkeypatch):
    """Collector mode: the worker vouches for a segment made of converted plain values, and
    encode_compact then skips its NaN walk. A NaN or an infinity in an output or the
    reward is not vouched for; what a vouched segment encodes to is what the checked path
    encodes (the same request bytes)."""
    pytest.importorskip("orjson")
    pytest.importorskip("grpc")
    from rtrace import _serialize
    from rtrace._serialize import vouched
    from rtrace.exporters import collector as collector_sink
    from rtrace.exporters.otel import encode_compact
    from rtrace.pipeline.otlp_receiver import OtlpReceiver

    seen = []
    original = collector_sink.CollectorSink.export

    def export(self, trajectories):
        for traj in trajectories:
            promised = vouched(traj)
            request = encode_compact([traj], {}).SerializeToString()
            traj.__dict__.pop(_serialize._VOUCHED, None)
            seen.append((traj, promised, request == encode_compact([traj], {}).SerializeToString()))
        return original(self, trajectories)

    monkeypatch.setattr(collector_sink.CollectorSink, "export", export)
    receiver = OtlpReceiver(lambda request: None)
    receiver.start()
    try:
        rtrace.configure(exporter="collector", collector_endpoint=f"127.0.0.1:{receiver.port}")

        @rtrace.traced_tool
        def answer():
            return value if where == "output" else "ok"

        with rtrace.rollout_context(step=1):
            answer()
            rtrace.record_reward(value if where == "reward" else 1.0)
        assert rtrace.flush(30)
    finally:
        rtrace.shutdown()
        receiver.stop()
    (traj, promised, same), = seen
    assert same
    # a tuple converts to a list, an enum member to its repr, a reward that is not a number
    # to outcome reward_raw: plain, all of them
    assert promised is not (isinstance(value, float) and value - value != 0)
