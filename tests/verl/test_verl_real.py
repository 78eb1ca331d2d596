"""rtrace's veRL shim inside the real veRL 0.9.1 agent loop (issue #15).

``AgentLoopWorker.generate_sequences`` -> ``ToolAgentLoop.run`` runs for real, on CPU:
veRL's Hydra-composed ``ppo_trainer`` config, its ``LLMServerClient`` and
``GlobalRequestLoadBalancer``, its ``HermesToolParser``, a ``BaseTool`` subclass loaded
through veRL's tool config, the Continuous Token builder of a qwen2 model; only the
inference engine is a scripted stand-in returning token ids (see verl_app.py). Tracing
is configured only through veRL's own ``actor_rollout_ref.rollout.trace.*`` config, with
``verl.utils.rollout_trace`` routed to ``rtrace.compat.verl`` by
``rtrace.compat.verl.install()`` (conftest.py); the sinks are real (JSONL, trackio) and
read back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import uuid

import numpy as np
import pytest

pytest.importorskip("verl")

import rtrace  # noqa: E402
from rtrace.compat.verl import RolloutTraceConfig  # noqa: E402
from rtrace.exporters.jsonl import read_jsonl  # noqa: E402
from rtrace.exporters.trackio import readable_messages  # noqa: E402

import verl_app as app  # noqa: E402  (tests/verl on sys.path: see conftest.py)
from verl_app import TOOL_LOOP_TREE, trace_overrides  # noqa: E402

pytestmark = pytest.mark.integration

RL_ATTRS = ("rl.step", "rl.sample_index", "rl.rollout_n", "rl.validate")

#: Where a veRL tool's step reward and metrics go (rtrace/pipeline/builder.py).
TOOL_REWARD_ATTR = "rl.tool.reward"
TOOL_METRIC_PREFIX = "rl.tool.metrics."


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return app.write_model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="session")
def tool_config(tmp_path_factory):
    return app.write_tool_config(tmp_path_factory.mktemp("tools") / "tools.yaml")


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from verl.utils import hf_tokenizer

    return hf_tokenizer(str(model_dir))


@pytest.fixture(autouse=True)
def fresh_trace_config(monkeypatch, tmp_path):
    """veRL's trace singleton reset; the JSONL sink writes to a temporary file."""
    RolloutTraceConfig.reset()
    monkeypatch.setenv("RTRACE_JSONL_PATH", str(tmp_path / "verl.jsonl"))
    monkeypatch.setenv("RTRACE_EXPORT_INTERVAL_S", "0.05")
    yield
    RolloutTraceConfig.reset()


def worker_for(model_dir, tool_config, tokenizer, overrides):
    config = app.compose_config(model_dir, tool_config, overrides)
    return app.make_worker(config, tokenizer)


def read_traces(tmp_path, name="verl.jsonl"):
    assert rtrace.flush(20)
    path = tmp_path / name
    return read_jsonl(path) if path.exists() else []


def by_coords(trajs):
    return {(t.step, t.sample_index, t.rollout_n, t.validate): t for t in trajs}


def snapshot(out) -> dict:
    """Everything generate_sequences returns except wall-clock timings."""
    batch = {k: out.batch[k].tolist() for k in sorted(out.batch.keys())}
    non_tensor = {k: json.dumps(v.tolist(), sort_keys=True, default=str) for k, v in sorted(out.non_tensor_batch.items())}
    meta = {k: v for k, v in out.meta_info.items() if k != "metrics"}
    preempted = [m["num_preempted"] for m in out.meta_info["metrics"]]
    return {"batch": batch, "non_tensor": non_tensor, "meta": meta, "num_preempted": preempted}


@pytest.fixture
def traced_run(model_dir, tool_config, tokenizer, tmp_path):
    """One traced step: samples 0 and 1, two rollouts each, backend=jsonl, token2text."""

    async def run(**kw):
        worker, _ = worker_for(model_dir, tool_config, tokenizer, trace_overrides(**kw))
        out = await worker.generate_sequences(app.make_batch([0, 1], n=2, step=3))
        return out, read_traces(tmp_path)

    return run


# ----------------------------------------------------------------------------- trajectories


