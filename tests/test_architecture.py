"""The house follows the data: imports flow instrumentation -> pipeline -> exporters."""

from __future__ import annotations

import ast
import pathlib

import pytest

import rtrace
import rtrace.testing

ROOT = pathlib.Path(rtrace.__file__).parent

#: layer -> the rtrace packages it must never import (nothing imports upward)
FORBIDDEN = {
    "exporters": ("rtrace.instrumentation", "rtrace.pipeline", "rtrace.compat", "rtrace.gateway", "rtrace._setup",
                  "rtrace.cli"),
    "pipeline": ("rtrace.instrumentation", "rtrace.compat", "rtrace.gateway", "rtrace._setup", "rtrace.cli"),
    "instrumentation": ("rtrace.exporters", "rtrace.compat", "rtrace.gateway", "rtrace._setup", "rtrace.cli"),
    # the dataset (rtrace/dataset/: schema, encoding, layout, writer, reader): below the sinks that
    # write it and the report that reads it, above the bottom layer only
    "dataset": ("rtrace.instrumentation", "rtrace.pipeline", "rtrace.exporters", "rtrace.compat", "rtrace._setup",
                "rtrace.cli", "rtrace.report", "rtrace.gateway"),
    # the capture gateway stands beside compat/: it opens spans through the runtime and may use
    # the pipeline and the exporters (its collector hop), but is built by _setup / the CLI only
    "gateway": ("rtrace.compat", "rtrace._setup", "rtrace.cli"),
    # the bottom layer: the model, settings, counters, conversion and ids
    "bottom": ("rtrace.instrumentation", "rtrace.pipeline", "rtrace.exporters", "rtrace.compat", "rtrace.gateway",
               "rtrace._setup", "rtrace.cli"),
}
#: layer -> modules of a forbidden layer it may import, and why
ALLOWED = {
    # one sampler: a reader cuts several collectors' samples with the selection the collectors
    # ran (rtrace/dataset/cut.py); sampling.py itself imports nothing of rtrace but _stats
    "dataset": ("rtrace.pipeline.sampling",),
}
BOTTOM = ("config.py", "trajectory.py", "summary.py", "_stats.py", "_serialize.py", "_ids.py", "placement.py",
          "events.py")


def _imports(path: pathlib.Path) -> set[str]:
    """Absolute names of the rtrace modules ``path`` imports (relative imports resolved)."""
    module = "rtrace." + ".".join(path.relative_to(ROOT).with_suffix("").parts)
    package = module.rsplit(".", 1)[0] if path.name != "__init__.py" else module.removesuffix(".__init__")
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            if name != "rtrace":  # `from .. import _stats` imports rtrace._stats, not the API
                out.add(name)
            out.update(f"{name}.{a.name}" for a in node.names)
    return {n for n in out if n == "rtrace" or n.startswith("rtrace.")}


def _layer_files():
    for layer in ("exporters", "pipeline", "instrumentation", "dataset", "gateway"):
        for path in sorted((ROOT / layer).rglob("*.py")):
            yield layer, path
    for name in BOTTOM:
        yield "bottom", ROOT / name


@pytest.mark.parametrize("layer, path", list(_layer_files()), ids=lambda v: getattr(v, "name", v))
def test_nothing_imports_upward(layer, path):
    """No module imports a layer upstream of it (a sink never imports a decorator, ...)."""
    allowed = ALLOWED.get(layer, ())
    bad = sorted(n for n in _imports(path)
                 if (n == "rtrace" or any(n == f or n.startswith(f + ".") for f in FORBIDDEN[layer]))
                 and not any(n == a or n.startswith(a + ".") for a in allowed))
    assert bad == [], f"{path.relative_to(ROOT)} imports upward: {bad}"


def test_importing_rtrace_imports_no_server():
    """``import rtrace`` (which re-exports gateway_access) loads none of the gateway's server
    dependencies: starlette, uvicorn and httptools are imported when a gateway starts."""
    import subprocess
    import sys

    code = ("import sys, rtrace; print(sorted(m for m in ('starlette', 'uvicorn', 'httptools', 'rtrace.gateway.app') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_checker_sees_an_upward_import(tmp_path):
    """The import check itself: a relative import of the decorators from a sink is found."""
    fake = ROOT / "exporters" / "_fake_for_test.py"
    fake.write_text("from ..instrumentation import decorators\n")
    try:
        assert "rtrace.instrumentation" in _imports(fake)
    finally:
        fake.unlink()


class TestTestingHelper:
    def test_capture_collects_in_memory(self):
        """rtrace.testing.capture() turns tracing on with a memory sink and resets afterwards."""

        @rtrace.traced_tool
        def add(a, b):
            return a + b

        with rtrace.testing.capture(max_traces_per_step=2) as got:
            for i in range(4):
                with rtrace.rollout_context(step=1, sample_index=i):
                    add(i, 1)
            trajectories = got.trajectories
            sampled_out = got.stats()["trajectories_sampled_out"]
        assert [(t.step, t.sample_index, t.spans[1].output) for t in trajectories] == [(1, 0, 1), (1, 1, 2)]
        assert sampled_out == 2
        assert rtrace.stats().get("trajectories_started", 0) == 0  # counters were reset

    def test_fixture(self, rtrace_capture):
        """The pytest fixture yields a Captured with tracing on."""
        with rtrace.rollout_context(step=7):
            pass
        assert [t.step for t in rtrace_capture.trajectories] == [7]


def test_what_the_dataset_may_import_of_the_pipeline_imports_nothing_upward():
    """The pipeline module the dataset reads (the sampler) imports nothing of rtrace but the bottom layer."""
    for name in ALLOWED["dataset"]:
        path = ROOT / (name.removeprefix("rtrace.").replace(".", "/") + ".py")
        assert {n for n in _imports(path) if not n.startswith("rtrace._stats")} == set()
