"""Property tests: the traced program observes exactly what the untraced one does, and what
rtrace writes is strict, bounded, redacted JSON (issue #13).

For arbitrary arguments, return values, exceptions and send/throw/close sequences, each
function shape (sync, async, generator, async generator) is run undecorated and then
decorated, in every mode (tracing off, on, sampled out as the root, sampled out inside
a trajectory, and the same two recorded as summaries only: ``RTRACE_SUMMARIES``); the two
transcripts must be identical, object for object, and the program's ``random`` state must
not move. With tracing on, every exported trajectory is encoded as the JSONL sink encodes
it: strict JSON, UTF-8, no value over ``max_value_chars`` (plus the truncation marker), and
no planted secret; recorded as summaries only, every rollout summary's wire form the same.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import rtrace  # noqa: E402
import rtrace.testing  # noqa: E402
from rtrace.exporters.jsonl import encode_line  # noqa: E402

MAX_CHARS = 120
#: the longest truncation marker: "…[truncated, N chars]" with N < 10**12
MARKER = len("…[truncated, 999999999999 chars]")
MODES = ["off", "on", "sampled_out_root", "sampled_out_child", "summary_root", "summary_child"]
#: examples per test and mode; PROPERTY_EXAMPLES=500 for a longer search
EXAMPLES = int(os.environ.get("PROPERTY_EXAMPLES", "50"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                           HealthCheck.data_too_large])

# ----------------------------------------------------------------------------- values
SK = "sk-proj-PLANTEDsk0123456789abcdef"
HF = "hf_PLANTEDhf0123456789abcdefghij"
GHP = "ghp_PLANTEDghp0123456789abcdefghij"
BEARER = "PLANTEDbearer.0123456789"
KEYED = "PLANTED-keyed-value-7f3a"  # only ever stored under a secret-looking key
SECRETS = (SK, HF, GHP, BEARER, KEYED)


class BadRepr:
    def __repr__(self):
        raise RuntimeError("repr failed")


class AttrDict(dict):
    __getattr__ = dict.__getitem__


@dataclasses.dataclass
class Credentials:
    user: str
    api_key: str


text = st.text(st.characters(categories=["L", "N", "P", "S", "Z", "Cc", "Cs"]), max_size=12)
long_text = st.builds(lambda s, n: s * n, text.filter(bool), st.integers(0, 400))
secret_text = st.builds(lambda a, s, b: f"{a} {s} {b}", text, st.sampled_from(
    [SK, HF, GHP, f"Bearer {BEARER}", f"api_key={KEYED}", f"password: '{KEYED}'"]), text)
atoms = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True, allow_infinity=True),
    # beyond 64 bits, beyond float range, beyond the int-to-str digit limit (mapped: repr fails)
    st.sampled_from([64, 70, 400, 5000]).map(lambda e: -(10**e) if e == 70 else 10**e),
    text, long_text, secret_text,
    st.binary(max_size=8), st.builds(BadRepr), st.builds(Credentials, text, st.just(KEYED)))


def _self_ref():
    a = []
    a.extend([a] * 4)
    return a


def _shared():
    inner = list(range(50))
    return [[inner] * 50] * 20


values = st.recursive(
    atoms,
    lambda children: st.one_of(
        st.lists(children, max_size=5),
        st.tuples(children, children),
        st.dictionaries(st.one_of(text, st.sampled_from(["api_key", "x-api-key", "hf_token", "note"])),
                        children, max_size=4),
        st.builds(lambda d: AttrDict(d), st.dictionaries(text, children, max_size=3)),
        st.builds(lambda d: {**d, "api_key": KEYED}, st.dictionaries(text, children, max_size=2)),
    ),
    max_leaves=12,
) | st.builds(_self_ref) | st.builds(_shared)


class Boom(Exception):
    pass


class Halt(BaseException):
    """A BaseException that is not an Exception (like KeyboardInterrupt)."""


exceptions = st.builds(
    lambda cls, args: cls(*args),
    st.sampled_from([ValueError, KeyError, RuntimeError, Boom, Halt, StopIteration]),
    st.lists(values, max_size=2))


# ----------------------------------------------------------------------------- modes
@pytest.fixture(params=MODES)
def mode(request):
    """(name, context manager factory for one call, sink or None)."""
    name = request.param
    if name == "off":
        rtrace.configure(exporter="none")
        yield name, _nothing, None
        return
    sink = SummarySink()
    cap = None if name == "on" else 0
    rtrace.configure(sinks=[sink], max_traces_per_step=cap, max_value_chars=MAX_CHARS, export_interval_s=0.02,
                     summaries=name.startswith("summary"))
    inside = name in ("on", "sampled_out_child", "summary_child")
    yield name, (lambda: rtrace.rollout_context(step=1, note=f"see {SK}")) if inside else _nothing, sink
    if name != "on":
        assert rtrace.flush(10) and sink.trajectories == []
        assert bool(sink.summaries) == name.startswith("summary")


class SummarySink(rtrace.testing.MemorySink):
    """The memory sink, also keeping the rollout summaries it gets."""

    def __init__(self):
        super().__init__()
        self.summaries = []

    def export_summaries(self, summaries):
        self.summaries.extend(summaries)


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _nothing():
    return _Nothing()


# ----------------------------------------------------------------------------- transcripts
def norm(obj):
    """Objects are compared by identity, except the str/int/bool/None Python makes afresh."""
    if type(obj) in (str, int, bool, type(None)):
        return ("v", obj)
    return ("id", id(obj))


#: the exceptions the current example raises or throws: the program must get these very
#: objects back (exceptions Python makes afresh are compared by type and args)
KNOWN: list[BaseException] = []


def outcome(exc):
    known = next((i for i, k in enumerate(KNOWN) if k is exc), None)
    return ("raise", type(exc).__name__, tuple(norm(a) for a in exc.args), known)


def check_outputs(sink, before):
    """Every trajectory exported since ``before``: strict UTF-8 JSON, values bounded, no secret."""
    assert rtrace.flush(10)
    for traj in sink.trajectories[before:]:
        line, degraded = encode_line(traj)
        assert not degraded, "the converter let through a value the JSONL encoder could not take"
        text = line.decode("utf-8")
        json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
        for secret in SECRETS:
            assert secret not in text
        for span in traj.spans:
            captured = list((span.input or {}).values()) + ([span.output] if span.output is not None else [])
            for value in captured:
                size = len(value) if isinstance(value, str) else len(json.dumps(value, ensure_ascii=False))
                assert size <= MAX_CHARS + MARKER, (size, value)
            if span.error is not None:
                assert len(span.error) <= MAX_CHARS + MARKER
            for event in span.events:
                for v in event["attributes"].values():
                    assert not isinstance(v, str) or len(v) <= MAX_CHARS + MARKER
    return len(sink.trajectories)


def check_summaries(sink, before):
    """Every rollout summary since ``before``: its wire form strict JSON, its error bounded, no secret."""
    assert rtrace.flush(10)
    for summary in sink.summaries[before:]:
        text = json.dumps(summary.to_wire(), ensure_ascii=False, allow_nan=False)
        text.encode("utf-8")  # no lone surrogate
        for secret in SECRETS:
            assert secret not in text
        assert summary.error is None or len(summary.error) <= MAX_CHARS + MARKER


def run_checked(mode, decorated_run, plain_run):
    """Run undecorated, then decorated in the mode; compare transcripts and random state."""
    name, around, sink = mode
    expected = plain_run()
    before = len(sink.trajectories) if sink is not None else 0
    summarized = len(sink.summaries) if sink is not None else 0
    state = random.getstate()
    with around():
        got = decorated_run()
    assert got == expected
    if sink is not None and name == "on":
        check_outputs(sink, before)
    if sink is not None and name.startswith("summary"):
        check_summaries(sink, summarized)
    assert random.getstate() == state


# ----------------------------------------------------------------------------- functions
calls = st.tuples(st.lists(values, max_size=3), st.dictionaries(
    st.sampled_from(["a", "b", "api_key", "prompt", "hf_token"]), values, max_size=3))


def make_function(result, exc, log):
    def fn(*args, **kwargs):
        log.append((tuple(map(id, args)), {k: id(v) for k, v in kwargs.items()}))
        if exc is not None:
            raise exc
        return result
    return fn


def call_transcript(fn, args, kwargs, log):
    try:
        out = ("return", norm(fn(*args, **kwargs)))
    except BaseException as exc:  # noqa: BLE001 - the transcript records everything
        out = outcome(exc)
    return [out, *log]


@SETTINGS
@given(call=calls, result=values, exc=st.none() | exceptions)
def test_sync_function(mode, call, result, exc):
    args, kwargs = call
    KNOWN[:] = [exc] if exc is not None else []
    plain_log, log = [], []
    run_checked(mode,
                lambda: call_transcript(rtrace.traced_tool(make_function(result, exc, log)), args, kwargs, log),
                lambda: call_transcript(make_function(result, exc, plain_log), args, kwargs, plain_log))


@SETTINGS
@given(call=calls, result=values, exc=st.none() | exceptions)
def test_async_function(mode, call, result, exc):
    args, kwargs = call
    KNOWN[:] = [exc] if exc is not None else []

    def make(log):
        async def fn(*a, **kw):
            log.append((tuple(map(id, a)), {k: id(v) for k, v in kw.items()}))
            await asyncio.sleep(0)
            if exc is not None:
                raise exc
            return result
        return fn

    def run(fn, log):
        async def main():
            try:
                return [("return", norm(await fn(*args, **kwargs))), *log]
            except BaseException as e:  # noqa: BLE001
                return [outcome(e), *log]
        return asyncio.run(main())

    plain_log, log = [], []
    run_checked(mode, lambda: run(rtrace.traced_generation(make(log)), log), lambda: run(make(plain_log), plain_log))


# ----------------------------------------------------------------------------- generators
ops = st.lists(st.one_of(
    st.tuples(st.just("send"), values),
    st.tuples(st.just("next"), st.none()),
    st.tuples(st.just("throw"), exceptions),
    st.tuples(st.just("close"), st.none())), max_size=8)
generator_spec = st.fixed_dictionaries({
    "items": st.lists(values, max_size=5),
    "result": values,
    "fail_at": st.none() | st.integers(0, 5),
    "exc": exceptions,
    "catch": st.sampled_from([(), (ValueError,), (KeyError, Boom), (StopIteration,), (Halt,)]),
})


def make_generator(spec, log):
    def gen(*args, **kwargs):
        try:
            for i, item in enumerate(spec["items"]):
                if i == spec["fail_at"]:
                    raise spec["exc"]
                try:
                    received = yield item
                    log.append(("received", norm(received)))
                except spec["catch"] as caught:
                    log.append(("caught", id(caught)))
                    received = yield "caught"
                    log.append(("received", norm(received)))
            return spec["result"]
        finally:
            log.append(("finally",))
    return gen


def generator_transcript(gen_fn, operations, log):
    g = gen_fn(1, key="v")
    out = []
    for op, arg in operations:
        try:
            if op == "send":
                out.append(("yield", norm(g.send(arg))))
            elif op == "next":
                out.append(("yield", norm(next(g))))
            elif op == "throw":
                out.append(("yield", norm(g.throw(arg))))
            else:
                out.append(("closed", norm(g.close())))
        except BaseException as exc:  # noqa: BLE001
            out.append(outcome(exc))
    g.close()
    return out + log


@SETTINGS
@given(spec=generator_spec, operations=ops)
def test_generator_protocol(mode, spec, operations):
    KNOWN[:] = [spec["exc"]] + [arg for op, arg in operations if op == "throw"]
    plain_log, log = [], []
    run_checked(mode,
                lambda: generator_transcript(rtrace.traced(make_generator(spec, log)), operations, log),
                lambda: generator_transcript(make_generator(spec, plain_log), operations, plain_log))


def make_async_generator(spec, log):
    async def agen(*args, **kwargs):
        try:
            for i, item in enumerate(spec["items"]):
                if i == spec["fail_at"]:
                    raise spec["exc"]
                try:
                    received = yield item
                    log.append(("received", norm(received)))
                except spec["catch"] as caught:
                    log.append(("caught", id(caught)))
                    received = yield "caught"
                    log.append(("received", norm(received)))
        finally:
            log.append(("finally",))
    return agen


def async_generator_transcript(agen_fn, operations, log):
    async def main():
        g = agen_fn(1, key="v")
        out = []
        for op, arg in operations:
            try:
                if op == "send":
                    out.append(("yield", norm(await g.asend(arg))))
                elif op == "next":
                    out.append(("yield", norm(await g.__anext__())))
                elif op == "throw":
                    out.append(("yield", norm(await g.athrow(arg))))
                else:
                    out.append(("closed", norm(await g.aclose())))
            except BaseException as exc:  # noqa: BLE001
                out.append(outcome(exc))
        await g.aclose()
        return out + log
    return asyncio.run(main())


@SETTINGS
@given(spec=generator_spec, operations=ops)
def test_async_generator_protocol(mode, spec, operations):
    KNOWN[:] = [spec["exc"]] + [arg for op, arg in operations if op == "throw"]
    plain_log, log = [], []
    run_checked(mode,
                lambda: async_generator_transcript(rtrace.traced(make_async_generator(spec, log)), operations, log),
                lambda: async_generator_transcript(make_async_generator(spec, plain_log), operations, plain_log))


_big = st.integers(min_value=-(10**200), max_value=10**200)  # beyond 64 bits: written as digits
_leaf = (st.none() | st.booleans() | st.integers(min_value=-(2**64) + 1, max_value=2**64 - 1) | _big
         | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=40)
         | st.text(alphabet=st.characters(max_codepoint=0x1f), max_size=20)
         | st.binary(max_size=8))
_values = st.recursive(_leaf, lambda inner: st.lists(inner, max_size=12)
                       | st.dictionaries(st.text(max_size=12) | _big, inner, max_size=8),
                       max_leaves=60)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=_values, max_chars=st.integers(min_value=20, max_value=600))
def test_converter_output_fits_max_chars(value, max_chars):
    """The converter skips encoding values whose budget shows they fit: whatever was
    not truncated must really encode within max_chars (control characters escaped,
    21-digit int keys, floats)."""
    import json

    from rtrace._serialize import Converter

    conv = Converter(max_chars, ("api_key", "token"))
    data = conv(value)
    if conv.truncated == 0 and isinstance(data, (list, dict)):  # (a scalar number is never cut)
        assert len(json.dumps(data, ensure_ascii=False, default=str)) <= max_chars
    elif isinstance(data, str) and conv.truncated == 0:
        assert len(data) <= max_chars
