"""rtrace.compat.skyrl against the real skyrl-train: its SkyRLGymGenerator, agent loop,
InferenceEngineClient and the skyrl-gym text2sql environment with its real SQL tool on a
SQLite file; only the inference engine is scripted.

``rtrace.compat.skyrl.install()`` and nothing else: training steps, evaluation (a batch
size the training group size does not divide), step-wise trajectories, and a truncated
response under ``apply_overlong_filtering``. Each trajectory is checked against SkyRL's
own output: one per trajectory id, exact coordinates, the reward, the stop reason, the
turns of the loop (not the loss mask), real times, and SkyRL's output unchanged by tracing.

Runs in its own venv (``make test-frameworks`` builds ``.venv-skyrl``); skipped without skyrl-train.
"""

from __future__ import annotations

import asyncio
import copy
import os
import sqlite3

import pytest

pytest.importorskip("skyrl_train", reason="make test-frameworks runs this in .venv-skyrl")

import rtrace  # noqa: E402
import rtrace.compat.skyrl  # noqa: E402
from rtrace.compat import _skyrl_private  # noqa: E402
from rtrace.exporters.jsonl import read_jsonl  # noqa: E402

pytestmark = pytest.mark.integration

GOLD = "SELECT name FROM items WHERE price > 5 ORDER BY name"
WRONG = "SELECT name FROM items ORDER BY name"
#: a query of one row: skyrl-gym's SQL tool returns rows as a frozenset, in an order that
#: changes with the process's string hash seed; one row reads the same in every process
ONE_ROW = "SELECT name FROM items WHERE price > 20"
#: instance -> what the scripted model does: "right" (a query, then the right solution),
#: "wrong" (a query, then a wrong solution), "long" (rambles until the length limit),
#: "one" (a query of one row, then the right solution)
SCRIPT = {"q0": "right", "q1": "wrong", "q2": "long", "q3": "right", "q4": "wrong", "q5": "one", "q6": "one"}
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def tok():
    """rtrace's offline ChatML tokenizer, its end token <|im_end|> as a Qwen-2.5 instruct model's."""
    from rtrace.demo import build_tokenizer

    tok = copy.deepcopy(build_tokenizer())
    tok.eos_token = "<|im_end|>"
    return tok


@pytest.fixture(scope="module")
def db_root(tmp_path_factory):
    """The text2sql env's database folder: <root>/spider/database/shop/shop.sqlite."""
    root = tmp_path_factory.mktemp("sql")
    folder = root / "spider" / "database" / "shop"
    folder.mkdir(parents=True)
    conn = sqlite3.connect(folder / "shop.sqlite")
    conn.executescript("CREATE TABLE items (name TEXT, price REAL);"
                       "INSERT INTO items VALUES ('apple', 3), ('book', 12), ('lamp', 25), ('pen', 2);")
    conn.commit()
    conn.close()
    return root


def config(db_root, **generator):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import skyrl_train

    folder = os.path.join(os.path.dirname(skyrl_train.__file__), "config")
    with initialize_config_dir(config_dir=folder, version_base=None):
        cfg = compose(config_name="ppo_base_config")
    OmegaConf.set_struct(cfg, False)
    cfg.trainer.policy.model.path = "tiny-sql"
    cfg.generator.max_turns = 3
    cfg.generator.sampling_params.max_generate_length = MAX_TOKENS
    cfg.environment.skyrl_gym.text2sql.db_path = str(db_root)
    cfg.environment.skyrl_gym.max_env_workers = 0
    for key, value in generator.items():
        cfg.generator[key] = value
    return cfg


def engine_logprob(turn, k):
    """The scripted engine's logprob of the k-th token of a turn's reply (each one different)."""
    return round(-0.05 - 0.01 * k - turn, 6)


