"""Telemetry never changes the traced program (issue #13, items 1, 2, 4, 8).

Each test drives a decorated function and the same undecorated function through the
same protocol (asend/athrow/aclose, exceptions whose ``__str__`` raises, the program's
seeded ``random``) and compares what the program observes, in every mode: tracing off,
on, sampled out (the root itself, and a call inside a sampled-out trajectory), and
recorded as a summary only (sampled out with ``RTRACE_SUMMARIES`` on, the default: the
calls are tallied as marks instead of spans; issue 40).
"""

from __future__ import annotations

import contextlib
import random

import pytest

import rtrace
import rtrace.testing

MODES = ["off", "on", "sampled_out_root", "sampled_out_child", "summary_root", "summary_child"]


@contextlib.contextmanager
def mode(name):
    """Tracing in mode ``name``; yields a context manager to run each call in."""
    if name == "off":
        rtrace.configure(exporter="none")
        yield contextlib.nullcontext
        return
    cap = None if name == "on" else 0
    with rtrace.testing.capture(max_traces_per_step=cap, summaries=name.startswith("summary")) as got:
        if name.endswith("_root"):
            yield contextlib.nullcontext  # the decorated call is the (sampled-out) root
        else:
            yield lambda: rtrace.rollout_context(step=1)
        if name == "on":
            assert got.trajectories, "tracing on recorded nothing"
        else:
            assert got.trajectories == [] and got.stats()["trajectories_sampled_out"] >= 1
            # summary mode tallied the rollouts (and counted them); sampled out without it, nothing
            assert (got.stats().get("rollouts_summarized", 0) >= 1) == name.startswith("summary")


# ----------------------------------------------------------------------------- item 1
def make_echo(log):
    """An async generator that logs every value and exception it receives."""

    async def echo(first):
        try:
            received = yield first
            while True:
                log.append(("received", received))
                try:
                    received = yield f"got {received!r}"
                except ValueError as exc:
                    log.append(("caught", type(exc).__name__, exc.args))
                    received = yield "recovered"
        finally:
            log.append(("finally",))

    return echo


async def drive(agen, log, ops):
    """Run ``ops`` against ``agen``; log each result or exception as the program sees it."""
    for op, arg in ops:
        try:
            if op == "asend":
                result = await agen.asend(arg)
            elif op == "athrow":
                result = await agen.athrow(arg)
            else:
                result = await agen.aclose()
            log.append((op, "->", result))
        except BaseException as exc:  # noqa: BLE001 - the transcript records everything
            log.append((op, "raised", type(exc).__name__, exc.args))
    return log


SEND_THROW = [("asend", None), ("asend", 1), ("asend", "two"), ("athrow", ValueError("v", 1)),
              ("asend", 3), ("athrow", KeyError("k")), ("asend", 4)]
CLOSE = [("asend", None), ("asend", 1), ("aclose", None), ("asend", 2)]


async def transcript(decorate, ops):
    log = []
    echo = make_echo(log)
    if decorate:
        echo = rtrace.traced(echo)
    return await drive(echo("first"), log, ops)


@pytest.mark.parametrize("name", MODES)
@pytest.mark.parametrize("ops", [SEND_THROW, CLOSE], ids=["send_throw", "close"])
async def test_async_generator_forwards_asend_athrow_aclose(name, ops):
    """A decorated async generator receives the same asend() values and athrow() exceptions, and
    the caller sees the same items and exceptions, as undecorated, in every mode (0.1.0: off and
    sampled-out calls iterated with `async for`, so asend values arrived as None and athrow raised
    at the wrapper)."""
    expected = await transcript(False, ops)
    with mode(name) as run:
        with run():
            got = await transcript(True, ops)
    assert got == expected


@pytest.mark.parametrize("name", MODES)
def test_generator_forwards_send_throw_close(name):
    """The same protocol on a sync generator (send, throw, close, return value)."""

    def make(log):
        def gen():
            try:
                received = yield "first"
                while True:
                    log.append(("received", received))
                    try:
                        received = yield f"got {received!r}"
                    except ValueError as exc:
                        log.append(("caught", exc.args))
                        received = yield "recovered"
                        if received == "stop":
                            return "the end"
            finally:
                log.append(("finally",))
        return gen

    def run_ops(gen_fn, log):
        g = gen_fn()
        for op, arg in [("send", None), ("send", 1), ("throw", ValueError("v")), ("send", "stop"),
                        ("send", 5)]:
            try:
                log.append((op, "->", g.send(arg) if op == "send" else g.throw(arg)))
            except BaseException as exc:  # noqa: BLE001
                log.append((op, "raised", type(exc).__name__, exc.args))
        g2 = gen_fn()
        next(g2)
        log.append(("close", g2.close()))
        return log

    expected_log: list = []
    expected = run_ops(make(expected_log), expected_log)
    with mode(name) as run:
        with run():
            log: list = []
            got = run_ops(rtrace.traced(make(log)), log)
    assert got == expected


