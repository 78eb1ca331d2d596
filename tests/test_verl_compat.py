"""rtrace.compat.verl: veRL's rollout_trace API, backed by rtrace's sinks.

A veRL-style async ToolAgentLoop (an LLM server client's ``generate``, a tool's
``execute``, the loop's ``run``, driven like ``AgentLoopWorker._run_agent_loop``) is
written once below and instantiated twice: with veRL's decorator names from the shim,
and with rtrace's own decorators. Both write to a real JSONL sink and are read back.
The LLM server is a scripted stand-in for vLLM (the I/O boundary); the tokenizer is the
real offline one of the demo.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
from typing import Any, Optional

import pytest
from pydantic import BaseModel

import rtrace
from rtrace import _stats
from rtrace.compat.verl import RolloutTraceConfig, rollout_trace_attr, rollout_trace_op
from rtrace.exporters.jsonl import read_jsonl
from rtrace import set_tokenizer

SAMPLING = {"temperature": 1.0, "top_p": 1.0}
EXPERIMENT = "verl-run-1"


@pytest.fixture(scope="module")
def tokenizer():
    from rtrace.demo import build_tokenizer

    return build_tokenizer()


@pytest.fixture(autouse=True)
def clean_verl(monkeypatch, tmp_path):
    """Each test starts with veRL's singleton reset and no process-wide tokenizer, and
    writes its JSONL traces to a temporary file."""
    RolloutTraceConfig.reset()
    set_tokenizer(None)
    monkeypatch.setenv("RTRACE_JSONL_PATH", str(tmp_path / "verl.jsonl"))
    monkeypatch.setenv("RTRACE_EXPORT_INTERVAL_S", "0.05")
    yield
    RolloutTraceConfig.reset()
    set_tokenizer(None)


def read(tmp_path, name="verl.jsonl"):
    assert rtrace.flush(10)
    path = tmp_path / name
    return read_jsonl(path) if path.exists() else []


# ----------------------------------------------------------------------------- the app


class TokenOutput(BaseModel):
    """veRL's TokenOutput (verl.workers.rollout.replica)."""

    token_ids: list[int]
    log_probs: Optional[list[float]] = None
    stop_reason: Optional[str] = None


class AgentLoopOutput(BaseModel):
    """veRL's AgentLoopOutput, the fields this loop fills."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    num_turns: int = 0


class ToolResponse(BaseModel):
    text: Optional[str] = None


_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)


def make_agent(op_run, op_generate, op_execute):
    """A veRL-style ToolAgentLoop whose three traced methods use the given decorators."""

    class LLMServerClient:
        """Scripted server: a tool call for the calculator first, then the answer."""

        def __init__(self, tokenizer):
            self.tok = tokenizer  # veRL's client has no `tokenizer` attribute either

        @op_generate
        async def generate(self, request_id, *, prompt_ids: list[int], sampling_params: dict[str, Any],
                           image_data: Optional[list[Any]] = None) -> TokenOutput:
            await asyncio.sleep(0)
            text = self.tok.decode(prompt_ids)
            a, b = re.search(r"What is (\d+) \+ (\d+)\?", text).groups()
            if "<tool_response>" not in text:
                reply = f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{a} + {b}"}}}}\n</tool_call>'
            else:
                reply = f"The answer is {int(a) + int(b)}."
            return TokenOutput(token_ids=self.tok.encode(reply, add_special_tokens=False) + [2], stop_reason="stop")

    class CalculatorTool:
        """veRL's BaseTool shape: ``self.name`` and ``execute(instance_id, parameters, **kwargs)``."""

        name = "calculator"

        @op_execute
        async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple:
            value = eval(parameters["expression"], {"__builtins__": {}}, {})  # test input only
            return ToolResponse(text=str(value)), 0.0, {}

    class ToolAgentLoop:
        def __init__(self, tokenizer, max_turns=3):
            self.tokenizer = tokenizer
            self.server_manager = LLMServerClient(tokenizer)
            self.tools = {"calculator": CalculatorTool()}
            self.max_turns = max_turns

        @op_run
        async def run(self, sampling_params: dict[str, Any], **kwargs) -> AgentLoopOutput:
            messages = list(kwargs["raw_prompt"])
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            prompt_ids = self.tokenizer.encode(text, add_special_tokens=False)
            n_prompt = len(prompt_ids)
            mask: list[int] = []
            turns = 0
            for turn in range(self.max_turns):
                output = await self.server_manager.generate(
                    f"req-{kwargs['index']}", prompt_ids=prompt_ids, sampling_params=sampling_params,
                    image_data=None)
                turns += 1
                prompt_ids += output.token_ids  # in place, as veRL's loop does
                mask += [1] * len(output.token_ids)
                calls = [json.loads(c) for c in _CALL.findall(self.tokenizer.decode(output.token_ids))]
                if not calls:
                    break
                results = await asyncio.gather(*(
                    self.tools[c["name"]].execute(f"inst-{turn}-{k}", c["arguments"]) for k, c in enumerate(calls)))
                reply = "".join(f"<|im_start|>user\n<tool_response>\n{r.text}\n</tool_response><|im_end|>\n"
                                for r, _, _ in results) + "<|im_start|>assistant\n"
                tool_ids = self.tokenizer.encode(reply, add_special_tokens=False)
                prompt_ids += tool_ids
                mask += [0] * len(tool_ids)
            return AgentLoopOutput(prompt_ids=prompt_ids[:n_prompt], response_ids=prompt_ids[n_prompt:],
                                   response_mask=mask, num_turns=turns)

    return ToolAgentLoop