class ScriptedEngine:
    """The stand-in for vLLM: token ids in, token ids out, scripted by the question."""

    def __init__(self, tok, logprobs=False):
        self.tok = tok
        self.eos = tok.eos_token_id
        self.logprobs = logprobs  # as a vLLM engine made with the config's sampling_params.logprobs

    async def generate(self, input_batch):
        out = {"responses": [], "response_ids": [], "stop_reasons": [], "response_logprobs": None}
        params = input_batch.get("sampling_params") or {}
        if self.logprobs or params.get("logprobs") is not None:  # each sampled token's logprob
            out["response_logprobs"] = []
        for ids in input_batch["prompt_token_ids"]:
            text = self.tok.decode(ids, skip_special_tokens=False)
            instance = next(q for q in SCRIPT if f"[{q}]" in text)
            turn = text.count("</sql>") + 1  # the replies so far are in the prompt, in either mode
            mode = SCRIPT[instance]
            await asyncio.sleep(0.002)
            if mode == "long":
                reply, stop = "I will think about it " * 30, "length"
                reply_ids = self.tok(reply, add_special_tokens=False)["input_ids"][:MAX_TOKENS]
                reply = self.tok.decode(reply_ids)
            else:
                if turn == 1:
                    reply = f"<think>Look at the prices.</think><sql>{ONE_ROW if mode == 'one' else GOLD}</sql>"
                else:
                    reply = f"<think>That is it.</think><solution>{WRONG if mode == 'wrong' else GOLD}</solution>"
                reply_ids = self.tok(reply, add_special_tokens=False)["input_ids"] + [self.eos]
                stop = "stop"
            out["responses"].append(reply)
            out["response_ids"].append(reply_ids)
            out["stop_reasons"].append(stop)
            if out["response_logprobs"] is not None:
                out["response_logprobs"].append([engine_logprob(turn, k) for k in range(len(reply_ids))])
        return out

    # the rest of InferenceEngineInterface is not used by generate()
    def tp_size(self):
        return 1

    def pp_size(self):
        return 1

    def dp_size(self):
        return 1


def generator(cfg, tok):
    from skyrl_train.generators.skyrl_gym_generator import SkyRLGymGenerator
    from skyrl_train.inference_engines.inference_engine_client import InferenceEngineClient

    client = InferenceEngineClient([ScriptedEngine(tok, cfg.generator.sampling_params.logprobs is not None)], tok, cfg)
    return SkyRLGymGenerator(cfg.generator, cfg.environment.skyrl_gym, client, tok, "tiny-sql")


def batch(instances, n, step, phase):
    from skyrl_train.generators.base import BatchMetadata, TrajectoryID

    rows = [(q, r) for q in instances for r in range(n)]
    return {
        "prompts": [[{"role": "system", "content": "Answer with SQL. Put the final query in <solution></solution>."},
                     {"role": "user", "content": f"[{q}] Which items cost more than 5?"}] for q, _ in rows],
        "env_classes": ["text2sql"] * len(rows),
        "env_extras": [{"db_id": "shop", "reward_spec": {"ground_truth": GOLD}, "data": "spider"} for _ in rows],
        "sampling_params": None,
        "trajectory_ids": [TrajectoryID(instance_id=q, repetition_id=r) for q, r in rows],
        "batch_metadata": BatchMetadata(global_step=step, training_phase=phase),
    }


def run(gen, input_batch):
    return asyncio.run(gen.generate(copy.deepcopy(input_batch), disable_tqdm=True))


@pytest.fixture(autouse=True)
def installed():
    assert rtrace.compat.skyrl.install() == ["skyrl_train"]


def traced(tmp_path, gen, batches):
    path = tmp_path / "t.jsonl"
    rtrace.configure(exporter="jsonl", jsonl_path=str(path), token2text=True, export_interval_s=0.05,
                     token2text_keep_ids=True)
    rtrace.set_tokenizer(gen.tokenizer)
    outputs = [run(gen, b) for b in batches]
    assert rtrace.flush(30)
    rtrace.shutdown()
    return outputs, read_jsonl(path)


def plain(out):
    """A GeneratorOutput without what is not SkyRL's data (metrics holding timings)."""
    return {k: v for k, v in out.items() if k != "rollout_metrics"}


