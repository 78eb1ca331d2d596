"""rtrace.compat.areal against the real AReaL: its RemoteSGLangEngine over real HTTP to a small
scripted SGLang server on 127.0.0.1 (the only stand-in), its WorkflowExecutor,
GroupedRolloutWorkflow, RLVRWorkflow with gsm8k_reward_fn, and MultiTurnWorkflow.

``rtrace.compat.areal.install()`` and nothing else: two training steps with GRPO groups of
3 (``prepare_batch`` as ``PPOTrainer.train`` calls it, ``set_version`` between them), an
evaluation (``submit(is_eval=True)``), a multi-turn rollout whose first answer is wrong (the
retry prompt is a turn of the conversation), and ``group_size == 1``. Each trajectory is
checked against AReaL's own output: one per episode, exact coordinates, the reward AReaL
computed, the generation's ids and stop reason; AReaL's outputs unchanged by tracing.

Runs in its own venv (``make test-frameworks`` builds ``.venv-areal``); skipped without AReaL.
"""

from __future__ import annotations

import copy
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

pytest.importorskip("areal", reason="make test-frameworks runs this in .venv-areal")
os.environ.setdefault("AREAL_SPMD_MODE", "1")

import rtrace  # noqa: E402
import rtrace.compat.areal  # noqa: E402
from rtrace.compat import _areal_private  # noqa: E402
from rtrace.exporters.jsonl import read_jsonl  # noqa: E402

pytestmark = pytest.mark.integration

RIGHT, WRONG = "The answer is \\boxed{42}.", "The answer is \\boxed{41}."


@pytest.fixture(scope="module")
def tok():
    """rtrace's offline ChatML tokenizer, its end token <|im_end|> as a Qwen-2.5 instruct model's."""
    from rtrace.demo import build_tokenizer

    tok = copy.deepcopy(build_tokenizer())
    tok.eos_token = "<|im_end|>"
    return tok


def logprob(i):
    """The scripted engine's logprob of a reply's i-th token (a different one per position)."""
    return round(-0.1 - 0.013 * i, 6)