class TestTrajectories:
    async def test_one_trajectory_per_rollout(self, traced_run):
        """Each (sample, rollout) of the batch is one trajectory with veRL's span tree."""
        out, trajs = await traced_run()
        assert len(out) == 4
        assert sorted(by_coords(trajs)) == [(3, i, r, False) for i in (0, 1) for r in (0, 1)]
        for t in trajs:
            assert (t.name, t.experiment, t.status) == ("agent_loop", app.EXPERIMENT, "ok")
            assert [(d, s.name, s.kind) for d, s in t.walk()] == TOOL_LOOP_TREE

    async def test_rl_coordinates_on_every_span(self, traced_run):
        """rl.step, rl.sample_index, rl.rollout_n and rl.validate are on every span."""
        _, trajs = await traced_run()
        for t in trajs:
            for span in t.spans:
                assert {k: span.attributes.get(k) for k in RL_ATTRS} == {
                    "rl.step": 3, "rl.sample_index": t.sample_index, "rl.rollout_n": t.rollout_n,
                    "rl.validate": False}, span.name

    async def test_decoded_assistant_turns(self, traced_run, tokenizer):
        """token2text: the generations' decoded text, and the assistant turns of the
        conversation, are what the scripted model said (tool call, then the answer)."""
        _, trajs = await traced_run()
        for t in trajs:
            a, b = app.question(t.sample_index)
            gens = t.spans_of_kind("generation")
            assert [g.attributes["rtrace.response_text"] for g in gens] == [
                app.tool_call_text(a, b), app.answer_text(a, b)]
            assert gens[0].attributes["rtrace.prompt_text"].endswith(f"What is {a} + {b}?\nassistant\n")
            assistant = [m["content"] for m in t.messages if m["role"] == "assistant"]
            assert assistant == [app.tool_call_text(a, b), app.answer_text(a, b)]
            run = t.spans[1]
            assert run.output["response_text"].endswith(app.answer_text(a, b))

    async def test_tool_span_input_has_the_call(self, traced_run):
        """The tool span records the tool's name and the parsed parameters."""
        _, trajs = await traced_run()
        for t in trajs:
            a, b = app.question(t.sample_index)
            (tool,) = t.spans_of_kind("tool")
            assert tool.attributes["gen_ai.tool.name"] == "calculator"
            assert tool.input["parameters"] == {"expression": f"{a} + {b}"}

    async def test_tool_call_arguments_are_the_parameters(self, traced_run):
        """The conversation's tool call has the parameters as arguments (not instance_id
        nor agent_data)."""
        _, trajs = await traced_run()
        for t in trajs:
            a, b = app.question(t.sample_index)
            (call,) = [c for m in t.messages for c in m.get("tool_calls", [])]
            assert call["function"]["name"] == "calculator"
            assert json.loads(call["function"]["arguments"]) == {"expression": f"{a} + {b}"}

    async def test_tool_span_input_has_no_object_addresses(self, traced_run):
        """veRL's AgentData shows without its address: traces compare run to run."""
        _, trajs = await traced_run()
        for t in trajs:
            (tool,) = t.spans_of_kind("tool")
            assert " at 0x" not in json.dumps(tool.input)

    async def test_tool_message_is_the_response_text(self, traced_run):
        """The tool message is the ToolResponse's text, not the JSON of veRL's triple."""
        _, trajs = await traced_run()
        for t in trajs:
            a, b = app.question(t.sample_index)
            (tool_msg,) = [m for m in t.messages if m["role"] == "tool"]
            assert tool_msg["content"] == str(a + b)
            assert tool_msg["name"] == "calculator"

    async def test_tool_reward_and_metrics_on_tool_span(self, traced_run):
        """The tool's reward and metrics (2nd and 3rd items of veRL's triple) are
        attributes of the tool span."""
        _, trajs = await traced_run()
        for t in trajs:
            a, b = app.question(t.sample_index)
            (tool,) = t.spans_of_kind("tool")
            assert tool.attributes[TOOL_REWARD_ATTR] == 1.0
            assert tool.attributes[TOOL_METRIC_PREFIX + "ok"] is True
            assert tool.attributes[TOOL_METRIC_PREFIX + "chars"] == len(f"{a} + {b}")

    async def test_conversation_starts_with_the_chat_messages(self, traced_run):
        """The conversation starts with the chat messages veRL passes to
        ToolAgentLoop.run as raw_prompt, not with one user turn of decoded prompt."""
        _, trajs = await traced_run()
        for t in trajs:
            assert t.messages[:2] == app.prompt(t.sample_index)
            assert [m["role"] for m in t.messages] == ["system", "user", "assistant", "tool", "assistant"]


