"""rtrace.compat.open_instruct: checked against open-instruct's real names, on data of its real shape.

open-instruct is not on PyPI and its rollout path imports vLLM, olmo_core and deepspeed: no
test here can import it. So (1) every field, function, parameter and call the adapter uses is
checked against ``tests/frameworks/open_instruct_names.json``, read with ``ast`` out of the
real code at the commit it names (``OPEN_INSTRUCT_DIR=<checkout>`` reads it again and
compares); (2) the adapter runs on ``GenerationResult`` / ``Batch`` objects with exactly those
fields; (3) ``install()`` wraps a module of the real function's signature, called the two
ways open-instruct calls it (the data preparation loop, ``maybe_evaluate``).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import os
import sys
import types
from pathlib import Path

import pytest

import rtrace
import rtrace.testing
from rtrace.compat import open_instruct
from tests.frameworks.open_instruct_names import MANIFEST, extract

ROOT = Path(__file__).resolve().parents[1]
NAMES = json.loads(MANIFEST.read_text())


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
        assert {"responses", "masks", "finish_reasons", "reward_scores", "model_step", "index",
                "request_info"} <= attributes_read(path, "result")

    def test_the_wrapped_function_and_its_callers(self):
        """accumulate_inference_batches takes training_step (8th), both callers look it up at call
        time (a global of data_loader, an attribute of data_loader_lib), and maybe_evaluate is the
        evaluation caller's name."""
        params = NAMES["functions"]["accumulate_inference_batches"]
        assert params.index("training_step") == 7
        assert NAMES["calls"]["DataPreparationActor._data_preparation_loop"]["calls"] == ["accumulate_inference_batches"]
        assert NAMES["calls"]["maybe_evaluate"]["calls"] == ["data_loader_lib.accumulate_inference_batches"]
        from rtrace.compat import _open_instruct_private

        for name in _open_instruct_private.PRIVATE_NAMES:
            module, _, attr = name.partition(":")
            if module.startswith("open_instruct"):
                assert attr in NAMES["functions"] or attr in NAMES["data_loader_imports"], name
        # the arguments the adapter reads, by name
        assert {"tokenizer", "training_step"} <= set(params)
        assert {"result", "dataset"} <= set(NAMES["functions"]["process_group"])

    def test_filtered_groups_are_dropped_where_the_adapter_looks(self):
        """accumulate_inference_batches calls process_group as a module global (the wrapped one is
        called), and process_group returns None only for a zero-std group under
        filter_zero_std_samples, which is on by default."""
        assert NAMES["calls"]["accumulate_inference_batches"]["calls"] == ["process_group"]
        assert NAMES["process_group_returns_none_if"] == [
            "filter_zero_std_samples and np.std(result.reward_scores) == 0"]
        assert NAMES["defaults"]["StreamingDataLoaderConfig.filter_zero_std_samples"] == "True"

    def test_a_tool_s_output_has_loss_mask_1_without_mask_tool_use(self):
        """The loss mask says nothing of authorship without mask_tool_use (on by default)."""
        assert NAMES["tool_output_masks"] == ["masks = [0 if mask_tool_use else 1] * len(tokens)"]
        assert NAMES["defaults"]["StreamingDataLoaderConfig.mask_tool_use"] == "True"

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


FAKE = """
def accumulate_inference_batches({accumulate}):
    # as open-instruct's: each prompt's result through process_group (a module global), the kept
    # groups made into one GenerationResult and Batch; (None, None, None, None) when all are filtered
    groups = []
    for result in inference_results_Q:
        group = process_group(result=result, generation_config=generation_config, tokenizer=tokenizer,
                              dataset=dataset, max_possible_score=max_possible_score,
                              no_resampling_pass_rate=no_resampling_pass_rate, iter_dataloader=iter_dataloader,
                              filter_zero_std_samples=filter_zero_std_samples, replenish_prompts=replenish_prompts,
                              param_prompt_Q=param_prompt_Q, base_env_config=base_env_config,
                              ground_truth_overrides=ground_truth_overrides)
        if group is not None:
            groups.append(group)
    if not groups:
        return None, None, None, None
    return COMBINE(groups) + ({{}}, None)


def process_group({process_group}):
    query = dataset[result.index][INPUT_IDS_PROMPT_KEY]
    scores = result.reward_scores
    if filter_zero_std_samples and max(scores) == min(scores):
        return None
    return result, query
"""