@pytest.fixture(scope="module")
def server(tok):
    """SGLang's /health and /generate on 127.0.0.1, scripted: "Q1" (and any retry: AReaL asks to "try to answer it again") answers 42,
    the other questions 41."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"ok")

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            text = tok.decode(body["input_ids"], skip_special_tokens=False)
            reply = RIGHT if ("Q1" in text or "answer it again" in text) else WRONG
            ids = tok(reply, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            out = json.dumps({"meta_info": {
                "finish_reason": {"type": "stop"}, "output_token_logprobs": [[logprob(i), t, None]
                                                                             for i, t in enumerate(ids)],
                "prompt_tokens": len(body["input_ids"]), "completion_tokens": len(ids)}}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def engine(addr):
    from areal.api.cli_args import InferenceEngineConfig
    from areal.engine.sglang_remote import RemoteSGLangEngine

    eng = RemoteSGLangEngine(InferenceEngineConfig(experiment_name=None, trial_name=None, backend="sglang:d1",
                                                   max_concurrent_rollouts=4, consumer_batch_size=2))
    eng.initialize(addr=addr)
    return eng


def items(n, prefix="Q"):
    return [{"messages": [{"role": "user", "content": f"{prefix}{i}: what is 40 + 2?"}], "answer": "42"}
            for i in range(n)]


def rlvr(tok):
    from areal.api.cli_args import GenerationHyperparameters
    from areal.reward.gsm8k import gsm8k_reward_fn
    from areal.workflow.rlvr import RLVRWorkflow

    return RLVRWorkflow(reward_fn=gsm8k_reward_fn, gconfig=GenerationHyperparameters(n_samples=1, max_new_tokens=16),
                        tokenizer=tok)


def multi_turn(tok):
    from areal.api.cli_args import GenerationHyperparameters
    from areal.reward.gsm8k import gsm8k_reward_fn
    from areal.workflow.multi_turn import MultiTurnWorkflow

    return MultiTurnWorkflow(reward_fn=gsm8k_reward_fn, gconfig=GenerationHyperparameters(n_samples=1,
                                                                                          max_new_tokens=16),
                             tokenizer=tok, max_turns=2, turn_discount=0.9)


def loader(data):
    from torchdata.stateful_dataloader import StatefulDataLoader

    return StatefulDataLoader(data, batch_size=2, collate_fn=lambda x: x)


def settle():
    """A weight update is marked at set_version: the episodes after it wait a collector's settle
    time (test_one_process_and_collector_write_the_same: 0.2 s), so that a collector has the update
    before them, as one process has (docs/timeline.md: an update marked less than the settle time
    before a rollout ended can be missed by a collector)."""
    time.sleep(0.3)


def job(server, tok):
    """What PPOTrainer.train does with the engine: 2 steps of prepare_batch (groups of 3),
    set_version after each; an evaluation; a multi-turn rollout; group_size 1. Returns AReaL's
    outputs (tensors as lists)."""
    out = {}
    train = engine(server)
    dl = loader(items(4))
    for step in (0, 1):
        out[f"train{step}"] = [{k: v.tolist() for k, v in b.items()} for b in train.prepare_batch(dl, workflow=rlvr(tok),
                                                                                                group_size=3)]
        train.pause()  # PPOTrainer: pause, update the servers' weights (actor.update_weights), set_version
        time.sleep(0.01)  # (the weight update)
        train.set_version(step + 1)
        train.resume()
        settle()
    train.destroy()
    evals = engine(server)
    evals.set_version(2)
    settle()
    for item in items(3, prefix="E"):
        evals.submit(item, workflow=rlvr(tok), group_size=1, is_eval=True)
    out["eval"] = [{k: v.tolist() for k, v in r.items()} for r in evals.wait(count=3)]
    evals.destroy()
    mt = engine(server)  # (one training engine per job in real training: these get their own versions)
    mt.set_version(5)
    settle()
    out["multi"] = [{k: v.tolist() for k, v in r.items()} for r in mt.rollout_batch(items(1, prefix="M"),
                                                                                   workflow=multi_turn(tok))]
    mt.destroy()
    single = engine(server)
    single.set_version(6)
    settle()
    out["single"] = [{k: v.tolist() for k, v in b.items()}
                     for b in single.prepare_batch(loader(items(2, prefix="S")), workflow=rlvr(tok), group_size=1)]
    single.destroy()
    return out


@pytest.fixture(scope="module")
def traced(server, tok, tmp_path_factory):
    assert rtrace.compat.areal.install()
    path = tmp_path_factory.mktemp("areal") / "t.jsonl"
    rtrace.configure(exporter="jsonl", jsonl_path=str(path), token2text=True, tokenizer=tok, export_interval_s=0.05,
                     token2text_keep_ids=True)
    out = job(server, tok)
    assert rtrace.flush(30)
    rtrace.shutdown()
    return out, read_jsonl(path), path


def _key(t):
    return (t.validate, t.step, t.sample_index, t.rollout_n)


def test_training_groups_and_steps(traced, tok):
    """Two steps of 2 prompts x 3: one trajectory per member, step = the engine version, a dense
    sample_index per task, rollout_n 0-2, the reward AReaL put in each member's row."""
    out, trajs, _ = traced
    train = sorted((t for t in trajs if not t.validate and t.step in (0, 1) and t.extra["prompt_id"].startswith("p-")
                    and "Q" in t.messages[0]["content"]), key=_key)
    assert [(t.step, t.sample_index, t.rollout_n) for t in train] == [
        (s, i, n) for s in (0, 1) for i in (0, 1) for n in range(3)]
    for step in (0, 1):
        for group in out[f"train{step}"]:
            text = tok.decode([t for t, m in zip(group["input_ids"][0], group["attention_mask"][0]) if m])
            question = next(q for q in ("Q0", "Q1", "Q2", "Q3") if q in text)
            mine = [t for t in train if t.step == step and question in t.messages[0]["content"]]
            assert sorted(t.reward for t in mine) == sorted(group["rewards"])
            assert len({t.group_id for t in mine}) == 1 and len({t.sample_index for t in mine}) == 1
    for t in train:
        (gen,) = t.spans_of_kind("generation")
        assert t.policy_version == t.step and t.finish_reason == "stop"
        assert t.messages[-1] == {"role": "assistant", "content": RIGHT if "Q1" in t.messages[0]["content"] else WRONG}
        assert t.reward == (1.0 if "Q1" in t.messages[0]["content"] else 0.0)
        assert gen.duration_ms > 0 and not t.root.attributes.get("rtrace.synthetic_times")
        assert t.health == []