@pytest.mark.parametrize("name", MODES)
def test_methods_classmethods_staticmethods(name):
    """Decorated methods (sync and async), classmethods and staticmethods get the same
    arguments and give the same results and exceptions as undecorated, in every mode."""
    import asyncio

    def make(decorate):
        seen = []
        d = decorate

        class Tool:
            name = "calculator"

            @d
            def run(self, x, *, scale=1):
                seen.append(("run", self, x, scale))
                if x < 0:
                    raise ValueError(x)
                return x * scale

            @d
            async def arun(self, x):
                seen.append(("arun", self, x))
                await asyncio.sleep(0)
                return [x]

            @d
            @classmethod
            def make(cls, x):
                seen.append(("make", cls, x))
                return cls

            @d
            @staticmethod
            def pure(x):
                seen.append(("pure", x))
                return (x,)

        return Tool, seen

    def transcript(decorate):
        Tool, seen = make(decorate)
        tool = Tool()
        out = [tool.run(2, scale=3), asyncio.run(tool.arun(4)), Tool.make(5) is Tool, tool.pure(6), Tool.pure(7)]
        try:
            tool.run(-1)
        except ValueError as exc:
            out.append(("raised", exc.args))
        return out, [(e[0], *(("self" if a is tool else "cls" if a is Tool else a) for a in e[1:])) for e in seen]

    expected = transcript(lambda f: f)
    with mode(name) as run:
        with run():
            got = transcript(rtrace.traced_tool)
    assert got == expected


# ----------------------------------------------------------------------------- item 2
class EvilError(Exception):
    """An exception whose __str__ and __repr__ raise."""

    def __str__(self):
        raise RuntimeError("__str__ raised")

    def __repr__(self):
        raise RuntimeError("__repr__ raised")


class TestExceptionsWhoseTextRaises:
    def test_decorated_call_reraises_the_same_exception(self, rtrace_capture):
        """The program gets its own exception object back; the span is marked failed."""
        err = EvilError("payload")

        @rtrace.traced_tool
        def tool():
            raise err

        with pytest.raises(EvilError) as info:
            with rtrace.rollout_context(step=1):
                tool()
        assert info.value is err and info.value.args == ("payload",)
        (traj,) = rtrace_capture.trajectories
        assert [s.status for s in traj.spans] == ["error", "error"]
        assert traj.spans[1].error.startswith("EvilError: ")
        # the exception event is still there, with its type
        assert traj.spans[1].events[0]["attributes"]["exception.type"] == "EvilError"

    def test_rollout_context_still_ends_its_span(self, rtrace_capture):
        """An exception raised in a rollout_context body whose str() raises: the trajectory is
        complete (not partial), status error (0.1.0: the span never ended, the error escaped as
        RuntimeError from __exit__)."""
        err = EvilError()
        with pytest.raises(EvilError) as info:
            with rtrace.rollout_context(step=1, sample_index=3):
                raise err
        assert info.value is err
        (traj,) = rtrace_capture.trajectories
        assert not traj.partial and traj.status == "error" and traj.sample_index == 3
        assert rtrace_capture.stats().get("open_trajectories") == 0

    async def test_async_and_generator_shapes(self, rtrace_capture):
        """Coroutines and generators behave the same."""

        @rtrace.traced
        async def coro():
            raise EvilError("c")

        @rtrace.traced
        def gen():
            yield 1
            raise EvilError("g")

        with rtrace.rollout_context(step=1):
            with pytest.raises(EvilError):
                await coro()
            with pytest.raises(EvilError):
                list(gen())
        (traj,) = rtrace_capture.trajectories
        assert [s.status for s in traj.spans[1:]] == ["error", "error"]

    def test_summary_mode(self):
        """Recorded as a summary only, the same: the program gets its own exception objects back,
        from a call and from the rollout_context body, and the rollout counts as failed."""
        err, body = EvilError("payload"), EvilError("body")

        @rtrace.traced_tool
        def tool():
            raise err

        with rtrace.testing.capture(max_traces_per_step=0, sinks=[summaries := _Summaries()]) as got:
            with pytest.raises(EvilError) as info:
                with rtrace.rollout_context(step=1, sample_index=0):
                    tool()
            assert info.value is err
            with pytest.raises(EvilError) as info:
                with rtrace.rollout_context(step=1, sample_index=1):
                    try:
                        tool()
                    except EvilError:
                        pass
                    raise body
            assert info.value is body and body.args == ("body",)
            assert got.trajectories == []
        assert [(s.sample_index, s.status, s.error, s.tool_calls) for s in summaries.summaries] == [
            (0, "error", "EvilError: <str() of the exception failed>", 1),
            (1, "error", "EvilError: <str() of the exception failed>", 1)]