VerlLoop = make_agent(rollout_trace_op, rollout_trace_op, rollout_trace_op)
NativeLoop = make_agent(rtrace.traced_rollout, rtrace.traced_generation, rtrace.traced_tool)


def prompt(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"What is {i} + {10 * i + 1}?"}]


async def verl_worker(loop, step, samples, n, validate=False, traced=None):
    """Like veRL's AgentLoopWorker: every (sample, rollout) concurrently in rollout_trace_attr."""
    async def one(i, r):
        with rollout_trace_attr(step=step, sample_index=i, rollout_n=r, validate=validate, name="agent_loop",
                                trace=True if traced is None else i in traced):
            return await loop.run(SAMPLING, raw_prompt=prompt(i), index=i)

    return await asyncio.gather(*(one(i, r) for i in samples for r in range(n)))


async def generate_sequences(loop, step, samples, n, rng, validate=False):
    """One ``AgentLoopWorker.generate_sequences`` call as veRL 0.9.1 makes it: K =
    ``max_samples_per_step_per_worker`` distinct samples picked at random in this call
    (no memory of earlier calls), ``trace=False`` for the rollouts of the others.
    Returns the samples picked."""
    cap = RolloutTraceConfig.get_instance().max_samples_per_step_per_worker
    unique = sorted(set(samples))
    chosen = set(unique) if cap is None or cap >= len(unique) else set(rng.sample(unique, cap))
    await verl_worker(loop, step, samples, n, validate=validate, traced=chosen)
    return chosen


async def native_worker(loop, step, samples, n, validate=False):
    async def one(i, r):
        with rtrace.rollout_context(step=step, sample_index=i, rollout_n=r, validate=validate, name="agent_loop"):
            return await loop.run(SAMPLING, raw_prompt=prompt(i), index=i)

    return await asyncio.gather(*(one(i, r) for i in samples for r in range(n)))


def shape(traj) -> tuple:
    """Everything but ids and timings: coordinates, and per span depth, name, kind,
    input, output, token ids, status and the non-timing attributes."""
    spans = tuple((depth, s.name, s.kind, json.dumps(s.input, sort_keys=True), json.dumps(s.output, sort_keys=True),
                   tuple(s.prompt_ids or ()), tuple(s.response_ids or ()), s.status,
                   json.dumps(s.attributes, sort_keys=True))
                  for depth, s in traj.walk())
    return (traj.name, traj.step, traj.sample_index, traj.rollout_n, traj.validate, traj.experiment, spans)


# ----------------------------------------------------------------------------- tests