def test_training_steps_and_evaluation(tmp_path, tok, db_root):
    """Two training steps (3 prompts x 2) and an evaluation of 5 prompts x 1 (a batch size 2 does not
    divide): one trajectory per trajectory id, exact coordinates, SkyRL's rewards and stop reasons,
    the loop's turns (SQL tool calls with the env's observation), real times."""
    cfg = config(db_root)
    gen = generator(cfg, tok)
    train1, train2 = batch(["q0", "q1", "q2"], 2, 1, "train"), batch(["q3", "q0", "q1"], 2, 2, "train")
    evals = batch(["q0", "q1", "q2", "q3", "q4"], 1, 2, "eval")
    outputs, trajs = traced(tmp_path, gen, [train1, train2, evals])
    assert len(trajs) == 6 + 6 + 5
    by = {(t.step, t.validate, t.group_id, t.rollout_n): t for t in trajs}
    for b, out in zip((train1, train2, evals), outputs):
        meta = b["batch_metadata"]
        seen = []
        for i, tid in enumerate(b["trajectory_ids"]):
            t = by[(meta.global_step, meta.training_phase == "eval", tid.instance_id, tid.repetition_id)]
            if tid.instance_id not in seen:
                seen.append(tid.instance_id)
            assert t.sample_index == seen.index(tid.instance_id)  # dense, in order of first arrival
            assert t.reward == float(out["rewards"][i] if not isinstance(out["rewards"][i], list)
                                     else sum(out["rewards"][i]))
            assert t.finish_reason == out["stop_reasons"][i]
            assert t.extra["env_class"] == "text2sql"
    right = by[(1, False, "q0", 0)]
    assert right.reward == 1.0 and by[(1, False, "q1", 1)].reward == 0.0
    # the loop's turns: a generation, the SQL tool's observation, the final generation
    assert [(s.kind, s.name) for s in right.spans] == [
        ("rollout", "skyrl_trajectory"), ("generation", "generation"), ("tool", "SQLEnv"), ("generation", "generation")]
    assert [m["role"] for m in right.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert "book" in right.messages[3]["content"]
    assert right.messages[4]["content"] == f"<think>That is it.</think><solution>{GOLD}</solution>"
    assert right.spans[1].attributes["rtrace.response_text"] == f"<think>Look at the prices.</think><sql>{GOLD}</sql>"
    # real times: each span lasts what it lasted, in order
    gen1, tool, gen2 = right.spans[1:]
    assert right.root.attributes.get("rtrace.synthetic_times") is None
    assert gen1.end_ns <= tool.start_ns <= tool.end_ns <= gen2.start_ns and gen1.duration_ms >= 1.0
    # the loop is token in, token out: no health finding but the truncation
    assert right.health == []
    long = by[(1, False, "q2", 0)]
    assert long.finish_reason == "length" and [f["check"] for f in long.health] == ["generation"]


def test_step_wise_rows_are_grouped_by_trajectory(tmp_path, tok, db_root):
    """step_wise_trajectories: SkyRL outputs one row per turn; rtrace writes one trajectory per
    trajectory id with all its turns, its reward the sum of the step rows' rewards."""
    gen = generator(config(db_root, step_wise_trajectories=True), tok)
    b = batch(["q0", "q1"], 2, 3, "train")
    (out,), trajs = traced(tmp_path, gen, [b])
    assert len(out["response_ids"]) == 8  # 4 trajectories x 2 turns
    assert sorted((t.group_id, t.rollout_n) for t in trajs) == [("q0", 0), ("q0", 1), ("q1", 0), ("q1", 1)]
    for t in trajs:
        rows = [i for i, tid in enumerate(out["trajectory_ids"]) if (tid.instance_id, tid.repetition_id) == (
            t.group_id, t.rollout_n)]
        assert len(rows) == 2 and t.reward == sum(sum(out["rewards"][i]) for i in rows)
        assert [s.kind for s in t.spans[1:]] == ["generation", "tool", "generation"]
        assert t.root.attributes["rl.loss_tokens"] == sum(sum(out["loss_masks"][i]) for i in rows)


def test_overlong_filtering_keeps_the_turns(tmp_path, tok, db_root):
    """apply_overlong_filtering zeroes a truncated response's loss mask: the trajectory still
    shows the policy's turns (from the loop, not read off the mask as tool turns), each with
    rl.loss_tokens 0: nothing of it is trained on."""
    gen = generator(config(db_root, apply_overlong_filtering=True), tok)
    (out,), trajs = traced(tmp_path, gen, [batch(["q2", "q0"], 1, 1, "train")])
    long = next(t for t in trajs if t.group_id == "q2")
    i = [tid.instance_id for tid in out["trajectory_ids"] or batch(["q2", "q0"], 1, 1, "train")["trajectory_ids"]
         ].index("q2")
    assert sum(out["loss_masks"][i]) == 0
    gens = long.spans_of_kind("generation")
    assert len(gens) == 3  # every turn ran to the length limit, up to max_turns
    for g in gens:
        assert g.attributes["rtrace.role"] == "assistant" and g.attributes["gen_ai.usage.output_tokens"] == MAX_TOKENS
        assert g.attributes["rl.loss_tokens"] == 0
    assert long.root.attributes["rl.loss_tokens"] == 0
    assert long.verdict() == "truncated"
    right = next(t for t in trajs if t.group_id == "q0")
    assert right.root.attributes["rl.loss_tokens"] > 0


def test_single_turn_mode_is_healthy(tmp_path, tok, db_root):
    """use_conversation_multi_turn=False (replies and observations in one assistant message, the
    reply's end token dropped to continue it): the loop's turns, and no health finding for it."""
    gen = generator(config(db_root, use_conversation_multi_turn=False), tok)
    (out,), trajs = traced(tmp_path, gen, [batch(["q0"], 2, 1, "train")])
    for t in trajs:
        assert [s.kind for s in t.spans[1:]] == ["generation", "tool", "generation"]
        assert t.health == [] and t.reward == 1.0


def test_outputs_unchanged_by_tracing(tmp_path, tok, db_root):
    """SkyRL's output is the same with rtrace tracing, with rtrace installed but off, and with
    SkyRL's own methods (rtrace's wrappers taken out)."""
    from skyrl_train.generators.skyrl_gym_generator import SkyRLGymGenerator
    from skyrl_train.inference_engines.inference_engine_client import InferenceEngineClient

    from tests.frameworks import unpatched

    cfg = config(db_root)
    b = batch(["q0", "q1", "q2"], 2, 1, "train")
    (on,), _ = traced(tmp_path, generator(cfg, tok), [b])
    off = run(generator(cfg, tok), b)  # rtrace is shut down: the wrappers call straight through
    with unpatched(SkyRLGymGenerator, InferenceEngineClient):
        bare = run(generator(cfg, tok), b)
    assert plain(on) == plain(off) == plain(bare)


def test_patched_names_exist():
    """Canary: every SkyRL name rtrace.compat._skyrl_private patches exists in the installed SkyRL."""
    import importlib

    import inspect

    for name in _skyrl_private.PRIVATE_NAMES:
        module, _, path = name.partition(":")
        obj = importlib.import_module(f"skyrl_train.{module}")
        if path == "RayPPOTrainer.global_step":  # an instance attribute: in the source
            assert "self.global_step = 0" in inspect.getsource(obj.RayPPOTrainer.__init__)
            continue
        for part in path.split("."):
            obj = getattr(obj, part)
        assert callable(obj), name
    # the trainers publish after each step, at the global_step of the step just trained
    from skyrl_train.fully_async_trainer import FullyAsyncRayPPOTrainer
    from skyrl_train.trainer import RayPPOTrainer

    train = inspect.getsource(RayPPOTrainer.train)
    assert train.count("ray.get(self.sync_policy_weights_to_inference_engines())") == 2
    assert train.index("ray.get(self.sync_policy_weights_to_inference_engines())", train.index("# 7. sync")) < \
        train.rindex("self.global_step += 1")
    assert "await self.async_sync_policy_weights_to_inference_engines()" in inspect.getsource(
        FullyAsyncRayPPOTrainer.train)


def test_a_client_of_another_class_is_traced_too(tmp_path, tok, db_root):
    """A client whose class rtrace did not patch (skyrl 0.4's RemoteInferenceClient lives
    under skyrl.backends; a team's own client): its engine calls are generation spans all
    the same (wrapped on the generator's instance), with SkyRL's outputs unchanged."""
    from skyrl_train.generators.skyrl_gym_generator import SkyRLGymGenerator

    class OwnClient:  # no InferenceEngineClient anywhere: it calls the engine itself
        def __init__(self):
            self.engine = ScriptedEngine(tok)

        async def generate(self, input_batch, *args, **kwargs):
            return await self.engine.generate(input_batch)

    cfg = config(db_root)

    def own():
        return SkyRLGymGenerator(cfg.generator, cfg.environment.skyrl_gym, OwnClient(), tok, "tiny-sql")

    b = batch(["q1"], 2, 1, "train")
    expected = plain(run(own(), b))
    outputs, trajs = traced(tmp_path, own(), [b])
    assert plain(outputs[0]) == expected
    assert sorted(t.rollout_n for t in trajs) == [0, 1]
    for t in trajs:  # each engine call a generation with its real time, the environment's turn between
        assert [s.kind for s in t.spans] == ["rollout", "generation", "tool", "generation"]
        assert [m["role"] for m in t.messages] == ["system", "user", "assistant", "user", "assistant"]
        assert all(s.end_ns - s.start_ns > 1000 for s in t.spans)


def test_evaluation_with_several_samples_over_several_batches(tmp_path, tok, db_root):
    """eval_n_samples_per_prompt > 1, and one step's evaluation split into two generate() calls:
    every trajectory id is one validation trajectory, sample indices dense across the batches
    (no two share coordinates), rollout_n the repetition."""
    gen = generator(config(db_root), tok)
    first = batch(["q3", "q4"], 3, 7, "eval")  # a step no other test evaluates (indices are per step)
    second = batch(["q1", "q3"], 3, 7, "eval")  # q3 again: the same prompt, its samples 3..5 here
    for tid in second["trajectory_ids"]:
        if tid.instance_id == "q3":
            tid.repetition_id += 3
    _, trajs = traced(tmp_path, gen, [first, second])
    assert all(t.validate and t.step == 7 for t in trajs)
    got = sorted((t.group_id, t.sample_index, t.rollout_n) for t in trajs)
    assert got == sorted([("q3", 0, r) for r in range(6)] + [("q4", 1, r) for r in range(3)]
                         + [("q1", 2, r) for r in range(3)])
    assert len({(t.sample_index, t.rollout_n) for t in trajs}) == len(trajs) == 12


# ----------------------------------------------------------------------------- issue 31


def test_text_is_decoded_with_the_generator_s_tokenizer_by_default(tmp_path, tok, db_root, monkeypatch):
    """install() and RTRACE_EXPORTER alone (no token2text, no set_tokenizer): the generator's
    tokenizer is handed to rtrace, the spans carry decoded text; RTRACE_TOKEN2TEXT=0 keeps ids only."""
    gen = generator(config(db_root), tok)
    b = batch(["q0"], 1, 1, "train")
    for setting, decoded in ((None, True), ("0", False)):
        if setting is not None:
            monkeypatch.setenv("RTRACE_TOKEN2TEXT", setting)
        path = tmp_path / f"t{setting}.jsonl"
        rtrace.configure(exporter="jsonl", jsonl_path=str(path), export_interval_s=0.05)
        run(gen, b)
        assert rtrace.flush(30)
        rtrace.shutdown()
        (t,) = read_jsonl(path)
        first = t.spans_of_kind("generation")[0]
        if decoded:
            assert first.attributes["rtrace.response_text"] == f"<think>Look at the prices.</think><sql>{GOLD}</sql>"
            assert "book" in t.spans_of_kind("tool")[0].attributes["rtrace.response_text"]
        else:
            assert "rtrace.response_text" not in first.attributes and first.response_ids


def generate_all(db_root, tok_dir, batches):
    """What the trainer's process does (a Ray worker in the doc's form): the generator with the
    tokenizer loaded from ``tok_dir``, every batch generated; rtrace flushed (Ray runs no atexit)."""
    from transformers import AutoTokenizer

    gen = generator(config(db_root), AutoTokenizer.from_pretrained(tok_dir))
    outputs = [plain(run(gen, b)) for b in batches]
    rtrace.flush(30)
    return outputs


def test_the_doc_s_ray_form_through_a_collector_writes_what_one_process_writes(tmp_path, tok, db_root,
                                                                               monkeypatch):
    """docs/frameworks/skyrl.md's form: ray.init(runtime_env={"worker_process_setup_hook":
    "rtrace.compat.skyrl.install", "env_vars": collector.env}), the generator in a Ray worker:
    the collector writes, field by field (ids and times aside), what one process writes —
    SkyRL's system / user / observation messages, coordinates, rewards, and the text decoded
    with the trainer's tokenizer, which the collector loaded by the name the worker sent."""
    ray = pytest.importorskip("ray")
    from rtrace.testing import reset
    from tests.test_fidelity import _normal

    tok_dir = tmp_path / "tokenizer"
    tok.save_pretrained(tok_dir)
    # (instances whose SQL tool output reads the same in every process: see ONE_ROW)
    batches = [batch(["q5", "q6", "q2"], 2, 21, "train"), batch(["q5", "q2"], 1, 21, "eval")]

    one = tmp_path / "one.jsonl"
    rtrace.configure(exporter="jsonl", jsonl_path=str(one), export_interval_s=0.05)
    expected = generate_all(str(db_root), str(tok_dir), batches)
    assert rtrace.flush(30)
    reset()  # nothing of the first run (its tokenizer) is left in this process

    through = tmp_path / "collector.jsonl"
    collector = rtrace.start_collector(exporter="jsonl", jsonl_path=str(through), settle_s=0.2)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    monkeypatch.setenv("PYTHONPATH", root)  # Ray's workers import this module (inherited, not in env_vars)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import shutil
    import tempfile

    # (a session directory of its own: /tmp/ray is shared with every other Ray on the machine)
    ray_dir = tempfile.mkdtemp(prefix="rt-ray-")
    try:
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, _temp_dir=ray_dir,
                 runtime_env={"worker_process_setup_hook": "rtrace.compat.skyrl.install", "env_vars": collector.env})
        try:
            got = ray.get(ray.remote(generate_all).remote(str(db_root), str(tok_dir), batches), timeout=300)
        finally:
            ray.shutdown()
        assert collector.flush(30)
        stats = collector.stats()
    finally:
        collector.stop()
        shutil.rmtree(ray_dir, ignore_errors=True)
    assert got == expected  # SkyRL did the same thing both times

    def key(t):
        return (t["validate"], t["step"], t["sample_index"], t["rollout_n"])

    # an id too: the job's (collector.env's RTRACE_JOB_ID), which one process has not (_normal drops it)
    assert all(t.root.attributes["rtrace.job_id"] == collector.job_id for t in read_jsonl(through))
    a = sorted((_normal(t) for t in read_jsonl(one)), key=key)
    b = sorted((_normal(t) for t in read_jsonl(through)), key=key)
    assert len(a) == 8 and a[0]["reward"] == 1.0
    assert [m["role"] for m in a[0]["messages"]] == ["system", "user", "assistant", "user", "assistant"]
    assert all(s["attributes"].get("rtrace.response_text") for t in a for s in t["spans"] if s["kind"] != "rollout")
    assert b == a
    assert stats.get("token2text_tokenizer_unloadable", 0) == 0


