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
import math
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


def rewards(batch):
    """veRL's token-level scores: one reward per rollout on its last response token (as its
    reward loop's rm_scores), here a function of the response's length, so that the rollouts
    of a group differ and GRPO's advantages are not all 0."""
    prompt_len = batch.batch["prompts"].shape[1]
    lengths = batch.batch["attention_mask"][:, prompt_len:].sum(dim=1)
    scores = torch.zeros_like(batch.batch["response_mask"], dtype=torch.float32)
    scores[torch.arange(len(lengths)), lengths - 1] = (lengths % 5).float() / 4
    return scores


def one_step(model_dir, tokenizer, model, tmp_path, overrides=()):
    """Rollout then the trainer's step: (generated responses and logprobs, their index, the
    trained batch, the entropy), flushed."""
    tool_config = app.write_tool_config(tmp_path / "tools.yaml")
    config = app.compose_config(model_dir, tool_config, [
        *app.trace_overrides(token2text=False), "actor_rollout_ref.rollout.calculate_log_probs=True",
        f"actor_rollout_ref.rollout.n={N}", "algorithm.adv_estimator=grpo", *overrides])
    worker, _ = app.make_worker(config, tokenizer, app.ModelServer(tokenizer, model))
    generated = asyncio.run(worker.generate_sequences(app.make_batch(SAMPLES, n=N, step=STEP)))
    before = {k: generated.batch[k].clone() for k in ("responses", "rollout_log_probs")}
    index_before = generated.non_tensor_batch["index"].copy()
    batch = generated
    batch.non_tensor_batch["uid"] = np.array([f"uid-{i}" for i in batch.non_tensor_batch["index"]], dtype=object)
    trained, entropy = app.train_step(app.make_trainer(config, model, STEP), batch, rewards)
    assert rtrace.flush(60)
    return before, index_before, trained, entropy


def expected_coordinates(index):
    """veRL's own numbering of the generated rows (the agent loop's get_trajectory_info)."""
    from verl.experimental.agent_loop.agent_loop import get_trajectory_info

    info = asyncio.run(get_trajectory_info(STEP, list(index), False))
    return [(t["sample_index"], t["rollout_n"]) for t in info]


def mismatch_of(sampler, trainer, mask):
    """The logprob_mismatch values of docs/token-values.md, from veRL's tensors."""
    keep = mask.bool()
    s, t = sampler[keep].double(), trainer[keep].double()
    delta = t - s
    return {"logprob_mismatch_k1": (s - t).mean().item(),
            "logprob_mismatch_k3": (torch.expm1(delta) - delta).mean().item(),
            "logprob_mismatch_max": delta.abs().max().item(),
            "logprob_mismatch_frac": (delta.abs() > math.log(1.05)).double().mean().item()}


def check_values(before, index_before, trained, entropy, trajs, exact=True):
    """Each trajectory's generations carry veRL's tensors of its own row; returns the largest
    |Δlogprob| seen. The mismatch equals the one of veRL's tensors (``exact``), or, through a
    collector, the one of the values as they travel (6 significant digits)."""
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
        tensors = {"logprob": trained.batch["rollout_log_probs"][row], "old_logprob": trained.batch["old_log_probs"][row],
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
        if not exact:  # the sampler's values as they came over the wire, the trainer's as given (in-process)
            sampler = torch.tensor([v for g in gens for v in g.token_values["logprob"]], dtype=torch.float32)
            keep = torch.cat([torch.arange(len(g.prompt_ids) - base, len(g.prompt_ids) - base + len(g.response_ids))
                              for g in gens])
            exact_values, expected = expected, mismatch_of(sampler, tensors["old_logprob"][keep], mask[keep])
            for key, value in exact_values.items():  # off by the rounding of -6.3 to 6 digits at most
                assert t.annotations[key] == pytest.approx(value, abs=2e-5), key
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
        print(f"\nveRL, same weights, KV-cached sampler vs veRL's recomputed old_log_probs: max |Δlogprob| {worst:.3g}")
    assert worst < 1e-5


def test_through_the_job_s_collector(model_dir, tokenizer, model, tmp_path, monkeypatch, capsys):
    """Collector mode: the agent loop's worker streams its rollouts to the job's collector
    (started in this process, as a launcher does), the trainer hands its values to the same
    collector: the same trajectories and values. The sampler's values cross the wire as JSON
    numbers of 6 significant digits (docs/token-values.md): a difference of 1e-6 between
    logprobs near -6 is below that rounding, so the collector's k1 / max differ from one
    process's by up to ~1e-5 (and equal the ones of the values it received)."""
    pytest.importorskip("grpc")
    collector = rtrace.start_collector(exporter="jsonl", jsonl_path=str(tmp_path / "verl.jsonl"), settle_s=0.2,
                                       await_annotations="old_logprob", annotation_timeout_s=120)
    try:
        for key, value in collector.env.items():
            monkeypatch.setenv(key, value)
        before, index, trained, entropy = one_step(model_dir, tokenizer, model, tmp_path)
        assert collector.flush(60)
    finally:
        collector.stop()
    trajs = read_jsonl(tmp_path / "verl.jsonl")
    check_values(before, index, trained, entropy, trajs, exact=False)
    with capsys.disabled():
        print(f"\nveRL through a collector: max |Δlogprob| {max(t.annotations['logprob_mismatch_max'] for t in trajs):.3g} "
              f"(one process: see above; the wire rounds to 6 significant digits)")


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

    for name in _verl_private.PRIVATE_NAMES:
        module, _, path = name.partition(":")
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