# ----------------------------------------------------------------------------- an op with messages


class TestMessagesOp:
    @pytest.fixture
    def chat_run(self, model_dir, tool_config, tokenizer, tmp_path):
        loops = app.write_agent_loop_config(tmp_path / "agent_loops.yaml")

        async def run():
            worker, _ = worker_for(model_dir, tool_config, tokenizer, trace_overrides(
                **{"actor_rollout_ref.rollout.agent.agent_loop_config_path": str(loops)}))
            out = await worker.generate_sequences(app.make_batch([2], n=1, step=1, agent="chat_agent"))
            return out, read_traces(tmp_path)

        return run

    async def test_custom_loop_is_traced(self, chat_run):
        """A custom agent loop registered via agent_loop_config_path is traced like veRL's own."""
        out, (t,) = await chat_run()
        assert len(out) == 1
        assert [(d, s.name, s.kind) for d, s in t.walk()] == [
            (0, "agent_loop", "rollout"), (1, "ChatAgentLoop.run", "agent"),
            (2, "ChatAgentLoop.chat", "chain"), (3, "LLMServerClient.generate", "generation"),
            (2, "calculator", "tool"),
            (2, "ChatAgentLoop.chat", "chain"), (3, "LLMServerClient.generate", "generation")]
        last_chat = t.spans[5]
        assert last_chat.input["messages"][:2] == app.prompt(2)

    async def test_messages_op_gives_the_conversation(self, chat_run):
        """An op taking `messages` (any kind, as veRL's trackio backend reads them) gives
        the conversation; the generation inside it, the reply."""
        _, (t,) = await chat_run()
        a, b = app.question(2)
        last_chat = [s for s in t.spans if s.name == "ChatAgentLoop.chat"][-1]
        assert t.messages == last_chat.input["messages"] + [{"role": "assistant", "content": app.answer_text(a, b)}]
        assert [m["role"] for m in t.messages] == ["system", "user", "assistant", "tool", "assistant"]


# ----------------------------------------------------------------------------- outputs


class TestOutputsUnchanged:
    async def test_outputs_identical_with_tracing_on_and_off(self, model_dir, tool_config, tokenizer, tmp_path):
        """generate_sequences returns the same DataProto with tracing off (backend null)
        and on (jsonl + token2text)."""
        results = {}
        for backend in (None, "jsonl"):
            RolloutTraceConfig.reset()
            worker, server = worker_for(model_dir, tool_config, tokenizer, trace_overrides(backend=backend))
            out = await worker.generate_sequences(app.make_batch([0, 1, 2], n=2, step=1))
            calls = sorted(json.dumps([c["prompt_ids"], c["sampling_params"]], sort_keys=True) for c in server.calls)
            results[backend] = (snapshot(out), calls)  # the agent loops run concurrently: call order varies
        assert results[None] == results["jsonl"]
        assert len(read_traces(tmp_path)) == 6


# ----------------------------------------------------------------------------- the per-step cap


def verl_choice(index: np.ndarray, cap: int, seed: int) -> set:
    """The samples veRL's AgentLoopWorker.generate_sequences picks under this seed."""
    np.random.seed(seed)
    unique = np.unique(index)
    if cap >= len(unique):
        return set(unique.tolist())
    return set(np.random.choice(unique, cap, replace=False).tolist())


