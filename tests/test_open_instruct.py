"""rtrace.compat.open_instruct: checked against open-instruct's real names, on data of its real shape.

open-instruct is not on PyPI and its rollout path imports vLLM, olmo_core and deepspeed: no
test here can import it. So (1) every field, function, parameter and call the adapter uses is
checked against ``tests/frameworks/open_instruct_names.json``, read with ``ast`` out of the
real code at the commit it names (``OPEN_INSTRUCT_DIR=<checkout>`` reads it again and
compares); (2) the adapter runs on ``GenerationResult`` / ``Batch`` objects with exactly those
fields; (3) ``install()`` wraps a module of the real function's signature, called the two
ways open-instruct calls it (the data preparation loop, ``maybe_evaluate``).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import os
import sys
import types
from pathlib import Path

import pytest

import rtrace
import rtrace.testing
from rtrace.compat import open_instruct
from tests.frameworks.open_instruct_names import MANIFEST, extract

ROOT = Path(__file__).resolve().parents[1]
NAMES = json.loads(MANIFEST.read_text())


def attributes_read(module_path: Path, var: str) -> set[str]:
    tree = ast.parse(module_path.read_text())
    return {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
            and n.value.id == var}


class TestTheRealNames:
    def test_fields_the_adapter_reads_exist(self):
        """Every attribute the adapter reads on a GenerationResult and a Batch is a field of the
        real dataclass."""
        path = ROOT / "rtrace" / "compat" / "open_instruct.py"
        assert attributes_read(path, "result") <= set(NAMES["classes"]["GenerationResult"])
        assert attributes_read(path, "batch") <= set(NAMES["classes"]["Batch"])
        assert {"responses", "masks", "finish_reasons"} <= attributes_read(path, "result")

    def test_the_wrapped_function_and_its_callers(self):
        """accumulate_inference_batches takes training_step (8th), both callers look it up at call
        time (a global of data_loader, an attribute of data_loader_lib), and maybe_evaluate is the
        evaluation caller's name."""
        params = NAMES["functions"]["accumulate_inference_batches"]
        assert params.index("training_step") == 7
        assert NAMES["calls"]["DataPreparationActor._data_preparation_loop"]["calls"] == ["accumulate_inference_batches"]
        assert NAMES["calls"]["maybe_evaluate"]["calls"] == ["data_loader_lib.accumulate_inference_batches"]
        from rtrace.compat import _open_instruct_private

        for name in _open_instruct_private.PRIVATE_NAMES:
            module, _, attr = name.partition(":")
            if module.startswith("open_instruct"):
                assert attr in NAMES["functions"], name

    @pytest.mark.skipif(not os.environ.get("OPEN_INSTRUCT_DIR"), reason="set OPEN_INSTRUCT_DIR to an open-instruct "
                        "checkout to read the names again")
    def test_the_names_file_matches_the_checkout(self):
        got = extract(Path(os.environ["OPEN_INSTRUCT_DIR"]))
        assert {k: v for k, v in got.items() if k != "commit"} == {k: v for k, v in NAMES.items() if k != "commit"}


def real_shape(name: str, **values):
    """An object with exactly the real dataclass's fields (the names file)."""
    cls = dataclasses.make_dataclass(name, [(f, object, dataclasses.field(default=None))
                                            for f in NAMES["classes"][name]])
    unknown = set(values) - set(NAMES["classes"][name])
    assert not unknown, unknown
    return cls(**values)


