"""The published rl.* convention (docs/semconv.yaml, docs/semconv.md) against what rtrace
emits, both ways: every rl.* attribute on an exported span is listed for that span's group,
and every listed attribute is emitted by the feature trajectories (tests/semconv_job.py:
the agent loop with tools, rewards, annotations, health findings, validation, truncation,
errors, a segment, a tensor batch, a partial trajectory)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import rtrace
from rtrace.exporters import otel
from rtrace.testing import MemorySink
from tests import semconv_job

yaml = pytest.importorskip("yaml")

DOCS = Path(__file__).resolve().parents[1] / "docs"
REGISTRY = DOCS / "semconv.yaml"
TYPES = {"int": (int,), "double": (float,), "boolean": (bool,), "string": (str,), "string[]": (list, tuple)}
STABILITY = ("development", "release_candidate", "stable")
GROUPS = ("rl.trajectory", "rl.generation", "rl.tool", "rl.span")


def load_registry(path: Path = REGISTRY) -> tuple[dict[str, dict], dict[str, set[str]]]:
    """(attributes by key, span group -> the keys it lists), refs and ref_groups resolved."""
    doc = yaml.safe_load(path.read_text())
    assert doc["file_format"] == "definition/2"
    attrs = {a["key"]: a for a in doc["attributes"]}
    groups = {g["id"]: g for g in doc.get("attribute_groups", ())}

    def keys(entries) -> set[str]:
        out: set[str] = set()
        for entry in entries:
            if "ref_group" in entry:
                out |= keys(groups[entry["ref_group"]]["attributes"])
            else:
                out.add(entry["ref"])
        return out

    return attrs, {s["type"]: keys(s["attributes"]) for s in doc["spans"]}


def group_of(index: int, kind: str) -> str:
    """The convention's span group of a trajectory's span."""
    if index == 0 and kind != "segment":
        return "rl.trajectory"
    return {"generation": "rl.generation", "tool": "rl.tool"}.get(kind, "rl.span")


def registered(key: str, attrs: dict[str, dict]) -> str | None:
    """The registry key an emitted attribute falls under (itself, or a template prefix)."""
    if key in attrs:
        return key
    for name, spec in attrs.items():
        if spec["type"].startswith("template[") and key.startswith(name + "."):
            return name
    return None


def _type_name(value) -> str:
    for name, types in TYPES.items():
        if type(value) in types:
            return name
    return type(value).__name__


@pytest.fixture(scope="module")
def emitted(tok):
    """{(group, attribute key): a value seen} over the feature trajectories' exported spans
    (the default RTRACE_SEMCONV); asserts the rl.* attributes are the same in every mode."""
    from opentelemetry.sdk.resources import Resource

    sink = MemorySink()
    rtrace.configure(sinks=[sink], token2text=True, tokenizer=tok, experiment="exp-1", export_interval_s=0.02,
                     await_annotations="advantage", annotation_timeout_s=1.0)
    try:
        ids = semconv_job.run(tok, partial=True)
        assert rtrace.flush(60)
    finally:
        rtrace.shutdown()  # writes the open trajectory as partial
    ids.pop("partial_ctx").__exit__(None, None, None)
    trajectories = sink.trajectories
    assert any(t.partial for t in trajectories) and any(t.health for t in trajectories)
    seen: dict[tuple[str, str], object] = {}
    by_mode = {}
    for mode in ("both", "genai", "rtrace"):
        rl = []
        for traj in trajectories:
            for i, span in enumerate(otel.to_readable_spans(traj, Resource.get_empty(), semconv=mode)):
                kind = traj.spans[i].kind
                for key, value in span.attributes.items():
                    if key.startswith("rl."):
                        rl.append((traj.trace_id, i, key, value))
                        if mode == "both":
                            seen.setdefault((group_of(i, kind), key), value)
        by_mode[mode] = rl
    assert by_mode["both"] == by_mode["genai"] == by_mode["rtrace"], "rl.* must not depend on RTRACE_SEMCONV"
    reset = rtrace.testing.reset
    reset()
    return seen


def _snippet(missing: dict[str, set[tuple[str, str]]]) -> str:
    """The YAML to add for attributes emitted but not listed."""
    lines = ["attributes:"]
    refs = []
    for key, where in sorted(missing.items()):
        type_name = sorted({t for _, t in where})[0]
        lines += [f"  - key: {key}", f"    type: {type_name}", "    brief: <what it means>",
                  "    stability: development"]
        refs += [f"spans: {group}:  - ref: {key}" for group in sorted({g for g, _ in where})]
    return "\n".join(lines + ["", "and under the span group(s):"] + refs)


def unlisted(emitted: dict, attrs: dict, groups: dict) -> str:
    """What the registry lacks for ``emitted`` ({(group, key): value}), as the message that
    says what to add; empty when nothing."""
    missing: dict[str, set[tuple[str, str]]] = {}
    misplaced = []
    for (group, key), value in emitted.items():
        name = registered(key, attrs)
        if name is None:
            missing.setdefault(key, set()).add((group, _type_name(value)))
        elif name not in groups[group]:
            misplaced.append(f"{key} on {group} spans: add `- ref: {name}` to the {group} span group")
    out = []
    if missing:
        out.append("rl.* attributes emitted but not in docs/semconv.yaml (and docs/semconv.md's table); add:\n"
                   + _snippet(missing))
    if misplaced:
        out.append("rl.* attributes emitted on spans whose group does not list them:\n" + "\n".join(misplaced))
    return "\n".join(out)


def test_nothing_emitted_is_unlisted(emitted):
    """Every rl.* attribute on an exported span is in docs/semconv.yaml, for that span's group."""
    attrs, groups = load_registry()
    message = unlisted(emitted, attrs, groups)
    assert not message, message