class TestSampleCap:
    async def test_cap_matches_verl_choice_in_one_call(self, model_dir, tool_config, tokenizer, tmp_path):
        """max_samples_per_step_per_worker=2: exactly the samples veRL picked (all their
        rollouts) are traced; one generate_sequences call per step."""
        worker, _ = worker_for(model_dir, tool_config, tokenizer, trace_overrides(cap=2, token2text=False))
        expected = set()
        for step, seed in ((1, 11), (2, 12)):
            batch = app.make_batch([0, 1, 2, 3], n=2, step=step)
            chosen = verl_choice(batch.non_tensor_batch["index"], 2, seed)
            expected |= {(step, i, r) for i in chosen for r in (0, 1)}
            np.random.seed(seed)
            await worker.generate_sequences(batch)
        assert {(t.step, t.sample_index, t.rollout_n) for t in read_traces(tmp_path)} == expected

    async def test_cap_matches_verl_choice_with_several_calls_per_step(self, model_dir, tool_config, tokenizer,
                                                                       tmp_path):
        """Validation: the trainer calls generate_sequences once per val batch, all with
        the same global_steps; veRL picks K samples in each call, so K per call are traced."""
        worker, _ = worker_for(model_dir, tool_config, tokenizer, trace_overrides(cap=1, token2text=False))
        expected = set()
        for samples, seed in (([0, 1, 2], 21), ([3, 4, 5], 22)):
            batch = app.make_batch(samples, n=1, step=5, validate=True)
            chosen = verl_choice(batch.non_tensor_batch["index"], 1, seed)
            expected |= {(5, i, True) for i in chosen}
            np.random.seed(seed)
            await worker.generate_sequences(batch)
        assert {(t.step, t.sample_index, t.validate) for t in read_traces(tmp_path)} == expected
        assert len(expected) == 2


# ----------------------------------------------------------------------------- backends


class TestBackends:
    async def test_weave_backend_does_not_crash_worker_start(self, model_dir, tool_config, tokenizer, tmp_path,
                                                             caplog):
        """backend=weave (no rtrace sink): AgentLoopWorker starts and runs, untraced, and
        one warning says so."""
        with caplog.at_level("WARNING", logger="rtrace"):
            worker, _ = worker_for(model_dir, tool_config, tokenizer, trace_overrides(backend="weave"))
            out = await worker.generate_sequences(app.make_batch([0], n=1, step=1))
        assert len(out) == 1
        assert not rtrace.is_enabled() and not (tmp_path / "verl.jsonl").exists()
        (warning,) = [r.getMessage() for r in caplog.records if "weave" in r.getMessage()]
        assert "no weave sink, tracing is off" in warning

    async def test_weave_with_other_backends_traces_to_them(self, model_dir, tool_config, tokenizer, tmp_path):
        """backend='weave,jsonl' (quoted for Hydra): the JSONL sink gets every rollout."""
        worker, _ = worker_for(model_dir, tool_config, tokenizer, trace_overrides(backend="weave,jsonl"))
        await worker.generate_sequences(app.make_batch([0, 1], n=1, step=1))
        assert sorted((t.step, t.sample_index) for t in read_traces(tmp_path)) == [(1, 0), (1, 1)]

    async def test_trackio_backend(self, model_dir, tool_config, tokenizer, tmp_path, monkeypatch):
        """backend=trackio,jsonl: trackio stores one trace per rollout, with the same
        conversation and coordinates as the JSONL sink."""
        if "trackio" not in sys.modules:
            monkeypatch.setenv("TRACKIO_DIR", tempfile.mkdtemp(prefix="trackio-verl-"))
        from trackio import utils
        from trackio.sqlite_storage import SQLiteStorage

        if not str(utils.TRACKIO_DIR).startswith(tempfile.gettempdir()):
            pytest.skip(f"trackio was imported earlier with TRACKIO_DIR={utils.TRACKIO_DIR}")
        project = f"rt-verl-{uuid.uuid4().hex[:8]}"
        worker, _ = worker_for(model_dir, tool_config, tokenizer, trace_overrides(
            backend="trackio,jsonl", **{"trainer.project_name": project}))
        await worker.generate_sequences(app.make_batch([0, 1], n=1, step=2))
        ref = by_coords(read_traces(tmp_path))
        got = SQLiteStorage.get_traces(project, run=app.EXPERIMENT)
        assert len(got) == 2 == len(ref)
        for g in got:
            md = g["metadata"]
            t = ref[(md["step"], md["sample_index"], md["rollout_n"], md.get("validate", False))]
            assert (g["step"], g["key"], md["experiment"]) == (2, "rollout/traces", app.EXPERIMENT)
            assert g["messages"] == readable_messages(t.messages)  # a tool-call turn shows its call


# ----------------------------------------------------------------------------- install & token2text


