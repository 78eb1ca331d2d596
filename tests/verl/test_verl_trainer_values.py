"""veRL's trainer values on the traced rollouts (issue #33), checked against veRL's own tensors.

One step the way ``RayPPOTrainer.fit`` runs it, on CPU, with veRL's own code: the agent loop
(``AgentLoopWorker.generate_sequences`` -> ``ToolAgentLoop``) against a server whose log probs
come from a tiny random-weight qwen2 decoded token by token with a KV cache (verl_app.ModelServer),
then the trainer's ``_balance_batch`` (two data-parallel ranks: the rows are reordered),
``_compute_old_log_prob`` (veRL's FSDP engine code recomputing the log probs and the entropy
with the same weights, verl_app.InProcessActor), ``compute_advantage`` (GRPO) and
``_update_actor``. ``rtrace.compat.verl.install()`` (conftest.py) wrapped ``RayPPOTrainer``:
nothing else hands the values over. Each trajectory read back from JSONL carries, on each
generation, veRL's tensors of its own row: the server's ``log_probs`` (``logprob``, equal to
the batch's ``rollout_log_probs``), ``old_log_probs``, the entropy, the advantages and the
response mask; the mismatch rtrace computes equals the one computed from veRL's tensors.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("verl")
torch = pytest.importorskip("torch")

import rtrace  # noqa: E402
from rtrace.compat import _verl_private  # noqa: E402
from rtrace.compat.verl import RolloutTraceConfig  # noqa: E402
from rtrace.compat.verl_trainer import rollout_numbers  # noqa: E402
from rtrace.exporters.jsonl import read_jsonl  # noqa: E402
from tests.token_reference import mismatch_of  # noqa: E402
from rtrace.trajectory import token_list  # noqa: E402

import verl_app as app  # noqa: E402  (tests/verl on sys.path: see conftest.py)

pytestmark = pytest.mark.integration

STEP = 3
SAMPLES = [0, 1, 2, 3]
N = 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = app.write_model_dir(tmp_path_factory.mktemp("model"))
    app.write_model_weights(path)
    return path


@pytest.fixture(scope="module")
def model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from verl.utils import hf_tokenizer

    return hf_tokenizer(str(model_dir))


@pytest.fixture(autouse=True)
def fresh(monkeypatch, tmp_path):
    RolloutTraceConfig.reset()
    monkeypatch.setenv("RTRACE_JSONL_PATH", str(tmp_path / "verl.jsonl"))
    monkeypatch.setenv("RTRACE_EXPORT_INTERVAL_S", "0.05")
    # the rollouts end before the trainer computes its values: they wait for them
    monkeypatch.setenv("RTRACE_AWAIT_ANNOTATIONS", "old_logprob")
    monkeypatch.setenv("RTRACE_ANNOTATION_TIMEOUT_S", "120")
    yield
    RolloutTraceConfig.reset()
    rtrace.shutdown()


def step_config(model_dir, tmp_path):
    return app.compose_config(model_dir, app.write_tool_config(tmp_path / "tools.yaml"), [
        *app.trace_overrides(token2text=False), "actor_rollout_ref.rollout.calculate_log_probs=True",
        f"actor_rollout_ref.rollout.n={N}", "algorithm.adv_estimator=grpo"])


def rollout(model_dir, tokenizer, model, tmp_path):
    """The step's rollouts: (the generated batch, its responses and index as generated)."""
    worker, _ = app.make_worker(step_config(model_dir, tmp_path), tokenizer, app.ModelServer(tokenizer, model))
    generated = asyncio.run(worker.generate_sequences(app.make_batch(SAMPLES, n=N, step=STEP)))
    before = {k: generated.batch[k].clone() for k in ("responses", "rollout_log_probs")}
    generated.non_tensor_batch["uid"] = np.array([f"uid-{i}" for i in generated.non_tensor_batch["index"]],
                                                 dtype=object)
    return generated, before, generated.non_tensor_batch["index"].copy()


def one_step(model_dir, tokenizer, model, tmp_path):
    """Rollout then the trainer's step, in this process: (generated responses and logprobs,
    their index, the trained batch, the entropy), flushed."""
    generated, before, index_before = rollout(model_dir, tokenizer, model, tmp_path)
    trained, entropy = app.train_step(app.make_trainer(step_config(model_dir, tmp_path), model, STEP), generated)
    assert rtrace.flush(60)
    return before, index_before, trained, entropy


def expected_coordinates(index):
    """veRL's own numbering of the generated rows (the agent loop's get_trajectory_info)."""
    from verl.experimental.agent_loop.agent_loop import get_trajectory_info

    info = asyncio.run(get_trajectory_info(STEP, list(index), False))
    return [(t["sample_index"], t["rollout_n"]) for t in info]


