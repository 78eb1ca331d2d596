"""rtrace.compat._after_import: a framework's module patched when imported, never imported by rtrace."""

from __future__ import annotations

import importlib
import sys

import pytest

from rtrace import _stats
from rtrace.compat._after_import import when_imported


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A package ``rtrace_probe_pkg`` with a module ``mod`` (``VALUE = 1``) on sys.path, never
    imported yet; removed from sys.modules afterwards."""
    root = tmp_path / "rtrace_probe_pkg"
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "mod.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "rtrace_probe_pkg.mod"
    for name in [n for n in sys.modules if n.startswith("rtrace_probe_pkg")]:
        del sys.modules[name]


def test_the_callback_runs_at_the_import_and_not_before(package):
    """Registered before the import: nothing is imported, the callback runs once, on the module,
    right after its code; registered after: it runs at once."""
    seen = []

    def patch(module):
        seen.append(module.VALUE)
        module.VALUE = 2

    assert when_imported(package, patch) is False and when_imported(package, patch) is False
    assert package not in sys.modules and "rtrace_probe_pkg" not in sys.modules
    assert importlib.import_module(package).VALUE == 2 and seen == [1]
    assert when_imported(package, lambda module: seen.append(module.VALUE)) is True and seen == [1, 2]


def test_a_failing_callback_never_fails_the_import(package):
    """The module imports as it would without rtrace; the error is counted."""
    before = _stats.snapshot().get("internal_errors", 0)

    def broken(module):
        raise RuntimeError("boom")

    when_imported(package, broken)
    assert importlib.import_module(package).VALUE == 1
    assert _stats.snapshot()["internal_errors"] == before + 1