INSTALL_CHECK = """
import sys
import rtrace.compat.verl as shim
from importlib import import_module
hook = getattr(import_module("rtrace.compat.verl"), "install")  # as Ray resolves worker_process_setup_hook
hook()
hook()  # idempotent
import verl.utils.rollout_trace as mod
from verl.experimental.agent_loop import agent_loop, single_turn_agent_loop, tool_agent_loop, tool_parser
from verl.tools import base_tool
from verl.workers.rollout import llm_server
import verl.utils
assert mod is shim and sys.modules["verl.utils.rollout_trace"] is shim and verl.utils.rollout_trace is shim
assert shim.__spec__.name == "rtrace.compat.verl"
assert sum(type(f).__name__ == "_VerlFinder" for f in sys.meta_path) == 1
assert agent_loop.RolloutTraceConfig is shim.RolloutTraceConfig
assert agent_loop.rollout_trace_attr is shim.rollout_trace_attr
for m in (single_turn_agent_loop, tool_agent_loop, tool_parser, base_tool, llm_server):
    assert m.rollout_trace_op is shim.rollout_trace_op, m.__name__
print("INSTALLED")
"""


class TestInstall:
    def test_install_routes_verl_to_rtrace(self):
        """In a fresh interpreter, rtrace.compat.verl.install() (resolved the way Ray
        resolves a worker_process_setup_hook string) makes the six veRL modules that
        import verl.utils.rollout_trace get rtrace's names."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
        proc = subprocess.run([sys.executable, "-c", INSTALL_CHECK], capture_output=True, text=True, env=env,
                              timeout=300)
        assert proc.returncode == 0 and "INSTALLED" in proc.stdout, proc.stderr[-3000:]
        assert "rtrace" not in proc.stderr  # no warning

    def test_late_install_rebinds_and_warns_once(self):
        """install() after veRL's own module was imported: the names are rebound in the
        modules that imported them, the methods veRL's decorator wrapped are traced by
        rtrace's, and one warning says to install earlier."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
        proc = subprocess.run([sys.executable, "-c", LATE_INSTALL_CHECK], capture_output=True, text=True, env=env,
                              timeout=300)
        assert proc.returncode == 0 and "REBOUND" in proc.stdout, proc.stderr[-3000:]
        warnings = [line for line in proc.stderr.splitlines() if "was imported first" in line]
        assert len(warnings) == 1 and "re-decorated" in warnings[0], proc.stderr[-3000:]


LATE_INSTALL_CHECK = """
import logging, sys
logging.basicConfig(level=logging.WARNING)
from verl.experimental.agent_loop import agent_loop, tool_agent_loop, tool_parser
from verl.tools import base_tool
import verl.utils.rollout_trace as theirs
import rtrace.compat.verl as shim
assert theirs is not shim
shim.install()
assert sys.modules["verl.utils.rollout_trace"] is shim
assert agent_loop.RolloutTraceConfig is shim.RolloutTraceConfig
assert agent_loop.rollout_trace_attr is shim.rollout_trace_attr
for m in (tool_agent_loop, tool_parser, base_tool):
    assert m.rollout_trace_op is shim.rollout_trace_op, m.__name__
for method in (tool_agent_loop.ToolAgentLoop.run, base_tool.BaseTool.execute,
               tool_parser.HermesToolParser.extract_tool_calls):
    assert getattr(method, "__rtrace_verl_op__", False), method.__qualname__
shim.install()
print("REBOUND")
"""


class NoKwargTokenizer:
    """A tokenizer whose ``decode`` / ``batch_decode`` take no ``skip_special_tokens``
    (as some custom and processor-backed tokenizers); everything else is the real one's."""

    def __init__(self, real):
        object.__setattr__(self, "_real", real)

    def __getattr__(self, name):
        return getattr(self._real, name)

    def __setattr__(self, name, value):  # veRL sets padding_side before tokenizer.pad()
        setattr(self._real, name, value)

    def __len__(self):
        return len(self._real)

    def decode(self, ids):
        return self._real.decode(ids, skip_special_tokens=True)

    def batch_decode(self, seqs):
        return [self.decode(s) for s in seqs]


