"""rtrace's GenAI conventions rendered natively, in a real browser (issue #36).

The feature trajectories (tests/semconv_job.py: a tool-calling agent loop given chat
messages, rewards with components, a validation, a truncated and a failed rollout, a
tensor batch...) are written by tests/ui/genai_job.py, in its own process, to:

* a real ``mlflow server`` (SQLite, 127.0.0.1): once through rtrace's OTLP sink to its
  ``/v1/traces`` endpoint (MLflow translates the GenAI attributes itself), once through
  rtrace's MLflow sink (which adds span types, chat inputs and the reward assessments);
* a real Phoenix (``arize-phoenix`` from PyPI in ``.venv-phoenix``, which ``make test-ui``
  builds; ``phoenix serve`` on 127.0.0.1), through the OTLP sink.

Playwright drives Debian's chromium through each UI; screenshots go to ``artifacts/ui/``
(or ``$RTRACE_UI_ARTIFACTS``). What each backend renders wrong is asserted as it is and
explained in docs/semconv.md ("Rendered by the backends"): a change there fails here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("playwright.sync_api", reason="make test-ui installs playwright")

from tests.semconv_job import ANSWER, QUESTION, SYSTEM  # noqa: E402
from tests.servers import free_port, start_mlflow_server, stop_server, wait_http  # noqa: E402

from tests.ui.browser import ARTIFACTS, REPO  # noqa: E402
PHOENIX = os.environ.get("RTRACE_PHOENIX") or str(REPO / ".venv-phoenix" / "bin" / "phoenix")
#: Phoenix's first project ("default"): its GraphQL id, base64 of "Project:1"
PHOENIX_PROJECT = "UHJvamVjdDox"
TIMEOUT_MS = 30_000

pytestmark = pytest.mark.integration


def _job(*args: str) -> dict:
    """Run tests/ui/genai_job.py with ``args``; returns its trace ids."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RTRACE_", "OTEL_"))}
    env.update(HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    job = subprocess.run([sys.executable, str(REPO / "tests" / "ui" / "genai_job.py"), *args], env=env,
                         capture_output=True, text=True, timeout=600)
    assert job.returncode == 0, job.stderr[-4000:]
    return json.loads(job.stdout.strip().splitlines()[-1])


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.load(resp)


@pytest.fixture(scope="module")
def mlflow_ui(tmp_path_factory):
    """A real mlflow server holding the feature trajectories twice: experiment ``otlp`` (rtrace's
    OTLP sink to /v1/traces) and ``sink`` (rtrace's MLflow sink). Yields a dict of both."""
    base, popen = start_mlflow_server(tmp_path_factory.mktemp("mlflow-ui"))
    try:
        otlp_exp = _post(f"{base}/api/2.0/mlflow/experiments/create", {"name": "otlp"})["experiment_id"]
        otlp_ids = _job("otlp", f"{base}/v1/traces", f"x-mlflow-experiment-id={otlp_exp}")
        sink_ids = _job("mlflow", base, "sink")
        with urllib.request.urlopen(f"{base}/api/2.0/mlflow/experiments/get-by-name?experiment_name=sink") as r:
            sink_exp = json.load(r)["experiment"]["experiment_id"]
        yield {"base": base, "otlp": (otlp_exp, otlp_ids), "sink": (sink_exp, sink_ids)}
    finally:
        stop_server(popen)


@pytest.fixture(scope="module")
def phoenix_ui(tmp_path_factory):
    """A real Phoenix (``phoenix serve``, SQLite in a temporary folder) holding the feature
    trajectories sent by rtrace's OTLP sink. Yields (base URL, trace ids)."""
    if not Path(PHOENIX).exists():
        pytest.skip(f"no Phoenix at {PHOENIX} (make test-ui installs it in .venv-phoenix)")
    work = tmp_path_factory.mktemp("phoenix")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RTRACE_", "OTEL_", "PHOENIX_"))}
    env.update(PHOENIX_HOST="127.0.0.1", PHOENIX_PORT=str(port), PHOENIX_GRPC_PORT=str(free_port()),
               PHOENIX_WORKING_DIR=str(work), PHOENIX_TELEMETRY_ENABLED="false")
    with open(work / "phoenix.log", "wb") as log:
        popen = subprocess.Popen([PHOENIX, "serve"], env=env, stdout=log, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_http(f"{base}/healthz", 180, popen)
        except RuntimeError as exc:
            pytest.fail(f"{exc}\n{(work / 'phoenix.log').read_text(errors='replace')[-3000:]}")
        yield base, _job("otlp", f"{base}/v1/traces")
    finally:
        stop_server(popen)


@pytest.fixture
def page(browser):
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    context = browser.new_context(viewport={"width": 1800, "height": 1100})
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    yield page
    context.close()


def _shot(page, name: str) -> None:
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


# ----------------------------------------------------------------------------- MLflow
def _mlflow_traces(page, base: str, experiment: str) -> None:
    """The experiment's traces list, without the assistant panel and the first-visit tip."""
    page.goto(f"{base}/#/experiments/{experiment}/traces")
    page.get_by_text("Rows per page").wait_for()
    page.get_by_role("button", name="Close guidance", exact=True).click()  # the tip's popover hides the rows
    page.get_by_role("button", name="Close", exact=True).first.click()  # the assistant's panel
    try:
        page.get_by_role("row").nth(1).wait_for()
    except Exception:
        _shot(page, f"mlflow-traces-{experiment}-not-loaded")
        raise


def _mlflow_open(page, trace_id: str) -> None:
    """Open one trace's detail from the list (a click on its row's time cell)."""
    row = page.get_by_role("row").filter(has_text=trace_id)
    row.first.get_by_role("cell").nth(1).click()
    page.get_by_text("Inputs / Outputs").first.wait_for()


def _expect(page, texts, shot: str) -> None:
    """Each text is on the page (exactly, as an element's whole text); else a screenshot
    ``<shot>-failed`` and the missing ones."""
    body = page.locator("body")
    for _ in range(40):  # the detail pane loads the selected span asynchronously: up to ~10 s
        missing = [text for text in texts if body.get_by_text(text, exact=True).count() == 0]
        if not missing:
            return
        page.wait_for_timeout(250)
    if missing:
        _shot(page, f"{shot}-failed")
    assert not missing, f"not on the page: {missing}"


def _span(page, name: str, nth: int = 0) -> None:
    """Select the ``nth`` span of that name in the trace's tree (the selected span's name is
    also the detail's title: the agent span, a unique name, is selected first)."""
    if nth:
        page.get_by_text("invoke_agent agent", exact=True).first.click()
        page.wait_for_timeout(500)
    page.get_by_text(name, exact=True).nth(nth).click()
    page.wait_for_timeout(500)


def test_mlflow_renders_rtrace_otlp_as_an_agent_trace(page, mlflow_ui):
    """OTLP into `mlflow server`: agent / chat / tool spans by their GenAI names and types, the
    prompts and answers as a chat, tool arguments and results; the evaluation events on the root."""
    base = mlflow_ui["base"]
    exp, ids = mlflow_ui["otlp"]
    _mlflow_traces(page, base, exp)
    _shot(page, "mlflow-otlp-traces")
    _mlflow_open(page, ids["train1"])
    for name in ("invoke_agent rollout", "invoke_agent agent", "chat toy-policy", "execute_tool calculator",
                 "execute_tool lookup"):
        assert page.get_by_text(name, exact=True).count() >= 1, name
    _span(page, "chat toy-policy")  # the first turn: given the system prompt and the question, it calls the tool
    detail = page.locator("body")
    _expect(page, ("System", SYSTEM, "User", QUESTION, "Assistant", "Tool calls", "calculator", "expression"),
            "mlflow-otlp-chat-span")
    _shot(page, "mlflow-otlp-chat-span")
    _span(page, "chat toy-policy", 1)  # the second: the whole conversation in, the answer out
    _expect(page, ("51", ANSWER), "mlflow-otlp-chat-answer")
    _shot(page, "mlflow-otlp-chat-answer")
    _span(page, "execute_tool calculator")
    _expect(page, ("17 * 3", "51"), "mlflow-otlp-tool-span")
    _shot(page, "mlflow-otlp-tool-span")
    _span(page, "invoke_agent rollout")
    page.get_by_role("tab", name="Events").click()
    assert detail.get_by_text("gen_ai.evaluation.result").count() >= 1
    _shot(page, "mlflow-otlp-root-events")


def test_mlflow_shows_a_reasoning_part_as_raw_json(page, mlflow_ui):
    """Rendered wrong (docs/semconv.md): MLflow 3.17's chat view takes only text, tool_call and
    tool_call_response parts; a message with a reasoning part is shown as raw data."""
    base = mlflow_ui["base"]
    exp, ids = mlflow_ui["otlp"]
    _mlflow_traces(page, base, exp)
    _mlflow_open(page, ids["train0"])  # its answer starts with <think>: a reasoning part
    _span(page, "chat toy-policy", 1)
    _shot(page, "mlflow-otlp-reasoning-part")
    detail = page.locator("body")
    # the message's keys and the part's type as data (a chat view shows neither)
    _expect(page, ("reasoning", "finish_reason", "parts"), "mlflow-otlp-reasoning-part")


def test_mlflow_sink_shows_rewards_as_assessments(page, mlflow_ui):
    """The MLflow sink: reward, verdict and each component as assessments, columns of the traces
    list and in the trace's Assessments panel; searchable through MLflow's own API."""
    from mlflow import MlflowClient

    base = mlflow_ui["base"]
    exp, ids = mlflow_ui["sink"]
    client = MlflowClient(tracking_uri=base)
    wrong = client.search_traces(locations=[exp], filter_string="feedback.verdict = 'wrong'")
    assert [t.info.trace_id for t in wrong] == ["tr-" + ids["train1"]]
    rewarded = client.search_traces(locations=[exp], filter_string="feedback.reward > 0.5")
    assert {t.info.trace_id for t in rewarded} >= {"tr-" + ids["train0"], "tr-" + ids["validate"]}
    [train0] = [t for t in rewarded if t.info.trace_id == "tr-" + ids["train0"]]
    assert {a.name: a.value for a in train0.info.assessments} == {
        "reward": 1.0, "verdict": "correct", "correct": True, "format": 0.5}

    page.set_viewport_size({"width": 2600, "height": 1100})  # the assessment columns come after the tags
    _mlflow_traces(page, base, exp)
    headers = page.get_by_role("columnheader").all_inner_texts()
    for name in ("reward", "verdict", "correct", "format"):
        assert any(h.strip() == name for h in headers), (name, headers)
    row = page.get_by_role("row").filter(has_text=ids["train1"]).first
    cells = [c.strip() for c in row.get_by_role("cell").all_inner_texts()]
    assert "wrong" in cells and "False" in cells, cells
    _shot(page, "mlflow-sink-traces-assessments")
    _mlflow_open(page, ids["train1"])
    panel = page.locator("body")
    for text in ("reward", "verdict", "wrong", "correct", "format"):
        assert panel.get_by_text(text, exact=True).count() >= 1, text
    _span(page, "chat toy-policy")
    for text in ("System", SYSTEM, "User", QUESTION):
        assert panel.get_by_text(text, exact=True).count() >= 1, text
    _shot(page, "mlflow-sink-trace")


# ----------------------------------------------------------------------------- Phoenix
def _phoenix_trace(page, base: str, trace_id: str) -> None:
    page.goto(f"{base}/projects/{PHOENIX_PROJECT}/spans/{trace_id}")
    page.get_by_text("invoke_agent rollout", exact=True).first.wait_for()


def test_phoenix_renders_rtrace_otlp_as_an_agent_trace(page, phoenix_ui):
    """Phoenix: the trajectory as an agent trace (kinds agent, llm, tool) with the prompt and the
    answer as messages, the tool's arguments and result."""
    base, ids = phoenix_ui
    page.goto(f"{base}/projects/{PHOENIX_PROJECT}/spans")
    page.get_by_text("invoke_agent rollout", exact=True).first.wait_for()
    assert page.get_by_text("agent", exact=True).count() >= 6  # the roots' kind column
    _shot(page, "phoenix-spans")
    _phoenix_trace(page, base, ids["train1"])
    detail = page.locator("body")
    _expect(page, ("invoke_agent agent", "chat toy-policy", "execute_tool calculator", "execute_tool lookup"),
            "phoenix-trace")
    _span(page, "chat toy-policy")
    _expect(page, ("system", SYSTEM, "user", QUESTION), "phoenix-chat-span")
    _shot(page, "phoenix-chat-span")
    _span(page, "chat toy-policy", 1)
    _expect(page, ("assistant", ANSWER), "phoenix-chat-answer")
    _shot(page, "phoenix-chat-answer")
    _span(page, "execute_tool calculator")
    assert detail.get_by_text("51").count() >= 1
    _shot(page, "phoenix-tool-span")
    _phoenix_trace(page, base, ids["train1"])  # opens with the root selected (the spans list is behind it)
    page.get_by_role("tab", name="Events").click()
    events = page.get_by_text("gen_ai.evaluation.result")
    events.first.wait_for()
    assert events.count() == 3  # reward, correct, format
    _shot(page, "phoenix-root-events")
