"""The trackio sink against real trackio: traces read back with trackio's own storage.

trackio reads ``TRACKIO_DIR`` once, at import, so the session fixture points it at a
temporary directory before the first import; each test uses its own project.
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
import uuid

import pytest

import rtrace
from rtrace.exporters.jsonl import read_jsonl
from rtrace.exporters.trackio import TrackioSink, iso_time, normalize, span_dict
from rtrace.pipeline.metrics import StepMetricsTracker
from rtrace.trajectory import SpanRecord, Trajectory



@pytest.fixture
def project(trackio_mod):
    """A fresh trackio project name for one test."""
    return f"rt-{uuid.uuid4().hex[:10]}"


def traces_of(project, run, **kw):
    from trackio.sqlite_storage import SQLiteStorage

    out = SQLiteStorage.get_traces(project, run=run, **kw)
    return sorted(out, key=lambda t: (t["step"], t["key"], t["metadata"].get("sample_index") or 0))


def logs_with(project, run, prefix):
    """Metric rows of a run that contain a key starting with ``prefix``, by step."""
    from trackio.sqlite_storage import SQLiteStorage

    rows = [r for r in SQLiteStorage.get_logs(project, run) if any(k.startswith(prefix) for k in r)]
    # numbers only: the step's rollouts table is logged beside them (tables_of)
    return [{k: v for k, v in r.items() if (k.startswith(prefix) and not isinstance(v, dict)) or k == "step"}
            for r in rows]


def tables_of(project, run, key="rollout/rollouts"):
    """The rollouts tables of a run, by step (rows as trackio stored them)."""
    from trackio.sqlite_storage import SQLiteStorage

    return {r["step"]: r[key]["_value"] for r in SQLiteStorage.get_logs(project, run) if key in r}


# ----------------------------------------------------------------------------- an agent
SYSTEM = {"role": "system", "content": "You are a calculator agent."}


@rtrace.traced_generation(model="toy-lm")
async def generate(messages, prompt_ids):
    await asyncio.sleep(0)
    turn = sum(1 for m in messages if m["role"] == "assistant")
    if turn < 2:
        expr = ["17*3", "51+1"][turn]
        return {"content": f"Let me compute {expr}.", "response_ids": [7] * (3 + turn),
                "finish_reason": "tool_calls", "call": ("calculator", expr, f"call_{turn}")}
    return {"content": "The answer is 52.", "response_ids": [9, 9], "finish_reason": "stop", "call": None}


class Calculator:
    name = "calculator"

    @rtrace.traced_tool
    async def __call__(self, expression, tool_call_id):
        return str(eval(expression))  # noqa: S307 (fixed test expressions)


@rtrace.traced_rollout
async def agent_loop(question):
    messages = [SYSTEM, {"role": "user", "content": question}]
    calc = Calculator()
    while True:
        out = await generate(messages, prompt_ids=list(range(10 + 5 * len(messages))))
        if out["call"] is None:
            return messages, out["content"]
        name, expr, call_id = out["call"]
        messages = messages + [{"role": "assistant", "content": out["content"], "tool_calls": [
            {"id": call_id, "type": "function",
             "function": {"name": name, "arguments": json.dumps({"expression": expr, "tool_call_id": call_id})}}]}]
        result = await calc(expr, tool_call_id=call_id)
        messages = messages + [{"role": "tool", "tool_call_id": call_id, "name": name, "content": result}]


async def one_rollout(step, i, validate=False, reward=1.0):
    async with rtrace.rollout_context(step=step, sample_index=i, rollout_n=0, validate=validate,
                                      group_id=f"g{i}", policy_version=step):
        msgs, final = await agent_loop("What is 17*3+1?")
        rtrace.record_reward(reward, correct=True)
    return msgs, final


def calls_turn(calls):
    return {"role": "assistant", "content": "", "tool_calls": calls}


# ----------------------------------------------------------------------------- tests
class TestRoundTrip:
    def test_multi_turn_trajectory_round_trips(self, project, tmp_path, capsys):
        """A two-tool-call trajectory comes back with its messages, span tree and metadata."""
        jsonl = tmp_path / "t.jsonl"
        # (health checks off: its scripted prompt ids do not continue the responses; tests/test_health.py)
        rtrace.configure(exporter="trackio,jsonl", jsonl_path=str(jsonl), project=project, health_checks="none",
                         experiment="run-1", export_interval_s=0.05)
        msgs, final = asyncio.run(one_rollout(4, 17))
        assert rtrace.flush(30)
        (ref,) = read_jsonl(jsonl)  # what rtrace saw, from an independent sink
        (got,) = traces_of(project, "run-1")
        assert (got["key"], got["step"], got["run"]) == ("rollout/traces", 4, "run-1")

        assert got["messages"] == msgs + [{"role": "assistant", "content": final}]

        spans = got["spans"]
        assert [(s["name"], s["kind"], s["metadata"]["rtrace.kind"]) for s in spans] == [
            ("rollout", "span", "rollout"), ("agent_loop", "span", "agent"),
            ("toy-lm", "generation", "generation"), ("calculator", "tool", "tool"),
            ("toy-lm", "generation", "generation"), ("calculator", "tool", "tool"),
            ("toy-lm", "generation", "generation")]
        ids = [s["id"] for s in spans]
        assert [s["parent_id"] for s in spans] == [None, ids[0]] + [ids[1]] * 5
        root, gens = ref.spans[0], [r for r in ref.spans if r.kind == "generation"]
        for s, r in zip(spans, ref.spans):
            assert (s["id"], s["parent_id"]) == (r.span_id, r.parent_id)
            assert s["duration_ms"] == r.duration_ms and s["duration_ms"] > 0
            assert (s["start_time"], s["end_time"]) == (iso_time(r.start_ns), iso_time(r.end_ns))
            assert (s["status"], s["error"]) == ("success", None)
            ids_kept = {f"rtrace.{k}": getattr(r, k) for k in ("prompt_ids", "response_ids") if getattr(r, k)}
            if r.kind == "generation":  # the rest of the captured output stays in the metadata
                assert s["metadata"] == {"rtrace.kind": r.kind, **r.attributes, **ids_kept,
                                         "rtrace.output": r.output}
            else:
                assert s["metadata"] == {"rtrace.kind": r.kind, **r.attributes, **ids_kept}
            if r is not root and r.kind != "generation":  # other spans show what their call captured
                assert (s["input"], s["output"]) == (r.input, r.output)
        # the root, which a trace opens on: the task in; the final answer, reward and outcome out
        assert spans[0]["input"] == [SYSTEM, {"role": "user", "content": "What is 17*3+1?"}]
        assert spans[0]["output"] == {"answer": "The answer is 52.", "reward": 1.0, "outcome": {"correct": True}}
        # a generation: its chat messages in; its response out, with the tool calls that followed it
        assert [s["input"] for s in spans if s["kind"] == "generation"] == [r.input["messages"] for r in gens]
        assert [s["output"] for s in spans if s["kind"] == "generation"] == [msgs[2], msgs[4], "The answer is 52."]
        assert msgs[2]["content"] == "Let me compute 17*3." and msgs[2]["tool_calls"][0]["id"] == "call_0"
        gen0, tool0 = spans[2], spans[3]
        assert gen0["model"] == "toy-lm"
        assert gen0["usage"] == {"input_tokens": 20, "output_tokens": 3, "total_tokens": 23}
        assert gen0["metadata"]["rtrace.response_ids"] == [7, 7, 7]  # ids without token2text are kept
        assert gen0["metadata"]["code.function.name"] == f"{__name__}.generate"
        assert tool0["output"] == "51" and tool0["metadata"]["gen_ai.tool.call.id"] == "call_0"
        assert tool0["usage"] is None and tool0["model"] is None

        # the header: what a researcher looks for first, defaults (partial, error, dropped spans) left out
        total = ref.duration_ms
        gen = sum(s.duration_ms for s in ref.spans if s.kind == "generation")
        tool = sum(s.duration_ms for s in ref.spans if s.kind == "tool")
        # rtrace's trace id first (trackio's TRACE ID column is a log batch's); durations to 0.1 ms;
        # validate only when true (a search for "false" must not match every training trace)
        assert list(got["metadata"].items()) == [
            ("trace_id", ref.trace_id), ("step", 4), ("sample_index", 17), ("rollout_n", 0), ("reward", 1.0),
            ("group_id", "g17"), ("policy_version", 4), ("outcome.correct", True),
            ("duration_ms", round(total, 1)), ("generation_ms", round(gen, 1)), ("tool_ms", round(tool, 1)),
            ("num_turns", 3), ("num_tool_calls", 2), ("finish_reason", "stop"), ("prompt_tokens", 20 + 30 + 40),
            ("response_tokens", 3 + 4 + 2), ("experiment", "run-1"), ("status", "✓ correct reward=1.0")]
        # the list previews the first assistant message: a tool-call turn shows its call
        assert [m["content"] for m in got["messages"] if m["role"] == "assistant"] == [
            'Let me compute 17*3.', 'Let me compute 51+1.', "The answer is 52."]

        # approx: the expected fractions sum the span durations in another order (1 ulp apart)
        (logged,) = logs_with(project, "run-1", "rollout/")
        assert logged == pytest.approx({
            "step": 4, "rollout/trajectories": 1, "rollout/reward_mean": 1.0, "rollout/reward_min": 1.0,
            "rollout/reward_max": 1.0, "rollout/reward_std": 0.0, "rollout/turns_mean": 3.0,
            "rollout/tool_calls_mean": 2.0, "rollout/tokens_in_mean": 90.0, "rollout/tokens_out_mean": 9.0,
            "rollout/finish_reason/stop_frac": 1 / 3, "rollout/finish_reason/tool_calls_frac": 2 / 3,
            "rollout/latency_ms_mean": total, "rollout/latency_ms_p50": total, "rollout/latency_ms_p90": total,
            "rollout/latency_ms_max": total, "rollout/time_generation_frac": gen / total,
            "rollout/time_tool_frac": tool / total, "rollout/time_other_frac": (total - gen - tool) / total,
            "rollout/error_rate": 0.0, "rollout/truncated_rate": 0.0, "rollout/partial_rate": 0.0,
            # the fleet in time (docs/timeline.md): on policy (step 4, version 4), calls one after another
            "rollout/generation_ms_mean": gen, "rollout/tool_ms_mean": tool,
            "rollout/wait_ms_mean": total - gen - tool, "rollout/staleness_mean": 0.0, "rollout/staleness_max": 0.0,
            "rollout/staleness/0_frac": 1.0, "rollout/staleness/0_pass_rate": 1.0, "rollout/staleness/1_frac": 0.0,
            "rollout/staleness/2_frac": 0.0, "rollout/staleness/3_frac": 0.0, "rollout/staleness/4plus_frac": 0.0,
            "rollout/inflight_peak": 1.0}, rel=1e-9, abs=1e-9)
        capsys.readouterr()
        rtrace.shutdown()
        assert "Run finished" in capsys.readouterr().out  # the run rtrace opened is finished

    def test_steps_and_eval_key(self, project):
        """Steps 1 and 2 come back under their steps; validation under eval/traces; one summary per step."""
        rtrace.configure(exporter="trackio", project=project, experiment="steps", export_interval_s=0.05)

        async def main():
            for step in (1, 2):
                await asyncio.gather(*(one_rollout(step, i, reward=float(i)) for i in range(3)))
            await one_rollout(2, 0, validate=True, reward=0.5)

        asyncio.run(main())
        assert rtrace.flush(30)
        for step in (1, 2):
            got = traces_of(project, "steps", step=step)
            train = [t for t in got if t["key"] == "rollout/traces"]
            assert [(t["step"], t["metadata"]["step"], t["metadata"]["sample_index"]) for t in train] == \
                [(step, step, i) for i in range(3)]
        (val,) = [t for t in traces_of(project, "steps") if t["key"] == "eval/traces"]
        assert (val["step"], val["metadata"]["validate"], val["metadata"]["reward"]) == (2, True, 0.5)
        # told apart in trackio's trace list, whose Status column shows metadata["status"]: the
        # verdict and the reward ...
        assert val["metadata"]["status"] == "[val] ✓ correct reward=0.5"
        assert sorted(t["metadata"]["status"] for t in traces_of(project, "steps") if t["id"] != val["id"]) == [
            f"✓ correct reward={float(i)!r}" for i in (0, 0, 1, 1, 2, 2)]
        assert [t["metadata"]["sample_index"] for t in traces_of(project, "steps", search="reward=2.0")] == [2, 2]
        # ... and found by the list's search box (trackio searches metadata values)
        assert [t["id"] for t in traces_of(project, "steps", search="[val]")] == [val["id"]]
        assert [t["id"] for t in traces_of(project, "steps", search=val["metadata"]["trace_id"])] == [val["id"]]
        rows = logs_with(project, "steps", "rollout/")
        assert [(r["step"], r["rollout/trajectories"], r["rollout/reward_mean"], r["rollout/reward_max"])
                for r in rows] == [(1, 3, 1.0, 2.0), (2, 3, 1.0, 2.0)]
        assert [(r["step"], r["eval/trajectories"], r["eval/reward_mean"])
                for r in logs_with(project, "steps", "eval/")] == [(2, 1, 0.5)]

    def test_summary_metrics_off(self, project):
        """summary_metrics=False logs the traces and no summary rows."""
        rtrace.configure(exporter="trackio", project=project, experiment="quiet", summary_metrics=False,
                         export_interval_s=0.05)
        asyncio.run(one_rollout(1, 0))
        assert rtrace.flush(30)
        assert len(traces_of(project, "quiet")) == 1
        assert logs_with(project, "quiet", "rollout/") == []


class TestWhatAPersonSees:
    """What trackio's traces page shows: INPUT / OUTPUT panes of each span, the header."""

    def test_generation_shows_decoded_prompt_and_response(self, project, tok):
        """A generation without chat messages shows the decoded prompt in and the decoded response
        out, not its captured {"finish_reason": ...}, which stays in the span's metadata."""
        rtrace.configure(exporter="trackio", project=project, experiment="t2t", token2text=True, tokenizer=tok,
                         export_interval_s=0.05)
        prompt, answer = tok("What is 2 + 2?")["input_ids"], tok("It is 4.")["input_ids"]

        @rtrace.traced_generation
        def generate(prompt_ids, temperature):
            return {"response_ids": answer, "finish_reason": "length"}

        with rtrace.rollout_context(step=1, sample_index=0):
            generate(prompt, temperature=0.7)
            rtrace.record_reward(0.0)
        assert rtrace.flush(30)
        (got,) = traces_of(project, "t2t")
        root, gen = got["spans"]
        assert (gen["input"], gen["output"]) == ("What is 2 + 2?", "It is 4.")
        assert gen["metadata"]["gen_ai.response.finish_reasons"] == ["length"]
        assert gen["metadata"]["rtrace.output"] == {"finish_reason": "length"}
        assert gen["metadata"]["rtrace.input"] == {"temperature": 0.7}
        assert root["input"] == [{"role": "user", "content": "What is 2 + 2?"}]
        assert root["output"] == {"answer": "It is 4.", "reward": 0.0}
        assert got["metadata"]["finish_reason"] == "length"

    def test_generation_shows_the_model_text_with_the_parsed_tool_calls(self, project, tok):
        """When the agent records the turn without its tool-call markup, a generation's output is
        the decoded text the model wrote, with the tool calls the agent parsed from it."""
        rtrace.configure(exporter="trackio", project=project, experiment="calls", token2text=True, tokenizer=tok,
                         export_interval_s=0.05)
        raw = '<tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>'
        calls = [{"id": "c1", "type": "function",
                  "function": {"name": "calculator", "arguments": '{"expression": "2+2"}'}}]

        @rtrace.traced_generation
        def generate(messages, prompt_ids):
            return tok(raw if len(messages) == 1 else "It is 4.")["input_ids"]

        @rtrace.traced_tool(tool_name="calculator")
        def calculator(expression, tool_call_id):
            return "4"

        with rtrace.rollout_context(step=1, sample_index=0):
            chat = [{"role": "user", "content": "2+2?"}]
            generate(list(chat), [1])
            chat += [{"role": "assistant", "content": "", "tool_calls": calls},  # markup stripped by the agent
                     {"role": "tool", "tool_call_id": "c1", "content": calculator("2+2", tool_call_id="c1")}]
            generate(list(chat), [2])
        assert rtrace.flush(30)
        (got,) = traces_of(project, "calls")
        first, second = [s for s in got["spans"] if s["kind"] == "generation"]
        assert first["output"] == {"role": "assistant", "content": raw, "tool_calls": calls}
        assert second["output"] == "It is 4."
        # the tool-call turn's content is its call in trackio (its list previews it), not ""
        assert got["messages"][1] == {**calls_turn(calls), "content": 'calculator(expression="2+2")'}

    def test_generation_without_text_says_what_it_holds(self, project):
        """Without token2text a generation's output (and its turn) says how many tokens it holds."""
        rtrace.configure(exporter="trackio", project=project, experiment="ids", export_interval_s=0.05)

        @rtrace.traced_generation
        def generate(prompt_ids):
            return [5] * 16

        with rtrace.rollout_context(step=1, sample_index=0):
            generate([1, 2, 3])
        assert rtrace.flush(30)
        (got,) = traces_of(project, "ids")
        text = "[16 tokens, not decoded: set RTRACE_TOKEN2TEXT]"
        assert got["spans"][1]["output"] == text and got["spans"][1]["metadata"]["rtrace.response_ids"] == [5] * 16
        assert got["messages"][-1] == {"role": "assistant", "content": text}
        assert got["spans"][0]["output"] == {"answer": text}

    def test_header_order_flattening_and_defaults(self, project):
        """outcome, annotations and kept become readable keys after the coordinates; partial, error and
        dropped_spans appear only when they are not at their default; None values are left out."""
        settings = rtrace.configure(exporter="none", project=project, experiment="hdr")
        span = SpanRecord("a" * 16, None, "rollout", "rollout", 10**18, 10**18 + 10**9)
        odd = Trajectory("e" * 32, "rollout", [span], step=3, sample_index=1, rollout_n=2, validate=True, reward=0.5,
                         group_id="g1", outcome={"correct": False}, annotations={"advantage": 0.4, "step": 9},
                         kept=["best", "error"], extra={"dataset": "gsm8k"}, partial=True, dropped_spans=2,
                         status="error", error="Timeout: too slow")
        plain = Trajectory("f" * 32, "agent_loop", [SpanRecord("b" * 16, None, "agent_loop", "agent", 1, 2)], step=3)
        sink = TrackioSink(settings)
        sink.export([odd, plain])
        sink.shutdown()
        by_id = {t["metadata"]["trace_id"]: t["metadata"] for t in traces_of(project, "hdr")}
        assert list(by_id["e" * 32]) == [
            "trace_id", "step", "sample_index", "rollout_n", "reward", "group_id", "policy_version", "validate",
            "outcome.correct", "advantage", "annotations.step", "kept", "duration_ms", "generation_ms",
            "tool_ms", "num_turns", "num_tool_calls", "extra.dataset", "status", "partial", "error", "dropped_spans"]
        assert {k: by_id["e" * 32][k] for k in ("advantage", "annotations.step", "kept", "status", "error")} == {
            "advantage": 0.4, "annotations.step": 9, "kept": "best,error", "status": "[val] ✗ error reward=0.5",
            "error": "Timeout: too slow"}
        assert by_id["e" * 32]["policy_version"] is None  # the first keys are always there
        assert list(by_id["f" * 32]) == [
            "trace_id", "step", "sample_index", "rollout_n", "reward", "group_id", "policy_version",
            "duration_ms", "generation_ms", "tool_ms", "num_turns", "num_tool_calls", "status", "name"]
        assert by_id["f" * 32]["status"] == "ok"