def per_prompt(index, responses, masks, scores, finish, calls, model_step=4):
    """One prompt's GenerationResult, as a vLLM actor sends it."""
    n = len(responses)
    return real_shape("GenerationResult", responses=responses, masks=masks, finish_reasons=finish,
                      request_info=real_shape("RequestInfo", num_calls=calls, tool_outputs=[""] * n),
                      index=index, prompt_id=f"0_{index}", reward_scores=scores, model_step=model_step)


def combine(groups):
    """make_batch_from_groups's shape: one GenerationResult and a Batch for the kept groups."""
    results = [g[0] for g in groups]
    result = real_shape("GenerationResult", responses=[r for g in results for r in g.responses],
                        masks=[m for g in results for m in g.masks],
                        finish_reasons=[f for g in results for f in g.finish_reasons],
                        request_info=real_shape("RequestInfo",
                                                num_calls=[c for g in results for c in g.request_info.num_calls]),
                        index=None, prompt_id=results[0].prompt_id)
    batch = real_shape("Batch", queries=[q for r, q in groups for _ in r.responses],
                       indices=[r.index for r, _ in groups for _ in r.responses],
                       scores=[s for r, _ in groups for s in r.reward_scores],
                       model_steps=[r.model_step for r, _ in groups for _ in r.responses])
    return result, batch


DATASET = {7: {"input_ids_prompt": [1, 2]}, 3: {"input_ids_prompt": [5, 6]}, 9: {"input_ids_prompt": [8, 8, 8]}}


def queue():
    """A step's results: prompt 7 mixed (1, 0; its second sample called a tool), prompt 3 all
    solved, prompt 9 all failed (the second cut by the length limit)."""
    return [per_prompt(7, [[10, 11, 2], [12, 13, 20, 21, 14, 2]], [[1, 1, 1], [1, 1, 0, 0, 1, 1]], [1.0, 0.0],
                       ["stop", "stop"], [0, 1]),
            per_prompt(3, [[15, 2], [16, 2]], [[1, 1], [1, 1]], [1.0, 1.0], ["stop", "stop"], [0, 0], model_step=3),
            per_prompt(9, [[17, 18, 2], [19, 19, 19]], [[1, 1, 1], [1, 1, 1]], [0.0, 0.0], ["stop", "length"], [0, 0])]