# ----------------------------------------------------------------------------- issue 33: per-token values


@pytest.mark.parametrize("step_wise", [False, True], ids=["trajectory rows", "step-wise rows"])
def test_rollout_logprobs_and_loss_masks_are_on_the_turns(tmp_path, tok, db_root, step_wise):
    """sampling_params.logprobs set: SkyRL's rollout_logprobs (the engine's logprobs, 0 on the
    environment's tokens) and loss_masks are cut into the turns: each generation carries its
    reply's logprobs and loss mask, equal to SkyRL's lists at its place in the response; the
    observation's tokens are on no span. Step-wise rows (one per turn) are joined first."""
    cfg = config(db_root, step_wise_trajectories=step_wise)
    cfg.generator.sampling_params.logprobs = 0
    gen = generator(cfg, tok)
    b = batch(["q0", "q1", "q2"], 2, 1, "train")
    (out,), trajs = traced(tmp_path, gen, [b])
    assert len(trajs) == 6
    for t in trajs:
        rows = [i for i, tid in enumerate(out["trajectory_ids"] or b["trajectory_ids"])
                if (tid.instance_id, tid.repetition_id) == (t.group_id, t.rollout_n)]
        if not step_wise:
            rows = rows[:1]
        logprobs = [v for r in rows for v in out["rollout_logprobs"][r]]
        mask = [v for r in rows for v in out["loss_masks"][r]]
        pos = 0
        for span in (s for s in t.spans[1:] if s.response_ids is not None):
            k = len(span.response_ids)
            if span.kind == "generation":
                assert span.token_values["logprob"] == logprobs[pos:pos + k]
                # the engine's own values for this reply (its turn as the engine counts it)
                assert any(span.token_values["logprob"] == [engine_logprob(turn, j) for j in range(k)]
                           for turn in (1, 2, 3))
                assert span.token_values["loss_mask"] == [float(v) for v in mask[pos:pos + k]]
            else:
                assert span.token_values is None and set(logprobs[pos:pos + k]) <= {0.0}
            pos += k
        assert pos == len(logprobs) == len(mask)
        assert not [f for f in t.health if f["check"] == "token_arrays"]