def check_values(before, index_before, trained, entropy, trajs):
    """Each trajectory's generations carry veRL's tensors of its own row; returns the largest
    |Δlogprob| seen. The mismatch equals the one of veRL's tensors, in one process and through
    a collector alike (the values travel as float32 bytes)."""
    coords = expected_coordinates(index_before)
    assert len(trajs) == len(coords) == len(SAMPLES) * N
    # the trained batch is the generated one reordered: find each trajectory's row by its
    # response (the rollouts of a group differ, verl_app.ModelServer)
    responses = [r.tolist() for r in trained.batch["responses"]]
    assert responses != [r.tolist() for r in before["responses"]], "the batch was not reordered"
    worst = 0.0
    for t in trajs:
        generated_row = coords.index((t.sample_index, t.rollout_n))
        row = responses.index(before["responses"][generated_row].tolist())
        assert responses.count(responses[row]) == 1
        mask = trained.batch["response_mask"][row]
        tensors = {"logprob": trained.batch["rollout_log_probs"][row],
                   "old_logprob": trained.batch["old_log_probs"][row],
                   "advantage": trained.batch["advantages"][row], "loss_mask": mask, "entropy": entropy[row]}
        # each generation's slice of the row: its prompt is the first one plus the response so far
        gens = sorted(t.spans_of_kind("generation"), key=lambda s: s.start_ns)
        base, real = len(gens[0].prompt_ids), int(trained.batch["attention_mask"][row, -mask.numel():].sum())
        covered = torch.zeros(real, dtype=torch.bool)
        for gen in gens:
            off, k = len(gen.prompt_ids) - base, len(gen.response_ids)
            assert set(gen.token_values) == set(tensors)
            for name, tensor in tensors.items():
                assert gen.token_values[name] == token_list(tensor[off:off + k].float().numpy()), (name, t.rollout_n)
            assert gen.token_values["loss_mask"] == [1.0] * k
            covered[off:off + k] = True
        assert len(gens) == 2 and not covered.all()  # the tool's tokens: in the row, on no generation,
        assert not mask[:real][~covered].any()        # and not trained on
        expected = mismatch_of(tensors["logprob"][:real], tensors["old_logprob"][:real], mask[:real])
        for key, value in expected.items():
            assert t.annotations[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
        assert not [f for f in t.health if f["check"] in ("token_arrays", "logprob_mismatch")], t.health
        worst = max(worst, t.annotations["logprob_mismatch_max"])
    return worst


def test_the_trainer_s_values_on_each_rollout(model_dir, tokenizer, model, tmp_path, capsys):
    """One process (the agent loop and the trainer in this process, trace.backend=jsonl)."""
    before, index, trained, entropy = one_step(model_dir, tokenizer, model, tmp_path)
    assert trained.batch["advantages"].abs().sum() > 0
    worst = check_values(before, index, trained, entropy, read_jsonl(tmp_path / "verl.jsonl"))
    with capsys.disabled():
        print(f"\nveRL, same weights, KV-cached sampler vs veRL's recomputed old_log_probs: "
              f"max |Δlogprob| {worst:.3g}")
    assert worst < 1e-5


#: The trainer in a process of its own (veRL's TaskRunner is a Ray actor): started with the
#: collector's environment and install() (Ray's setup hook), nothing else.
DRIVER = """
import os, sys, torch
sys.path[:0] = [{here!r}, os.path.dirname(os.path.dirname({here!r}))]  # verl_app; the repo (tests.*)
import rtrace, rtrace.compat.verl
rtrace.compat.verl.install()
import verl_app as app
from test_verl_trainer_values import STEP, step_config
from pathlib import Path
from transformers import AutoModelForCausalLM
batch = torch.load({batch!r}, weights_only=False)
model = AutoModelForCausalLM.from_pretrained({model_dir!r}, dtype=torch.float32)
trained, entropy = app.train_step(app.make_trainer(step_config(Path({model_dir!r}), Path({tmp!r})), model, STEP), batch)
assert rtrace.flush(60)
print("sent", rtrace.stats().get("annotations_sent"))
torch.save({{"trained": trained, "entropy": entropy}}, {out!r})
"""


def test_through_the_job_s_collector(model_dir, tokenizer, model, tmp_path, monkeypatch, capsys):
    """veRL's production topology: the job's collector (started in the launcher: here), the
    agent loop's worker streaming its rollouts to it (collector.env), and the trainer in a
    process of its own whose environment is collector.env and which ran install(): the
    trainer's values reach the collector and join the rollouts there. The values cross the
    wire as float32 bytes (docs/token-values.md), veRL's own dtype: the collector's mismatch
    equals the one of one process, exactly."""
    pytest.importorskip("grpc")
    collector = rtrace.start_collector(exporter="jsonl", jsonl_path=str(tmp_path / "verl.jsonl"), settle_s=0.2,
                                       await_annotations="old_logprob", annotation_timeout_s=120)
    try:
        for key, value in collector.env.items():
            monkeypatch.setenv(key, value)
        generated, before, index = rollout(model_dir, tokenizer, model, tmp_path)
        assert rtrace.flush(60)
        rtrace.shutdown()
        torch.save(generated, tmp_path / "batch.pt")
        code = DRIVER.format(here=os.path.dirname(__file__), batch=str(tmp_path / "batch.pt"),
                             model_dir=str(model_dir), tmp=str(tmp_path), out=str(tmp_path / "trained.pt"))
        env = {k: v for k, v in os.environ.items() if k != "RTRACE_JSONL_PATH"}
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.split()[-2:] == ["sent", str(len(SAMPLES) * N)]
        assert collector.flush(60)
    finally:
        collector.stop()
    saved = torch.load(tmp_path / "trained.pt", weights_only=False)
    trajs = read_jsonl(tmp_path / "verl.jsonl")
    check_values(before, index, saved["trained"], saved["entropy"], trajs)
    with capsys.disabled():
        worst = max(t.annotations["logprob_mismatch_max"] for t in trajs)
        print(f"\nveRL through a collector: max |Δlogprob| {worst:.3g} (the wire rounds to 6 significant digits)")


def test_a_trainer_process_without_a_collector_is_left_alone(monkeypatch, caplog):
    """The trainer's process with per-worker sinks in its environment (RTRACE_EXPORTER=jsonl
    for every Ray worker) and rtrace not configured there: the hook configures nothing (no
    sink of its own in the driver, where no rollout is), hands nothing over, and says once
    that the values need the job's collector."""
    import logging

    import rtrace.testing
    from rtrace.compat import verl_trainer
    from rtrace.instrumentation import _state

    rtrace.testing.reset()
    monkeypatch.setenv("RTRACE_EXPORTER", "jsonl")
    with caplog.at_level(logging.WARNING):
        assert not verl_trainer._ready() and not verl_trainer._ready()
    assert _state.runtime is _state.UNSET
    said = [r.getMessage() for r in caplog.records if "not configured in veRL's trainer process" in r.getMessage()]
    assert len(said) == 1 and "through the job's collector (collector.env in the driver's environment" in said[0]


def test_veRL_s_default_v1_trainer_traces_no_rollout(model_dir, tmp_path):
    """veRL 0.9.1's default trainer is the v1 (TransferQueue) one, whose agent loop runs every
    rollout with tracing off (a TODO in its code): docs/frameworks/verl.md says to run the
    trainer ray_trainer.py with trainer.use_v1=False."""
    from pathlib import Path

    import verl

    assert step_config(model_dir, tmp_path).trainer.use_v1 is True
    source = (Path(verl.__file__).parent / "trainer" / "ppo" / "v1" / "agent_loop_tq.py").read_text()
    assert "# TODO(wuxibin): add trace support\n            trace_this_sample = False" in source


@pytest.mark.parametrize("index, workers, expected", [
    ([5, 5, 7, 7], None, [0, 1, 0, 1]),          # one worker: consecutive rows of one index
    ([5, 5, 5, 5], 2, [0, 1, 0, 1]),             # two workers: each chunk counts from 0, as veRL does
    ([5, 5, 7, 7, 7, 9], 4, [0, 1, 0, 1, 2, 0]),  # a batch the workers do not divide: not chunked
])
def test_rollout_numbers_are_veRL_s(index, workers, expected):
    """rollout_n of each row as veRL's agent loop numbers it (get_trajectory_info per worker chunk)."""
    from verl.experimental.agent_loop.agent_loop import get_trajectory_info

    assert rollout_numbers(index, workers) == expected
    size = len(index) // workers if workers and len(index) % workers == 0 else len(index)
    chunks = [index[i:i + size] for i in range(0, len(index), size)]
    veRL = [t["rollout_n"] for c in chunks for t in asyncio.run(get_trajectory_info(0, c, False))]
    assert veRL == expected


def test_private_names_exist():
    """Canary: every veRL private name rtrace.compat._verl_private lists exists in the installed
    veRL (global_steps on a trainer), and install() wrapped the trainer's methods."""
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    import importlib

    for name in _verl_private.PRIVATE_NAMES:
        module, _, path = name.partition(":")
        if module != _verl_private.TRAINER_MODULE:  # the weight sync (test_the_weight_sync_is_where_...)
            obj = importlib.import_module(module)
            for part in path.split("."):
                obj = getattr(obj, part)
            assert callable(obj), name
            continue
        cls_name, attr = path.split(".")
        assert module == _verl_private.TRAINER_MODULE and cls_name == "RayPPOTrainer"
        assert hasattr(RayPPOTrainer, attr) or attr == "global_steps", name
    assert "self.global_steps" in open(sys.modules[_verl_private.TRAINER_MODULE].__file__).read()
    for attr in ("_balance_batch", "_compute_old_log_prob", "_update_actor"):
        assert getattr(getattr(RayPPOTrainer, attr), "__rtrace_wrapped__", False), attr


def test_install_wraps_the_trainer_in_a_fresh_interpreter():
    """install() before veRL's trainer module is imported (Ray's setup hook in the driver) wraps
    RayPPOTrainer when it is; the module's loader still gives its source."""
    code = ("import inspect, rtrace.compat.verl as v; v.install(); "
            "from verl.trainer.ppo import ray_trainer; "
            "print(ray_trainer.RayPPOTrainer._update_actor.__rtrace_wrapped__, "
            "'def fit' in inspect.getsource(ray_trainer))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), ) if p))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["True", "True"]


# ----------------------------------------------------------------------------- issue 41: weight updates


class ActorGroup:
    """Stands for veRL's actor worker group (FSDP workers, whose weight push needs GPUs): its
    ``update_weights`` returns the workers' Ray refs, each finishing after a while (or failing);
    it notes the thread it was called on."""

    def __init__(self, ray, fail=False):
        self.ray, self.fail, self.threads, self.done = ray, fail, [], []

    def update_weights(self, global_steps=None, mode=None):
        import threading

        @self.ray.remote
        def push(fail):
            import time

            time.sleep(0.05)
            if fail:
                raise RuntimeError("the weight push failed")
            return time.time_ns()

        self.threads.append(threading.get_ident())
        refs = [push.remote(self.fail)]
        self.done.append(refs[0])
        return refs


def test_each_weight_sync_to_the_replicas_is_a_weight_update(tmp_path):
    """veRL's CheckpointEngineManager (the naive backend, a real Ray) as its trainers call it:
    fit's update_weights(0) before training and update_weights(global_steps) after a step, from
    sync code; the fully async trainer's `await ...update_weights(global_steps=v)` from async
    code (veRL's auto_await still awaits it in the caller's loop: the push runs on the caller's
    thread, not in a pool). Each is one weight update marked when it returned (after the
    workers' push finished): version and step = global_steps, with its duration. A call
    without global_steps marks nothing; a failed push raises what Ray raises, marks nothing,
    and the return values are veRL's."""
    import threading

    ray = pytest.importorskip("ray")
    from verl.checkpoint_engine import CheckpointEngineManager
    from verl.workers.config import CheckpointEngineConfig

    from rtrace.exporters.jsonl import read_events

    assert CheckpointEngineManager.update_weights.__rtrace_wrapped__
    rtrace.configure(exporter="jsonl", jsonl_path=str(tmp_path / "w.jsonl"), export_interval_s=0.05)
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        group = ActorGroup(ray)
        manager = CheckpointEngineManager(config=CheckpointEngineConfig(backend="naive"), actor_wg=group, replicas=[])
        assert manager.update_weights(0) == {} and manager.update_weights(global_steps=1) == {}

        async def fully_async():
            return await manager.update_weights(global_steps=2)

        assert asyncio.run(fully_async()) == {}
        assert manager.update_weights() == {}  # (v1's trainer_base calls it so)
        assert group.threads == [threading.get_ident()] * 4
        finished = ray.get(group.done)
        broken = CheckpointEngineManager(config=CheckpointEngineConfig(backend="naive"), actor_wg=ActorGroup(ray, True),
                                         replicas=[])
        with pytest.raises(ray.exceptions.RayTaskError, match="the weight push failed"):
            broken.update_weights(3)
    finally:
        ray.shutdown()
    assert rtrace.flush(30)
    events = read_events(tmp_path / "w.jsonl")
    assert [(e.kind, e.version, e.step) for e in events] == [("weight_update", v, v) for v in (0, 1, 2)]
    assert all(set(e.attributes) == {"duration_ms"} and e.attributes["duration_ms"] > 0 for e in events)
    assert all(e.time_ns >= done for e, done in zip(events, finished))


def test_the_weight_sync_is_where_the_trainer_publishes():
    """Canary: fit calls checkpoint_manager.update_weights(self.global_steps) before training and
    after each actor update; the method takes global_steps; auto_await wraps it."""
    import inspect

    from verl.checkpoint_engine import CheckpointEngineManager
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    fit = inspect.getsource(RayPPOTrainer.fit)
    assert fit.count("self.checkpoint_manager.update_weights(self.global_steps)") == 3
    original = CheckpointEngineManager.update_weights.__wrapped__
    assert list(inspect.signature(original).parameters) == ["self", "global_steps"]
    assert inspect.iscoroutinefunction(original.__wrapped__)  # auto_await's functools.wraps
