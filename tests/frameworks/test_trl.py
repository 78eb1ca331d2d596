"""rtrace.compat.trl against the real TRL: a GRPOTrainer on CPU, a tiny Qwen2 built in code.

``GRPOTrainer(..., callbacks=[RTraceCallback()])`` and nothing else: every completion of the
two training steps (one generation batch for both, ``steps_per_generation=2``) and of the
evaluation is a trajectory whose rewards and advantages equal those TRL computed — read
back from the completions table TRL itself logs to trackio — and training is unchanged by
tracing (the weights after training are identical with and without the callback).

Runs in its own venv (``make test-frameworks`` builds ``.venv-trl``); skipped without trl.
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
import time

import pytest

trl = pytest.importorskip("trl", reason="make test-frameworks runs this in .venv-trl")
torch = pytest.importorskip("torch")

import rtrace  # noqa: E402
from rtrace.compat import _trl_private  # noqa: E402
from rtrace.compat.trl import RTraceCallback  # noqa: E402
from rtrace.exporters.jsonl import read_jsonl  # noqa: E402
from tests.token_reference import mismatch_of  # noqa: E402

pytestmark = pytest.mark.integration

PROJECT = "rtrace-trl"
QUESTIONS = [(2, 3), (4, 5), (6, 1), (7, 2)]


@pytest.fixture(scope="module")
def trackio_dir(tmp_path_factory):
    """trackio reads TRACKIO_DIR at import: set before the first import in this process."""
    path = tmp_path_factory.mktemp("trackio")
    if "trackio" in sys.modules:
        from trackio import utils

        if not str(utils.TRACKIO_DIR).startswith(tempfile.gettempdir()):
            pytest.skip(f"trackio was imported with TRACKIO_DIR={utils.TRACKIO_DIR}")
        return utils.TRACKIO_DIR
    os.environ["TRACKIO_DIR"] = str(path)
    return path


def tiny_model(tok):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                         tie_word_embeddings=True, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
                         pad_token_id=tok.pad_token_id)
    return Qwen2ForCausalLM(config)


def correct(completions, answer, **kwargs):
    return [1.0 if a in c[0]["content"] else 0.0 for c, a in zip(completions, answer)]


def brevity(completions, **kwargs):
    return [-len(c[0]["content"]) / 100 for c in completions]


def dataset(questions=QUESTIONS):
    from datasets import Dataset

    return Dataset.from_list([{"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "answer": str(a + b)}
                              for a, b in questions])


def train(tmp_path, tok, callbacks, run_name, report_to="trackio", eval_questions=QUESTIONS, outputs=None,
          rollout_func=None, **overrides):
    """A GRPOTrainer on the tiny model, trained. ``outputs``: a list that gets a copy of every
    generation batch TRL computes (``(validate, global_step, output)``: TRL's own tensors)."""
    from trl import GRPOConfig, GRPOTrainer

    config = dict(output_dir=str(tmp_path / run_name), per_device_train_batch_size=4, num_generations=2,
                  max_completion_length=8, max_steps=2, logging_steps=1, report_to=report_to, use_cpu=True,
                  bf16=False, seed=0, log_completions=True, save_strategy="no", steps_per_generation=2,
                  project=PROJECT, run_name=run_name, eval_strategy="steps", eval_steps=2,
                  per_device_eval_batch_size=4, num_generations_eval=2, reward_weights=[1.0, 0.5])
    config.update(overrides)
    trainer = GRPOTrainer(model=tiny_model(tok), reward_funcs=[correct, brevity], args=GRPOConfig(**config),
                          train_dataset=dataset(), eval_dataset=dataset(eval_questions), processing_class=tok,
                          callbacks=callbacks, rollout_func=rollout_func)
    if outputs is not None:
        keep_outputs(trainer, outputs)
    trainer.train()
    return trainer


def keep_outputs(trainer, into):
    """Keep a copy of each generation batch's output (the callback's wrapper runs inside)."""
    inner = trainer._generate_and_score_completions

    def kept(inputs, *args, **kwargs):
        out = inner(inputs, *args, **kwargs)
        into.append((not trainer.model.training, trainer.state.global_step,
                     {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in out.items()}))
        return out

    trainer._generate_and_score_completions = kept


def trl_completions(run_name):
    """The completions tables TRL logged to its trackio run (prompt, completion, one column per
    reward function, advantage), as rows."""
    from trackio.sqlite_storage import SQLiteStorage

    rows = []
    for log in SQLiteStorage.get_logs(PROJECT, run_name):
        if "completions" in log:
            rows.extend(log["completions"]["_value"])
    return rows


@pytest.fixture(scope="module")
def traced(tmp_path_factory, trackio_dir):
    from rtrace.demo import build_tokenizer

    tmp = tmp_path_factory.mktemp("trl")
    tok = build_tokenizer()
    outputs = []
    trainer = train(tmp, tok, [RTraceCallback(exporter="jsonl,trackio", jsonl_path=str(tmp / "t.jsonl"),
                                                  token2text_keep_ids=True)], "traced", outputs=outputs)
    assert rtrace.flush(60)
    stats = rtrace.stats()
    rtrace.shutdown()
    return {"trainer": trainer, "trajs": read_jsonl(tmp / "t.jsonl"), "tok": tok, "tmp": tmp, "stats": stats,
            "outputs": outputs}


def test_every_completion_is_a_trajectory_with_exact_coordinates(traced):
    """2 training steps of one generation batch (4 prompts x 2 completions) and the evaluation's
    4 x 2: one trajectory each, step = the optimizer step the batch starts (global_step + 1),
    evaluation at global_step 2, sample_index per prompt in its step, rollout_n per completion."""
    trajs = traced["trajs"]
    train = sorted((t.step, t.sample_index, t.rollout_n) for t in trajs if not t.validate)
    evals = sorted((t.step, t.sample_index, t.rollout_n) for t in trajs if t.validate)
    assert train == [(1, i, n) for i in range(4) for n in range(2)]
    assert evals == [(2, i, n) for i in range(4) for n in range(2)]
    for t in trajs:
        assert t.policy_version == (2 if t.validate else 0)
        assert t.group_id == t.extra["prompt_id"] and t.group_id.startswith("p-")
    # a prompt's group id is the same at every step it comes back (training and evaluation here)
    by_prompt = {}
    for t in trajs:
        by_prompt.setdefault(t.messages[0]["content"], set()).add(t.group_id)
    assert len(by_prompt) == 4 and all(len(ids) == 1 for ids in by_prompt.values())


def test_rewards_and_advantages_equal_trl_s(traced):
    """Each function's score, the weighted reward TRL trains on and the advantage equal the values
    of the completions table TRL logged itself, completion by completion."""
    trajs = [t for t in traced["trajs"] if not t.validate]
    table = [r for r in trl_completions("traced") if r["step"] == 1]
    assert len(table) >= len(trajs) == 8
    for t in trajs:
        matches = [r for r in table if _same(r, t, t.final_answer()["content"])]
        assert matches, t.messages  # (two identical completions of a prompt have the same values)
        row = matches[0]
        assert t.outcome == {"reward/correct": row["correct"], "reward/brevity": row["brevity"]}
        assert math.isclose(t.reward, row["correct"] * 1.0 + row["brevity"] * 0.5, rel_tol=1e-6, abs_tol=1e-7)
        assert math.isclose(t.annotations["advantage"], row["advantage"], rel_tol=1e-6, abs_tol=1e-7)


def _same(row, traj, answer):
    prompt = row["prompt"][-1]["content"] if isinstance(row["prompt"], list) else row["prompt"]
    completion = row["completion"][0]["content"] if isinstance(row["completion"], list) else row["completion"]
    return prompt == traj.messages[0]["content"] and completion == answer


def test_ids_text_and_finish_reasons(traced):
    """The prompt and completion ids decode to the conversation TRL scored; a completion that
    reached max_completion_length without an end token is `length`, else `stop`."""
    tok = traced["tok"]
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    for t in traced["trajs"]:
        (gen,) = t.spans_of_kind("generation")
        ids = gen.response_ids
        assert 1 <= len(ids) <= 8 == gen.attributes["gen_ai.usage.output_tokens"] or len(ids) < 8
        assert t.finish_reason == ("stop" if ids[-1] == eos else "length")
        assert gen.attributes["rtrace.response_text"] == tok.decode(ids, skip_special_tokens=True)
        assert gen.attributes["rtrace.prompt_text"] == tok.decode(gen.prompt_ids, skip_special_tokens=True)
        assert tok.decode(gen.prompt_ids, skip_special_tokens=False).startswith("<|im_start|>user\n")


def test_summaries_go_to_trl_s_own_trackio_run(traced):
    """report_to="trackio": rtrace's traces, step summaries and rollouts tables are in TRL's run
    (no second run of the same name), written before TRL finished it."""
    from trackio.sqlite_storage import SQLiteStorage

    runs = SQLiteStorage.get_runs(PROJECT)
    assert runs.count("traced") == 1
    logs = SQLiteStorage.get_logs(PROJECT, "traced")
    assert any("rollout/reward_mean" in r and r["step"] == 1 for r in logs)
    assert any("eval/rollouts" in r for r in logs) and any("rollout/rollouts" in r for r in logs)
    traces = SQLiteStorage.get_traces(PROJECT, run="traced")
    assert len(traces) == len(traced["trajs"])
    assert traced["stats"]["sink.trackio.exported"] == len(traced["trajs"])


def test_training_is_unchanged(traced, tmp_path):
    """The same training without the callback ends with the same weights, bit for bit."""
    plain = train(tmp_path, traced["tok"], [], "plain", report_to="none")
    ours = traced["trainer"].model.state_dict()
    theirs = plain.model.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_private_names_exist(traced):
    """Canary: every TRL private name rtrace.compat._trl_private lists exists in the installed TRL."""
    import importlib

    import inspect

    from trl import GRPOTrainer

    trainer = traced["trainer"]
    for name in _trl_private.PRIVATE_NAMES:
        module, _, path = name.partition(":")
        obj = importlib.import_module(module)
        if path == "GRPOTrainer.vllm_generation":  # only use_vllm sets it (test_each_push_of_weights_...)
            assert "self.vllm_generation = VLLMGeneration(" in inspect.getsource(GRPOTrainer.__init__)
            continue
        for i, part in enumerate(path.split(".")):
            if i == 1 and module.startswith("trl") and not hasattr(obj, part):
                obj = trainer  # an instance attribute
            obj = getattr(obj, part)
    # where TRL pushes its weights: before generating, when global_step moved; no argument
    source = inspect.getsource(GRPOTrainer._generate_single_turn)
    assert "self.vllm_generation.sync_weights()\n" in source
    assert "self._last_loaded_step = self.state.global_step" in source


@pytest.mark.parametrize("report_to, exporter", [
    (["trackio"], "trackio"),              # TRL logs to trackio: rtrace's traces go to the same run
    (["mlflow", "trackio"], "trackio,mlflow"),
    ("none", "jsonl"),                     # no tracker: a JSONL file in the output dir
])
def test_sinks_follow_report_to(tmp_path, monkeypatch, report_to, exporter):
    """RTraceCallback() with no arguments takes its sinks from TRL's own report_to, the run
    name as the experiment, and decodes text."""
    from trl import GRPOConfig

    monkeypatch.delenv("RTRACE_EXPORTER", raising=False)
    monkeypatch.delenv("RTRACE_EXPERIMENT", raising=False)
    args = GRPOConfig(output_dir=str(tmp_path / "out"), run_name="run-7", report_to=report_to, use_cpu=True)
    got = RTraceCallback()._defaults(args)
    expected = {"exporter": exporter, "experiment": "run-7"}  # token2text: unset, decodes with TRL's tokenizer
    if exporter == "jsonl":
        expected["jsonl_path"] = os.path.join(str(tmp_path / "out"), "rtrace_traces.jsonl")
    assert {k: v for k, v in got.items() if k != "project"} == expected


# ----------------------------------------------------------------------------- issue 31


EVAL_QUESTIONS = [(1, 1), (2, 2), (3, 4), (5, 5), (8, 1), (9, 3)]


def test_an_evaluation_batch_larger_than_the_generation_batch(tmp_path):
    """per_device_eval_batch_size=6 with a generation batch of 4 (TRL's completions table keeps 4
    rows): every evaluation completion has its reward, each function's score, its advantage and
    TRL's chat messages, and each prompt its own group id. The values are checked against the
    reward functions applied to the completion itself, and TRL's advantage formula per group."""
    from rtrace.demo import build_tokenizer

    tok = build_tokenizer()
    path = tmp_path / "t.jsonl"
    train(tmp_path, tok, [RTraceCallback(exporter="jsonl", jsonl_path=str(path))], "big-eval", report_to="none",
          eval_questions=EVAL_QUESTIONS, per_device_train_batch_size=2, per_device_eval_batch_size=6)
    assert rtrace.flush(60)
    stats = rtrace.stats()
    rtrace.shutdown()
    evals = [t for t in read_jsonl(path) if t.validate]
    assert len(evals) == 12  # 6 prompts x 2, in two batches of 6
    groups = {}
    for t in evals:
        question = t.messages[0]["content"]
        answer = t.final_answer()["content"]
        a, b = next((a, b) for a, b in EVAL_QUESTIONS if question == f"What is {a} + {b}?")
        expected = {"reward/correct": 1.0 if str(a + b) in answer else 0.0, "reward/brevity": -len(answer) / 100}
        assert t.outcome == pytest.approx(expected), t.messages
        assert t.reward == pytest.approx(expected["reward/correct"] + 0.5 * expected["reward/brevity"])
        assert isinstance(t.annotations.get("advantage"), float)
        assert "rtrace.missing" not in t.root.attributes
        groups.setdefault(t.group_id, []).append(t)
    # one group id per prompt, never one shared by two prompts
    assert len(groups) == 6 and all(len(g) == 2 for g in groups.values())
    assert all(len({t.messages[0]["content"] for t in g}) == 1 for g in groups.values())
    for g in groups.values():  # TRL's advantage: (r - group mean) / (group std + 1e-4)
        rewards = torch.tensor([t.reward for t in g])
        expected = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
        assert [t.annotations["advantage"] for t in g] == pytest.approx(expected.tolist(), abs=1e-5)
    assert stats.get("trl_values_missing", 0) == 0


def test_token2text_off_is_respected(tmp_path, monkeypatch):
    """The callback hands TRL's tokenizer to rtrace and token2text decodes by default (the other
    tests read rtrace.response_text); RTRACE_TOKEN2TEXT=0 turns that off: ids, no text."""
    from rtrace.demo import build_tokenizer

    monkeypatch.setenv("RTRACE_TOKEN2TEXT", "0")
    path = tmp_path / "t.jsonl"
    train(tmp_path, build_tokenizer(), [RTraceCallback(exporter="jsonl", jsonl_path=str(path))], "no-text",
          report_to="none", max_steps=1, eval_strategy="no")
    assert rtrace.flush(60)
    rtrace.shutdown()
    trajs = read_jsonl(path)
    assert len(trajs) == 8
    for t in trajs:
        (gen,) = t.spans_of_kind("generation")
        assert "rtrace.response_text" not in gen.attributes and gen.response_ids


def test_one_process_and_collector_write_the_same(tmp_path):
    """Both ways, field by field (ids and times aside): the callback writing JSONL in this
    process, and streaming to rtrace.start_collector (RTRACE_EXPORTER=collector): the same
    trajectories, TRL's chat messages, rewards, advantages and decoded text."""
    from rtrace.demo import build_tokenizer

    from tests.test_fidelity import _normal  # needs grpc: the otlp extra

    tok = build_tokenizer()

    def run(where, **settings):
        train(tmp_path / where, tok, [RTraceCallback(**settings)], "both", report_to="none")
        assert rtrace.flush(60)
        rtrace.shutdown()

    one = tmp_path / "one.jsonl"
    run("one", exporter="jsonl", jsonl_path=str(one))
    through = tmp_path / "collector.jsonl"
    collector = rtrace.start_collector(exporter="jsonl", jsonl_path=str(through), settle_s=0.2)
    try:
        run("two", exporter="collector", collector_endpoint=collector.endpoint)
        assert collector.flush(30)
    finally:
        collector.stop()

    def key(t):
        return (t["validate"], t["step"], t["sample_index"], t["rollout_n"])

    a = sorted((_normal(t) for t in read_jsonl(one)), key=key)
    b = sorted((_normal(t) for t in read_jsonl(through)), key=key)
    assert len(a) == 16 and all(t["annotations"].get("advantage") is not None for t in a)
    assert all(s["attributes"].get("rtrace.response_text") for t in a for s in t["spans"] if s["kind"] == "generation")
    assert b == a


# ----------------------------------------------------------------------------- issue 33: per-token values


def _expected(values):
    """A tensor row as rtrace's JSONL writes it (float32, 6 significant digits)."""
    from rtrace.trajectory import token_list

    return token_list(values.detach().float().numpy())


def _row(outputs, traj, validate=False):
    """TRL's output of the generation batch a trajectory came from, and its row there (one
    process: a step's prompts are rows sample_index * num_generations + rollout_n)."""
    ((out),) = [o for v, _, o in outputs if v == validate]
    return out, traj.sample_index * 2 + traj.rollout_n


def test_per_token_values_are_trl_s_own_tensors(traced):
    """Each training completion's generation carries TRL's old_per_token_logps (the trainer's
    recompute: steps_per_generation=2), its advantage on each completion token and its
    completion_mask as the loss mask, equal to TRL's tensors for that row: in JSONL at its 6
    significant digits, in trackio bit for bit (float32). TRL's generation here returns no
    sampler logprobs, so no mismatch is measured."""
    from trackio.sqlite_storage import SQLiteStorage

    from rtrace.trajectory import read_token_field

    trajs = [t for t in traced["trajs"] if not t.validate]
    assert len(trajs) == 8
    exact = {}
    for trace in SQLiteStorage.get_traces(PROJECT, run="traced"):
        meta = trace["metadata"]
        if not meta.get("validate"):  # left out at its default (false)
            (gen,) = [s for s in trace["spans"] if s["kind"] == "generation"]
            exact[(meta["sample_index"], meta["rollout_n"])] = read_token_field(gen["metadata"]["rtrace.token_values"])
    assert len(exact) == 8
    for t in trajs:
        out, j = _row(traced["outputs"], t)
        (gen,) = t.spans_of_kind("generation")
        n = len(gen.response_ids)
        assert n == int(out["completion_mask"][j].sum())
        assert set(gen.token_values) == {"old_logprob", "advantage", "loss_mask"}
        assert gen.token_values["old_logprob"] == _expected(out["old_per_token_logps"][j, :n])
        assert gen.token_values["advantage"] == _expected(out["advantages"][j].expand(n))
        assert gen.token_values["loss_mask"] == _expected(out["completion_mask"][j, :n])
        back = exact[(t.sample_index, t.rollout_n)]
        assert back["old_logprob"] == out["old_per_token_logps"][j, :n].tolist()  # float32, exact
        assert back["advantage"] == [out["advantages"][j].item()] * n
        # the advantage is also the completion's own annotation (one number), as before
        assert t.annotations["advantage"] == pytest.approx(out["advantages"][j].item(), rel=1e-6, abs=1e-7)
        assert "logprob_mismatch_k3" not in t.annotations
        assert not [f for f in t.health if f["check"] in ("token_arrays", "logprob_mismatch")]
    for t in (t for t in traced["trajs"] if t.validate):  # evaluation: TRL's eval batch has them too
        (gen,) = t.spans_of_kind("generation")
        assert {"old_logprob", "advantage", "loss_mask"} <= set(gen.token_values)


#: what the environment inserts after the model's first turn (kv_cache_sampler with env=True)
ENV_TEXT = "<tool_response>\n4\n</tool_response>"


def kv_cache_sampler(prompts, trainer, env=False):
    """A TRL ``rollout_func`` that samples like an inference engine: token by token with a KV
    cache, at temperature 1 with no top-k / top-p, returning each sampled token's logprob
    under the trainer's current weights (what vLLM returns with ``logprobs=0``). With ``env``,
    a completion that has not ended after 3 tokens gets the environment's tokens
    (:data:`ENV_TEXT`, logprob 0, ``env_mask`` 0: TRL's tool mask), then the model goes on."""
    tok = trainer.processing_class
    model = trainer.model
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    env_ids = tok.encode(ENV_TEXT, add_special_tokens=False)
    gen = torch.Generator().manual_seed(1000 + trainer.state.global_step)
    out = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "env_mask": []}
    with torch.no_grad():
        for prompt in prompts:
            ids = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
            step_in, past, completion, logps, mask = torch.tensor([ids]), None, [], [], []
            for turn, budget in enumerate((3, 5) if env else (trainer.max_completion_length,)):
                if turn:  # the environment's tokens: fed to the model, not sampled
                    completion += env_ids
                    logps += [0.0] * len(env_ids)
                    mask += [0] * len(env_ids)
                    step_in = torch.cat([step_in, torch.tensor([env_ids])], dim=1)
                for _ in range(budget):
                    o = model(input_ids=step_in, past_key_values=past, use_cache=True)
                    past = o.past_key_values
                    logp = torch.log_softmax(o.logits[0, -1].float(), dim=-1)
                    token = int(torch.multinomial(logp.exp(), 1, generator=gen))
                    completion.append(token)
                    logps.append(float(logp[token]))
                    mask.append(1)
                    step_in = torch.tensor([[token]])
                    if token == eos:
                        break
                if completion[-1] == eos:
                    break
            out["prompt_ids"].append(ids)
            out["completion_ids"].append(completion)
            out["logprobs"].append(logps)
            out["env_mask"].append(mask)
    if not env:
        del out["env_mask"]
    return out


