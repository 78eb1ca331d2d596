"""The MLflow sink against real MLflow: a SQLite store and a real ``mlflow server``.

Trajectories are made with the public API (decorators, rollout_context, record_reward,
flush) and read back with MLflow's own API (``get_trace``, ``search_traces``); the JSONL
sink runs next to MLflow so each test knows exactly what rtrace built.
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

import rtrace
from rtrace.exporters import mlflow as mlflow_sink
from tests.conftest import read_back
from tests.servers import start_mlflow_server, stop_server

mlflow = pytest.importorskip("mlflow")
from mlflow.tracking import MlflowClient  # noqa: E402


SYSTEM = {"role": "system", "content": "You are a calculator. Call calc(a, b)."}


@pytest.fixture(autouse=True)
def clean_mlflow(monkeypatch):
    """No tracking URI, active experiment or active run leaks between tests."""
    from mlflow.tracking import fluent
    from mlflow.tracking._tracking_service import utils

    monkeypatch.setattr(utils, "_tracking_uri", None)
    monkeypatch.setattr(fluent, "_active_experiment_id", None)
    for key in ("MLFLOW_EXPERIMENT_ID", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_RUN_ID"):
        # set first so monkeypatch removes what mlflow.set_experiment() exports at teardown
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    yield
    while mlflow.active_run() is not None:
        mlflow.end_run()


@pytest.fixture
def sqlite_uri(tmp_path):
    return f"sqlite:///{tmp_path}/mlflow.db"


# ----------------------------------------------------------------------------- a toy agent
@rtrace.traced_generation
def generate(messages, model="toy-1"):
    last = messages[-1]
    if last["role"] == "user":
        return {"role": "assistant", "content": "",
                "tool_calls": [{"id": "call_1", "type": "function",
                                "function": {"name": "calc", "arguments": '{"a": 6, "b": 7}'}}]}
    return {"role": "assistant", "content": f"The answer is {last['content']}."}


@rtrace.traced_tool
def calc(a, b):
    return a * b


@rtrace.traced_rollout
def agent(task):
    messages = [SYSTEM, {"role": "user", "content": task}]
    for _ in range(3):
        reply = generate(list(messages))
        messages.append(reply)
        if not reply.get("tool_calls"):
            return reply["content"]
        result = calc(6, 7)
        messages.append({"role": "tool", "tool_call_id": "call_1", "content": str(result)})
    return None


def rollout(step, sample_index, validate=False, reward=1.0, **extra):
    with rtrace.rollout_context(step=step, sample_index=sample_index, rollout_n=0, validate=validate,
                                group_id=f"p{sample_index}", policy_version=step, **extra) as ctx:
        agent("What is 6 * 7?")
        rtrace.record_reward(reward)
    return ctx.trace_id


def configure(tmp_path, uri, **kwargs):
    rtrace.configure(exporter="mlflow,jsonl", mlflow_tracking_uri=uri, jsonl_path=str(tmp_path / "t.jsonl"),
                     export_interval_s=0.05, **kwargs)


def experiment_id(uri, name):
    return MlflowClient(tracking_uri=uri).get_experiment_by_name(name).experiment_id


def search(uri, exp_id, **kwargs):
    traces = MlflowClient(tracking_uri=uri).search_traces(locations=[exp_id], max_results=500, **kwargs)
    return sorted(t.info.trace_id for t in traces)


# ----------------------------------------------------------------------------- SQLite
def test_previews_show_bidirectional_controls(tmp_path, sqlite_uri):
    """A task and an answer holding a right-to-left override: MLflow's request and response
    previews (and the root's messages) show it as ⟨U+202E⟩, so "\u202egnp.exe" does not read
    "exe.png"; the JSONL keeps the text as it was."""
    configure(tmp_path, sqlite_uri, project="bidi")
    with rtrace.rollout_context(step=1, sample_index=0, rollout_n=0):
        agent("Open \u202egnp.exe?")
    [traj] = read_back(tmp_path / "t.jsonl")
    assert traj.messages[1]["content"] == "Open \u202egnp.exe?"
    trace = MlflowClient(tracking_uri=sqlite_uri).get_trace("tr-" + traj.trace_id)
    assert trace.info.request_preview == "Open ⟨U+202E⟩gnp.exe?"
    assert trace.data.spans[0].inputs["messages"][1]["content"] == "Open ⟨U+202E⟩gnp.exe?"
    assert trace.data.spans[1].inputs == {"task": "Open \u202egnp.exe?"}  # a call's captured input: as it was


def test_multi_turn_trajectory_round_trips(tmp_path, sqlite_uri):
    """get_trace returns every span with our ids, names, types, parents, times, inputs and outputs."""
    configure(tmp_path, sqlite_uri, project="roundtrip")
    rollout(step=1, sample_index=0)
    [traj] = read_back(tmp_path / "t.jsonl")
    trace = MlflowClient(tracking_uri=sqlite_uri).get_trace("tr-" + traj.trace_id)

    got = trace.data.spans
    assert [s.span_id for s in got] == [s.span_id for s in traj.spans]
    assert [s.name for s in got] == ["rollout", "agent", "generate", "calc", "generate"]
    assert [s.span_type for s in got] == ["AGENT", "AGENT", "LLM", "TOOL", "LLM"]
    assert [s.parent_id for s in got] == [s.parent_id for s in traj.spans]
    assert [(s.start_time_ns, s.end_time_ns) for s in got] == [(s.start_ns, s.end_ns) for s in traj.spans]
    for mine, theirs in zip(traj.spans[1:], got[1:]):
        assert theirs.inputs == mine.input and theirs.outputs == mine.output
    assert got[1].inputs == {"task": "What is 6 * 7?"} and got[1].outputs == "The answer is 42."
    assert got[3].inputs == {"a": 6, "b": 7} and got[3].outputs == 42
    # the root (a rollout_context captures no call) shows the opening and the final messages
    assert got[0].inputs == {"messages": [SYSTEM, {"role": "user", "content": "What is 6 * 7?"}]}
    assert got[0].outputs == {"messages": [{"role": "assistant", "content": "The answer is 42."}]}
    assert trace.info.request_preview == "What is 6 * 7?"
    assert trace.info.response_preview == "The answer is 42."
    # every attribute is kept
    assert got[2].attributes["gen_ai.operation.name"] == "chat"
    assert got[3].attributes["gen_ai.tool.name"] == "calc"
    assert got[4].attributes["rl.step"] == 1 and got[0].attributes["rl.reward"] == 1.0
    assert trace.info.tags["mlflow.traceName"] == "rollout"
    assert trace.info.state.value == "OK"
    assert rtrace.stats()["sink.mlflow.exported"] == 1


def test_search_by_step_validate_and_run(tmp_path, sqlite_uri):
    """search_traces by tags.step, tags.validate and run_id returns exactly the expected trajectories."""
    client = MlflowClient(tracking_uri=sqlite_uri)
    run = client.create_run(client.create_experiment("grpo"))
    configure(tmp_path, sqlite_uri, mlflow_run_id=run.info.run_id)
    # > 100 trajectories in one batch: MLflow links at most 100 per call, the sink chunks
    step1 = [rollout(1, i) for i in range(101)]
    val1 = [rollout(1, 9, validate=True)]
    step2 = [rollout(2, i) for i in range(2)]
    assert rtrace.flush(60)
    want = lambda ids: sorted("tr-" + t for t in ids)  # noqa: E731
    exp = run.info.experiment_id  # traces go to the run's experiment

    assert search(sqlite_uri, exp, filter_string="tags.step = '1'") == want(step1 + val1)
    # validate is 'True' / 'False', as veRL's MLflow backend writes it
    assert search(sqlite_uri, exp, filter_string="tags.validate = 'False'") == want(step1 + step2)
    assert search(sqlite_uri, exp, filter_string="tags.step = '1' AND tags.validate = 'True'") == want(val1)
    assert search(sqlite_uri, exp, run_id=run.info.run_id) == want(step1 + val1 + step2)
    other = client.create_run(exp)
    assert search(sqlite_uri, exp, run_id=other.info.run_id) == []


def test_tags_are_normalised_strings(tmp_path, sqlite_uri):
    """Trace tags are strings: integers without '.0', NaN as 'NaN', extras under extra.<k>; validate and
    experiment_name as veRL's MLflow backend writes them ('True' / 'False', the experiment's name)."""
    configure(tmp_path, sqlite_uri, project="tags", experiment="run-7")
    a = rollout(3, 5, validate=True, reward=2.0, task="gsm8k")
    b = rollout(3, 6, reward=float("nan"))
    c = rollout(3, 7, reward=0.25)
    assert rtrace.flush(60)
    client = MlflowClient(tracking_uri=sqlite_uri)
    tags = {t: {k: v for k, v in client.get_trace("tr-" + t).info.tags.items() if not k.startswith("mlflow.")}
            for t in (a, b, c)}
    assert tags[a] == {"step": "3", "sample_index": "5", "rollout_n": "0", "validate": "True",
                       "experiment_name": "run-7", "group_id": "p5", "policy_version": "3", "reward": "2",
                       "verdict": "ok", "extra.task": "gsm8k"}
    assert tags[b]["reward"] == "NaN" and tags[b]["validate"] == "False"
    assert tags[c]["reward"] == "0.25"
    exp = experiment_id(sqlite_uri, "tags")
    assert search(sqlite_uri, exp, filter_string="tags.reward = 'NaN'") == ["tr-" + b]
    assert sorted(search(sqlite_uri, exp, filter_string="tags.verdict = 'ok'")) == sorted("tr-" + t for t in (a, b, c))


@pytest.mark.parametrize("value, text", [
    (True, "true"), (False, "false"),
    (3, "3"), (3.0, "3"), (-0.5, "-0.5"),          # integral floats lose their '.0'
    (math.nan, "NaN"), (math.inf, "Infinity"), (-math.inf, "-Infinity"),
    ("p17", "p17"),
])
def test_tag_value(value, text):
    """tag_value gives the documented string form of each kind of value."""
    assert mlflow_sink.tag_value(value) == text


def test_active_run_and_tracking_uri_of_the_app(tmp_path, sqlite_uri):
    """With no URI or run id given, traces go to the app's tracking URI and link to its active run."""
    mlflow.set_tracking_uri(sqlite_uri)
    mlflow.set_experiment("app-exp")
    with mlflow.start_run() as run:
        rtrace.configure(exporter="mlflow,jsonl", jsonl_path=str(tmp_path / "t.jsonl"), export_interval_s=0.05)
        ids = [rollout(4, i) for i in range(2)]
        assert rtrace.flush(60)
        found = mlflow.search_traces(run_id=run.info.run_id, return_type="list")
    assert sorted(t.info.trace_id for t in found) == sorted("tr-" + t for t in ids)
    assert {t.info.experiment_id for t in found} == {run.info.experiment_id}