class TestInstall:
    @pytest.fixture
    def data_loader(self, monkeypatch):
        """``open_instruct.data_loader`` with accumulate_inference_batches and process_group of the
        real signatures (the names file), working as the real ones do for what the adapter sees."""
        module = types.ModuleType("open_instruct.data_loader")
        module.COMBINE, module.INPUT_IDS_PROMPT_KEY = combine, "input_ids_prompt"
        sig = {name: ", ".join(f"{p}=None" for p in NAMES["functions"][name])
               for name in ("accumulate_inference_batches", "process_group")}
        # the functions' globals are the module's: what install() patches is what they call
        exec(FAKE.format(accumulate=sig["accumulate_inference_batches"], process_group=sig["process_group"]),
             module.__dict__)
        package = types.ModuleType("open_instruct")
        package.data_loader = module
        monkeypatch.setitem(sys.modules, "open_instruct", package)
        monkeypatch.setitem(sys.modules, "open_instruct.data_loader", module)
        assert open_instruct.install() and open_instruct.install()  # idempotent
        return module

    @staticmethod
    def calls(module, tok, training_step, eval_step):
        """The two calls open-instruct makes: the data preparation loop's (keywords, 0-based
        training_step, filter_zero_std_samples on) and maybe_evaluate's (its step, no filter)."""
        out = module.accumulate_inference_batches(queue(), None, num_prompts=3, model_dims=None, tokenizer=tok,
                                                  dataset=DATASET, training_step=training_step,
                                                  filter_zero_std_samples=True, replenish_prompts=True)

        def maybe_evaluate():
            return module.accumulate_inference_batches(queue(), None, num_prompts=3, model_dims=None,
                                                       tokenizer=tok, dataset=DATASET, base_env_config=None,
                                                       timeout=0.01, active_sampling=False,
                                                       filter_zero_std_samples=False, replenish_prompts=False,
                                                       max_possible_score=1.0, training_step=eval_step)

        return out, maybe_evaluate()

    def test_training_and_evaluation_calls(self, data_loader, tok):
        """The data preparation loop's call (0-based training_step 8) gives training trajectories of
        the trainer's step 9; maybe_evaluate's at the trainer's step 9 gives validation ones of step
        9; what open-instruct gets back is unchanged; the text is decoded with the tokenizer
        argument (token2text not set)."""
        with rtrace.testing.capture() as got:
            out, out_eval = self.calls(data_loader, tok, 8, 9)
            trajs = got.trajectories
        assert [len(o[0].responses) for o in (out, out_eval)] == [2, 6]  # the filter dropped 2 groups
        assert out[0].responses[0] == [10, 11, 2]
        assert sorted({(t.step, t.validate) for t in trajs}) == [(9, False), (9, True)]
        assert len(trajs) == 12
        for t in trajs:
            for span in t.spans_of_kind("generation"):
                assert span.attributes["rtrace.response_text"] == tok.decode(span.response_ids or [], skip_special_tokens=True) \
                    or span.response_ids is None

    def test_filtered_groups_are_traced_and_marked(self, data_loader, tok):
        """filter_zero_std_samples drops the all-solved and all-failed groups inside the call: they
        are traced all the same, at the step, with their scores, prompts and model steps, marked
        extra.filtered = zero_std; the kept group and the evaluation are not marked."""
        with rtrace.testing.capture() as got:
            self.calls(data_loader, tok, 11, 12)
            trajs = got.trajectories
        train = sorted((t for t in trajs if not t.validate), key=lambda t: (t.sample_index, t.rollout_n))
        assert [(t.step, t.group_id, t.rollout_n, t.reward, t.policy_version, t.extra.get("filtered"))
                for t in train] == [(12, "7", 0, 1.0, 4, None), (12, "7", 1, 0.0, 4, None),
                                    (12, "3", 0, 1.0, 3, "zero_std"), (12, "3", 1, 1.0, 3, "zero_std"),
                                    (12, "9", 0, 0.0, 4, "zero_std"), (12, "9", 1, 0.0, 4, "zero_std")]
        solved = train[2]
        assert solved.spans[1].attributes["rtrace.prompt_text"] == tok.decode([5, 6], skip_special_tokens=True)
        assert train[5].finish_reason == "length"
        assert not any(t.extra.get("filtered") for t in trajs if t.validate)
        assert len([t for t in trajs if t.validate]) == 6

    def test_one_process_and_collector_write_the_same(self, data_loader, tok, tmp_path):
        """The same calls, in one process and through rtrace.start_collector: the same records,
        field by field (ids and times aside), filtered groups and decoded text included."""
        pytest.importorskip("grpc")
        from tests.test_fidelity import _both_ways

        one, through = _both_ways(lambda: self.calls(data_loader, tok, 20, 21), tmp_path)
        assert len(one) == 12 and sum(1 for t in one if t["extra"].get("filtered")) == 4
        assert all(s["attributes"].get("rtrace.response_text") is not None for t in one for s in t["spans"]
                   if s["kind"] == "generation")
        assert through == one