def step_data():
    """Two prompts (dataset indices 7 and 3) x 2 samples; sample 1 called a tool (mask 0 on its
    output), sample 3 was cut by the length limit."""
    result = real_shape(
        "GenerationResult",
        responses=[[10, 11, 2], [12, 13, 20, 21, 14, 2], [15, 2], [16, 17, 18]],
        finish_reasons=["stop", "stop", "stop", "length"],
        masks=[[1, 1, 1], [1, 1, 0, 0, 1, 1], [1, 1], [1, 1, 1]],
        request_info=real_shape("RequestInfo", num_calls=[0, 1, 0, 0], tool_outputs=["", "4", "", ""]),
        index=None, prompt_id=None, model_step=4)
    batch = real_shape("Batch", queries=[[1, 2], [1, 2], [5, 6], [5, 6]], indices=[7, 7, 3, 3],
                       scores=[1.0, 0.0, 1.0, 0.0], model_steps=[4, 4, 3, 4], ground_truths=[None] * 4,
                       datasets=["gsm8k"] * 4)
    return result, batch


class TestLogBatch:
    def test_one_trajectory_per_sample(self):
        """Each sample: its query, the model's turns and the tool's output, finish reason, score,
        coordinates (dense sample_index per dataset index, rollout_n, group_id, policy_version)."""
        result, batch = step_data()
        with rtrace.testing.capture() as got:
            assert open_instruct.log_batch(result, batch, step=5) == 4
            trajs = sorted(got.trajectories, key=lambda t: (t.sample_index, t.rollout_n))
        assert [(t.step, t.sample_index, t.rollout_n, t.group_id, t.policy_version, t.reward) for t in trajs] == [
            (5, 0, 0, "7", 4, 1.0), (5, 0, 1, "7", 4, 0.0), (5, 1, 0, "3", 3, 1.0), (5, 1, 1, "3", 4, 0.0)]
        tool = trajs[1]
        assert [(s.attributes["rtrace.role"], s.response_ids) for s in tool.spans[1:]] == [
            ("assistant", [12, 13]), ("tool", [20, 21]), ("assistant", [14, 2])]
        assert tool.spans[1].prompt_ids == [1, 2] and tool.finish_reason == "stop"
        assert trajs[3].finish_reason == "length" and trajs[3].verdict() == "truncated"


class TestInstall:
    @pytest.fixture
    def data_loader(self, monkeypatch):
        """``open_instruct.data_loader`` with accumulate_inference_batches of the real signature (the
        names file), returning what the real one returns: (result, batch, metrics, stats)."""
        params = NAMES["functions"]["accumulate_inference_batches"]
        ns: dict = {}
        exec(f"def accumulate_inference_batches({', '.join(params)}):\n    return DATA, DATA_BATCH, {{}}, None\n", ns)
        module = types.ModuleType("open_instruct.data_loader")
        ns["accumulate_inference_batches"].__globals__["DATA"], ns["accumulate_inference_batches"].__globals__[
            "DATA_BATCH"] = step_data()
        module.accumulate_inference_batches = ns["accumulate_inference_batches"]
        package = types.ModuleType("open_instruct")
        package.data_loader = module
        monkeypatch.setitem(sys.modules, "open_instruct", package)
        monkeypatch.setitem(sys.modules, "open_instruct.data_loader", module)
        return module

    def test_training_and_evaluation_calls(self, data_loader):
        """The data preparation loop's call (training_step as a keyword) gives training trajectories
        of that step; maybe_evaluate's gives validation ones; what open-instruct gets back is
        unchanged."""
        assert open_instruct.install() and open_instruct.install()  # idempotent
        n = len(inspect.signature(data_loader.accumulate_inference_batches.__wrapped__).parameters)
        args = [None] * n

        def maybe_evaluate():
            return data_loader.accumulate_inference_batches(*args[:7], 9, *args[8:])

        with rtrace.testing.capture() as got:
            kwargs = dict(zip(NAMES["functions"]["accumulate_inference_batches"], args))
            kwargs["training_step"] = 8
            out = data_loader.accumulate_inference_batches(**kwargs)
            out_eval = maybe_evaluate()
            trajs = got.trajectories
        assert out[0] is out_eval[0] and out[0].responses[0] == [10, 11, 2]
        assert sorted({(t.step, t.validate) for t in trajs}) == [(8, False), (9, True)]
        assert len(trajs) == 8
