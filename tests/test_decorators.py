"""Decorators on every function shape, with tracing on (JSONL sink) and off."""

from __future__ import annotations

import asyncio
import functools
import inspect

import pytest

import rtrace
import rtrace.testing
from tests.conftest import read_back


def only(trajs, name=None):
    """The single trajectory written (optionally: the one whose root is ``name``)."""
    if name is not None:
        trajs = [t for t in trajs if t.name == name]
    assert len(trajs) == 1, [t.name for t in trajs]
    return trajs[0]


class Agent:
    name = "agent-1"

    @rtrace.traced
    def method(self, x, y=2):
        return x * y

    @rtrace.traced(name="cm")
    @classmethod
    def cmethod(cls, x):
        return x + 1

    @classmethod
    @rtrace.traced(name="cm2")
    def cmethod2(cls, x):
        return x + 2

    @rtrace.traced(kind="chain")
    @staticmethod
    def smethod(x):
        return -x

    @rtrace.traced_generation
    async def generate(self, prompt_ids):
        await asyncio.sleep(0)
        return {"response_ids": [9, 8], "finish_reason": "stop"}

    @rtrace.traced_tool
    def execute(self, tool_call_id, parameters):
        return "ok"


@rtrace.traced
def plain(a, b=1, *, c=3):
    """Docstring kept."""
    return a + b + c


@rtrace.traced_rollout(name="loop")
async def coro(x):
    await asyncio.sleep(0)
    return x * 2


@rtrace.traced(kind="stream")
def gen(n):
    total = 0
    for i in range(n):
        sent = yield i
        total += sent or 0
    return total


@rtrace.traced(kind="stream")
async def agen(n):
    for i in range(n):
        await asyncio.sleep(0)
        yield i