class TestSameTrajectories:
    async def test_verl_decorators_match_rtrace_api(self, tokenizer, tmp_path, monkeypatch):
        """The veRL-decorated loop and the rtrace-decorated loop write identical trajectories
        (names, tree, inputs, outputs, token ids, coordinates), and return identical results."""
        RolloutTraceConfig.init("proj", EXPERIMENT, "jsonl")
        verl_out = await verl_worker(VerlLoop(tokenizer), step=3, samples=[0, 1], n=2)
        verl = read(tmp_path)
        rtrace.shutdown()

        monkeypatch.setenv("RTRACE_JSONL_PATH", str(tmp_path / "native.jsonl"))
        rtrace.configure(exporter="jsonl", project="proj", experiment=EXPERIMENT)
        native_out = await native_worker(NativeLoop(tokenizer), step=3, samples=[0, 1], n=2)
        native = read(tmp_path, "native.jsonl")

        assert [o.model_dump() for o in verl_out] == [o.model_dump() for o in native_out]
        assert len(verl) == 4
        assert sorted(map(shape, verl)) == sorted(map(shape, native))
        t = min(verl, key=lambda t: (t.sample_index, t.rollout_n))
        assert [(d, s.name, s.kind) for d, s in t.walk()] == [
            (0, "agent_loop", "rollout"), (1, "ToolAgentLoop.run", "agent"),
            (2, "LLMServerClient.generate", "generation"), (2, "calculator", "tool"),
            (2, "LLMServerClient.generate", "generation")]
        assert (t.step, t.sample_index, t.rollout_n, t.validate, t.experiment) == (3, 0, 0, False, EXPERIMENT)
        run, gen, tool = t.spans[1], t.spans[2], t.spans[3]
        assert run.input == {"sampling_params": SAMPLING, "raw_prompt": prompt(0), "index": 0}
        assert gen.input == {"request_id": "req-0", "sampling_params": SAMPLING, "image_data": None}
        assert gen.prompt_ids == tokenizer.encode(
            tokenizer.apply_chat_template(prompt(0), add_generation_prompt=True, tokenize=False),
            add_special_tokens=False)  # what the call saw, not the list extended afterwards
        assert gen.attributes["gen_ai.response.finish_reasons"] == ["stop"]
        assert tool.input == {"instance_id": "inst-0-0", "parameters": {"expression": "0 + 1"}}
        assert tool.attributes["gen_ai.tool.name"] == "calculator"
        # the tool's name shows, not the method's (kept fully qualified, as OTel's code.function.name)
        assert tool.attributes["code.function.name"].endswith(".CalculatorTool.execute")
        assert tool.output == [{"text": "1"}, 0.0, {}]

    async def test_defaults_are_bound(self, tokenizer, tmp_path):
        """An op's input is the bound arguments with defaults applied, as veRL records them."""
        RolloutTraceConfig.init("proj", EXPERIMENT, "jsonl")
        client = VerlLoop(tokenizer).server_manager
        with rollout_trace_attr(step=1, sample_index=0, rollout_n=0):
            await client.generate("r1", prompt_ids=tokenizer.encode("What is 1 + 2?"), sampling_params={})
        (t,) = read(tmp_path)
        assert t.spans[1].input == {"request_id": "r1", "sampling_params": {}, "image_data": None}


class TestTraceFalse:
    async def test_trace_false_disables_nested_ops(self, tokenizer, tmp_path):
        """Inside rollout_trace_attr(trace=False) no op is traced (nor any rtrace-decorated
        call), the results are unchanged, and sibling traced rollouts are unaffected."""
        RolloutTraceConfig.init("proj", EXPERIMENT, "jsonl")
        loop = VerlLoop(tokenizer)

        @rtrace.traced_tool
        async def native_tool(tool_call_id):
            return "x"

        async def untraced():
            with rollout_trace_attr(step=1, sample_index=7, rollout_n=0, trace=False):
                assert rtrace.current_coordinates() == {"step": 1, "sample_index": 7, "rollout_n": 0,
                                                        "validate": False}
                await native_tool("c1")
                return await loop.run(SAMPLING, raw_prompt=prompt(7), index=7)

        async def traced():
            with rollout_trace_attr(step=1, sample_index=8, rollout_n=0):
                return await loop.run(SAMPLING, raw_prompt=prompt(8), index=8)

        off, on = await asyncio.gather(untraced(), traced())
        trajs = read(tmp_path)
        assert [(t.step, t.sample_index) for t in trajs] == [(1, 8)]
        assert off.num_turns == on.num_turns == 2 and off.response_ids[-1] == 2

    async def test_trace_false_outside_any_backend_is_a_no_op(self, tokenizer, tmp_path):
        """With no backend (None) the context and the ops do nothing, as in veRL."""
        RolloutTraceConfig.init("proj", EXPERIMENT, None)
        with rollout_trace_attr(step=1, sample_index=0, trace=False):
            assert rtrace.current_coordinates() == {}
            out = await VerlLoop(tokenizer).run(SAMPLING, raw_prompt=prompt(1), index=1)
        assert out.num_turns == 2
        assert not rtrace.is_enabled() and not (tmp_path / "verl.jsonl").exists()