@pytest.mark.parametrize("env", [False, True], ids=["single-turn", "with-env-tokens"])
def test_sampler_and_trainer_logprobs_and_their_mismatch(tmp_path, monkeypatch, capsys, env):
    """With a sampler that returns logprobs (a rollout_func; vLLM's importance sampling
    correction gives the same field), each completion carries TRL's sampling_per_token_logps
    as `logprob` beside its old_per_token_logps, and the mismatch rtrace computes equals the
    one computed from TRL's tensors over TRL's loss mask (completion_mask x tool_mask). With
    environment tokens in the completion (env_mask, TRL's tool mask) the rows are cut into the
    model's turns, the environment's tokens on none. Sampler and trainer use the same weights
    (a KV-cached token-by-token pass vs TRL's padded batch forward): no finding, and the size
    of the difference is printed."""
    import functools

    from rtrace.demo import build_tokenizer

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    path = tmp_path / "t.jsonl"
    outputs = []
    callback = RTraceCallback(exporter="jsonl", jsonl_path=str(path), token2text_keep_ids=True)
    train(tmp_path, build_tokenizer(), [callback], "sampler", report_to="none", eval_strategy="no", outputs=outputs,
          rollout_func=functools.partial(kv_cache_sampler, env=env), max_completion_length=16)
    assert rtrace.flush(60)
    rtrace.shutdown()
    trajs = read_jsonl(path)
    assert len(trajs) == 8
    worst, tokens, with_env = 0.0, 0, 0
    for t in trajs:
        out, j = _row(outputs, t)
        gens = t.spans_of_kind("generation")
        n = int(out["completion_mask"][j].sum())
        loss = out["completion_mask"][j, :n] * out["tool_mask"][j, :n] if env else out["completion_mask"][j, :n]
        # the row, cut into the model's turns (the environment's tokens between them on none)
        pos = 0
        for span in sorted(t.spans, key=lambda s: s.start_ns)[1:]:
            k = len(span.response_ids)
            if span.kind == "generation":
                assert span.token_values["logprob"] == _expected(out["sampling_per_token_logps"][j, pos:pos + k])
                assert span.token_values["old_logprob"] == _expected(out["old_per_token_logps"][j, pos:pos + k])
                assert span.token_values["loss_mask"] == [1.0] * k
            else:
                assert span.token_values is None and not loss[pos:pos + k].any()
            pos += k
        assert pos == n
        with_env += len(gens) > 1
        expected = mismatch_of(out["sampling_per_token_logps"][j, :n], out["old_per_token_logps"][j, :n], loss)
        for key, value in expected.items():
            assert t.annotations[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
        assert not [f for f in t.health if f["check"] in ("token_arrays", "logprob_mismatch")]
        worst = max(worst, t.annotations["logprob_mismatch_max"])
        tokens += int(loss.sum())
    assert with_env > 0 if env else with_env == 0
    with capsys.disabled():
        print(f"\nTRL ({'with env tokens' if env else 'single turn'}), same weights, KV-cached sampler vs TRL's "
              f"old_per_token_logps: max |Δlogprob| {worst:.3g} over {tokens} loss-masked tokens")
    assert worst < 1e-5


# ----------------------------------------------------------------------------- issue 41: weight updates


class FakeVLLMServer:
    """A vLLM server as TRL's ``VLLMClient`` reaches it in server mode, in this process.

    TRL's client speaks HTTP to the server and pushes weights over NCCL, which does not run on
    CPU: this object stands at that boundary and answers the calls TRL makes on its client
    (``get_server_info``, ``update_named_params``, ``reset_prefix_cache``, ``generate``). Its
    model is a copy of the trainer's initial one (the checkpoint a server loads), whose
    parameters each push replaces; it samples token by token at temperature 1 and returns each
    token's logprob. ``calls`` keeps, per generate call, when it came and how many pushes the
    server had taken, and whether its weights were the trainer's at that moment."""

    def __init__(self, model, trainer_model):
        import copy

        self.model = copy.deepcopy(model)
        self.trainer_model = trainer_model
        self.pushes = 0
        self.calls = []

    def get_server_info(self):
        return {"model_config": {"logprobs_mode": "processed_logprobs"}}

    def update_named_params(self, metadata, named_params):
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, tensor in named_params:
                params[name].copy_(tensor)
        self.pushes += 1

    def reset_prefix_cache(self):
        pass

    def generate(self, prompts, features=None, n=1, max_tokens=16, **sampling):
        ours, theirs = self.model.state_dict(), self.trainer_model().state_dict()
        self.calls.append((time.time_ns(), self.pushes, all(torch.equal(ours[k], theirs[k]) for k in ours)))
        gen = torch.Generator().manual_seed(len(self.calls))
        out = {"prompt_ids": list(prompts), "completion_ids": [], "logprobs": [], "logprob_token_ids": None}
        with torch.no_grad():
            for ids in prompts:
                for _ in range(n):
                    step_in, past, completion, logps = torch.tensor([ids]), None, [], []
                    for _ in range(max_tokens):
                        o = self.model(input_ids=step_in, past_key_values=past, use_cache=True)
                        past = o.past_key_values
                        logp = torch.log_softmax(o.logits[0, -1].float(), dim=-1)
                        token = int(torch.multinomial(logp.exp(), 1, generator=gen))
                        completion.append(token)
                        logps.append([float(logp[token])])
                        step_in = torch.tensor([[token]])
                        if token == self.model.config.eos_token_id:
                            break
                    out["completion_ids"].append(completion)
                    out["logprobs"].append(logps)
        return out


def test_each_push_of_weights_to_vllm_is_a_weight_update(tmp_path, monkeypatch):
    """GRPOTrainer with use_vllm (server mode; the server at the client boundary, above): TRL
    pushes its weights before each generation whose global_step moved (steps 0 and 1 of the
    training, 2 before the evaluation). Each push is one weight update, marked when it
    returned: version and step = global_step, with its duration; before the server generated
    with those weights (which then equal the trainer's), and the completions generated next
    carry that version as policy_version, ending on it without crossing an update."""
    from trl.generation.vllm_generation import VLLMGeneration

    from rtrace.demo import build_tokenizer
    from rtrace.exporters.jsonl import read_events

    servers = []

    def connect(self):  # VLLMGeneration's connection to its server (HTTP + NCCL): the fake instead
        servers.append(FakeVLLMServer(self.model, lambda: self.model))
        self.vllm_client = servers[-1]

    monkeypatch.setattr(VLLMGeneration, "_init_vllm", connect)
    path = tmp_path / "t.jsonl"
    before = time.time_ns()
    trainer = train(tmp_path, build_tokenizer(), [RTraceCallback(exporter="jsonl", jsonl_path=str(path))], "vllm",
                    report_to="none", use_vllm=True, vllm_mode="server", steps_per_generation=1)
    assert rtrace.flush(60)
    rtrace.shutdown()
    (server,) = servers
    events = read_events(path)
    assert [(e.kind, e.version, e.step) for e in events] == [("weight_update", v, v) for v in (0, 1, 2)]
    assert _trl_private.wrap_weight_sync(trainer, None)  # wrapped once, at on_train_begin
    assert all(set(e.attributes) == {"duration_ms"} and e.attributes["duration_ms"] >= 0 for e in events)
    # the evaluation's 4 prompts x 2 come in two batches of 4 completions, on the same weights
    assert [pushes for _, pushes, _ in server.calls] == [1, 2, 3, 3] and all(same for *_, same in server.calls)
    # each update is marked after the generation before its push, before the first one on its weights
    times = [before] + [t for t, _, _ in server.calls]
    assert all(times[i] <= events[i].time_ns <= times[i + 1] for i in range(3))
    trajs = read_jsonl(path)
    assert sorted({(t.validate, t.step, t.policy_version) for t in trajs}) == [(False, 1, 0), (False, 2, 1),
                                                                              (True, 2, 2)]
    assert len(trajs) == 16  # 2 steps x 4 completions, the evaluation's 4 prompts x 2
    assert all(t.policy_version_end == t.policy_version and t.crossed_update is False for t in trajs)


def test_without_vllm_nothing_is_published(traced):
    """use_vllm off (the other tests): the trainer generates with its own weights; nothing is
    pushed, no weight update is marked."""
    from rtrace.exporters.jsonl import read_events

    assert traced["stats"].get("weight_updates", 0) == 0
    assert read_events(traced["tmp"] / "t.jsonl") == []
    assert not _trl_private.wrap_weight_sync(traced["trainer"], None)
