"""``rtrace demo``: the real traced rollout, run as users run it, read back from each backend.

The demo runs as a subprocess with the venv's python (``python -m rtrace demo``), once
per backend set (session fixtures: each run costs the torch/transformers import), and
its traces are read back through the backend's own storage API. One run uses the
default options (what ``make demo`` runs) to check the trained policy's behaviour.
"""

from __future__ import annotations

import json
import os
import random
import re
import string
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from rtrace.exporters.jsonl import read_jsonl

# runs `rtrace demo` as a process: make test-integration
pytestmark = pytest.mark.integration

STEPS, PROMPTS, ROLLOUTS = 1, 2, 2
VAL = PROMPTS  # the validation pass: one greedy rollout per prompt
SMALL = ["--steps", str(STEPS), "--prompts", str(PROMPTS), "--rollouts", str(ROLLOUTS),
         "--max-turns", "2", "--max-new-tokens", "8", "--seed", "3"]


def run_demo(out_dir: Path, *args: str, small: bool = True) -> subprocess.CompletedProcess:
    """``python -m rtrace demo`` in a clean environment (no RTRACE_*, no tracking URIs);
    with the small test options unless ``small`` is false (then the defaults)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RTRACE_", "OTEL_", "TRACKIO_", "MLFLOW_"))}
    env["HF_HUB_OFFLINE"] = "1"
    cwd = out_dir.parent / f"{out_dir.name}-cwd"  # apart from --out-dir: nothing may land here
    cwd.mkdir(exist_ok=True)
    return subprocess.run([sys.executable, "-m", "rtrace", "demo", *(SMALL if small else []), "--out-dir",
                           str(out_dir), *args], capture_output=True, text=True, env=env, cwd=str(cwd),
                          timeout=300)


def check_coordinates(coords: list[tuple[int, int, int, bool]]) -> None:
    """(step, sample_index, rollout_n, validate) of the demo's rollouts: each training step
    draws PROMPTS distinct prompts of its 2 * PROMPTS-prompt dataset (sample_index = the
    dataset index), ROLLOUTS each; validation has its own prompts, numbered after them."""
    train = [c for c in coords if not c[3]]
    for step in range(1, STEPS + 1):
        drawn = sorted({c[1] for c in train if c[0] == step})
        assert len(drawn) == PROMPTS and set(drawn) <= set(range(2 * PROMPTS))
        assert sorted(c[1:3] for c in train if c[0] == step) == [(i, n) for i in drawn for n in range(ROLLOUTS)]
    assert len(train) == STEPS * PROMPTS * ROLLOUTS
    assert sorted(c for c in coords if c[3]) == [(STEPS, 2 * PROMPTS + i, 0, True) for i in range(VAL)]


def check_trajectory_set(trajs: list) -> None:
    """The demo's shape: coordinates, tool spans, decoded text, rewards, advantages."""
    check_coordinates([(t.step, t.sample_index, t.rollout_n, t.validate) for t in trajs])
    groups: dict = defaultdict(list)
    for t in trajs:
        groups[(t.step, t.validate, t.group_id)].append(t.reward)
    for t in trajs:
        assert t.reward in (0.0, 1.0) and t.outcome["expected"]
        assert t.group_id == f"prompt-{t.sample_index}" and t.extra["prompt_id"] == t.sample_index
        rewards = groups[(t.step, t.validate, t.group_id)]
        mean = sum(rewards) / len(rewards)
        std = (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5
        # the trainer's GRPO advantage, joined to the training trajectories (validation has none)
        assert t.annotations == ({} if t.validate else {"advantage": (t.reward - mean) / std if std else 0.0})
        names = [s.name for s in t.spans]
        assert names[0] == "rollout" and "ToolAgentLoop.run" in names and "reward" in names
        tools = t.spans_of_kind("tool")
        # the forced first-turn call (max-turns 2: one tool round, then the final answer)
        assert [s.attributes["gen_ai.tool.name"] for s in tools] == [
            "calculator" if t.extra["task_kind"] == "arithmetic" else "lookup"]
        assert tools[0].attributes["gen_ai.tool.call.id"] == "call_1_0"
        gens = t.spans_of_kind("generation")
        assert len(gens) == 2
        for g in gens:
            assert isinstance(g.attributes["rtrace.prompt_text"], str)
            assert isinstance(g.attributes["rtrace.response_text"], str)
            assert g.attributes["gen_ai.usage.output_tokens"] <= 8
        assert "user\n" in gens[0].attributes["rtrace.prompt_text"]
        roles = [m["role"] for m in t.messages]
        assert roles == ["system", "user", "assistant", "tool", "assistant"]
        assert t.messages[3]["tool_call_id"] == "call_1_0"


def trackio_traces(trackio_dir: Path, project: str) -> list[dict]:
    """Every trace of ``project``, read through trackio's own CLI (its storage API)."""
    env = {**os.environ, "TRACKIO_DIR": str(trackio_dir), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([str(Path(sys.executable).parent / "trackio"), "list", "traces", "--project", project,
                           "--json"], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["traces"]


@pytest.fixture(scope="session")
def trackio_demo(tmp_path_factory):
    """The demo with no --exporter (what `make demo` runs): trackio and the dataset, in local
    folders under --out-dir."""
    out = tmp_path_factory.mktemp("demo-trackio")
    return out, run_demo(out)


def open_lines(stdout: str) -> list[str]:
    """The commands the demo ends with (each followed by an indented line saying what it opens)."""
    tail = stdout.split("Open what it wrote:\n", 1)[1].splitlines()
    return [line[2:] for line in tail if line.startswith("  ") and not line.startswith("      ")]


class TestDemoTrackio:
    def test_default_writes_trackio_and_the_dataset_and_says_how_to_open_them(self, trackio_demo):
        """With no exporter given the demo writes trackio under <out-dir>/trackio and the run's
        dataset under <out-dir>/dataset, and ends with the commands that open them, the live
        viewer first: `rtrace serve <the dataset>`, then `trackio show` with its TRACKIO_DIR."""
        out, proc = trackio_demo
        assert proc.returncode == 0, proc.stderr
        assert (out / "trackio" / "rtrace-demo.db").is_file()
        (run,) = (out / "dataset").iterdir()
        n = STEPS * PROMPTS * ROLLOUTS + VAL
        for sink in ("trackio", "parquet"):
            assert f"rtrace: {n} trajectories written to {sink}" in proc.stdout
        commands = open_lines(proc.stdout)
        # `rtrace`, `trackio`: or their full paths next to the venv's python when not on PATH
        assert re.fullmatch(rf"(\S*/)?rtrace serve {re.escape(str(run))}", commands[0])
        assert re.fullmatch(rf"TRACKIO_DIR={re.escape(str(out / 'trackio'))} (\S*/)?trackio show "
                            r"--project rtrace-demo", commands[1])
        assert re.fullmatch(rf'(\S*/)?rtrace query {re.escape(str(run))} "SELECT step, avg\(reward\) FROM '
                            r'trajectories WHERE NOT validate GROUP BY step ORDER BY step"', commands[2])
        assert len(commands) == 3
        # trackio's own banner, whose `trackio show` lacks TRACKIO_DIR and opens "No projects", is not shown
        assert "trackio show --project" not in proc.stdout.replace(commands[1], "", 1)
        assert "* View dashboard" not in proc.stdout and "* Trackio project initialized" not in proc.stdout

    def test_the_output_is_what_a_newcomer_needs(self, trackio_demo):
        """No library's deprecation notice (transformers' FutureWarning through torch) and no
        trackio message among the demo's lines."""
        _, proc = trackio_demo
        assert proc.returncode == 0, proc.stderr
        for stream in (proc.stdout, proc.stderr):
            assert "Warning" not in stream and "warnings.warn" not in stream and "* Trackio" not in stream
        allowed = ("rtrace demo:", "step ", "update ", "validation ")
        assert all(line.startswith(allowed) for line in proc.stderr.splitlines()), proc.stderr

    def test_the_serve_command_opens_the_run(self, trackio_demo):
        """The first command's path is a run rtrace serve reads: every rollout, training by default."""
        pytest.importorskip("duckdb")
        from rtrace.serve.sources import sources_from_paths

        out, proc = trackio_demo
        path = open_lines(proc.stdout)[0].split(" serve ", 1)[1]
        srcs = sources_from_paths([path])
        try:
            srcs.refresh()
            (source,) = srcs.runs.values()
            assert source.snapshot.problem is None
            assert source.snapshot.splits == {"train": STEPS * PROMPTS * ROLLOUTS, "val": VAL,
                                              "all": STEPS * PROMPTS * ROLLOUTS + VAL}
        finally:
            srcs.close()

    def test_traces_readable_from_trackio_storage(self, trackio_demo):
        """trackio's storage holds one trace per rollout (training under rollout/traces,
        validation under eval/traces) with tool spans, decoded text and rewards."""
        out, proc = trackio_demo
        assert proc.returncode == 0, proc.stderr
        traces = trackio_traces(out / "trackio", "rtrace-demo")
        train = [t for t in traces if t["key"] == "rollout/traces"]
        val = [t for t in traces if t["key"] == "eval/traces"]
        assert len(train) == STEPS * PROMPTS * ROLLOUTS and len(val) == VAL and len(traces) == len(train) + len(val)
        check_coordinates([(t["step"], t["metadata"]["sample_index"], t["metadata"]["rollout_n"],
                            t["key"] == "eval/traces") for t in traces])
        for t in traces:
            meta = t["metadata"]
            assert meta["reward"] in (0.0, 1.0) and meta.get("validate", False) == (t["key"] == "eval/traces")
            assert meta["num_tool_calls"] == 1 and meta["num_turns"] == 2
            spans = t["spans"]
            tools = [s for s in spans if s["kind"] == "tool"]
            assert [s["metadata"]["gen_ai.tool.name"] for s in tools] == [
                "calculator" if meta["extra.task_kind"] == "arithmetic" else "lookup"]
            assert [s["name"] for s in tools] == [s["metadata"]["gen_ai.tool.name"] for s in tools]
            assert tools[0]["output"] == t["messages"][3]["content"] and tools[0]["output"] != "not found"
            gens = [s for s in spans if s["kind"] == "generation"]
            assert len(gens) == 2
            assert all(isinstance(g["metadata"]["rtrace.response_text"], str) for g in gens)
            assert "user\n" in gens[0]["metadata"]["rtrace.prompt_text"]
            assert [m["role"] for m in t["messages"]] == ["system", "user", "assistant", "tool", "assistant"]
            assert t["messages"][2]["content"] == gens[0]["metadata"]["rtrace.response_text"]
            # what the traces page shows: each generation's chat in and its response out (the first
            # with the tool call that followed it); the root: the task in, the answer and reward out
            assert [g["input"] for g in gens] == [t["messages"][:2], t["messages"][:4]]
            # the decoded response (the agent's message holds it without the tool-call markup)
            assert gens[0]["output"] == {**t["messages"][2], "content": gens[0]["metadata"]["rtrace.response_text"]}
            assert gens[1]["output"] == t["messages"][4]["content"]
            assert spans[0]["input"] == t["messages"][:2]
            assert spans[0]["output"]["answer"] == t["messages"][4]["content"]
            assert spans[0]["output"]["reward"] == meta["reward"]
            verdict = f"{'✓ correct' if meta['reward'] == 1.0 else '✗ wrong'} reward={meta['reward']!r}"
            assert meta["status"] == (f"[val] {verdict}" if meta.get("validate") else verdict)
            if t["key"] == "rollout/traces":  # the trainer's advantage, in the header
                assert isinstance(meta["advantage"], float)


MLFLOW_READER = """
import json, sys
from mlflow import MlflowClient
client = MlflowClient(tracking_uri=sys.argv[1])
exp = client.get_experiment_by_name(sys.argv[2])
traces = client.search_traces(locations=[exp.experiment_id], max_results=1000)
print(json.dumps([{"tags": t.info.tags,
                   "spans": [{"name": s.name, "type": s.span_type, "attributes": s.attributes} for s in t.data.spans]}
                  for t in traces], default=str))
"""


MLFLOW_RUN_READER = """
import json, sys
from mlflow import MlflowClient
client = MlflowClient(tracking_uri=sys.argv[1])
exp = client.get_experiment_by_name(sys.argv[2])
out = []
for run in client.search_runs([exp.experiment_id]):
    linked = client.search_traces(locations=[exp.experiment_id], run_id=run.info.run_id, max_results=1000)
    out.append({"run_id": run.info.run_id, "experiment_id": exp.experiment_id, "status": run.info.status,
                "linked": len(linked),
                "metrics": {k: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, k)]
                            for k in ("rollout/trajectories", "eval/trajectories")}})
print(json.dumps(out))
"""


def mlflow_traces(uri: str, experiment: str) -> list[dict]:
    """Every trace of an MLflow experiment, read with MlflowClient.search_traces."""
    proc = subprocess.run([sys.executable, "-c", MLFLOW_READER, uri, experiment], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.fixture(scope="session")
def jsonl_demo(tmp_path_factory):
    """The demo with two sinks at once: JSONL and MLflow (SQLite under --out-dir)."""
    out = tmp_path_factory.mktemp("demo-jsonl-mlflow")
    return out, run_demo(out, "--exporter", "jsonl,mlflow")


class TestDemoJsonlMlflow:
    def test_exits_zero_and_prints_table_and_path(self, jsonl_demo):
        """The demo exits 0, prints the per-step table, the note on the trained policy and the JSONL path."""
        out, proc = jsonl_demo
        assert proc.returncode == 0, proc.stderr
        lines = proc.stdout.splitlines()
        header = next(i for i, line in enumerate(lines) if line.startswith("step"))
        assert lines[header].split() == ["step", "split", "rollouts", "kept", "mean", "reward", "mean", "turns",
                                         "tool", "calls", "mean", "latency"]
        assert lines[header + 2].split()[:4] == ["1", "train", str(PROMPTS * ROLLOUTS), str(PROMPTS * ROLLOUTS)]
        assert lines[header + 3].split()[:4] == [str(STEPS), "val", str(VAL), str(VAL)]
        assert "random weights" not in proc.stdout
        assert "trained by `python -m rtrace.demo.train`" in proc.stdout
        assert re.search(r"Answers: train \d+ correct, \d+ wrong; val \d+ correct, \d+ wrong\.", proc.stdout)
        for sink in ("jsonl", "mlflow"):
            assert f"rtrace: {STEPS * PROMPTS * ROLLOUTS + VAL} trajectories written to {sink}" in proc.stdout
        commands = open_lines(proc.stdout)
        jsonl = re.escape(str(out / "traces.jsonl"))
        assert re.fullmatch(rf"(\S*/)?rtrace serve {jsonl}", commands[0])  # the live viewer first
        uri = re.escape(f"sqlite:///{out / 'mlflow.db'}")
        assert re.fullmatch(rf"(\S*/)?mlflow ui --backend-store-uri {uri}", commands[1])
        assert re.fullmatch(rf"(\S*/)?rtrace report {jsonl} --html \S+report.html", commands[2])
        assert "Filters -> Tag: step = 1" in proc.stdout and "tags.step = '1'" in proc.stdout
        assert "step 1/1" in proc.stderr and "validation" in proc.stderr  # the progress bars

    def test_writes_only_under_out_dir(self, jsonl_demo):
        """Everything the demo writes is under --out-dir: the MLflow run's tables go to its
        artifact store there, not to ./mlruns of the current directory."""
        out, proc = jsonl_demo
        assert proc.returncode == 0, proc.stderr
        assert list((out.parent / f"{out.name}-cwd").iterdir()) == []
        assert list((out / "mlflow-artifacts").rglob("rollout_rollouts/step_*.json"))

    def test_traces_have_tools_text_and_rewards(self, jsonl_demo):
        """Every rollout is one trajectory with its coordinates, tool spans, decoded text and reward."""
        out, proc = jsonl_demo
        assert proc.returncode == 0, proc.stderr
        check_trajectory_set(read_jsonl(out / "traces.jsonl"))

    def test_mlflow_has_the_same_trajectories(self, jsonl_demo):
        """MLflow holds the same trajectories as the JSONL file: same trace ids, coordinates
        as trace tags, tool spans, decoded text on LLM spans and the reward."""
        out, proc = jsonl_demo
        assert proc.returncode == 0, proc.stderr
        by_id = {t.trace_id: t for t in read_jsonl(out / "traces.jsonl")}
        traces = mlflow_traces(f"sqlite:///{out / 'mlflow.db'}", "rtrace-demo")
        assert len(traces) == len(by_id) == STEPS * PROMPTS * ROLLOUTS + VAL
        for trace in traces:
            tags = trace["tags"]
            root = trace["spans"][0]["attributes"]
            traj = next(t for t in by_id.values() if (t.step, t.sample_index, t.rollout_n, t.validate) == (
                int(tags["step"]), int(tags["sample_index"]), int(tags["rollout_n"]), tags["validate"] == "True"))
            assert float(tags["reward"]) == traj.reward and tags["group_id"] == traj.group_id
            assert root["rl.reward"] == traj.reward
            names = [(s["name"], s["type"]) for s in trace["spans"]]
            assert sorted(names) == sorted((s.name, {"rollout": "AGENT", "agent": "AGENT", "generation": "LLM",
                                                     "tool": "TOOL"}.get(s.kind, "CHAIN")) for s in traj.spans)
            tool = next(s for s in trace["spans"] if s["type"] == "TOOL")
            assert tool["attributes"]["gen_ai.tool.name"] == traj.spans_of_kind("tool")[0].attributes["gen_ai.tool.name"]
            llm = [s["attributes"]["rtrace.response_text"] for s in trace["spans"] if s["type"] == "LLM"]
            assert sorted(llm) == sorted(g.attributes["rtrace.response_text"] for g in traj.spans_of_kind("generation"))

    def test_mlflow_run_has_the_traces_and_step_metrics(self, jsonl_demo):
        """The demo opens an MLflow run, as a training job has: every trace is linked to it, it
        holds the per-step metrics, and the printed hint links to it."""
        out, proc = jsonl_demo
        assert proc.returncode == 0, proc.stderr
        reader = subprocess.run([sys.executable, "-c", MLFLOW_RUN_READER, f"sqlite:///{out / 'mlflow.db'}",
                                 "rtrace-demo"], capture_output=True, text=True, timeout=120)
        assert reader.returncode == 0, reader.stderr
        (run,) = json.loads(reader.stdout)
        assert run["status"] == "FINISHED" and run["linked"] == STEPS * PROMPTS * ROLLOUTS + VAL
        assert run["metrics"] == {"rollout/trajectories": [[s, PROMPTS * ROLLOUTS] for s in range(1, STEPS + 1)],
                                  "eval/trajectories": [[STEPS, VAL]]}
        assert f"http://127.0.0.1:5000/#/experiments/{run['experiment_id']}/runs/{run['run_id']}" in proc.stdout


def test_kept_counts_what_reached_the_sinks(tmp_path):
    """With a cap, the table's `kept` is what the sinks got per step (here 1 of 4), not the
    rollouts traced; the JSONL hint gives the report command."""
    proc = run_demo(tmp_path, "--exporter", "jsonl", "--max-traces-per-step", "1")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("step"))
    assert lines[header + 2].split()[:4] == ["1", "train", str(PROMPTS * ROLLOUTS), "1"]
    written = read_jsonl(tmp_path / "traces.jsonl")
    assert sum(not t.validate for t in written) == 1
    assert re.search(rf"(\S*/)?rtrace report {re.escape(str(tmp_path / 'traces.jsonl'))} --html ", proc.stdout)


def test_bad_exporter_is_a_clear_error(tmp_path):
    """An unknown exporter name exits 2 with the accepted values, before any rollout."""
    proc = run_demo(tmp_path, "--exporter", "wandb")
    assert proc.returncode == 2
    assert "unknown exporter 'wandb'" in proc.stderr and "accepted values" in proc.stderr
    assert "rollouts" not in proc.stdout


# ----------------------------------------------------------------------------- the policy's behaviour

@pytest.fixture(scope="session")
def default_demo(tmp_path_factory):
    """The demo with its default options (steps, prompts, rollouts, tokens: what `make demo`
    runs), written to JSONL."""
    out = tmp_path_factory.mktemp("demo-default")
    proc = run_demo(out, "--exporter", "jsonl", small=False)
    assert proc.returncode == 0, proc.stderr
    return out, proc, read_jsonl(out / "traces.jsonl")


def _printable_share(texts: list[str]) -> float:
    text = "".join(texts)
    return sum(c in string.printable for c in text) / max(len(text), 1)


class TestDefaultDemoPolicy:
    """The shipped policy (trained by rtrace.demo.train) behaves like a small, imperfect agent."""

    def test_assistant_text_is_readable(self, default_demo):
        """At least 95% of the characters the policy wrote are printable ASCII, in the
        assistant messages and in every generation's decoded response (a random-weight
        model writes byte soup: replacement characters, stray UTF-8)."""
        _, _, trajs = default_demo
        contents = [m["content"] for t in trajs for m in t.messages if m["role"] == "assistant" and m["content"]]
        responses = [g.attributes["rtrace.response_text"] for t in trajs for g in t.spans_of_kind("generation")]
        assert contents and responses
        assert _printable_share(contents) >= 0.95
        assert _printable_share(responses) >= 0.95

    def test_policy_writes_tool_calls_with_the_prompts_numbers(self, default_demo):
        """The tool calls come from the policy (not the agent's fallback rule) for most
        rollouts, and in at least one rollout the calculator got exactly the prompt's
        expression and the final answer is the tool's result."""
        _, _, trajs = default_demo
        written = [t for t in trajs if t.outcome["policy_tool_calls"] >= 1 and t.outcome["forced_tool_calls"] == 0]
        assert len(written) >= 0.8 * len(trajs)
        copied = 0
        for t in written:
            tools = t.spans_of_kind("tool")
            if t.extra["task_kind"] != "arithmetic" or not tools:
                continue
            question = next(m["content"] for m in t.messages if m["role"] == "user")
            copied += (tools[0].input["expression"] in question and t.reward == 1.0
                       and t.messages[-1]["content"] == f"The answer is {tools[0].output}.")
        assert copied >= 1

    def test_some_answers_right_some_wrong(self, default_demo):
        """One run has at least one incorrect final answer and at least one correct one
        reached through a tool call the policy wrote itself."""
        _, _, trajs = default_demo
        assert all(t.outcome["correct"] == (t.reward == 1.0) for t in trajs)
        assert any(t.reward == 0.0 for t in trajs)
        assert any(t.reward == 1.0 and t.outcome["forced_tool_calls"] == 0 and t.outcome["policy_tool_calls"] >= 1
                   for t in trajs)

    def test_the_demo_is_a_token_in_token_out_loop(self, default_demo):
        """rtrace's showcase passes its own checks: its loop extends the prompt ids with the ids
        the model sampled and the template's ids after them (never re-rendering the chat), so
        no trajectory has a token_continuity finding, on multi-turn trajectories the check ran on."""
        _, _, trajs = default_demo
        multi = [t for t in trajs if t.num_turns >= 2]
        assert len(multi) >= len(trajs) // 2
        assert all("token_continuity" in t.health_checks for t in multi)
        assert [(t.trace_id, f) for t in trajs for f in t.health if f["check"] == "token_continuity"] == []

    def test_rewards_vary_within_groups_and_across_steps(self, default_demo):
        """At least one GRPO group (the rollouts of one prompt) has rewards with non-zero
        variance, and the mean training reward is not the same at every step."""
        _, proc, trajs = default_demo
        groups = defaultdict(list)
        steps = defaultdict(list)
        for t in trajs:
            if not t.validate:
                groups[t.group_id].append(t.reward)
                steps[t.step].append(t.reward)
        assert len(groups) > 1 and all(len(g) > 1 for g in groups.values())
        variances = [sum((r - sum(g) / len(g)) ** 2 for r in g) / len(g) for g in groups.values()]
        assert max(variances) > 0
        assert len(steps) > 1 and len({sum(r) / len(r) for r in steps.values()}) > 1
        assert "policy-gradient step on" in proc.stderr  # the update between steps ran


@pytest.fixture(scope="session")
def jsonl_demo_again(tmp_path_factory):
    """The small demo again, with the same seed as ``jsonl_demo``."""
    out = tmp_path_factory.mktemp("demo-jsonl-again")
    return out, run_demo(out, "--exporter", "jsonl")


def test_same_seed_same_rollouts_new_trace_ids(jsonl_demo, jsonl_demo_again):
    """Two runs with the same --seed sample the same rollouts (the seed drives private
    generators) but get different trace ids (the global ``random`` that OpenTelemetry
    draws ids from is neither seeded nor replayed)."""
    (out1, proc1), (out2, proc2) = jsonl_demo, jsonl_demo_again
    assert proc1.returncode == 0, proc1.stderr
    assert proc2.returncode == 0, proc2.stderr
    first, second = read_jsonl(out1 / "traces.jsonl"), read_jsonl(out2 / "traces.jsonl")
    assert len(first) == len(second) == STEPS * PROMPTS * ROLLOUTS + VAL
    assert not {t.trace_id for t in first} & {t.trace_id for t in second}
    assert not {s.span_id for t in first for s in t.spans} & {s.span_id for t in second for s in t.spans}

    def rollouts(trajs):
        return sorted((t.step, t.sample_index, t.rollout_n, t.validate, t.reward,
                       tuple(g.attributes["rtrace.response_text"] for g in t.spans_of_kind("generation")))
                      for t in trajs)

    assert rollouts(first) == rollouts(second)


def test_policy_leaves_global_generators_alone():
    """Loading the policy and sampling from it neither seeds nor draws from Python's global
    ``random`` or torch's global generator."""
    import asyncio

    import torch

    from rtrace.demo.agent import SYSTEM_PROMPT, render_prompt
    from rtrace.demo.model import build_policy

    py_state, torch_state = random.getstate(), torch.random.get_rng_state()
    policy = build_policy(max_new_tokens=8)
    try:
        prompt = render_prompt(policy.tokenizer, [{"role": "system", "content": SYSTEM_PROMPT},
                                                  {"role": "user", "content": "What is 12 + 30 * 2?"}])
        first = asyncio.run(policy.generate(prompt, seed=5, temperature=1.0))
        again = asyncio.run(policy.generate(prompt, seed=5, temperature=1.0))
    finally:
        policy.close()
    assert first == again and first["response_ids"]
    assert random.getstate() == py_state
    assert torch.equal(torch.random.get_rng_state(), torch_state)
