# Copyright 2025 Bytedance Ltd. and/or its affiliates
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""veRL's own ``tests/utils/test_rollout_trace_on_cpu.py``, ported to rtrace's shim.

Source: volcengine/verl, ``tests/utils/test_rollout_trace_on_cpu.py`` as of commit
b178a3cd56f58b2d502255daba591e92833930a7 (the file last changed in 53d97537, "limit
tracing samples"); the verl 0.9.1 sdist and wheel do not ship ``tests/utils``. Changes:

* the import is ``rtrace.compat.verl`` instead of ``verl.utils.rollout_trace``;
* the mocked weave client is replaced by rtrace's real JSONL sink, read back: where the
  original asserts ``create_call`` / ``finish_call`` on the mock, this asserts the
  spans written (name = the method's ``__qualname__``, input = the bound arguments,
  output = the return value, error status). ``backend="weave"`` becomes ``"jsonl"``;
* ``get_client()`` is always None in rtrace (its sinks run in their own threads), where
  veRL returns the weave client;
* the weave integration test is skipped (rtrace has no weave sink); the MLflow one runs
  against rtrace's MLflow sink on a temporary SQLite store instead of being gated on
  ``RUN_MLFLOW_INTEGRATION_TESTS``.
"""

import pytest

pytest.importorskip("verl")

import rtrace  # noqa: E402
from rtrace.compat.verl import RolloutTraceConfig, rollout_trace_attr, rollout_trace_op  # noqa: E402
from rtrace.exporters.jsonl import read_jsonl  # noqa: E402


@pytest.fixture(autouse=True)
def reset_rollout_trace_config_singleton(monkeypatch, tmp_path):
    """Fixture to reset the RolloutTraceConfig singleton before each test (and send the
    JSONL sink to a temporary file)."""
    RolloutTraceConfig.reset()
    monkeypatch.setenv("RTRACE_JSONL_PATH", str(tmp_path / "trace.jsonl"))
    monkeypatch.setenv("RTRACE_EXPORT_INTERVAL_S", "0.05")
    yield
    RolloutTraceConfig.reset()


@pytest.fixture
def traces(tmp_path):
    """Reads back what the JSONL sink wrote (replaces the mocked weave client)."""

    def read(timeout=10):
        if rtrace.is_enabled():
            assert rtrace.flush(timeout)
        path = tmp_path / "trace.jsonl"
        return read_jsonl(path) if path.exists() else []

    return read


def op_spans(trajs):
    """(name, input, output, status) of every op span (not the rollout_trace_attr roots)."""
    return [(s.name, s.input, s.output, s.status) for t in trajs for s in t.spans if s.kind != "rollout"]


class TracedClass:
    @rollout_trace_op
    # @weave.op
    # @mlflow.trace
    async def my_method(self, a, b="default"):
        return f"result: {a}, {b}"

    @rollout_trace_op
    # @weave.op
    # @mlflow.trace
    async def middle_method(self, a, b="default"):
        await self.my_method("test_a1", b="test_b1")
        return f"result: {a}, {b}"

    @rollout_trace_op
    # @mlflow.trace
    async def my_method_with_exception(self):
        raise ValueError("Test Exception")

    async def upper_method(self):
        await self.my_method("test_a0", b="test_b0")
        await self.middle_method("test_a2", b="test_b2")
        return True


class UntracedClass:
    @rollout_trace_op
    async def my_method(self, x):
        return x * 2


async def test_rollout_trace_on_untraced_class(traces):
    """Tests that the decorator works correctly when no backend is configured."""
    instance = UntracedClass()
    assert await instance.my_method(10) == 20
    assert traces() == [] and not rtrace.is_enabled()


async def test_rollout_trace_with_tracer(traces):
    """Tests that the decorator records the op's name, bound inputs and output."""
    RolloutTraceConfig.init(project_name="my-project", experiment_name="my-experiment", backend="jsonl")
    instance = TracedClass()
    assert RolloutTraceConfig.get_client() is None  # veRL: the weave client

    result = await instance.my_method("test_a", b="test_b")

    assert result == "result: test_a, test_b"
    (traj,) = traces()
    expected_inputs = {"a": "test_a", "b": "test_b"}
    assert op_spans([traj]) == [("TracedClass.my_method", expected_inputs, result, "ok")]
    assert traj.experiment == "my-experiment"


async def test_rollout_trace_with_exception(traces):
    """Tests that the span is finished with the exception when one is raised."""
    RolloutTraceConfig.init(project_name="my-project", experiment_name="my-experiment", backend="jsonl")
    instance = TracedClass()

    with pytest.raises(ValueError, match="Test Exception"):
        await instance.my_method_with_exception()

    (traj,) = traces()
    (span,) = traj.spans
    assert (span.name, span.status, span.error) == (
        "TracedClass.my_method_with_exception", "error", "ValueError: Test Exception")


async def test_rollout_trace_with_dummy_backend(traces):
    """Tests that nothing is traced when the backend is 'dummy'."""
    RolloutTraceConfig.init(project_name="my-project", experiment_name="my-experiment", backend="dummy")
    instance = TracedClass()

    await instance.my_method("test_a")

    assert traces() == []


async def test_trace_disabled_with_trace_false(traces):
    """Tests that tracing is disabled when trace=False."""
    RolloutTraceConfig.init(
        project_name="my-project",
        experiment_name="my-experiment",
        backend="jsonl",
    )
    instance = TracedClass()

    assert RolloutTraceConfig.get_backend() == "jsonl"

    with rollout_trace_attr(step=1, sample_index=0, rollout_n=0, trace=False):
        result = await instance.my_method("test_a", b="test_b")
        assert result == "result: test_a, test_b"

    # No tracing should have occurred
    assert traces() == []

    # Verify that tracing works again with trace=True (default)
    with rollout_trace_attr(step=1, sample_index=0, rollout_n=0):
        result = await instance.my_method("test_a", b="test_b")
        assert result == "result: test_a, test_b"

    (traj,) = traces()
    assert (traj.step, traj.sample_index, traj.rollout_n) == (1, 0, 0)
    assert [s.name for s in traj.spans] == ["rollout_trace", "TracedClass.my_method"]


async def test_trace_false_disables_nested_trace_ops(traces):
    """Tests that trace=False disables all nested @rollout_trace_op calls."""
    RolloutTraceConfig.init(
        project_name="my-project",
        experiment_name="my-experiment",
        backend="jsonl",
    )
    instance = TracedClass()

    with rollout_trace_attr(step=1, sample_index=0, rollout_n=0, trace=False):
        # Call upper_method which internally calls my_method and middle_method
        # All of these are decorated with @rollout_trace_op
        result = await instance.upper_method()
        assert result is True

    # No tracing should have occurred for any of the nested calls
    assert traces() == []

    with rollout_trace_attr(step=1, sample_index=0, rollout_n=0):
        result = await instance.my_method("test_a", b="test_b")
        assert result == "result: test_a, test_b"

    assert len(op_spans(traces())) == 1


async def test_trace_enabled_restored_after_exception(traces):
    """Tests that trace state is restored even if an exception occurs when trace=False."""
    RolloutTraceConfig.init(
        project_name="my-project",
        experiment_name="my-experiment",
        backend="jsonl",
    )
    instance = TracedClass()

    assert RolloutTraceConfig.get_backend() == "jsonl"

    # Use trace=False and raise an exception
    try:
        with rollout_trace_attr(step=1, sample_index=0, rollout_n=0, trace=False):
            raise RuntimeError("Test exception with trace disabled")
    except RuntimeError:
        pass

    with rollout_trace_attr(step=1, sample_index=0, rollout_n=0):
        result = await instance.my_method("test_a", b="test_b")
        assert result == "result: test_a, test_b"

    assert len(op_spans(traces())) == 1


@pytest.mark.skip(reason="weave only: rtrace has no weave sink (the original needs a weave project and "
                  "RUN_WEAVE_INTEGRATION_TESTS=true)")
async def test_rollout_trace_with_real_weave_backend():
    """Integration test with a real weave backend."""


@pytest.mark.integration
async def test_rollout_trace_with_real_mlflow_backend(traces, tmp_path, monkeypatch):
    """Integration test with a real mlflow backend (rtrace's MLflow sink, SQLite store);
    the trace is read back with MLflow's own client."""
    import mlflow
    from mlflow import MlflowClient
    from mlflow.tracking import fluent
    from mlflow.tracking._tracking_service import utils

    monkeypatch.setattr(utils, "_tracking_uri", None)
    monkeypatch.setattr(fluent, "_active_experiment_id", None)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    RolloutTraceConfig.init(project_name="my-project", experiment_name="my-experiment", backend="mlflow,jsonl")

    instance = TracedClass()

    with rollout_trace_attr(step=1, sample_index=2, rollout_n=3, name="agent_run"):
        assert await instance.upper_method()

    (traj,) = traces(timeout=120)  # a new MLflow SQLite store migrates its schema first
    trace = MlflowClient(tracking_uri=uri).get_trace("tr-" + traj.trace_id)
    spans = trace.data.spans
    assert [s.name for s in spans] == ["agent_run", "TracedClass.my_method", "TracedClass.middle_method",
                                       "TracedClass.my_method"]
    assert [s.parent_id for s in spans] == [None, spans[0].span_id, spans[0].span_id, spans[2].span_id]
    assert spans[2].inputs == {"a": "test_a2", "b": "test_b2"} and spans[2].outputs == "result: test_a2, test_b2"
    assert {k: spans[3].attributes[f"rl.{k}"] for k in ("step", "sample_index", "rollout_n")} == {
        "step": 1, "sample_index": 2, "rollout_n": 3}
    while mlflow.active_run() is not None:
        mlflow.end_run()