class TestApplicationRun:
    def test_app_run_opened_before_configure(self, trackio_mod, project, capsys):
        """A run the app opened before configure() gets the traces and is not finished by rtrace."""
        app = trackio_mod.init(project=project, name="app-run", auto_log_cpu=False, auto_log_gpu=False)
        try:
            rtrace.configure(exporter="trackio", project=f"{project}-unused", experiment="unused",
                             export_interval_s=0.05)
            asyncio.run(one_rollout(1, 0))
            assert rtrace.flush(30)
            capsys.readouterr()
            rtrace.shutdown()
            assert "Run finished" not in capsys.readouterr().out
            assert trackio_mod.context_vars.current_run.get() is app and not app._stop_flag.is_set()
            assert [t["metadata"]["sample_index"] for t in traces_of(project, "app-run")] == [0]
            assert logs_with(project, "app-run", "rollout/trajectories") == [{"step": 1, "rollout/trajectories": 1}]
            from trackio.sqlite_storage import SQLiteStorage

            assert SQLiteStorage.get_traces(f"{project}-unused", run="unused") == []
            trackio_mod.log({"app/after": 2.0}, step=5)  # the app's run still takes its own logs
        finally:
            trackio_mod.finish()
        assert logs_with(project, "app-run", "app/") == [{"step": 5, "app/after": 2.0}]

    def test_app_run_opened_after_configure(self, trackio_mod, project):
        """A run the app opens after configure() (on its own thread) is found and used."""
        rtrace.configure(exporter="trackio", project=f"{project}-unused", experiment="unused",
                         export_interval_s=0.05)
        app = trackio_mod.init(project=project, name="late-app", auto_log_cpu=False, auto_log_gpu=False)
        try:
            asyncio.run(one_rollout(3, 5))
            assert rtrace.flush(30)
            rtrace.shutdown()
            assert not app._stop_flag.is_set()
            assert [(t["step"], t["metadata"]["sample_index"]) for t in traces_of(project, "late-app")] == [(3, 5)]
        finally:
            trackio_mod.finish()