def test_run_started_after_configure_is_found_from_the_sink_thread(tmp_path, sqlite_uri):
    """A run the app starts after configure(), in its own thread, still gets the traces linked."""
    mlflow.set_tracking_uri(sqlite_uri)
    configure(tmp_path, sqlite_uri)
    with mlflow.start_run() as run:
        ids = [rollout(5, i) for i in range(2)]
        assert rtrace.flush(60)
    assert search(sqlite_uri, run.info.experiment_id, run_id=run.info.run_id) == sorted("tr-" + t for t in ids)


def test_default_tracking_uri_is_a_local_sqlite_file(tmp_path, monkeypatch):
    """Without MLFLOW_TRACKING_URI the sink writes to <cwd>/.rtrace/mlflow.db, experiment RTRACE_PROJECT."""
    monkeypatch.chdir(tmp_path)
    rtrace.configure(exporter="mlflow", project="local", export_interval_s=0.05)
    tid = rollout(1, 0)
    assert rtrace.flush(60)
    uri = f"sqlite:///{tmp_path}/.rtrace/mlflow.db"
    assert (tmp_path / ".rtrace" / "mlflow.db").is_file()
    assert search(uri, experiment_id(uri, "local")) == ["tr-" + tid]


def test_token2text_shows_decoded_text_on_generations(tmp_path, sqlite_uri):
    """With token2text, generation spans show the decoded prompt and response as inputs and outputs."""
    from rtrace.demo import build_tokenizer

    tok = build_tokenizer()
    configure(tmp_path, sqlite_uri, project="t2t", token2text=True, tokenizer=tok)

    @rtrace.traced_generation
    def gen(prompt_ids):
        return tok.encode("four")

    with rtrace.rollout_context(step=1) as ctx:
        gen(tok.encode("what is two plus two"))
    assert rtrace.flush(60)
    spans = MlflowClient(tracking_uri=sqlite_uri).get_trace("tr-" + ctx.trace_id).data.spans
    [g] = [s for s in spans if s.span_type == "LLM"]
    # the prompt as chat messages (MLflow renders them as a chat), the response as text
    assert g.inputs == {"messages": [{"role": "user", "content": "what is two plus two"}]}
    assert g.outputs == "four"
    assert g.attributes["rtrace.prompt_text"] == "what is two plus two"