class TestShapes:
    def test_metadata_and_introspection_kept(self):
        """functools.wraps metadata and inspect's function kind answer as for the original."""
        assert plain.__name__ == "plain" and plain.__doc__ == "Docstring kept."
        assert inspect.signature(plain) == inspect.signature(plain.__wrapped__)
        assert inspect.iscoroutinefunction(coro)
        assert inspect.isgeneratorfunction(gen)
        assert inspect.isasyncgenfunction(agen)
        assert not inspect.iscoroutinefunction(plain)
        assert inspect.iscoroutinefunction(Agent.generate)

    def test_plain_function_is_its_own_trajectory(self, jsonl_path):
        """Outside any rollout, a decorated call is the root of a trajectory with its inputs/output."""
        assert plain(1, 2, c=4) == 7
        traj = only(read_back(jsonl_path))
        assert traj.name == "plain" and traj.root.kind == "chain"
        assert traj.root.input == {"a": 1, "b": 2, "c": 4}
        assert traj.root.output == 7

    def test_methods_skip_self_and_cls(self, jsonl_path):
        """Methods, classmethods (either decorator order) and staticmethods record arguments without self/cls."""
        a = Agent()
        assert a.method(3) == 6
        assert Agent.cmethod(1) == 2 and a.cmethod(1) == 2
        assert Agent.cmethod2(1) == 3
        assert Agent.smethod(5) == -5
        trajs = {t.name: t for t in read_back(jsonl_path)}
        assert trajs["Agent.method"].root.input == {"x": 3}
        assert trajs["cm"].root.input == {"x": 1}
        assert trajs["cm2"].root.input == {"x": 1}
        assert trajs["Agent.smethod"].root.input == {"x": 5}
        assert trajs["Agent.smethod"].root.output == -5

    async def test_async_generation_and_tool_spans(self, jsonl_path):
        """Async generation and tool methods nest under the rollout root with GenAI attributes."""
        a = Agent()
        with rtrace.rollout_context(step=1, sample_index=0):
            await a.generate([1, 2, 3])
            a.execute("call-7", {"q": "x"})
        traj = only(read_back(jsonl_path))
        root, g, t = traj.spans
        assert (root.kind, g.kind, t.kind) == ("rollout", "generation", "tool")
        assert g.parent_id == root.span_id and t.parent_id == root.span_id
        assert g.prompt_ids == [1, 2, 3] and g.response_ids == [9, 8]
        assert g.attributes["gen_ai.operation.name"] == "chat"
        assert g.attributes["gen_ai.usage.input_tokens"] == 3
        assert g.attributes["gen_ai.usage.output_tokens"] == 2
        assert g.attributes["gen_ai.response.finish_reasons"] == ["stop"]
        assert t.attributes["gen_ai.tool.name"] == "agent-1"
        assert t.attributes["gen_ai.tool.call.id"] == "call-7"
        assert t.input == {"tool_call_id": "call-7", "parameters": {"q": "x"}}

    def test_tool_and_model_names_replace_qualnames(self, jsonl_path):
        """A tool span is named after its tool, a generation after its model, the qualified
        name kept, fully qualified, in code.function.name (OTel's; code.function is deprecated); a name=
        given to the decorator is kept as it is."""
        @rtrace.traced_generation(model="qwen-7b")
        def generate(prompt_ids):
            return [1]

        @rtrace.traced_generation(name="policy", model="qwen-7b")
        def named_generate(prompt_ids):
            return [1]

        @rtrace.traced_generation
        def unknown_model(prompt_ids):
            return [1]

        @rtrace.traced_tool(name="my-span", tool_name="search")
        def named_tool(q):
            return q

        with rtrace.rollout_context(step=1):
            generate([1])
            named_generate([1])
            unknown_model([1])
            Agent().execute("call-1", {})
            named_tool("x")
        _, gen, named, unknown, tool, named_t = only(read_back(jsonl_path)).spans
        assert (gen.name, gen.attributes["code.function.name"]) == (
            "qwen-7b", f"{__name__}.{type(self).__name__}.test_tool_and_model_names_replace_qualnames.<locals>.generate")
        assert (tool.name, tool.attributes["code.function.name"]) == ("agent-1", f"{__name__}.Agent.execute")
        assert [s.name for s in (named, unknown, named_t)] == ["policy", "unknown_model", "my-span"]
        assert not any(k.startswith("code.") for s in (gen, tool, named, unknown, named_t) for k in s.attributes
                       if k != "code.function.name")
        assert not any("code.function.name" in s.attributes for s in (named, unknown, named_t))
        assert named_t.attributes["gen_ai.tool.name"] == "search"

    def test_generator_span_covers_iteration_without_leaking(self, jsonl_path):
        """A generator's span lasts until exhaustion; between items the caller is not inside it."""
        with rtrace.rollout_context(step=2):
            g = gen(3)
            first = next(g)
            # between items, a decorated call made by the caller is a sibling, not a child
            plain(0)
            second = g.send(10)
            rest = list(g)
        assert (first, second, rest) == (0, 1, [2])
        traj = only(read_back(jsonl_path))
        by_name = {s.name: s for s in traj.spans}
        root = traj.root
        assert by_name["gen"].parent_id == root.span_id
        assert by_name["plain"].parent_id == root.span_id
        assert by_name["gen"].output == {"yielded": 3, "return": 10}
        assert by_name["gen"].end_ns >= by_name["plain"].end_ns

    def test_generator_closed_early(self, jsonl_path):
        """An early-closed generator ends its span (closed) and closes the inner generator."""
        closed = []

        @rtrace.traced
        def counting():
            try:
                yield 1
                yield 2
            finally:
                closed.append(True)

        with rtrace.rollout_context(step=1):
            for item in counting():
                break
        assert closed == [True]
        traj = only(read_back(jsonl_path))
        span = traj.spans[1]
        assert span.output == {"yielded": 1, "closed": True} and span.status == "ok"

    def test_generator_throw_is_forwarded(self, jsonl_path):
        """gen.throw() reaches the inner generator, which may handle it and go on."""

        @rtrace.traced
        def resilient():
            while True:
                try:
                    yield "item"
                except KeyError:
                    yield "handled"
                    return

        with rtrace.rollout_context(step=1):
            g = resilient()
            assert next(g) == "item"
            assert g.throw(KeyError("k")) == "handled"
            with pytest.raises(StopIteration):
                next(g)
        traj = only(read_back(jsonl_path))
        assert traj.spans[1].status == "ok"

    async def test_async_generator_and_early_close(self, jsonl_path):
        """Async generators: full iteration and aclose() both end the span with item counts."""
        with rtrace.rollout_context(step=1):
            items = [i async for i in agen(3)]
            ag = agen(5)
            assert await ag.__anext__() == 0
            await ag.aclose()
        assert items == [0, 1, 2]
        traj = only(read_back(jsonl_path))
        outputs = [s.output for s in traj.spans[1:]]
        assert outputs == [{"yielded": 3}, {"yielded": 1, "closed": True}]

    async def test_async_generator_does_not_leak_context(self, jsonl_path):
        """Between items of an async generator the caller's spans are siblings of it."""
        with rtrace.rollout_context(step=1):
            async for _ in agen(2):
                plain(1)
        traj = only(read_back(jsonl_path))
        root = traj.root
        assert all(s.parent_id == root.span_id for s in traj.spans[1:])
        assert [s.name for s in traj.spans[1:]] == ["agen", "plain", "plain"]