def test_a_response_that_does_not_lay_out_the_turns_gets_no_values(tmp_path, tok, db_root):
    """use_conversation_multi_turn=False: SkyRL's response is not the turns' tokens end to end
    (each reply's end token dropped to continue it, one added at the end), so its lists do not
    lay out the turns: no values on them (never a shifted overlay), counted, no health finding."""
    cfg = config(db_root, use_conversation_multi_turn=False)
    cfg.generator.sampling_params.logprobs = 0
    gen = generator(cfg, tok)
    path = tmp_path / "t.jsonl"
    rtrace.configure(exporter="jsonl", jsonl_path=str(path), export_interval_s=0.05)
    out = run(gen, batch(["q0"], 2, 1, "train"))
    assert rtrace.flush(30)
    stats = rtrace.stats()
    rtrace.shutdown()
    trajs = read_jsonl(path)
    assert out["rollout_logprobs"] is not None and len(trajs) == 2
    assert stats["skyrl_token_values_unaligned"] == 2
    for t in trajs:
        assert all(s.token_values is None for s in t.spans) and t.health == []
        turns = sum(len(s.response_ids) for s in t.spans[1:] if s.response_ids is not None)
        assert len(out["response_ids"][t.rollout_n]) != turns


# ----------------------------------------------------------------------------- issue 41: weight updates