class TestBadValues:
    def test_odd_values_arrive_in_defined_form(self, project):
        """NaN reward, tuples, non-string keys and a 1 MB tool output arrive in the documented form."""
        rtrace.configure(exporter="trackio", project=project, experiment="odd", export_interval_s=0.05,
                         health_checks="none")

        @rtrace.traced_tool
        def fetch(url):
            return "x" * 1_000_000

        with rtrace.rollout_context(step=2, sample_index=0, pair=(1, 2), table={1: "a"}):
            fetch("http://example")
            rtrace.record_reward(float("nan"), tags=("a", "b"), scores={7: float("inf")}, label="NaN-free")
        assert rtrace.flush(30)
        (got,) = traces_of(project, "odd")
        meta = got["metadata"]
        assert math.isnan(meta["reward"])  # written "NaN"; trackio's reader returns top-level NaN as a float
        assert (meta["outcome.tags"], meta["outcome.scores"], meta["outcome.label"]) == (
            ["a", "b"], {"7": "Infinity"}, "NaN-free")
        assert (meta["extra.pair"], meta["extra.table"]) == ([1, 2], {"1": "a"})
        truncated = "x" * 20_000 + "…[truncated, 1000000 chars]"
        assert got["spans"][1]["output"] == truncated
        assert got["messages"] == []  # no generation: nothing readable as a conversation
        total = got["spans"][0]["duration_ms"]  # the header's is rounded to 0.1 ms
        assert meta["duration_ms"] == round(total, 1)
        tool = got["spans"][1]["duration_ms"]
        # (wait_ms is summed from the spans' nanoseconds, the expectation from their milliseconds: 1 ulp apart)
        assert logs_with(project, "odd", "rollout/") == [pytest.approx({
            "step": 2, "rollout/trajectories": 1, "rollout/reward_non_finite": 1, "rollout/turns_mean": 0.0,
            "rollout/tool_calls_mean": 1.0, "rollout/tokens_in_mean": 0.0, "rollout/tokens_out_mean": 0.0,
            "rollout/latency_ms_mean": total, "rollout/latency_ms_p50": total, "rollout/latency_ms_p90": total,
            "rollout/latency_ms_max": total, "rollout/time_generation_frac": 0.0,
            "rollout/time_tool_frac": tool / total, "rollout/time_other_frac": (total - tool) / total,
            "rollout/error_rate": 0.0, "rollout/truncated_rate": 0.0, "rollout/partial_rate": 0.0,
            "rollout/generation_ms_mean": 0.0, "rollout/tool_ms_mean": tool, "rollout/wait_ms_mean": total - tool,
            "rollout/inflight_peak": 1}, rel=1e-9, abs=1e-12)]
        stats = rtrace.stats()
        assert stats["sink.trackio.exported"] == 1 and "sink.trackio.failed_batches" not in stats

    def test_hand_made_trajectory_values(self, project):
        """Values rtrace's capture never produces (tuples, int keys, huge ints, lone surrogates, inf) are normalised."""
        settings = rtrace.configure(exporter="none", project=project, experiment="hand")
        root = SpanRecord("a" * 16, None, "root", "rollout", 1_000_000_000_123_456_789, 1_000_000_001_123_456_789,
                          status="error", error="boom", attributes={"k": (1, 2)},
                          output={3: float("-inf"), "big": 2**70, "s": "bad\udcffbyte"})
        traj = Trajectory("f" * 32, "root", [root], step=1, reward=float("inf"), outcome={"t": (None, 1.5)},
                          status="error", error="boom", messages=[{"role": "user", "content": ("tu", "ple")}])
        sink = TrackioSink(settings)
        sink.export([traj])
        tracker = StepMetricsTracker()  # the pipeline computes step metrics; the sink logs them
        assert tracker.observe([traj]) == []
        sink.export_step_metrics(tracker.release())
        sink.shutdown()
        (got,) = traces_of(project, "hand")
        (span,) = got["spans"]
        assert span["output"] == {"3": "-Infinity", "big": str(2**70), "s": "bad\\udcffbyte"}
        assert (span["status"], span["error"], span["metadata"]["k"]) == ("error", "boom", [1, 2])
        assert (span["start_time"], span["end_time"]) == ("2001-09-09T01:46:40.123456Z", "2001-09-09T01:46:41.123456Z")
        assert span["duration_ms"] == 1000.0
        assert got["metadata"]["reward"] == math.inf and got["metadata"]["outcome.t"] == [None, 1.5]
        assert (got["metadata"]["status"], got["metadata"]["error"]) == ("✗ error reward=inf", "boom")
        assert got["messages"] == [{"role": "user", "content": ["tu", "ple"]}]
        assert logs_with(project, "hand", "rollout/error_rate") == [{"step": 1, "rollout/error_rate": 1.0}]


    def test_bidirectional_controls_are_shown_not_obeyed(self, project):
        """A tool result stored as RLO + "gnp.exe" (a browser shows "exe.png"): trackio's
        conversation and the root span's task and answer show the override as ⟨U+202E⟩; the
        spans keep what was recorded."""
        settings = rtrace.configure(exporter="none", project=project, experiment="bidi")
        start = 1_700_000_000_000_000_000
        root = SpanRecord("b" * 16, None, "rollout", "rollout", start, start + 10**9)
        tool = SpanRecord("c" * 16, "b" * 16, "lookup", "tool", start + 1, start + 2, output="\u202egnp.exe")
        messages = [{"role": "user", "content": "Which file? \u2067x\u2069"},
                    {"role": "tool", "name": "look\u202eup", "content": "\u202egnp.exe"},
                    {"role": "assistant", "content": "It is \u202egnp.exe"}]
        traj = Trajectory("e" * 32, "rollout", [root, tool], step=1, messages=messages)
        sink = TrackioSink(settings)
        sink.export([traj])
        sink.shutdown()
        (got,) = traces_of(project, "bidi")
        assert got["messages"] == [{"role": "user", "content": "Which file? ⟨U+2067⟩x⟨U+2069⟩"},
                                   {"role": "tool", "name": "look⟨U+202E⟩up", "content": "⟨U+202E⟩gnp.exe"},
                                   {"role": "assistant", "content": "It is ⟨U+202E⟩gnp.exe"}]
        spans = {s["name"]: s for s in got["spans"]}
        assert spans["rollout"]["input"] == got["messages"][:1]
        assert spans["rollout"]["output"]["answer"] == "It is ⟨U+202E⟩gnp.exe"
        assert spans["lookup"]["output"] == "\u202egnp.exe"  # a span's captured value: as recorded
        assert traj.messages[1]["content"] == "\u202egnp.exe"  # the trajectory itself is not changed