def test_evaluation_is_marked(traced):
    """submit(is_eval=True): validation trajectories, one per task, step = the engine's version."""
    _, trajs, _ = traced
    evals = sorted((t for t in trajs if t.validate), key=_key)
    assert [(t.step, t.sample_index, t.rollout_n) for t in evals] == [(2, i, 0) for i in range(3)]
    assert all("E" in t.messages[0]["content"] for t in evals)


def test_multi_turn_keeps_the_retry_prompt(traced):
    """MultiTurnWorkflow: a wrong first answer, AReaL's retry prompt (token ids it appends), the
    right answer: the conversation is user, assistant, user (the retry), assistant; the reward
    is AReaL's discounted one."""
    out, trajs, _ = traced
    (t,) = [t for t in trajs if "M0" in t.messages[0]["content"]]
    assert [m["role"] for m in t.messages] == ["user", "assistant", "user", "assistant"]
    assert t.messages[1]["content"] == WRONG and t.messages[3]["content"] == RIGHT
    assert "answer it again" in t.messages[2]["content"]
    assert t.reward == pytest.approx(out["multi"][0]["rewards"][0]) == pytest.approx(0.9)
    assert len(t.spans_of_kind("generation")) == 2 and t.health == []


def test_group_size_one(traced):
    """group_size 1 (no GroupedRolloutWorkflow): each episode is a trajectory, rollout_n 0."""
    _, trajs, _ = traced
    single = sorted((t for t in trajs if "S" in t.messages[0]["content"].split(":")[0]), key=_key)
    assert [(t.rollout_n, t.validate) for t in single] == [(0, False), (0, False)]
    assert sorted(t.sample_index for t in single) == [0, 1]


def test_outputs_unchanged_by_tracing(traced, server, tok):
    """AReaL's batches are the same with tracing on and off (rtrace shut down: the patched
    methods call straight through); order aside (AReaL shuffles), value for value."""
    from rtrace.compat import _areal_private
    from tests.frameworks import unpatched

    out, _, _ = traced
    off = job(server, tok)
    with unpatched(*_areal_private.classes()):  # AReaL's own methods: the baseline without rtrace
        bare = job(server, tok)

    def canon(batches):
        return sorted(json.dumps(b, sort_keys=True) for b in batches)

    for key in out:
        assert canon(out[key]) == canon(off[key]) == canon(bare[key]), key


def test_the_engine_s_logprobs_are_on_each_generation(traced):
    """Each generation carries the engine's output logprobs as its `logprob` array, equal to the
    logprobs AReaL's workflow put in the episode's batch row (at the tokens it trains on:
    loss_mask 1, the outputs); a multi-turn episode's two generations together are its row's."""
    from rtrace.trajectory import token_list

    out, trajs, _ = traced
    rows = {}  # an episode's whole sequence -> AReaL's logprobs of its output tokens
    for key in out:
        for r in out[key]:
            for ids, lps, mask, attn in zip(r["input_ids"], r["logprobs"], r["loss_mask"], r["attention_mask"]):
                real = [k for k, a in enumerate(attn) if a]
                rows[tuple(ids[k] for k in real)] = [lps[k] for k in real if mask[k]]
    generations = 0
    for t in trajs:
        gens = sorted(t.spans_of_kind("generation"), key=lambda s: s.start_ns)
        for g in gens:
            assert g.token_values["logprob"] == [logprob(i) for i in range(len(g.response_ids))]
        areal = rows[tuple(gens[-1].prompt_ids + gens[-1].response_ids)]
        assert [v for g in gens for v in g.token_values["logprob"]] == token_list(areal)
        generations += len(gens)
    assert generations == len(trajs) + 1  # the multi-turn episode has two generations


def test_weight_updates_are_marked_where_the_trainer_sets_the_version(traced):
    """As PPOTrainer does after each step: pause the engine, update the weights, set_version(step
    + 1), resume. Each new version is one weight update, marked at set_version: version and step
    = the version (the step and policy_version of the episodes started after it), duration_ms =
    the pause up to it. The same version set on a second engine (the evaluation's) is not marked
    again; versions set without a pause carry no duration. Episodes started after an update carry
    its version and end on it; those of step 0 ended before the first."""
    from rtrace.exporters.jsonl import read_events

    _, trajs, path = traced
    events = read_events(path)
    assert [(e.kind, e.version, e.step) for e in events] == [("weight_update", v, v) for v in (1, 2, 5, 6)]
    assert [sorted(e.attributes) for e in events] == [["duration_ms"], ["duration_ms"], [], []]
    assert all(e.attributes["duration_ms"] >= 10 for e in events[:2])  # the 10 ms the update took
    at = {e.version: e.time_ns for e in events}
    for t in trajs:
        if t.policy_version == 0:
            assert t.spans[0].end_ns <= at[1]
        else:
            assert t.spans[0].start_ns >= at[t.policy_version], t.policy_version
            assert (t.policy_version_end, t.crossed_update) == (t.policy_version, False)
    assert sorted({t.policy_version for t in trajs}) == [0, 1, 2, 5, 6]