class TestErrors:
    def test_exception_recorded_and_reraised_unchanged(self, jsonl_path):
        """The same exception object propagates; the span has status error and an exception event with stack."""
        err = ValueError("boom")

        @rtrace.traced_tool
        def bad():
            raise err

        with pytest.raises(ValueError) as info:
            with rtrace.rollout_context(step=1):
                bad()
        assert info.value is err
        traj = only(read_back(jsonl_path))
        tool = traj.spans[1]
        assert tool.status == "error" and tool.error == "ValueError: boom"
        event = tool.events[0]
        assert event["name"] == "exception"
        assert event["attributes"]["exception.type"] == "ValueError"
        assert "raise err" in event["attributes"]["exception.stacktrace"]
        assert traj.status == "error"

    async def test_async_exception(self, jsonl_path):
        """Async functions record and re-raise as well."""

        @rtrace.traced
        async def bad():
            await asyncio.sleep(0)
            raise KeyError("k")

        with pytest.raises(KeyError):
            await bad()
        traj = only(read_back(jsonl_path))
        assert traj.root.status == "error" and traj.root.error.startswith("KeyError")

    def test_generator_exception(self, jsonl_path):
        """An exception inside a generator ends its span with status error."""

        @rtrace.traced
        def bad_gen():
            yield 1
            raise RuntimeError("mid-stream")

        with pytest.raises(RuntimeError):
            list(bad_gen())
        assert only(read_back(jsonl_path)).root.error == "RuntimeError: mid-stream"


class TestCapture:
    def test_capture_false_records_only_names_and_timings(self, jsonl_path):
        """capture=False: no input, no output, but the span with its timing."""

        @rtrace.traced(capture=False)
        def secretive(x):
            return x

        secretive("hidden")
        traj = only(read_back(jsonl_path))
        assert traj.root.name == "secretive"
        assert traj.root.input is None and traj.root.output is None
        assert traj.root.end_ns >= traj.root.start_ns

    def test_secrets_redacted_by_default(self, jsonl_path):
        """Arguments and nested keys that look like secrets are replaced by [REDACTED]."""

        @rtrace.traced
        def call_api(url, api_key, headers):
            return {"ok": True, "access_token": "t0k"}

        call_api("http://x", "sk-live", {"Authorization": "Bearer z", "accept": "json"})
        root = only(read_back(jsonl_path)).root
        assert root.input == {"url": "http://x", "api_key": "[REDACTED]",
                              "headers": {"Authorization": "[REDACTED]", "accept": "json"}}
        assert root.output == {"ok": True, "access_token": "[REDACTED]"}
        assert rtrace.stats()["values_redacted"] == 3

    def test_truncation_limit(self, tmp_path):
        """A value longer than max_value_chars becomes its prefix plus a truncation marker."""
        path = tmp_path / "t.jsonl"
        rtrace.configure(exporter="jsonl", jsonl_path=str(path), max_value_chars=100)

        @rtrace.traced
        def big(text):
            return len(text)

        big("x" * 1000)
        root = only(read_back(path)).root
        assert root.input["text"] == "x" * 100 + "…[truncated, 1000 chars]"
        assert rtrace.stats()["values_truncated"] == 1

    def test_list_arguments_snapshot_at_call_time(self, jsonl_path):
        """A list extended in place after the call shows what the call saw."""

        @rtrace.traced_generation
        def generate(prompt_ids):
            return [7]

        prompt = [1, 2]
        with rtrace.rollout_context(step=1):
            out = generate(prompt)
            prompt += out
            generate(prompt)
        gens = only(read_back(jsonl_path)).spans[1:]
        assert [g.prompt_ids for g in gens] == [[1, 2], [1, 2, 7]]

    def test_arguments_snapshot_at_call_time_in_every_form(self, jsonl_path):
        """Lists and dicts changed in place after the call, given positionally, by keyword,
        next to a dict or alone: each span shows what its call saw (the hot path keeps the
        call's own argument tuple and notes list lengths; dicts are copied)."""

        @rtrace.traced
        def step(*args, **kwargs):
            return None

        items, info = [1], {"a": 1}
        with rtrace.rollout_context(step=1):
            step(items, "x")  # a list: its length noted
            step(items, info)  # a dict beside it: both snapshotted on the call
            step(items=items, info=info)  # by keyword
            step(items=items, tag="t")
            items.append(2)
            info["b"] = 2
            step(items)
        inputs = [s.input for s in only(read_back(jsonl_path)).spans[1:]]
        assert inputs == [{"arg0": [1], "arg1": "x"}, {"arg0": [1], "arg1": {"a": 1}},
                          {"items": [1], "info": {"a": 1}}, {"items": [1], "tag": "t"}, {"arg0": [1, 2]}]

    def test_unserialisable_argument_does_not_break_the_call(self, jsonl_path):
        """An argument whose repr raises is exported in a defined form and counted."""

        class Nasty:
            def __repr__(self):
                raise RuntimeError("no repr")

        @rtrace.traced
        def f(x):
            return 1

        assert f(Nasty()) == 1
        root = only(read_back(jsonl_path)).root
        assert root.input == {"x": "<unserialisable Nasty: RuntimeError>"}
        assert rtrace.stats()["capture_errors"] == 1