def test_llm_spans_take_chat_messages(tmp_path, sqlite_uri):
    """A generation's inputs are chat messages, {"messages": [...]} (what MLflow renders as a chat),
    also with token2text on: the conversation the call was given, with its other arguments; a
    generation given token ids only gets the conversation up to the turn it produced."""
    from rtrace.demo import build_tokenizer

    tok = build_tokenizer()
    configure(tmp_path, sqlite_uri, project="chat", token2text=True, tokenizer=tok)

    @rtrace.traced_generation
    def chat(messages, prompt_ids, temperature):
        return {"response_ids": tok.encode("calling calc"), "finish_reason": "stop"}

    @rtrace.traced_generation
    def complete(prompt_ids):
        return tok.encode("The answer is 42.")

    task = [SYSTEM, {"role": "user", "content": "What is 6 * 7?"}]
    with rtrace.rollout_context(step=1, sample_index=0) as ctx:
        chat(list(task), tok.encode("rendered"), temperature=0.7)
        calc(6, 7)
        complete(tok.encode("rendered again"))
        rtrace.record_reward(1.0)
    assert rtrace.flush(60)
    [traj] = read_back(tmp_path / "t.jsonl")
    assert search(sqlite_uri, experiment_id(sqlite_uri, "chat")) == ["tr-" + ctx.trace_id]
    first, second = [s for s in MlflowClient(tracking_uri=sqlite_uri).get_trace("tr-" + ctx.trace_id).data.spans
                     if s.span_type == "LLM"]
    assert first.inputs == {"temperature": 0.7, "messages": task} and first.outputs == "calling calc"
    assert second.inputs == {"messages": traj.messages[:4]} and second.outputs == "The answer is 42."
    assert [m["role"] for m in second.inputs["messages"]] == ["system", "user", "assistant", "tool"]