class TestSampleCap:
    """``max_samples_per_step_per_worker`` is veRL's: ``AgentLoopWorker.generate_sequences``
    reads it, picks the samples of each call and passes ``trace=False`` for the others.
    The shim follows that choice and keeps no cap of its own."""

    async def test_follows_the_worker_choice_in_each_call(self, tokenizer, tmp_path):
        """Validation calls generate_sequences once per val batch, all at the same step:
        K samples are traced per call (with all their rollouts), as in veRL."""
        RolloutTraceConfig.init("proj", EXPERIMENT, "jsonl", max_samples_per_step_per_worker=2)
        assert RolloutTraceConfig.get_instance().max_samples_per_step_per_worker == 2
        loop, rng = VerlLoop(tokenizer), random.Random(5)
        chosen = [await generate_sequences(loop, 2, batch, n=3, rng=rng, validate=True)
                  for batch in ([5, 6, 7, 8], [1, 2, 3, 4])]
        got = sorted((t.step, t.validate, t.sample_index, t.rollout_n) for t in read(tmp_path))
        assert got == sorted((2, True, i, r) for c in chosen for i in c for r in range(3))
        assert len(got) == 2 * 2 * 3
        # veRL's choice is not rtrace's sampling: nothing is counted as sampled out
        assert _stats.snapshot().get("trajectories_sampled_out", 0) == 0

    async def test_rollout_trace_attr_alone_does_not_cap(self, tokenizer, tmp_path):
        """As veRL's rollout_trace_attr: a custom worker that does not pick samples traces
        every rollout, whatever max_samples_per_step_per_worker says."""
        RolloutTraceConfig.init("proj", EXPERIMENT, "jsonl", max_samples_per_step_per_worker=2)
        outs = await verl_worker(VerlLoop(tokenizer), 1, samples=[5, 6, 7, 8], n=3)
        assert len(outs) == 12 and all(o.num_turns == 2 for o in outs)
        assert len(read(tmp_path)) == 12

    async def test_cap_agrees_with_verl_worker_selection(self, tokenizer, tmp_path):
        """When veRL's worker already chose the samples (trace=False for the others), exactly
        the chosen ones are traced, with all their rollouts."""
        RolloutTraceConfig.init("proj", EXPERIMENT, "jsonl", max_samples_per_step_per_worker=2)
        await verl_worker(VerlLoop(tokenizer), 1, samples=[0, 1, 2, 3], n=2, traced={1, 3})
        assert sorted((t.sample_index, t.rollout_n) for t in read(tmp_path)) == [(1, 0), (1, 1), (3, 0), (3, 1)]

    async def test_cap_zero_traces_nothing(self, tokenizer, tmp_path):
        """A cap of 0: veRL's worker picks no sample, nothing is traced."""
        RolloutTraceConfig.init("proj", EXPERIMENT, "jsonl", max_samples_per_step_per_worker=0)
        assert await generate_sequences(VerlLoop(tokenizer), 1, [0, 1], n=2, rng=random.Random(0)) == set()
        assert read(tmp_path) == []

    async def test_rtrace_cap_applies_on_top(self, tokenizer, tmp_path, monkeypatch):
        """rtrace's own cap (RTRACE_MAX_TRACES_PER_STEP, whole groups with
        RTRACE_SAMPLE_GROUPS) is applied by rtrace's sampler on top of veRL's choice."""
        monkeypatch.setenv("RTRACE_MAX_TRACES_PER_STEP", "4")
        monkeypatch.setenv("RTRACE_SAMPLE_GROUPS", "1")
        RolloutTraceConfig.init("proj", EXPERIMENT, "jsonl")
        await verl_worker(VerlLoop(tokenizer), 1, samples=[0, 1, 2, 3], n=2)
        assert sorted((t.sample_index, t.rollout_n) for t in read(tmp_path)) == [(0, 0), (0, 1), (1, 0), (1, 1)]
        assert _stats.snapshot()["trajectories_sampled_out"] == 4