class TestOff:
    def test_off_calls_through_and_records_nothing(self, tmp_path, monkeypatch):
        """With no exporter configured, decorated calls behave exactly like the originals."""
        monkeypatch.chdir(tmp_path)
        rtrace.configure(exporter="none")
        assert plain(1) == 5
        assert asyncio.run(coro(2)) == 4
        assert list(gen(2)) == [0, 1]
        with rtrace.rollout_context(step=1) as ctx:
            rtrace.record_reward(1.0)
            assert not ctx.traced and ctx.trace_id is None
        assert not rtrace.is_enabled()
        assert list(tmp_path.iterdir()) == []

    def test_off_wrapper_is_one_check(self, monkeypatch):
        """Tracing off: the wrapper reads one global and calls the function (no span code)."""
        rtrace.configure(exporter="none")
        calls = []

        @rtrace.traced
        def f(x):
            calls.append(x)
            return x

        from rtrace.instrumentation import decorators

        opened = []
        monkeypatch.setattr(decorators, "_open_or_none", lambda *a: opened.append(a))
        assert f(1) == 1 and calls == [1]
        assert opened == []  # the off path never reached the span code
        rtrace.configure(sinks=[rtrace.testing.MemorySink()])
        assert f(2) == 2 and len(opened) == 1  # ... which the on path does (the check can fail)

    def test_env_var_turns_tracing_on_lazily(self, tmp_path, monkeypatch):
        """RTRACE_EXPORTER alone (no configure call) turns tracing on at the first traced call."""
        path = tmp_path / "env.jsonl"
        monkeypatch.setenv("RTRACE_EXPORTER", "jsonl")
        monkeypatch.setenv("RTRACE_JSONL_PATH", str(path))
        assert plain(1) == 5
        assert only(read_back(path)).name == "plain"


def test_wraps_keeps_wrapped_attribute():
    """The original function is reachable as __wrapped__ (functools.wraps)."""
    assert plain.__wrapped__(1) == 5
    assert plain.__name__ == "plain" and plain.__doc__ == plain.__wrapped__.__doc__
    assert inspect.signature(plain) == inspect.signature(plain.__wrapped__)


def test_a_calls_output_is_recorded_before_its_span_ends(monkeypatch, rtrace_capture):
    """Once a span ends, the worker may read what its call saw at any moment: the return
    value is recorded before the end, not after (a worker that ran in between lost it)."""
    from rtrace.pipeline.worker import Pipeline

    seen = []
    offer = Pipeline.offer

    def watching(self, span):
        if getattr(span, "spec", None) is not None:  # a decorated call's span, as it ends
            seen.append((span.name, span.has_output, span.output))
        return offer(self, span)

    monkeypatch.setattr(Pipeline, "offer", watching)

    @rtrace.traced
    def add_one(x):
        return x + 1

    @rtrace.traced
    async def double(x):
        return x * 2

    with rtrace.rollout_context(step=1):
        add_one(1)
        asyncio.run(double(2))
    assert seen == [("add_one", True, 2), ("double", True, 4)]
    assert [s.output for s in rtrace_capture.trajectories[0].spans[1:]] == [2, 4]