def test_the_failure_says_what_to_add():
    """An attribute another change starts to emit is named, with its type and span group, as YAML to paste."""
    attrs, groups = load_registry()
    message = unlisted({("rl.span", "rl.gateway.route"): "/v1", ("rl.tool", "rl.step"): 1,
                        ("rl.generation", "rl.tool.reward"): 0.5}, attrs, groups)
    assert "  - key: rl.gateway.route\n    type: string\n" in message
    assert "spans: rl.span:  - ref: rl.gateway.route" in message
    assert "rl.tool.reward on rl.generation spans: add `- ref: rl.tool.reward` to the rl.generation span group" \
        in message
    assert "rl.step" not in message


def test_nothing_listed_is_never_emitted(emitted):
    """Every attribute docs/semconv.yaml lists for a span group is emitted there by the feature trajectories."""
    attrs, groups = load_registry()
    seen = {(group, registered(key, attrs)) for group, key in emitted}
    never = sorted(f"{key} on {group} spans" for group, keys in groups.items() for key in keys
                   if (group, key) not in seen)
    assert not never, ("listed in docs/semconv.yaml but never emitted by tests/semconv_job.py (remove it from the "
                       "YAML and docs/semconv.md, or make the job exercise it):\n" + "\n".join(never))


def _base_type(declared: str) -> str:
    """The type of a (template) attribute's values: ``template[double]`` -> ``double``."""
    return declared[len("template["):-1] if declared.startswith("template[") else declared


def test_emitted_types_match(emitted):
    """A listed attribute's values have its declared type (a template's too: ``template[any]`` when it
    carries what the application gave, any OTel primitive or a homogeneous array)."""
    attrs, _ = load_registry()
    wrong = []
    for (group, key), value in emitted.items():
        spec = attrs[registered(key, attrs)]
        base = _base_type(spec["type"])
        if base == "any":
            ok = isinstance(value, (str, int, float, bool)) or (
                isinstance(value, (list, tuple)) and len({type(v) for v in value}) <= 1)
        else:
            ok = type(value) in TYPES[base]
        if not ok:
            wrong.append(f"{key} on {group}: {value!r} is not {spec['type']}")
    assert not wrong, "\n".join(wrong)


def test_registry_is_well_formed():
    """Every attribute has a key, a known type, a brief and a stability; every ref resolves;
    the span groups are the four the docs name."""
    attrs, groups = load_registry()
    for key, spec in attrs.items():
        assert key.startswith("rl."), key
        base = _base_type(spec["type"])
        assert base in TYPES or (base == "any" and spec["type"] != "any"), (key, spec["type"])
        assert spec["brief"].strip() and spec["stability"] in STABILITY, key
    assert set(groups) == set(GROUPS)
    for group, keys in groups.items():
        assert keys <= set(attrs), (group, keys - set(attrs))


def test_docs_table_lists_the_registry():
    """docs/semconv.md's rl.* table names the same attributes, types, places and stabilities as the YAML."""
    attrs, groups = load_registry()
    text = (DOCS / "semconv.md").read_text()
    rows = {}
    for line in text.splitlines():
        m = re.match(r"\| `(rl\.[a-z0-9_.]+?)(\.<key>)?` \| (\S+) \| .+ \| (.+) \| (\w+) \|$", line)
        if m:
            rows[m.group(1)] = (m.group(3), m.group(4), m.group(5))
    assert set(rows) == set(attrs)
    for key, (type_name, where, stability) in rows.items():
        spec = attrs[key]
        assert type_name == f"`{spec['type']}`", key
        assert stability == spec["stability"], key
        places = {g for g, keys in groups.items() if key in keys}
        named = {g for g in GROUPS if g.split(".")[1] in where.replace("root", "trajectory").replace("every span",
                                                                                                    "trajectory generation tool span")}
        assert named == places, (key, where, places)
