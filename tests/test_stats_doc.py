"""docs/stats.md names every counter rtrace counts: a loss nobody can look up is a loss
without a counter."""

from __future__ import annotations

import ast
import pathlib
import re

import rtrace

ROOT = pathlib.Path(rtrace.__file__).parent
DOC = (ROOT.parent / "docs" / "stats.md").read_text()


def _counters() -> set[str]:
    """Every counter name given as a string literal to ``_stats.incr`` (an f-string's fixed
    start: ``collector_refused.``, ``sink.`` ...)."""
    out = set()
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "incr" and node.args):
                continue
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                out.add(arg.value)
            elif isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
                out.add(arg.values[0].value + "<")
            elif isinstance(arg, ast.IfExp):
                out.update(v.value for v in (arg.body, arg.orelse) if isinstance(v, ast.Constant))
    return out


def _documented(name: str) -> bool:
    if f"`{name}`" in DOC or (name.endswith("<") and f"`{name[:-1]}" in DOC):
        return True
    if name.startswith("sink."):  # sink.<name>.<counter>
        rest = name.split(".", 2)[-1]
        return f"sink.<name>.{rest}" in DOC or re.search(rf"`sink\.[a-z]+\.{re.escape(rest)}`", DOC) is not None \
            or f"`.{rest}`" in DOC
    if "." in name:  # a family: `prefix.<what>`
        return f"`{name.rsplit('.', 1)[0]}.<" in DOC
    # a family written with slashes: `trajectories_kept_sampled` / `_error` ...
    return any(f"`_{name.split('_', 2)[-1]}`" in line and name.rsplit("_", 1)[0] in line
               for line in DOC.splitlines() if f"_{name.rsplit('_', 1)[-1]}`" in line)


def test_every_counter_is_in_docs_stats():
    missing = sorted(n for n in _counters() if not _documented(n))
    assert missing == [], f"counters not in docs/stats.md: {missing}"