def test_step_metrics_on_the_linked_run(tmp_path, sqlite_uri):
    """The run the traces link to holds the per-step metrics, read back with get_metric_history."""
    mlflow.set_tracking_uri(sqlite_uri)
    with mlflow.start_run() as run:
        configure(tmp_path, sqlite_uri)
        for step in (1, 2):
            for i in range(3):
                rollout(step, i, reward=float(i + step))
            assert rtrace.flush(60)  # a step's metrics are final at a flush
        rollout(2, 0, validate=True, reward=0.5)
        assert rtrace.flush(60)
    client = MlflowClient(tracking_uri=sqlite_uri)
    history = {key: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
               for key in ("rollout/trajectories", "rollout/reward_mean", "rollout/turns_mean", "eval/reward_mean")}
    assert history == {"rollout/trajectories": [(1, 3), (2, 3)], "rollout/reward_mean": [(1, 2.0), (2, 3.0)],
                       "rollout/turns_mean": [(1, 2.0), (2, 2.0)], "eval/reward_mean": [(2, 0.5)]}
    assert search(sqlite_uri, run.info.experiment_id, run_id=run.info.run_id) != []


def test_version_outside_the_tested_range_fails_at_configure(monkeypatch):
    """An MLflow version outside the tested range raises ConfigError naming the range and the version."""
    monkeypatch.setattr(mlflow_sink, "MLFLOW_VERSION_RANGE", ((3, 99), (4, 0)))
    with pytest.raises(rtrace.ConfigError, match=r"mlflow>=3\.99,<4\.0, found mlflow 3\."):
        rtrace.configure(exporter="mlflow")