def test_patched_names_exist():
    """Canary: every AReaL name rtrace.compat._areal_private uses exists in the installed AReaL."""
    import importlib

    from areal.infra.remote_inf_engine import GroupedRolloutWorkflow

    for name in _areal_private.PRIVATE_NAMES:
        module, _, path = name.partition(":")
        obj = importlib.import_module(module)
        for part in path.split("."):
            if part == "workflow" and obj is GroupedRolloutWorkflow:
                obj = GroupedRolloutWorkflow(object(), 2, None)
            obj = getattr(obj, part)


# ----------------------------------------------------------------------------- issue 31


def test_the_switch_alone_writes_readable_text(server, tok, tmp_path, monkeypatch):
    """RTRACE_EXPORTER=jsonl and install(), nothing else: the workflow's tokenizer is handed to
    rtrace, every message is text (no "[17 tokens, not decoded ...]"); RTRACE_TOKEN2TEXT=0 still
    turns decoding off."""
    assert rtrace.compat.areal.install()
    for setting in (None, "0"):
        path = tmp_path / f"t{setting}.jsonl"
        monkeypatch.setenv("RTRACE_EXPORTER", "jsonl")
        monkeypatch.setenv("RTRACE_JSONL_PATH", str(path))
        if setting is not None:
            monkeypatch.setenv("RTRACE_TOKEN2TEXT", setting)
        eng = engine(server)
        eng.set_version(3)
        eng.rollout_batch(items(2, prefix="T"), workflow=rlvr(tok))
        eng.destroy()
        assert rtrace.flush(30)
        rtrace.shutdown()
        trajs = read_jsonl(path)
        assert len(trajs) == 2
        for t in trajs:
            if setting is None:
                assert t.messages[-1] == {"role": "assistant", "content": WRONG}
                assert not any("not decoded" in m["content"] for m in t.messages)
            else:
                assert "not decoded" in t.messages[-1]["content"]
        from rtrace.testing import reset

        reset()  # the tokenizer handed in by the first run is forgotten


def test_one_process_and_collector_write_the_same(server, tok, tmp_path):
    """The job both ways — JSONL in this process, and through rtrace.start_collector
    (RTRACE_EXPORTER=collector) — writes the same records, field by field (ids and times aside):
    groups, evaluation, the multi-turn retry, rewards, decoded text."""
    from tests.test_fidelity import _normal  # needs grpc: the otlp extra

    assert rtrace.compat.areal.install()

    def run():
        job(server, tok)
        assert rtrace.flush(30)
        rtrace.shutdown()

    one = tmp_path / "one.jsonl"
    rtrace.configure(exporter="jsonl", jsonl_path=str(one), export_interval_s=0.05)
    run()
    through = tmp_path / "collector.jsonl"
    collector = rtrace.start_collector(exporter="jsonl", jsonl_path=str(through), settle_s=0.2)
    try:
        rtrace.configure(exporter="collector", collector_endpoint=collector.endpoint, export_interval_s=0.05)
        run()
        assert collector.flush(30)
    finally:
        collector.stop()

    def key(t):  # what the episode was, not when it ran (AReaL runs a step's tasks concurrently)
        return (t["validate"], t["step"], t["sample_index"], t["rollout_n"], json.dumps(t["messages"]))

    def normal(t):
        # a rollout that ended before the job's first weight update is "nothing known" (None) or
        # "none crossed" (False) as the pipeline had or had not taken that update in when it
        # completed the rollout: one process at once, a collector after its settle time
        out = _normal(t)
        if out["crossed_update"] is None and out["policy_version_end"] is None:
            out["crossed_update"] = False
        return out

    a = sorted((normal(t) for t in read_jsonl(one)), key=key)
    b = sorted((normal(t) for t in read_jsonl(through)), key=key)
    assert len(a) == 18 and not any("not decoded" in m["content"] for t in a for m in t["messages"])
    assert b == a