class TestConfig:
    @pytest.mark.parametrize("backend", [None, "dummy"])
    async def test_off_backends(self, backend, tokenizer, tmp_path):
        """None and veRL's "dummy" mean off: rtrace is not configured, ops call through."""
        RolloutTraceConfig.init("proj", EXPERIMENT, backend)
        assert RolloutTraceConfig.get_backend() == backend
        with rollout_trace_attr(step=1, sample_index=0, rollout_n=0):
            out = await VerlLoop(tokenizer).run(SAMPLING, raw_prompt=prompt(2), index=2)
        assert out.num_turns == 2 and not rtrace.is_enabled() and not (tmp_path / "verl.jsonl").exists()

    @pytest.mark.parametrize("backend, message", [
        ("wandb", "unknown trace backend 'wandb'"),
        ("trackio,wandb", "unknown trace backend 'wandb'"),
        ("", "empty backend"),
    ])
    def test_unknown_backend_is_a_clear_error(self, backend, message):
        """Any other name raises ConfigError naming the accepted values; nothing is configured."""
        with pytest.raises(rtrace.ConfigError) as err:
            RolloutTraceConfig.init("proj", EXPERIMENT, backend)
        assert message in str(err.value)
        assert "accepted values: jsonl, trackio, mlflow, otlp" in str(err.value)
        assert RolloutTraceConfig.get_backend() is None and not rtrace.is_enabled()

    async def test_weave_alone_is_off_with_a_warning(self, tokenizer, tmp_path, caplog):
        """veRL's weave backend (rtrace has no weave sink) must not stop a worker from
        starting: tracing is off, said once in a warning, and the ops call through."""
        with caplog.at_level("WARNING", logger="rtrace"):
            RolloutTraceConfig.init("proj", EXPERIMENT, "weave")
            RolloutTraceConfig.reset()
            RolloutTraceConfig.init("proj", EXPERIMENT, "weave")
        warnings = [r.getMessage() for r in caplog.records if "weave" in r.getMessage()]
        assert len(warnings) == 1 and "no weave sink, tracing is off" in warnings[0]
        assert RolloutTraceConfig.get_backend() == "weave" and not rtrace.is_enabled()
        with rollout_trace_attr(step=1, sample_index=0, rollout_n=0):
            out = await VerlLoop(tokenizer).run(SAMPLING, raw_prompt=prompt(2), index=2)
        assert out.num_turns == 2 and not (tmp_path / "verl.jsonl").exists()

    async def test_weave_in_a_list_traces_to_the_others(self, tokenizer, tmp_path, caplog):
        """backend='weave,jsonl': the JSONL sink gets the traces; weave is left out, with a warning."""
        with caplog.at_level("WARNING", logger="rtrace"):
            RolloutTraceConfig.init("proj", EXPERIMENT, "weave,jsonl")
        assert any("tracing to jsonl only" in r.getMessage() for r in caplog.records)
        assert rtrace.current_settings().exporter == ("jsonl",)
        await verl_worker(VerlLoop(tokenizer), 1, samples=[0], n=1)
        assert len(read(tmp_path)) == 1

    def test_collector_backend_needs_the_collector_env(self):
        """backend='collector' without collector.env in the environment is a clear error."""
        with pytest.raises(rtrace.ConfigError, match="RTRACE_COLLECTOR_ENDPOINT"):
            RolloutTraceConfig.init("proj", EXPERIMENT, "collector")

    async def test_collector_env_streams_any_backend_to_the_collector(self, tokenizer, tmp_path, monkeypatch):
        """A worker started with collector.env (RTRACE_EXPORTER=collector ...) streams to the
        job's collector whatever backend veRL's config names; the collector's sink writes."""
        path = tmp_path / "collector.jsonl"
        with rtrace.start_collector(exporter="jsonl", jsonl_path=str(path), settle_s=0.2) as collector:
            for key, value in collector.env.items():
                monkeypatch.setenv(key, value)
            RolloutTraceConfig.init("proj", EXPERIMENT, "trackio")
            assert rtrace.current_settings().exporter == ("collector",)
            await verl_worker(VerlLoop(tokenizer), 1, samples=[0, 1], n=1)
            assert rtrace.flush(10)
            rtrace.shutdown()
            assert collector.flush(10)
            trajs = read_jsonl(path)
        assert sorted((t.step, t.sample_index, t.experiment) for t in trajs) == [(1, 0, EXPERIMENT), (1, 1, EXPERIMENT)]

    def test_bad_cap_is_a_clear_error(self):
        """A negative cap is refused with the accepted values."""
        with pytest.raises(rtrace.ConfigError, match="an integer >= 0, or None"):
            RolloutTraceConfig.init("proj", EXPERIMENT, "jsonl", max_samples_per_step_per_worker=-1)

    def test_init_once_then_reset(self):
        """init configures once (later calls are ignored, as in veRL); reset forgets it."""
        RolloutTraceConfig.init("proj", EXPERIMENT, "jsonl", token2text=True)
        RolloutTraceConfig.init("other", "x", "mlflow")
        cfg = RolloutTraceConfig()
        assert cfg is RolloutTraceConfig.get_instance()
        assert (cfg.backend, cfg.project_name, cfg.experiment_name, cfg.token2text) == ("jsonl", "proj", EXPERIMENT,
                                                                                        True)
        assert RolloutTraceConfig.enable_token2text() is True and RolloutTraceConfig.get_client() is None
        settings = rtrace.current_settings()
        assert (settings.exporter, settings.project, settings.experiment, settings.token2text) == (
            ("jsonl",), "proj", EXPERIMENT, True)
        RolloutTraceConfig.reset()
        assert RolloutTraceConfig.get_backend() is None and RolloutTraceConfig.enable_token2text() is False