def test_mlflow_is_imported_only_when_configured(tmp_path):
    """import rtrace and configure() with other sinks leave mlflow unimported; configure(exporter='mlflow')
    imports it on the calling thread (never in the sink thread, where it raced the application's own
    `import mlflow`: tests/test_process_lifecycle.py)."""
    code = ("import sys, rtrace; rtrace.configure(exporter='console'); before = 'mlflow' in sys.modules; "
            "rtrace.configure(exporter='mlflow'); print(before, 'mlflow' in sys.modules); "
            "rtrace.configure(exporter='none')")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False True", out.stderr


def test_missing_otlp_messages_fail_at_configure(tmp_path):
    """Without opentelemetry-proto (the OTLP messages MLflow reads), configure(exporter='mlflow')
    raises ConfigError naming rtrace[mlflow]."""
    code = ("import sys; sys.modules['opentelemetry.proto'] = None  # as if not installed\n"
            "import rtrace\ntry:\n    rtrace.configure(exporter='mlflow')\n"
            "except rtrace.ConfigError as exc:\n    print('ConfigError:', exc)")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.stdout.startswith("ConfigError:") and "opentelemetry-proto" in out.stdout, out.stderr
    assert "pip install 'rtrace[mlflow]'" in out.stdout


# ----------------------------------------------------------------------------- a real server
@pytest.mark.integration
def test_real_server_over_http(tmp_path, mlflow_server):  # noqa: F811
    """Against a real mlflow server: traces with their spans and tags, searchable, linked to the run."""
    client = MlflowClient(tracking_uri=mlflow_server)
    run = client.create_run(client.create_experiment("http"))
    configure(tmp_path, mlflow_server, mlflow_run_id=run.info.run_id)
    ids = [rollout(1, i) for i in range(4)] + [rollout(2, 0, validate=True)]
    assert rtrace.flush(120)
    exp = run.info.experiment_id
    assert search(mlflow_server, exp, run_id=run.info.run_id) == sorted("tr-" + t for t in ids)
    assert search(mlflow_server, exp, filter_string="tags.step = '1'") == sorted("tr-" + t for t in ids[:4])
    assert search(mlflow_server, exp, filter_string="tags.validate = 'True'") == ["tr-" + ids[-1]]
    trace = client.get_trace("tr-" + ids[0])
    assert [s.span_type for s in trace.data.spans] == ["AGENT", "AGENT", "LLM", "TOOL", "LLM"]
    assert trace.info.tags["step"] == "1" and trace.info.request_preview == "What is 6 * 7?"
    stats = rtrace.stats()
    assert stats["sink.mlflow.exported"] == 5 and "sink.mlflow.failed_links" not in stats


@pytest.mark.integration
def test_server_stopped_mid_run(tmp_path):
    """The server dies mid-run: the program finishes, failed batches are counted, flush and shutdown return."""
    base_url, popen = start_mlflow_server(tmp_path / "server")
    try:
        configure(tmp_path, base_url, project="dies")
        first = rollout(1, 0)
        assert rtrace.flush(60)
        assert search(base_url, experiment_id(base_url, "dies")) == ["tr-" + first]
    finally:
        stop_server(popen)
    for i in range(1, 4):
        rollout(1, i)
    # the sink gave up on the batch within its bounded retries, and flush says so
    assert rtrace.flush(60) is False
    stats = rtrace.stats()
    assert stats["sink.mlflow.exported"] == 1
    assert stats["sink.mlflow.failed_batches"] >= 1 and stats["sink.mlflow.failed_trajectories"] == 3
    assert stats["sink.jsonl.exported"] == 4  # the other sink is unaffected
    rtrace.shutdown()