class TestThroughput:
    def test_thousand_async_trajectories_arrive(self, project):
        """1,000 trajectories from an async loop all arrive, each under its step."""
        rtrace.configure(exporter="trackio", project=project, experiment="many", export_interval_s=0.05)

        @rtrace.traced_tool
        async def lookup(i):
            await asyncio.sleep(0)
            return i

        async def rollout(i):
            async with rtrace.rollout_context(step=i // 250, sample_index=i):
                await lookup(i)
                rtrace.record_reward(i % 2)

        async def main():
            await asyncio.gather(*(rollout(i) for i in range(1000)))

        asyncio.run(main())
        assert rtrace.flush(60)
        got = traces_of(project, "many")
        assert sorted((t["step"], t["metadata"]["sample_index"]) for t in got) == [(i // 250, i) for i in range(1000)]
        rows = logs_with(project, "many", "rollout/trajectories")
        assert rows == [{"step": s, "rollout/trajectories": 250} for s in range(4)]
        assert rtrace.stats()["sink.trackio.exported"] == 1000


class TestConversion:
    @pytest.mark.parametrize("value, expected", [
        (float("nan"), "NaN"),                      # non-finite floats: their string form
        ([float("inf"), -math.inf], ["Infinity", "-Infinity"]),
        ((1, (2, 3)), [1, [2, 3]]),                 # tuples: lists, also nested
        ({1: {None: "x"}}, {"1": {"None": "x"}}),   # keys: str(key)
        (2**64, str(2**64)),                        # beyond 64 bits: str
        ("ok\udc80", "ok\\udc80"),                  # lone surrogate: escaped
        ("héllo", "héllo"),                         # valid non-ASCII text unchanged
        ({"a": None, "b": True}, {"a": None, "b": True}),  # None and bools kept
        (object, str(object)),                      # anything else: str()
    ])
    def test_normalize(self, value, expected):
        """normalize() gives the documented form of each odd value."""
        assert normalize(value) == expected

    @pytest.mark.parametrize("kind, expected", [
        ("rollout", "span"), ("agent", "span"), ("chain", "span"), ("span", "span"),
        ("generation", "generation"), ("tool", "tool")])
    def test_span_kinds(self, kind, expected):
        """rtrace kinds map to trackio's three kinds; the original kind stays in metadata."""
        d = span_dict(SpanRecord("1" * 16, None, "n", kind, 0, 1_500_000))
        assert (d["kind"], d["metadata"]["rtrace.kind"], d["duration_ms"]) == (expected, kind, 1.5)
        assert (d["start_time"], d["end_time"]) == ("1970-01-01T00:00:00.000000Z", "1970-01-01T00:00:00.001500Z")