class TestToken2Text:
    async def test_tokenizer_without_skip_special_tokens(self, model_dir, tool_config, tokenizer, tmp_path):
        """A tokenizer whose decode takes no skip_special_tokens: decoded by rtrace's
        token2text (one decoder for spans and op outputs), no errors."""
        worker, _ = worker_for(model_dir, tool_config, tokenizer, trace_overrides())
        plain = NoKwargTokenizer(worker.tokenizer)
        worker.tokenizer = plain
        worker.llm_client.tokenizer = plain
        out = await worker.generate_sequences(app.make_batch([1], n=1, step=1))
        (t,) = read_traces(tmp_path)
        a, b = app.question(1)
        assert len(out) == 1
        assert [g.attributes.get("rtrace.response_text") for g in t.spans_of_kind("generation")] == [
            app.tool_call_text(a, b), app.answer_text(a, b)]
        run = t.spans[1]
        assert run.output["response_text"] is not None and run.output["response_text"].endswith(app.answer_text(a, b))
        assert rtrace.stats().get("token2text_errors", 0) == 0


# ----------------------------------------------------------------------------- rollout health


class TestHealth:
    async def test_tool_agent_loop_has_no_finding(self, model_dir, tool_config, tokenizer, tmp_path, monkeypatch):
        """veRL's own ToolAgentLoop, token in token out, its rewards annotated by the trainer (as
        veRL's driver computes them after the batch): every trajectory's health is empty, every
        check on (no false positive)."""
        monkeypatch.setenv("RTRACE_HEALTH_CHECKS", "all")
        monkeypatch.setenv("RTRACE_AWAIT_ANNOTATIONS", "reward")
        worker, _ = worker_for(model_dir, tool_config, tokenizer, trace_overrides())
        out = await worker.generate_sequences(app.make_batch([0, 1], n=2, step=3))
        index = [int(i) for i in out.non_tensor_batch["index"]]
        rtrace.annotate_batch(step=3, sample_index=index, rollout_n=[0, 1, 0, 1], reward=[1.0, 1.0, 0.0, 1.0])
        trajs = read_traces(tmp_path)
        assert sorted(by_coords(trajs)) == [(3, i, r, False) for i in (0, 1) for r in (0, 1)]
        assert [t.health for t in trajs] == [[], [], [], []]
        assert all(t.spans_of_kind("generation") for t in trajs)

    async def test_a_dropped_parallel_call_is_flagged(self, model_dir, tool_config, tokenizer, tmp_path):
        """The model writes two parallel calculator calls; veRL's ToolAgentLoop with its default
        multi_turn.max_parallel_calls 1 runs the first and silently drops the second: flagged,
        with 2 for max_parallel_calls it is not (issue 31, item 12)."""

        class Parallel(app.ScriptedServer):
            async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
                out = await super().generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params,
                                             **kwargs)
                text = self.tokenizer.decode(out.token_ids)
                if "<tool_call>" in text:  # the same call twice, in one reply
                    body = self.tokenizer.decode(out.token_ids[:-1])
                    out.token_ids = self.tokenizer.encode(body + "\n" + body, add_special_tokens=False) + \
                        [self.end_id]
                    out.log_probs = [-0.01] * len(out.token_ids)
                return out

        for step, parallel in ((1, 1), (2, 2)):
            config = app.compose_config(model_dir, tool_config, trace_overrides(
                **{"actor_rollout_ref.rollout.multi_turn.max_parallel_calls": parallel}))
            worker, _ = app.make_worker(config, tokenizer, Parallel(tokenizer))
            await worker.generate_sequences(app.make_batch([0], n=1, step=step))
        one, two = sorted(read_traces(tmp_path), key=lambda t: t.step)
        assert len(one.spans_of_kind("tool")) == 1 and len(two.spans_of_kind("tool")) == 2
        assert [f["detail"] for f in one.health if f["check"] == "generation"] == [
            "turn 1: the model called 2 tools but 1 ran; not run: calculator"]
        assert [f for f in two.health if f["check"] == "generation"] == []

    async def test_a_loop_that_re_renders_the_template_is_flagged(self, model_dir, tool_config, tokenizer, tmp_path):
        """A custom loop that renders the chat template again at every turn, its parser having
        re-serialized the call's arguments (CompactChatAgentLoop), is flagged token_continuity at
        turn 2, at the first token where its prompt leaves what the model sampled; the same loop
        without the re-serialization (ChatAgentLoop: the template renders the call as the model
        wrote it) is not."""
        loops = app.write_agent_loop_config(tmp_path / "agent_loops.yaml")
        worker, _ = worker_for(model_dir, tool_config, tokenizer, trace_overrides(
            token2text=False, **{"actor_rollout_ref.rollout.agent.agent_loop_config_path": str(loops)}))
        await worker.generate_sequences(app.make_batch([2], n=1, step=1, agent="chat_agent"))
        await worker.generate_sequences(app.make_batch([2], n=1, step=2, agent="compact_chat_agent"))
        faithful, t = sorted(read_traces(tmp_path), key=lambda t: t.step)
        # (no reward: nothing scored it; a run without any reward is said once, not per rollout)
        assert faithful.health == [] and "reward" in faithful.health_checks
        first, second = t.spans_of_kind("generation")
        expected = first.prompt_ids + first.response_ids
        pos = next(i for i, (a, b) in enumerate(zip(expected, second.prompt_ids)) if a != b)
        (finding,) = [f for f in t.health if f["check"] == "token_continuity"]
        assert finding["detail"] == (f"turn 2: its prompt does not continue turn 1's prompt + response at token {pos} "
                                     f"of {len(expected)} (expected id {expected[pos]}, got {second.prompt_ids[pos]})")
        assert pos > len(first.prompt_ids)  # inside what the model wrote, not in the prompt


