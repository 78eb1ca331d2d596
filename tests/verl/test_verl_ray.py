"""veRL's production topology on a local Ray, traced through the job's collector.

The same CPU agent loop as test_verl_real.py, but as veRL runs it in training:
``AgentLoopManager.create`` starts ``ray.remote(AgentLoopWorker)`` actors, the scripted
server is a Ray actor behind veRL's ``GlobalRequestLoadBalancer`` actor
(``get_router_handle``). Tracing is set up the way docs/frameworks/verl.md tells users
to: the driver (this test process) starts ``rtrace.start_collector(...)`` with the sink
and the tokenizer; the workers get nothing but Ray's runtime env, given in veRL's Hydra
config and passed to ``ray.init`` the way veRL's ``run_ppo`` does::

    +ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=rtrace.compat.verl.install
    +ray_kwargs.ray_init.runtime_env.env_vars.RTRACE_EXPORTER='collector'   # ... each of collector.env

and veRL's own ``trace.*`` settings. Slow (a Ray start and a worker that imports veRL:
about a minute or two on 2 cores).
"""

from __future__ import annotations

import os
import time

import pytest

pytest.importorskip("verl")
ray = pytest.importorskip("ray")

import rtrace  # noqa: E402
from rtrace.exporters.jsonl import read_jsonl  # noqa: E402

import verl_app as app  # noqa: E402
from verl_app import TOOL_LOOP_TREE, trace_overrides  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
HOOK = "rtrace.compat.verl.install"

pytestmark = pytest.mark.integration


def wait_for(collector, path, count, timeout=120.0):
    """The trajectories the collector wrote to ``path`` once ``count`` are there (the
    worker streams its spans; the collector writes a trajectory once its root arrived)."""
    deadline = time.monotonic() + timeout
    trajs = []
    while time.monotonic() < deadline:
        collector.flush(10)
        trajs = read_jsonl(path) if path.exists() else []
        if len(trajs) >= count:
            time.sleep(0.5)  # nothing more should come
            collector.flush(10)
            return read_jsonl(path)
        time.sleep(0.2)
    return trajs


@pytest.fixture
def model_dir(tmp_path):
    return app.write_model_dir(tmp_path / "model")


@pytest.fixture
def collector(tmp_path, model_dir):
    from verl.utils import hf_tokenizer

    c = rtrace.start_collector(exporter="jsonl", jsonl_path=str(tmp_path / "collector.jsonl"),
                               project=app.PROJECT, experiment=app.EXPERIMENT, settle_s=0.5,
                               token2text=True, tokenizer=hf_tokenizer(str(model_dir)))
    try:
        yield c
    finally:
        c.stop()


def ray_overrides(env: dict[str, str]) -> list[str]:
    """The Hydra overrides docs/frameworks/verl.md gives for the workers: the setup hook and
    the collector's env (values quoted: Ray wants strings, and host:port has a colon)."""
    return ["ray_kwargs.ray_init.num_cpus=2", "+ray_kwargs.ray_init.include_dashboard=False",
            f"+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook={HOOK}",
            *(f"+ray_kwargs.ray_init.runtime_env.env_vars.{k}='{v}'" for k, v in env.items())]


@pytest.fixture
def worker_env(tmp_path, collector):
    return {
        **collector.env,  # RTRACE_EXPORTER=collector, RTRACE_COLLECTOR_ENDPOINT, ...
        "PYTHONPATH": os.pathsep.join([HERE, ROOT]),  # verl_app (the tool's dotted name)
        "RTRACE_EXPORT_INTERVAL_S": "0.05",
        # where the worker would write had it not streamed to the collector
        "RTRACE_JSONL_PATH": str(tmp_path / "worker.jsonl"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }


def ray_init_as_verl(config) -> None:
    """``ray.init`` as veRL's ``run_ppo`` (verl/trainer/main_ppo.py) makes it from the config:
    veRL's default runtime env merged with ``ray_kwargs.ray_init.runtime_env``."""
    from omegaconf import OmegaConf
    from verl.trainer.constants_ppo import get_ppo_ray_runtime_env

    ray_init_kwargs = config.ray_kwargs.get("ray_init", {})
    runtime_env = OmegaConf.merge(get_ppo_ray_runtime_env(config), ray_init_kwargs.get("runtime_env", {}))
    ray.init(**OmegaConf.to_container(OmegaConf.create({**ray_init_kwargs, "runtime_env": runtime_env})))


def test_agent_loop_manager_on_ray_with_collector(collector, worker_env, model_dir, tmp_path):
    from verl.experimental.agent_loop.agent_loop import AgentLoopManager
    from verl.utils import hf_tokenizer
    from verl.workers.rollout.llm_server import LLMServerClient
    from verl.workers.rollout.router import get_router_handle

    tool_config = app.write_tool_config(tmp_path / "tools.yaml")
    # veRL's own trace config; the backend (jsonl here, trackio in a real job) is only
    # "on": a worker started with collector.env streams to the collector
    config = app.compose_config(model_dir, tool_config, trace_overrides(cap=1) + ray_overrides(worker_env))
    tokenizer = hf_tokenizer(str(model_dir))

    ray_init_as_verl(config)
    try:
        server = ray.remote(app.ScriptedServer).remote(tokenizer)
        balancer = get_router_handle(servers={app.SERVER_ADDRESS: server})
        client = LLMServerClient(config=config, load_balancer_handle=balancer)
        manager = AgentLoopManager.create(config, client)  # ray.remote(AgentLoopWorker) x num_workers=1
        out = manager.generate_sequences(app.make_batch([0, 1, 2], n=2, step=4))
        # before ray.shutdown: Ray ends the worker without atexit (what it still holds is lost)
        trajs = wait_for(collector, tmp_path / "collector.jsonl", 2)
    finally:
        ray.shutdown()
    assert len(out) == 6 and out.non_tensor_batch["__num_turns__"].tolist() == [4] * 6

    assert not (tmp_path / "worker.jsonl").exists()  # the worker did not write on its own
    # max_samples_per_step_per_worker=1: the one sample veRL's worker picked, both rollouts
    assert len({t.sample_index for t in trajs}) == 1
    (sample,) = {t.sample_index for t in trajs}
    assert sorted((t.step, t.sample_index, t.rollout_n, t.validate) for t in trajs) == [
        (4, sample, 0, False), (4, sample, 1, False)]
    a, b = app.question(sample)
    for t in trajs:
        assert [(d, s.name, s.kind) for d, s in t.walk()] == TOOL_LOOP_TREE
        assert (t.experiment, t.partial) == (app.EXPERIMENT, False)
        # decoded in the collector, with the driver's tokenizer
        assert [g.attributes["rtrace.response_text"] for g in t.spans_of_kind("generation")] == [
            app.tool_call_text(a, b), app.answer_text(a, b)]
        assert t.spans[1].output["response_text"].endswith(app.answer_text(a, b))
        (tool,) = t.spans_of_kind("tool")
        assert (tool.attributes["rl.tool.reward"], tool.attributes["rl.tool.metrics.ok"]) == (1.0, True)
        assert t.messages[:2] == app.prompt(sample)
        assert [m["role"] for m in t.messages] == ["system", "user", "assistant", "tool", "assistant"]
        assert t.messages[3]["content"] == str(a + b)
