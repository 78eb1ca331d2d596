"""rtrace.compat.open_instruct: checked against open-instruct's real names, on data of its real shape.

open-instruct is not on PyPI and its rollout path imports vLLM, olmo_core and deepspeed: no
test here can import it. So (1) every field, function, parameter, call and default the adapter
and its doc rely on is checked against ``tests/frameworks/open_instruct_names.json``, read with
``ast`` out of the real code at the commit it names (``OPEN_INSTRUCT_DIR=<checkout>`` reads it
again and compares); (2) the adapter runs on ``GenerationResult`` / ``Batch`` objects with
exactly those fields; (3) ``install()`` patches a stand-in for ``open_instruct.data_loader``
(``tests/frameworks/open_instruct_stand_in.py``: the real signatures, the real drops),
imported under the real name, called the two ways open-instruct calls it (the data
preparation actor's loop, ``maybe_evaluate``); (4) that actor's class, pickled by value as
Ray pickles it, is loaded and run in another process.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import inspect
import json
import os
import queue
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import rtrace
import rtrace.testing
from rtrace.compat import _open_instruct_private, open_instruct
from rtrace.exporters.jsonl import read_jsonl
from rtrace.instrumentation.turns import PromptIndex
from tests.frameworks.open_instruct_names import MANIFEST, extract

ROOT = Path(__file__).resolve().parents[1]
NAMES = json.loads(MANIFEST.read_text())
STAND_IN = ROOT / "tests" / "frameworks" / "open_instruct_stand_in.py"
SYNC_STAND_IN = ROOT / "tests" / "frameworks" / "open_instruct_sync_stand_in.py"
FAST_STAND_IN = ROOT / "tests" / "frameworks" / "open_instruct_fast_stand_in.py"


@pytest.fixture(autouse=True)
def fresh_numbering(monkeypatch):
    """Each test numbers samples from scratch: the adapter's numbering is per process (a
    dataset index seen again in a step continues its rollout numbers)."""
    monkeypatch.setattr(open_instruct, "_index", PromptIndex())


def attributes_read(module_path: Path, var: str) -> set[str]:
    tree = ast.parse(module_path.read_text())
    return {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
            and n.value.id == var}


class TestTheRealNames:
    def test_fields_the_adapter_reads_exist(self):
        """Every attribute the adapter reads on a GenerationResult and a Batch is a field of the
        real dataclass."""
        path = ROOT / "rtrace" / "compat" / "open_instruct.py"
        assert attributes_read(path, "result") <= set(NAMES["classes"]["GenerationResult"])
        assert attributes_read(path, "batch") <= set(NAMES["classes"]["Batch"])
        assert attributes_read(path, "info") <= set(NAMES["classes"]["RequestInfo"])
        assert attributes_read(path, "call") <= set(NAMES["classes"]["ToolCallStats"])
        assert {"responses", "masks", "finish_reasons", "reward_scores", "model_step", "index",
                "request_info"} <= attributes_read(path, "result")

    def test_the_wrapped_function_and_its_callers(self):
        """accumulate_inference_batches takes training_step (8th); maybe_evaluate looks it up in
        the module at each call; the data preparation loop calls it as a global of a method of a
        @ray.remote class (pickled by value by Ray: TestRayPickling); every private name the
        adapter lists exists."""
        params = NAMES["functions"]["accumulate_inference_batches"]
        assert params.index("training_step") == 7
        assert NAMES["calls"]["DataPreparationActor._data_preparation_loop"]["calls"] == ["accumulate_inference_batches"]
        assert NAMES["calls"]["maybe_evaluate"]["calls"] == ["data_loader_lib.accumulate_inference_batches"]
        assert NAMES["data_preparation_actor_decorators"] == ["ray.remote"]
        for name in _open_instruct_private.PRIVATE_NAMES:
            module, _, attr = name.partition(":")
            if module.startswith("open_instruct"):
                assert attr in NAMES["functions"] or attr in NAMES["data_loader_imports"] \
                    or attr in NAMES["defaults"], name
        # the arguments the adapter reads, by name
        assert {"tokenizer", "training_step", "dataset", "base_env_config"} <= set(params)
        assert {"result", "dataset"} <= set(NAMES["functions"]["process_group"])

    def test_filtered_groups_are_dropped_where_the_adapter_looks(self):
        """accumulate_inference_batches calls process_group as a module global (the wrapped one is
        called), and process_group returns None only for a zero-std group under
        filter_zero_std_samples, which is on by default."""
        assert NAMES["calls"]["accumulate_inference_batches"]["calls"] == ["process_group", "result_is_stale"]
        assert NAMES["process_group_returns_none_if"] == [
            "filter_zero_std_samples and np.std(result.reward_scores) == 0"]
        assert NAMES["defaults"]["StreamingDataLoaderConfig.filter_zero_std_samples"] == "True"

    def test_a_tool_s_output_has_loss_mask_1_without_mask_tool_use(self):
        """The loss mask says nothing of authorship without mask_tool_use (on by default)."""
        assert NAMES["tool_output_masks"] == ["masks = [0 if mask_tool_use else 1] * len(tokens)"]
        assert NAMES["defaults"]["StreamingDataLoaderConfig.mask_tool_use"] == "True"

    def test_stale_results_and_truncated_completions_are_dropped_where_the_adapter_looks(self):
        """accumulate_inference_batches drops a result for which result_is_stale (a module global)
        is true — asked about its local `result` (what the adapter reads) — i.e. older than
        max_result_age_steps, which the loop sets to async_steps (8 by default); the loop then
        keeps only the `stop` completions when mask_truncated_completions (off by default), and
        gathers the step again (training_step unchanged) when nothing is left or every group
        was filtered."""
        assert NAMES["stale_checks"] == ["result_is_stale(result.model_step, training_step, max_result_age_steps)"]
        assert NAMES["result_is_stale_returns"][0] == "training_step - model_step > max_result_age_steps"
        assert NAMES["loop_max_result_age_steps"] == ["self.config.async_steps"]
        assert NAMES["defaults"]["StreamingDataLoaderConfig.async_steps"] == "8"
        assert NAMES["loop_truncation_calls"] == [
            "maybe_mask_truncated_completions(result, batch, self.config.mask_truncated_completions)"]
        assert NAMES["truncation_keeps"][0] == "[i for i, fr in enumerate(result.finish_reasons) if fr == 'stop']"
        assert NAMES["defaults"]["StreamingDataLoaderConfig.mask_truncated_completions"] == "False"
        assert NAMES["loop_gathers_again_if"] == ["result is None", "len(result.responses) == 0"]

    def test_text_environments_reply_as_user(self):
        """A text environment (a TextRLEnvironment, marked is_text_env in the run's env config) is
        called after every model turn, after the tool calls parsed from it; its reply is inserted
        with its response_role (user; a tool's: tool), a failed call's error message as tool; each
        call leaves a ToolCallStats (tool name, success); a prompt's env_config merges over the
        run's."""
        calls = NAMES["process_request_tool_calls"]
        assert calls[0].startswith("tool_calls = [tc for tc in actor.tool_parser.get_tool_calls(output.text)")
        assert calls[1:] == ["tool_calls.append(EnvCall(id='', name=text_env_name, args={'text': output.text}))"]
        assert NAMES["process_request_observations"] == [
            "observations.append((step_result.result, tool_response_roles.get(tc.name, 'tool')))",
            "observations.append((error_msg, 'tool'))", "observations.append((error_msg, 'tool'))"]
        assert NAMES["defaults"]["TextRLEnvironment.response_role"] == "'user'"
        assert NAMES["defaults"]["RLEnvironment.response_role"] == "'tool'"
        assert all("ToolCallStats(tool_name=tc.name, success=" in c for c in NAMES["process_request_call_stats"])
        assert [c.split("success=")[1].split(",")[0] for c in NAMES["process_request_call_stats"][1:]] == [
            "False", "False"]  # the timeout and the exception
        assert NAMES["base_env_config_entries"] == [
            "EnvConfigEntry(env_name=pool_name, is_text_env=issubclass(config_cls.tool_class, TextRLEnvironment))"]
        assert NAMES["functions"]["_merge_env_config"] == ["base_env_config", "sample_env_config"]
        assert "ENV_CONFIG_KEY" in NAMES["data_loader_imports"]

    def test_the_stand_in_has_the_real_signatures_and_fields(self):
        """tests/frameworks/open_instruct_stand_in.py: the functions the adapter wraps or calls
        take the real parameters, its dataclasses have the real fields."""
        spec = importlib.util.spec_from_file_location("open_instruct_stand_in", STAND_IN)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        for name in ("accumulate_inference_batches", "process_group", "result_is_stale", "_merge_env_config",
                     "maybe_mask_truncated_completions"):
            assert list(inspect.signature(getattr(module, name)).parameters) == NAMES["functions"][name], name
        for name in ("GenerationResult", "RequestInfo", "Batch", "ToolCallStats", "EnvConfig", "EnvConfigEntry"):
            assert [f.name for f in dataclasses.fields(getattr(module, name))] == NAMES["classes"][name], name

    def test_the_doc_s_ray_init_keeps_open_instruct_s_own(self):
        """docs/frameworks/open-instruct.md's ray.init is grpo_fast.main's, key for key (its
        env_vars forwarding the environment, .git/ excluded), plus the setup hook; the
        collector's variables go into os.environ before it, and open-instruct excludes none of them."""
        doc = (ROOT / "docs" / "frameworks" / "open-instruct.md").read_text()
        code = doc.split("```python\n")[2].split("```")[0]
        tree = ast.parse(code)
        (init,) = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and ast.unparse(n.func) == "ray.init"]
        (env,) = [k.value for k in init.keywords if k.arg == "runtime_env"]
        ours = {ast.unparse(k): ast.unparse(v) for k, v in zip(env.keys, env.values)}
        theirs = NAMES["ray_init_runtime_env"]

        def tree_of(source):  # ast.unparse's spelling moves between Pythons ((k, v) in 3.10), the tree does not
            return ast.dump(ast.parse(source, mode="eval"))

        assert {k: tree_of(ours[k]) for k in theirs} == {k: tree_of(v) for k, v in theirs.items()}
        assert set(ours) - set(theirs) == {"'worker_process_setup_hook'"}
        assert ours["'worker_process_setup_hook'"] == "'rtrace.compat.open_instruct.install'"
        update = code.index("os.environ.update(collector.env)")
        assert update < code.index("ray.init(")
        assert not any(v.startswith("'RTRACE") for v in ast.literal_eval(NAMES["excluded_env_vars"][0]))

    def test_weights_are_published_where_the_adapter_marks_them(self):
        """open-instruct publishes new weights in grpo_utils.perform_weight_sync, called by two
        functions only, each looking it up in grpo_utils at the call: grpo_fast's weight sync
        thread (the step it sends in its local target_model_step) and the olmo-core trainer's
        VLLMWeightSyncCallback.post_step (the step: self.trainer.global_step). The call returns
        once the engines are awake with the new weights (wake_up, then the actors resumed), and
        an engine stamps the step it was sent on each request it takes next (model_step: the
        rollouts' policy_version). The stand-ins do the same, with the real signatures."""
        sync = NAMES["weight_sync"]
        assert sync["callers"] == ["open_instruct/grpo_callbacks.py:post_step",
                                   "open_instruct/grpo_fast.py:weight_sync_thread"]
        assert sync["thread_step"] == ["target_model_step = weight_sync_trigger.get_step_and_clear()"]
        assert sync["thread_calls"][0] == "m.broadcast_to_vllm.remote(target_model_step)"
        assert sync["thread_calls"][1].startswith("grpo_utils.perform_weight_sync(broadcast_refs, vllm_engines, ")
        assert "model_step=self.trainer.global_step" in sync["callback_calls"][0]
        assert sync["callback_calls"][1].startswith("grpo_utils.perform_weight_sync(broadcast_refs, ")
        assert sync["perform_remote_calls"] == ["actor_manager.set_should_stop.remote(True)", "e.wake_up.remote()",
                                                "actor_manager.set_should_stop.remote(False)"]
        assert sync["engine_sets_model_step"] == ["set_model_step: self.current_model_step = model_step",
                                                  "update_weights: self.current_model_step = model_step"]
        assert sync["request_stamps"] == ["'model_step': actor.current_model_step"]
        for path, name in ((SYNC_STAND_IN, "perform_weight_sync"), (FAST_STAND_IN, "weight_sync_thread")):
            tree = ast.parse(path.read_text())
            (fn,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
            assert [a.arg for a in fn.args.args + fn.args.kwonlyargs] == NAMES["functions"][name], name

    @pytest.mark.skipif(not os.environ.get("OPEN_INSTRUCT_DIR"), reason="set OPEN_INSTRUCT_DIR to an open-instruct "
                        "checkout to read the names again")
    def test_the_names_file_matches_the_checkout(self):
        got = extract(Path(os.environ["OPEN_INSTRUCT_DIR"]))
        assert {k: v for k, v in got.items() if k != "commit"} == {k: v for k, v in NAMES.items() if k != "commit"}


def real_shape(name: str, **values):
    """An object with exactly the real dataclass's fields (the names file)."""
    cls = dataclasses.make_dataclass(name, [(f, object, dataclasses.field(default=None))
                                            for f in NAMES["classes"][name]])
    unknown = set(values) - set(NAMES["classes"][name])
    assert not unknown, unknown
    return cls(**values)


def step_data():
    """Two prompts (dataset indices 7 and 3) x 2 samples; sample 1 called a tool (mask 0 on its
    output), sample 3 was cut by the length limit."""
    result = real_shape(
        "GenerationResult",
        responses=[[10, 11, 2], [12, 13, 20, 21, 14, 2], [15, 2], [16, 17, 18]],
        finish_reasons=["stop", "stop", "stop", "length"],
        masks=[[1, 1, 1], [1, 1, 0, 0, 1, 1], [1, 1], [1, 1, 1]],
        request_info=real_shape("RequestInfo", num_calls=[0, 1, 0, 0], tool_outputs=["", "4", "", ""]),
        index=None, prompt_id=None, model_step=4)
    batch = real_shape("Batch", queries=[[1, 2], [1, 2], [5, 6], [5, 6]], indices=[7, 7, 3, 3],
                       scores=[1.0, 0.0, 1.0, 0.0], model_steps=[4, 4, 3, 4], ground_truths=[None] * 4,
                       datasets=["gsm8k"] * 4)
    return result, batch


class TestLogBatch:
    def test_one_trajectory_per_sample(self):
        """Each sample: its query, the model's turns and the tool's output, finish reason, score,
        coordinates (dense sample_index per dataset index, rollout_n, group_id, policy_version)."""
        result, batch = step_data()
        with rtrace.testing.capture() as got:
            assert open_instruct.log_batch(result, batch, step=5) == 4
            trajs = sorted(got.trajectories, key=lambda t: (t.sample_index, t.rollout_n))
        assert [(t.step, t.sample_index, t.rollout_n, t.group_id, t.policy_version, t.reward) for t in trajs] == [
            (5, 0, 0, "7", 4, 1.0), (5, 0, 1, "7", 4, 0.0), (5, 1, 0, "3", 3, 1.0), (5, 1, 1, "3", 4, 0.0)]
        tool = trajs[1]
        assert [(s.attributes["rtrace.role"], s.response_ids, s.attributes["rl.loss_tokens"]) for s in tool.spans[1:]] \
            == [("assistant", [12, 13], 2), ("tool", [20, 21], 0), ("assistant", [14, 2], 2)]
        assert tool.spans[1].prompt_ids == [1, 2] and tool.finish_reason == "stop"
        assert tool.root.attributes["gen_ai.provider.name"] == "vllm"  # open-instruct's engines
        assert trajs[3].finish_reason == "length" and trajs[3].verdict() == "truncated"

    def test_a_loss_mask_of_1s_over_a_tool_call_is_not_read_as_the_model_s(self):
        """mask_tool_use=False: the tool's output has mask 1 like the model's tokens. A response in
        which a tool ran and whose mask is all 1s is one turn of role unknown (not the model's);
        one in which no tool ran is the model's."""
        result, batch = step_data()
        result.masks[1] = [1] * 6  # what open-instruct writes with mask_tool_use=False
        with rtrace.testing.capture() as got:
            open_instruct.log_batch(result, batch, step=5)
            trajs = sorted(got.trajectories, key=lambda t: (t.sample_index, t.rollout_n))
        tool = trajs[1]
        (turn,) = tool.spans[1:]
        assert (turn.kind, turn.attributes["rtrace.role"], turn.response_ids) == (
            "generation", "unknown", [12, 13, 20, 21, 14, 2])
        assert turn.attributes["rl.loss_tokens"] == 6 and "gen_ai.usage.output_tokens" not in turn.attributes
        assert [m["role"] for m in tool.messages] == ["user", "unknown"]
        assert tool.final_answer() is None  # nothing is shown as the model's answer
        assert [s.attributes["rtrace.role"] for s in trajs[0].spans[1:]] == ["assistant"]


class TestPerTokenValues:
    LOGPROBS = [[-0.1, -0.2, -0.3], [-0.4, -0.5, 0.0, 0.0, -0.6, -0.7], [-0.8, -0.9], [-1.0, -1.1, -1.2]]

    def test_what_open_instruct_puts_in_logprobs(self):
        """The real code: GenerationResult has `logprobs`; a tool's output gets logprob 0.0 (with
        its mask), the end token added to an empty response NaN."""
        assert "logprobs" in NAMES["classes"]["GenerationResult"]
        assert NAMES["tool_output_logprobs"] == ["logprobs = [0.0] * len(tokens)"]
        assert NAMES["empty_response_logprobs"] == ["result.logprobs[i].append(float('nan'))"]

    def test_vllm_s_logprobs_and_the_masks_are_cut_into_the_turns(self):
        """GenerationResult.logprobs (vLLM's, 0 on a tool's output) become each generation's
        logprob array and masks its loss_mask, cut into the model's turns; the tool's tokens are
        on none."""
        result, batch = step_data()
        result.logprobs = [list(r) for r in self.LOGPROBS]
        with rtrace.testing.capture() as got:
            open_instruct.log_batch(result, batch, step=5)
            trajs = sorted(got.trajectories, key=lambda t: (t.sample_index, t.rollout_n))
        tool = trajs[1]
        assert [(s.attributes["rtrace.role"], s.token_values and {k: v.tolist() for k, v in s.token_values.items()})
                for s in tool.spans[1:]] == [
            ("assistant", {"logprob": pytest.approx([-0.4, -0.5]), "loss_mask": [1.0, 1.0]}),
            ("tool", None),
            ("assistant", {"logprob": pytest.approx([-0.6, -0.7]), "loss_mask": [1.0, 1.0]})]
        for t, values in zip(trajs, [self.LOGPROBS[i] for i in (0, 1, 2, 3)]):
            got_values = [v for s in t.spans_of_kind("generation") for v in s.token_values["logprob"].tolist()]
            assert got_values == pytest.approx([v for v, m in zip(values, result.masks[trajs.index(t)]) if m])
            assert not [f for f in t.health if f["check"] == "token_arrays"]

    def test_the_nan_of_an_added_end_token_is_said(self):
        """An empty response's added end token has no sampler logprob (NaN): the token_arrays
        check says so."""
        result, batch = step_data()
        result.responses[2], result.masks[2] = [2], [1]
        result.logprobs = [list(r) for r in self.LOGPROBS]
        result.logprobs[2] = [float("nan")]
        with rtrace.testing.capture() as got:
            open_instruct.log_batch(result, batch, step=5)
            (t,) = [t for t in got.trajectories if (t.sample_index, t.rollout_n) == (1, 0)]
        assert {"check": "token_arrays", "detail": "logprob: 1 of 1 values are NaN or infinite"} in t.health

    def test_sampled_out_samples_leave_nothing_waiting(self):
        """A per-step cap of 2: the two traced samples get their values, the others are never
        annotated (no annotation waits for a trajectory that does not come)."""
        result, batch = step_data()
        result.logprobs = [list(r) for r in self.LOGPROBS]
        with rtrace.testing.capture(max_traces_per_step=2) as got:
            open_instruct.log_batch(result, batch, step=5)
            trajs = got.trajectories
            stats = rtrace.stats()
        assert len(trajs) == 2 and all(s.token_values for t in trajs for s in t.spans_of_kind("generation"))
        assert stats["annotations_sent"] == 2

    def test_without_logprobs_there_are_none(self):
        """A generation that kept no logprobs (the field's default, an empty list): no values."""
        result, batch = step_data()
        result.logprobs = []
        with rtrace.testing.capture() as got:
            open_instruct.log_batch(result, batch, step=5)
            trajs = got.trajectories
        assert len(trajs) == 4 and all(s.token_values is None for t in trajs for s in t.spans)


class TestTextEnvironments:
    @staticmethod
    def wordle_step():
        """One prompt, one sample: model, text env's reply, model, a tool's output and the text
        env's reply in one round, model, the text env's failed call, model."""
        calls = [real_shape("ToolCallStats", tool_name="wordle", success=True, runtime=0.0),
                 real_shape("ToolCallStats", tool_name="code", success=True, runtime=0.1),
                 real_shape("ToolCallStats", tool_name="wordle", success=True, runtime=0.0),
                 real_shape("ToolCallStats", tool_name="wordle", success=False, runtime=5.0)]
        result = real_shape(
            "GenerationResult", responses=[[10, 11, 30, 31, 12, 40, 30, 13, 50, 14, 2]],
            masks=[[1, 1, 0, 0, 1, 0, 0, 1, 0, 1, 1]], finish_reasons=["stop"],
            request_info=real_shape("RequestInfo", num_calls=[4], tool_call_stats=[calls]), model_step=1)
        batch = real_shape("Batch", queries=[[1, 2]], indices=[7], scores=[1.0], model_steps=[1])
        return result, batch

    def test_a_text_environment_s_replies_are_user_turns(self):
        """The text environment's own round is a user turn named after it (a user message); a
        round with a tool's output, or the environment's failed call, is a tool turn."""
        result, batch = self.wordle_step()
        with rtrace.testing.capture() as got:
            open_instruct.log_batch(result, batch, step=2, text_envs={"wordle"})
            (t,) = got.trajectories
        assert [(s.attributes["rtrace.role"], s.name, s.response_ids) for s in t.spans[1:]] == [
            ("assistant", "generation", [10, 11]), ("user", "wordle", [30, 31]), ("assistant", "generation", [12]),
            ("tool", "tool", [40, 30]), ("assistant", "generation", [13]), ("tool", "tool", [50]),
            ("assistant", "generation", [14, 2])]
        assert [m["role"] for m in t.messages] == ["user", "assistant", "user", "assistant", "tool", "assistant",
                                                   "tool", "assistant"]

    def test_without_a_text_environment_every_observation_is_a_tool_s(self):
        """The same sample, no text environment in its config: tool turns only."""
        result, batch = self.wordle_step()
        with rtrace.testing.capture() as got:
            open_instruct.log_batch(result, batch, step=2)
            (t,) = got.trajectories
        assert [s.attributes["rtrace.role"] for s in t.spans[1:]] == ["assistant", "tool"] * 3 + ["assistant"]


def results(*items):
    """A result queue as open-instruct's vLLM actors fill it (Ray's queue has the same get)."""
    q = queue.Queue()
    for item in items:
        q.put(item)
    return q


def per_prompt(index, responses, masks, scores, finish, calls, model_step=4, logprobs=None, stats=None):
    """One prompt's GenerationResult, as a vLLM actor sends it."""
    n = len(responses)
    return real_shape("GenerationResult", responses=responses, masks=masks, finish_reasons=finish,
                      request_info=real_shape("RequestInfo", num_calls=calls, tool_outputs=[""] * n,
                                              tool_call_stats=stats or [[] for _ in range(n)]),
                      index=index, prompt_id=f"0_{index}", reward_scores=scores, model_step=model_step,
                      logprobs=logprobs or [[-0.5] * len(r) for r in responses])


DATASET = {7: {"input_ids_prompt": [1, 2]}, 3: {"input_ids_prompt": [5, 6]}, 9: {"input_ids_prompt": [8, 8, 8]}}


def step_results():
    """A step's results: prompt 7 mixed (1, 0; its second sample called a tool), prompt 3 all
    solved, prompt 9 all failed (the second cut by the length limit)."""
    return [per_prompt(7, [[10, 11, 2], [12, 13, 20, 21, 14, 2]], [[1, 1, 1], [1, 1, 0, 0, 1, 1]], [1.0, 0.0],
                       ["stop", "stop"], [0, 1]),
            per_prompt(3, [[15, 2], [16, 2]], [[1, 1], [1, 1]], [1.0, 1.0], ["stop", "stop"], [0, 0], model_step=3),
            per_prompt(9, [[17, 18, 2], [19, 19, 19]], [[1, 1, 1], [1, 1, 1]], [0.0, 0.0], ["stop", "length"], [0, 0])]


@pytest.fixture
def data_loader(tmp_path, monkeypatch):
    """The stand-in, importable as ``open_instruct.data_loader``; install() run before anything
    imports it (as Ray's setup hook runs before the actor's class loads)."""
    package = tmp_path / "site" / "open_instruct"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    shutil.copy(STAND_IN, package / "data_loader.py")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert open_instruct.install() and open_instruct.install()  # idempotent
    assert "open_instruct" not in sys.modules  # install() imports nothing of open-instruct
    try:
        yield importlib.import_module("open_instruct.data_loader")
    finally:
        for name in [n for n in sys.modules if n == "open_instruct" or n.startswith("open_instruct.")]:
            del sys.modules[name]


def prepare(module, tok, items, training_step, *, config=None, env=None, prompts=3, dataset=DATASET):
    """The data preparation actor's loop, one step from ``training_step`` (0-based) — gathered
    again as often as open-instruct gathers it — on these results."""
    actor = module.ACTOR_CLASS(dataset, results(*items), tok, config or module.StreamingDataLoaderConfig(),
                               env or module.EnvConfig(), training_step + 1, prompts)
    actor.training_step = training_step
    return actor._data_preparation_loop()


def evaluate(module, tok, items, training_step):
    """maybe_evaluate's call (no filter, no staleness bound, the trainer's step)."""
    def maybe_evaluate():
        return module.accumulate_inference_batches(results(*items), None, num_prompts=len(items), model_dims=None,
                                                   tokenizer=tok, dataset=DATASET, base_env_config=None,
                                                   timeout=0.01, active_sampling=False,
                                                   filter_zero_std_samples=False, replenish_prompts=False,
                                                   max_possible_score=1.0, training_step=training_step)
    return maybe_evaluate()


def by_coords(trajs):
    return sorted(trajs, key=lambda t: (t.validate, t.step, t.sample_index, t.rollout_n))


def loss_tokens(t):
    """(the root's rl.loss_tokens, each turn's, the loss_mask values of its generations)."""
    return (t.spans[0].attributes.get("rl.loss_tokens"), [s.attributes.get("rl.loss_tokens") for s in t.spans[1:]],
            [v for s in t.spans_of_kind("generation") for v in s.token_values["loss_mask"].tolist()])


class TestInstall:
    def test_the_module_is_patched_when_imported(self, data_loader):
        """Imported after install(), the module's functions are rtrace's wrappers, each with its
        original's module, name and qualified name (what pickling by reference looks up)."""
        for name in ("accumulate_inference_batches", "process_group", "result_is_stale"):
            fn = getattr(data_loader, name)
            assert fn.__rtrace_wrapped__ and fn.__wrapped__.__name__ == name
            assert (fn.__module__, fn.__qualname__) == ("open_instruct.data_loader", name)
        assert not getattr(data_loader.maybe_mask_truncated_completions, "__rtrace_wrapped__", False)

    def test_without_open_instruct_install_says_so(self):
        """Not installed: install() returns False (and warns once), registering nothing."""
        assert "open_instruct" not in sys.modules
        assert open_instruct.install() is False

    def test_training_and_evaluation_calls(self, data_loader, tok):
        """The loop's call at its step 8 gives training trajectories of the trainer's step 9;
        maybe_evaluate's at the trainer's step 9 gives validation ones of step 9; what
        open-instruct gets back is unchanged; the text is decoded with the tokenizer argument
        (token2text not set)."""
        with rtrace.testing.capture() as got:
            assert prepare(data_loader, tok, step_results(), 8) == [8]
            out_eval = evaluate(data_loader, tok, step_results(), 9)
            trajs = got.trajectories
        assert len(out_eval[0].responses) == 6 and out_eval[0].responses[0] == [10, 11, 2]
        assert sorted({(t.step, t.validate) for t in trajs}) == [(9, False), (9, True)]
        assert len(trajs) == 12
        for t in trajs:
            for span in t.spans_of_kind("generation"):
                assert span.attributes["rtrace.response_text"] == tok.decode(span.response_ids or [], skip_special_tokens=True) \
                    or span.response_ids is None

    def test_filtered_groups_are_traced_marked_and_not_trained(self, data_loader, tok):
        """filter_zero_std_samples drops the all-solved and all-failed groups inside the call: they
        are traced at the step, with their scores, prompts and model steps, marked
        extra.filtered = zero_std, with no token counted as trained (rl.loss_tokens 0, loss_mask
        all 0); the kept group and the evaluation are unmarked and trained on."""
        with rtrace.testing.capture() as got:
            prepare(data_loader, tok, step_results(), 11)
            evaluate(data_loader, tok, step_results(), 12)
            trajs = got.trajectories
        train = by_coords(t for t in trajs if not t.validate)
        assert [(t.step, t.group_id, t.rollout_n, t.reward, t.policy_version, t.extra.get("filtered"))
                for t in train] == [(12, "7", 0, 1.0, 4, None), (12, "7", 1, 0.0, 4, None),
                                    (12, "3", 0, 1.0, 3, "zero_std"), (12, "3", 1, 1.0, 3, "zero_std"),
                                    (12, "9", 0, 0.0, 4, "zero_std"), (12, "9", 1, 0.0, 4, "zero_std")]
        assert [loss_tokens(t) for t in train] == [
            (3, [3], [1.0] * 3), (4, [2, 0, 2], [1.0] * 4),
            (0, [0], [0.0] * 2), (0, [0], [0.0] * 2), (0, [0], [0.0] * 3), (0, [0], [0.0] * 3)]
        assert train[2].spans[1].attributes["rtrace.prompt_text"] == tok.decode([5, 6], skip_special_tokens=True)
        assert train[5].finish_reason == "length"
        assert not any(t.extra.get("filtered") for t in trajs if t.validate)
        assert len([t for t in trajs if t.validate]) == 6

    def test_stale_results_are_traced_marked_and_not_trained(self, data_loader, tok):
        """A result generated more than async_steps (8) steps before the batch is dropped by
        open-instruct (result_is_stale) and another gathered in its place: traced at the step,
        marked extra.filtered = stale, not trained on; the batch is unchanged."""
        stale = per_prompt(3, [[15, 2], [16, 16, 2]], [[1, 1], [1, 1, 1]], [1.0, 0.0], ["stop", "stop"], [0, 0],
                           model_step=0)
        with rtrace.testing.capture() as got:
            prepare(data_loader, tok, [stale, *step_results()[:1]], 9, prompts=1)  # 9 - 0 > 8
            trajs = by_coords(got.trajectories)
        assert [(t.step, t.group_id, t.rollout_n, t.policy_version, t.extra.get("filtered"), loss_tokens(t)[0])
                for t in trajs] == [(10, "7", 0, 4, None, 3), (10, "7", 1, 4, None, 4),
                                    (10, "3", 0, 0, "stale", 0), (10, "3", 1, 0, "stale", 0)]
        assert [loss_tokens(t)[2] for t in trajs[2:]] == [[0.0] * 2, [0.0] * 3]

    def test_truncated_completions_and_a_batch_gathered_again(self, data_loader, tok):
        """mask_truncated_completions: open-instruct trains on none of the completions that did not
        finish with stop; a batch of only those is dropped and the step gathered again. All are
        traced at the step, the dropped ones marked extra.filtered = truncated and not trained on;
        the prompt drawn again in the second gathering continues its rollout numbers."""
        first = per_prompt(7, [[10, 10], [11, 11]], [[1, 1], [1, 1]], [1.0, 0.0], ["length", "length"], [0, 0])
        again = per_prompt(7, [[12, 2], [13, 13]], [[1, 1], [1, 1]], [1.0, 0.0], ["stop", "length"], [0, 0])
        config = data_loader.StreamingDataLoaderConfig(mask_truncated_completions=True)
        with rtrace.testing.capture() as got:
            assert prepare(data_loader, tok, [first, again], 0, config=config, prompts=1) == [0]
            trajs = by_coords(got.trajectories)
        assert [(t.step, t.sample_index, t.rollout_n, t.finish_reason, t.extra.get("filtered"), loss_tokens(t))
                for t in trajs] == [
            (1, 0, 0, "length", "truncated", (0, [0], [0.0, 0.0])),
            (1, 0, 1, "length", "truncated", (0, [0], [0.0, 0.0])),
            (1, 0, 2, "stop", None, (2, [2], [1.0, 1.0])),
            (1, 0, 3, "length", "truncated", (0, [0], [0.0, 0.0]))]

    def test_truncated_completions_are_trained_on_by_default(self, data_loader, tok):
        """mask_truncated_completions off (the default): a length-cut completion is trained on."""
        again = per_prompt(7, [[12, 2], [13, 13]], [[1, 1], [1, 1]], [1.0, 0.0], ["stop", "length"], [0, 0])
        with rtrace.testing.capture() as got:
            prepare(data_loader, tok, [again], 0, prompts=1)
            trajs = by_coords(got.trajectories)
        assert [(t.finish_reason, t.extra.get("filtered"), loss_tokens(t)[0]) for t in trajs] == [
            ("stop", None, 2), ("length", None, 2)]

    def test_a_dataset_index_twice_in_a_step(self, data_loader, tok):
        """Prompt 7 drawn twice in a step (kept both times) and a third time filtered: each sample
        has its own coordinates, rollout_n counting on over the step's samples of that index."""
        kept = step_results()[0]
        twice = per_prompt(7, [[22, 2], [23, 2]], [[1, 1], [1, 1]], [0.0, 1.0], ["stop", "stop"], [0, 0])
        solved = per_prompt(7, [[24, 2], [25, 2]], [[1, 1], [1, 1]], [1.0, 1.0], ["stop", "stop"], [0, 0])
        with rtrace.testing.capture() as got:
            prepare(data_loader, tok, [kept, twice, solved], 4)
            trajs = by_coords(got.trajectories)
        first_turns = [[10, 11, 2], [12, 13], [22, 2], [23, 2], [24, 2], [25, 2]]
        assert [(t.sample_index, t.rollout_n, t.extra.get("filtered"), t.spans[1].attributes["rtrace.response_text"])
                for t in trajs] == [(0, n, None if n < 4 else "zero_std", tok.decode(ids, skip_special_tokens=True))
                                    for n, ids in enumerate(first_turns)]

    def test_a_text_environment_through_the_loop(self, data_loader, tok):
        """The run's env config marks wordle a text environment: its replies are user turns; a
        prompt whose own env_config says otherwise (merged as open-instruct merges it) gets tool
        turns."""
        stats = [[real_shape("ToolCallStats", tool_name="wordle", success=True, runtime=0.0)]] * 2
        env = data_loader.EnvConfig(env_configs={"wordle": data_loader.EnvConfigEntry("wordle", True)})
        dataset = {7: {"input_ids_prompt": [1, 2]},
                   3: {"input_ids_prompt": [5, 6], "env_config": {"env_configs": [{"env_name": "wordle",
                                                                                  "is_text_env": False}]}}}
        items = [per_prompt(i, [[10, 30, 11], [12, 30, 13]], [[1, 0, 1], [1, 0, 1]], [1.0, 0.0], ["stop"] * 2,
                            [1, 1], stats=stats) for i in (7, 3)]
        with rtrace.testing.capture() as got:
            prepare(data_loader, tok, items, 0, env=env, prompts=2, dataset=dataset)
            trajs = by_coords(got.trajectories)
        assert [(t.group_id, [s.attributes["rtrace.role"] for s in t.spans[1:]]) for t in trajs] == [
            ("7", ["assistant", "user", "assistant"])] * 2 + [("3", ["assistant", "tool", "assistant"])] * 2

    def test_staleness_within_async_steps_is_healthy_with_the_documented_bound(self, data_loader, tok):
        """The oldest result open-instruct keeps (generated async_steps = 8 steps before the
        batch) is 9 steps old in the trainer's steps: RTRACE_HEALTH_MAX_STALENESS=9 (the doc's
        advice, async_steps + 1) says nothing of it, the default 1 reports it."""
        oldest = per_prompt(7, [[10, 2], [11, 2]], [[1, 1], [1, 1]], [1.0, 0.0], ["stop"] * 2, [0, 0], model_step=0)
        doc = (ROOT / "docs" / "frameworks" / "open-instruct.md").read_text()
        bound = int(NAMES["defaults"]["StreamingDataLoaderConfig.async_steps"]) + 1
        assert f"RTRACE_HEALTH_MAX_STALENESS={bound}" in doc
        for setting, findings in ((bound, []), (1, ["staleness"])):
            with rtrace.testing.capture(health_max_staleness=setting) as got:
                prepare(data_loader, tok, [oldest], 8, prompts=1)
                trajs = got.trajectories
            assert [(t.step, t.policy_version) for t in trajs] == [(9, 0)] * 2
            assert [[f["check"] for f in t.health] for t in trajs] == [findings] * 2

    def test_one_process_and_collector_write_the_same(self, data_loader, tok, tmp_path, monkeypatch):
        """The same calls, in one process and through rtrace.start_collector: the same records,
        field by field (ids and times aside), filtered groups and decoded text included."""
        pytest.importorskip("grpc")
        from tests.test_fidelity import _both_ways

        def produce():
            monkeypatch.setattr(open_instruct, "_index", PromptIndex())  # the same numbers both times
            prepare(data_loader, tok, step_results(), 9)
            evaluate(data_loader, tok, step_results(), 10)

        one, through = _both_ways(produce, tmp_path)
        assert len(one) == 12 and sum(1 for t in one if t["extra"].get("filtered")) == 4
        assert all(s["attributes"].get("rtrace.response_text") is not None for t in one for s in t["spans"]
                   if s["kind"] == "generation")
        assert through == one


ACTOR = """
import pickle, queue, sys
import rtrace, rtrace.compat.open_instruct

path, out = sys.argv[1], sys.argv[2]
if out != "-":
    rtrace.configure(exporter="jsonl", jsonl_path=out)
    rtrace.compat.open_instruct.install()  # Ray's worker_process_setup_hook: before the actor's class loads
    assert "open_instruct.data_loader" not in sys.modules
cls = pickle.loads(open(path, "rb").read())  # what Ray does with the class it exported
import open_instruct.data_loader as dl
q = queue.Queue()
q.put(dl.GenerationResult(responses=[[10, 2], [11, 2]], masks=[[1, 1], [1, 1]], finish_reasons=["stop"] * 2,
                          request_info=dl.RequestInfo(num_calls=[0, 0]), index=7, reward_scores=[1.0, 0.0],
                          model_step=0, logprobs=[[-0.1, -0.2], [-0.3, -0.4]]))
actor = cls({7: {"input_ids_prompt": [1, 2]}}, q, None, dl.StreamingDataLoaderConfig(), dl.EnvConfig(), 1, 1)
called = cls._data_preparation_loop.__globals__["accumulate_inference_batches"]
print(actor._data_preparation_loop(), called is dl.accumulate_inference_batches,
      getattr(called, "__rtrace_wrapped__", False))
rtrace.flush(30)
rtrace.shutdown()
"""


@pytest.fixture
def grpo(data_loader, tmp_path):
    """The grpo_utils and grpo_fast stand-ins beside the data loader's, imported under the real
    names after install() (grpo_fast.main's process: install() runs there first)."""
    package = tmp_path / "site" / "open_instruct"
    shutil.copy(SYNC_STAND_IN, package / "grpo_utils.py")
    shutil.copy(FAST_STAND_IN, package / "grpo_fast.py")
    return importlib.import_module("open_instruct.grpo_fast")


def engine_results(engine, index=7):
    """One prompt's results from an engine: the step it stamps on the request (add_request)."""
    stamped = engine.add_request([1, 2])["model_step"]
    return per_prompt(index, [[10, 2], [11, 2]], [[1, 1], [1, 1]], [1.0, 0.0], ["stop", "stop"], [0, 0],
                      model_step=stamped)


class TestWeightUpdates:
    def test_the_broadcast_is_marked_with_the_step_the_engines_then_stamp(self, grpo, data_loader, tok, tmp_path):
        """grpo_fast's weight sync thread publishes step 3 to two engines: one weight update is
        marked, version and step 3, once the call returned (after the engines woke), with the
        broadcast's duration and the number of engines; the rollouts the engines generate next
        carry policy_version 3, ended on it, crossing no update. The thread's behaviour is
        unchanged (its metrics, the engines' weights, the actors paused then resumed)."""
        import queue
        import threading

        from rtrace.exporters.jsonl import read_events

        assert grpo.grpo_utils.perform_weight_sync.__rtrace_wrapped__
        path = tmp_path / "oi.jsonl"
        engines = [grpo.LLMRayActor(), grpo.LLMRayActor()]
        manager = grpo.ActorManager()
        learners = SimpleNamespace(models=grpo.handles(grpo.Learner(engines, "w3")))
        trigger, stop, metrics = grpo.WeightSyncTrigger(0), threading.Event(), queue.Queue()
        with rtrace.testing.capture(exporter="jsonl", jsonl_path=str(path)) as got:
            thread = threading.Thread(target=grpo.weight_sync_thread, args=(
                SimpleNamespace(verbose=False), stop, trigger, learners, grpo.handles(*engines),
                grpo.handles(manager)[0], metrics))
            thread.start()
            before_ns = time.time_ns()
            trigger.notify(step=3)
            stats = metrics.get(timeout=30)
            returned_ns = time.time_ns()
            stop.set()
            thread.join(10)
            assert set(stats) == {"time/weight_sync"} and manager.calls == [True, False]
            assert [e.weights for e in engines] == ["w3", "w3"] and [e.current_model_step for e in engines] == [3, 3]
            prepare(data_loader, tok, [engine_results(engines[0]), engine_results(engines[1], 3)], 3, prompts=2)
            trajs = got.trajectories
        (event,) = read_events(path)
        assert (event.kind, event.version, event.step) == ("weight_update", 3, 3)
        assert set(event.attributes) == {"duration_ms", "engines"} and event.attributes["engines"] == 2
        assert 0 <= event.attributes["duration_ms"] <= (returned_ns - before_ns) / 1e6
        assert max(e.woken_ns[-1] for e in engines) <= event.time_ns <= returned_ns
        assert len(trajs) == 4
        assert {(t.step, t.policy_version, t.policy_version_end, t.crossed_update) for t in trajs} == {(4, 3, 3, False)}

    def test_the_olmo_core_trainer_s_callback_marks_its_global_step(self, grpo, tmp_path):
        """VLLMWeightSyncCallback.post_step (updates in flight): the step marked is the trainer's
        global_step, which it sent to the engines."""
        from rtrace.exporters.jsonl import read_events

        path = tmp_path / "oi.jsonl"
        engines = [grpo.LLMRayActor()]
        callback = grpo.VLLMWeightSyncCallback(SimpleNamespace(global_step=5), grpo.Learner(engines, "w5"),
                                               grpo.handles(*engines), grpo.handles(grpo.ActorManager())[0])
        with rtrace.testing.capture(exporter="jsonl", jsonl_path=str(path)):
            assert set(callback.post_step()) == {"time/weight_sync"}
        assert engines[0].current_model_step == 5
        assert [(e.version, e.step, e.attributes["engines"]) for e in read_events(path)] == [(5, 5, 1)]

    def test_a_failed_broadcast_raises_as_it_did_and_marks_nothing(self, grpo, tmp_path):
        """An engine that fails to wake: perform_weight_sync's own exception reaches its caller,
        the same object, the actors resumed by its finally; no weight update is marked. The
        wrapper pickles as a reference to open-instruct's function (no rtrace state)."""
        import pickle

        from rtrace.exporters.jsonl import read_events

        class Broken(grpo.LLMRayActor):
            def wake_up(self):
                raise error

        error = RuntimeError("engine gone")
        path = tmp_path / "oi.jsonl"
        manager = grpo.ActorManager()
        with rtrace.testing.capture(exporter="jsonl", jsonl_path=str(path)) as got:
            with pytest.raises(RuntimeError) as raised:
                grpo.grpo_utils.perform_weight_sync([[]], grpo.handles(Broken()), grpo.handles(manager)[0])
            assert rtrace.flush(30)
            stats = got.stats()
        assert raised.value is error and manager.calls == [True, False]
        assert stats.get("weight_updates", 0) == 0 and stats.get("internal_errors", 0) == 0
        assert not path.exists() or read_events(path) == []
        assert pickle.loads(pickle.dumps(grpo.grpo_utils.perform_weight_sync)) is grpo.grpo_utils.perform_weight_sync


class TestRayPickling:
    def test_the_actor_class_pickles_by_value_and_its_loop_calls_the_wrapper(self, data_loader, tmp_path):
        """install() ran before the actor is created (grpo_fast.main, the documented set-up): Ray
        pickles DataPreparationActor by value, its loop's global accumulate_inference_batches
        being rtrace's wrapper. It pickles as a reference to open-instruct's name (no rtrace state
        in it); loaded in a process that ran install() as the setup hook, the loop calls the
        wrapper and its trajectories are written; in one that did not, the original, untraced."""
        cloudpickle = pytest.importorskip("ray.cloudpickle")
        assert data_loader.accumulate_inference_batches.__rtrace_wrapped__
        data = cloudpickle.dumps(data_loader.ACTOR_CLASS)  # Ray's pickler, as in export_actor_class
        assert b"rtrace" not in data
        (tmp_path / "actor.pkl").write_bytes(data)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), str(ROOT),
                                                           os.environ.get("PYTHONPATH", "")]))
        traced = tmp_path / "actor.jsonl"
        for out, expected in ((traced, "[0] True True"), ("-", "[0] True False")):
            run = subprocess.run([sys.executable, "-c", ACTOR, str(tmp_path / "actor.pkl"), str(out)], env=env,
                                 capture_output=True, text=True, timeout=120)
            assert run.returncode == 0, run.stderr
            assert run.stdout.split("\n")[-2] == expected
        trajs = by_coords(read_jsonl(traced))
        assert [(t.step, t.sample_index, t.rollout_n, t.reward, t.spans[1].response_ids) for t in trajs] == [
            (1, 0, 0, 1.0, [10, 2]), (1, 0, 1, 0.0, [11, 2])]