# ----------------------------------------------------------------------------- both ways (issue 31)


class TestOneProcessAndCollector:
    async def test_the_same_records_both_ways(self, model_dir, tool_config, tokenizer, tmp_path, monkeypatch):
        """veRL's ToolAgentLoop traced in one process (trace.backend=jsonl), then in a worker
        whose environment is collector.env streaming to rtrace.start_collector (which decodes
        with the driver's tokenizer, as docs/frameworks/verl.md sets it up): the same records,
        field by field (ids, times and the collector's rtrace.job_id aside), op tree, tool
        results, conversation and decoded text included."""
        pytest.importorskip("grpc")
        from tests.test_fidelity import _normal

        async def run():
            worker, _ = worker_for(model_dir, tool_config, tokenizer, trace_overrides())
            await worker.generate_sequences(app.make_batch([0, 1], n=2, step=3))
            assert rtrace.flush(20)
            rtrace.shutdown()
            RolloutTraceConfig.reset()

        await run()
        one = read_jsonl(tmp_path / "verl.jsonl")
        through = tmp_path / "collector.jsonl"
        collector = rtrace.start_collector(exporter="jsonl", jsonl_path=str(through), project=app.PROJECT,
                                           experiment=app.EXPERIMENT, settle_s=0.2, token2text=True,
                                           tokenizer=tokenizer)
        try:
            for key, value in collector.env.items():
                monkeypatch.setenv(key, value)
            monkeypatch.setenv("RTRACE_JSONL_PATH", str(tmp_path / "worker.jsonl"))
            await run()
            assert collector.flush(30)
        finally:
            collector.stop()
        assert not (tmp_path / "worker.jsonl").exists()  # the worker streamed, it did not write

        def key(t):
            return (t["validate"], t["step"], t["sample_index"], t["rollout_n"])

        a = sorted((_normal(t) for t in one), key=key)
        assert all(t.root.attributes["rtrace.job_id"] == collector.job_id for t in read_jsonl(through))
        b = sorted((_normal(t) for t in read_jsonl(through)), key=key)  # (_normal drops the job id)
        assert len(a) == 4 and all(g["attributes"].get("rtrace.response_text") for t in a for g in t["spans"]
                                   if g["kind"] == "generation")
        for t in a + b:
            _scrub_ids_and_times(t)
        assert b == a


def _scrub_ids_and_times(traj: dict) -> None:
    """The ids and timings veRL makes per run (request and tool instance uuids, its timing
    metrics) and the tool-call ids derived from span ids, taken out of a normalised record:
    each call id must still pair its assistant turn with its tool message."""
    for span in traj["spans"]:
        if isinstance(span.get("input"), dict):
            span["input"].pop("request_id", None)
            span["input"].pop("instance_id", None)
        if isinstance(span.get("output"), dict) and isinstance(span["output"].get("metrics"), dict):
            span["output"]["metrics"] = sorted(span["output"]["metrics"])  # the names, not the seconds
    calls = [c["id"] for m in traj["messages"] for c in m.get("tool_calls", [])]
    answered = [m["tool_call_id"] for m in traj["messages"] if m["role"] == "tool"]
    assert calls == answered
    for m in traj["messages"]:
        for c in m.get("tool_calls", []):
            c["id"] = "call"
        if "tool_call_id" in m:
            m["tool_call_id"] = "call"