class PolicyWorker:
    """Stands for SkyRL's policy worker (a Ray actor; its NCCL weight push needs GPUs): its
    ``broadcast_to_inference_engines`` takes a while and returns None when it finished (when:
    ``finished_ns``), or fails."""

    def __init__(self, fail=False):
        self.fail = fail
        self.done_ns = None

    async def broadcast_to_inference_engines(self, inference_engine_client):
        import time

        await asyncio.sleep(0.05)
        if self.fail:
            raise RuntimeError("the weight push failed")
        self.done_ns = time.time_ns()

    def finished_ns(self):
        return self.done_ns


def policy_group(ray, fail=False):
    """SkyRL's PPORayActorGroup over one stand-in worker (its real dispatch, pass_through)."""
    from skyrl_train.distributed.dispatch import ActorInfo
    from skyrl_train.workers.worker import PPORayActorGroup

    group = object.__new__(PPORayActorGroup)
    group.actor_infos = [ActorInfo(ray.remote(PolicyWorker).remote(fail), None)]
    return group


def trainer_of(cls, group, step):
    """SkyRL's trainer with what its weight sync reads: the policy workers, the client, the step."""
    trainer = object.__new__(cls)
    trainer.policy_model, trainer.inference_engine_client, trainer.global_step = group, None, step
    return trainer