class TestOps:
    async def test_token2text_adds_text_and_keeps_the_result(self, tokenizer, tmp_path):
        """With token2text the loop's tokenizer is adopted: generation spans get decoded text,
        the run span's output shows prompt_text/response_text, and the caller's result is the
        untouched AgentLoopOutput."""
        RolloutTraceConfig.init("proj", EXPERIMENT, "jsonl", token2text=True)
        loop = VerlLoop(tokenizer)
        with rollout_trace_attr(step=1, sample_index=4, rollout_n=0):
            out = await loop.run(SAMPLING, raw_prompt=prompt(4), index=4)
        assert type(out) is AgentLoopOutput and set(out.model_dump()) == {
            "prompt_ids", "response_ids", "response_mask", "num_turns"}
        (t,) = read(tmp_path)
        run = t.spans[1]
        assert run.output["prompt_text"] == tokenizer.decode(out.prompt_ids, skip_special_tokens=True)
        assert run.output["response_text"] == tokenizer.decode(out.response_ids, skip_special_tokens=True)
        assert run.output["response_text"].endswith("The answer is 45.")
        assert run.output["prompt_ids"] == out.prompt_ids and run.output["num_turns"] == 2
        gens = t.spans_of_kind("generation")
        assert [g.attributes["rtrace.response_text"] for g in gens] == [
            '<tool_call>\n{"name": "calculator", "arguments": {"expression": "4 + 41"}}\n</tool_call>',
            "The answer is 45."]
        assert gens[0].attributes["rtrace.prompt_text"] == "user\nWhat is 4 + 41?\nassistant\n"

    async def test_sync_op_and_errors(self, tmp_path):
        """A sync method is traced too; an exception is recorded on its span and re-raised."""
        RolloutTraceConfig.init("proj", EXPERIMENT, "jsonl")

        class Scorer:
            @rollout_trace_op
            def compute_score(self, solution: str, ground_truth: str = "5") -> float:
                if solution == "boom":
                    raise ValueError("bad solution")
                return float(solution == ground_truth)

        with rollout_trace_attr(step=2, sample_index=0, rollout_n=0):
            assert Scorer().compute_score("5") == 1.0
            with pytest.raises(ValueError, match="bad solution"):
                Scorer().compute_score(solution="boom")
        (t,) = read(tmp_path)
        ok, bad = t.spans[1], t.spans[2]
        assert (ok.name, ok.kind, ok.input, ok.output) == (
            "TestOps.test_sync_op_and_errors.<locals>.Scorer.compute_score".rsplit("<locals>.", 1)[-1],
            "chain", {"solution": "5", "ground_truth": "5"}, 1.0)
        assert bad.status == "error" and bad.error == "ValueError: bad solution"

    async def test_op_outside_attr_is_its_own_trajectory(self, tokenizer, tmp_path):
        """An op called outside rollout_trace_attr is the root of its own trajectory."""
        RolloutTraceConfig.init("proj", EXPERIMENT, "jsonl")
        await VerlLoop(tokenizer).run(SAMPLING, raw_prompt=prompt(3), index=3)
        (t,) = read(tmp_path)
        assert t.name == "ToolAgentLoop.run" and t.step is None and t.num_tool_calls == 1