class _Summaries(rtrace.Sink):
    """Keeps the rollout summaries it gets (a sink with ``export_summaries``)."""

    name = "summaries"

    def __init__(self):
        super().__init__(None)
        self.summaries = []

    def export(self, trajectories):
        pass

    def export_summaries(self, summaries):
        self.summaries.extend(summaries)


# ----------------------------------------------------------------------------- item 4
class TestRandomState:
    def test_tracing_never_moves_the_programs_random_state(self, rtrace_capture):
        """Spans, trajectories and ids are made without drawing from the global `random`."""

        @rtrace.traced_tool
        def tool(x):
            return x

        random.seed(1234)
        before = random.getstate()
        for step in range(3):
            with rtrace.rollout_context(step=step, sample_index=0):
                tool(step)
        assert random.getstate() == before
        assert len(rtrace_capture.trajectories) == 3
        assert random.getstate() == before  # the worker and sink threads draw nothing either

    @pytest.mark.parametrize("summaries", [True, False], ids=["summary", "sampled_out"])
    def test_nor_does_a_rollout_sampled_out(self, summaries):
        """Tallied (a trace id of its own, marks, the worker's summary) or not traced at all."""

        @rtrace.traced_tool
        def tool(x):
            return x

        with rtrace.testing.capture(max_traces_per_step=0, summaries=summaries) as got:
            random.seed(1234)
            before = random.getstate()
            for step in range(3):
                with rtrace.rollout_context(step=step, sample_index=0):
                    tool(step)
            assert got.trajectories == [] and random.getstate() == before
            assert got.stats().get("rollouts_summarized", 0) == (3 if summaries else 0)
        assert random.getstate() == before

    def test_ids_differ_under_the_same_seed(self, rtrace_capture):
        """Re-seeding before each trajectory does not repeat trace ids (0.1.0: the SDK's
        generator drew them from the seeded `random`)."""
        ids = []
        for _ in range(5):
            random.seed(7)
            with rtrace.rollout_context(step=0) as ctx:
                pass
            ids.append(ctx.trace_id)
        assert len(set(ids)) == 5
        spans = {s.span_id for t in rtrace_capture.trajectories for s in t.spans}
        assert len(spans) == 5


    def test_application_provider_with_the_sdks_random_ids(self):
        """On an application's TracerProvider (whose default id generator draws from `random`),
        rtrace's own spans still take their ids from rtrace's private generator: the program's random state does not
        move and seeded runs do not repeat trace ids; the application's own spans keep its generator."""
        from opentelemetry import trace as otel_trace
        from opentelemetry.sdk.trace import TracerProvider

        provider = TracerProvider()  # RandomIdGenerator: random.getrandbits
        old = otel_trace._TRACER_PROVIDER
        otel_trace._TRACER_PROVIDER = provider
        try:
            with rtrace.testing.capture() as got:
                ids = []
                for _ in range(3):
                    random.seed(7)
                    before = random.getstate()
                    with rtrace.rollout_context(step=0) as ctx:
                        pass
                    assert random.getstate() == before
                    ids.append(ctx.trace_id)
                assert len(set(ids)) == 3 and len(got.trajectories) == 3
            random.seed(7)
            before = random.getstate()
            with provider.get_tracer("app").start_as_current_span("app-span"):
                pass
            assert random.getstate() != before  # the application's generator is its own business
        finally:
            rtrace.shutdown()
            otel_trace._TRACER_PROVIDER = old


# ----------------------------------------------------------------------------- item 8
def test_exception_text_is_bounded_by_max_value_chars():
    """A 200,000-character exception message is cut to max_value_chars (plus the marker) in the
    span's error and in every exception-event attribute."""
    limit = 1000
    with rtrace.testing.capture(max_value_chars=limit) as got:
        @rtrace.traced_tool
        def tool():
            raise ValueError("x" * 200_000)

        with pytest.raises(ValueError) as info:
            with rtrace.rollout_context(step=1):
                tool()
        assert len(str(info.value)) == 200_000  # the program's exception is untouched
        (traj,) = got.trajectories
    bound = limit + len("…[truncated, 200000 chars]") + len("ValueError: ")
    for span in traj.spans:
        assert span.error is not None and len(span.error) <= bound
        assert span.error.endswith("chars]")
        for event in span.events:
            for value in event["attributes"].values():
                assert not isinstance(value, str) or len(value) <= bound