def wait_for(count, timeout=30):
    """Until rtrace took ``count`` weight updates (the synchronous trainer's mark comes from
    Ray's thread when the workers' refs resolve)."""
    import time

    deadline = time.monotonic() + timeout
    while rtrace.stats().get("weight_updates", 0) < count and time.monotonic() < deadline:
        time.sleep(0.01)
    return rtrace.stats().get("weight_updates", 0)


def test_the_trainer_s_weight_syncs_are_weight_updates(tmp_path, tok, db_root, monkeypatch):
    """SkyRL's trainers publish weights in their real methods, run as their training loops run
    them: the synchronous trainer's sync_policy_weights_to_inference_engines (before training at
    global_step 0, after step 1 at global_step 1), whose refs its caller ray.get()s, and the
    fully async trainer's awaited async_sync_policy_weights_to_inference_engines (global_step 3).
    Each is one weight update, version and step = global_step, marked once the workers'
    broadcast finished (not before), with its duration; the rollouts the generator makes next
    carry that version as policy_version and end on it. A failed push raises what Ray raises,
    and marks nothing. The refs the trainer gets are the workers' own."""
    import time

    ray = pytest.importorskip("ray")
    import shutil
    import tempfile

    from skyrl_train.fully_async_trainer import FullyAsyncRayPPOTrainer
    from skyrl_train.trainer import RayPPOTrainer

    from rtrace.exporters.jsonl import read_events

    assert RayPPOTrainer.sync_policy_weights_to_inference_engines.__rtrace_wrapped__
    assert FullyAsyncRayPPOTrainer.async_sync_policy_weights_to_inference_engines.__rtrace_wrapped__
    monkeypatch.setattr(rtrace.compat.skyrl, "_published", [None])  # this process published nothing yet
    path = tmp_path / "t.jsonl"
    ray_dir = tempfile.mkdtemp(prefix="rt-ray-")
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, _temp_dir=ray_dir)
    try:
        rtrace.configure(exporter="jsonl", jsonl_path=str(path), export_interval_s=0.05)
        gen = generator(config(db_root), tok)
        finished = []
        for step in (0, 1):
            trainer = trainer_of(RayPPOTrainer, policy_group(ray), step)
            refs = trainer.sync_policy_weights_to_inference_engines()
            assert all(isinstance(r, ray.ObjectRef) for r in refs)
            assert ray.get(refs) == [None]  # as RayPPOTrainer.train() does
            finished.append(ray.get(trainer.policy_model.actor_infos[0].handle.finished_ns.remote()))
            assert wait_for(step + 1) == step + 1
            run(gen, batch(["q0", "q1"], 2, step + 1, "train"))
        with pytest.raises(ray.exceptions.RayTaskError, match="the weight push failed"):
            ray.get(trainer_of(RayPPOTrainer, policy_group(ray, fail=True), 2).sync_policy_weights_to_inference_engines())
        before = time.time_ns()
        asyncio.run(trainer_of(FullyAsyncRayPPOTrainer, policy_group(ray), 3).async_sync_policy_weights_to_inference_engines())
        after = time.time_ns()
        run(gen, batch(["q3"], 2, 4, "train"))
        time.sleep(0.5)  # (a mark of the failed push would have come by now)
        assert rtrace.flush(30)
        stats = rtrace.stats()
        rtrace.shutdown()
    finally:
        ray.shutdown()
        shutil.rmtree(ray_dir, ignore_errors=True)
    events = read_events(path)
    assert [(e.kind, e.version, e.step) for e in events] == [("weight_update", v, v) for v in (0, 1, 3)]
    assert all(set(e.attributes) == {"duration_ms"} and e.attributes["duration_ms"] > 0 for e in events)
    assert [e.time_ns >= done for e, done in zip(events, finished)] == [True, True]
    assert before <= events[2].time_ns <= after
    assert stats["weight_updates"] == 3 and stats.get("internal_errors", 0) == 0
    trajs = read_jsonl(path)
    assert sorted({(t.step, t.policy_version) for t in trajs}) == [(1, 0), (2, 1), (4, 3)]
    assert len(trajs) == 10
    assert all(t.policy_version_end == t.policy_version and t.crossed_update is False for t in trajs)


def test_without_a_trainer_the_generator_s_rollouts_have_no_version(tmp_path, tok, db_root):
    """The generator alone (no weight ever published in this process): no policy_version, as before."""
    _, trajs = traced(tmp_path, generator(config(db_root), tok), [batch(["q0"], 2, 1, "train")])
    assert [t.policy_version for t in trajs] == [None, None]
