"""The server's own pages: the frame around every view (header, navigation, live status),
the list of runs, a run's overview, one rollout with its tokens, two runs compared, and
the pages that say why there is nothing to show. The views themselves are
:mod:`rtrace.report.views` (shared with ``rtrace report --html``); everything is built with
:func:`rtrace.report.markup.h`, which escapes every text.
"""

from __future__ import annotations

import json
import math
from typing import Any, Sequence

from ..report import plots, tokens, views
from ..report import queries as Q
from ..report.markup import Raw, h, join, query_string
from ..report.views import fmt, step_key

__all__ = ["document", "header", "runs_page", "overview", "rollout_page", "compare_page", "nothing_page",
           "message_page", "TABS", "login_page"]

#: the tabs of a run: (name, label, path under the run)
TABS = (("overview", "overview", "overview"), ("rollouts", "rollouts", "rollouts"), ("prompts", "prompts", "prompts"),
        ("failures", "failures", "failures"))
STYLES = ("/static/report.css", "/static/serve.css")
SCRIPTS = ("/static/serve.js", "/static/tokens.js")


def document(title: str, body: Any, nav: Any = None, run: str | None = None, version: int | None = None,
             swap: bool = True) -> str:
    """A whole page. ``run`` / ``version``: what the page shows, for its live updates
    (``swap``: the page's ``<main>`` is replaced by the new one when the run changes)."""
    attrs = {"data_run": run, "data_version": None if version is None else str(version),
             "data_swap": "1" if swap and run else None}
    return "<!doctype html>\n" + h("html", {"lang": "en"}, h("head", None,
        h("meta", {"charset": "utf-8"}), h("meta", {"name": "viewport", "content": "width=device-width, initial-scale=1"}),
        h("link", {"rel": "icon", "href": "data:,"}), h("title", None, title),
        [h("link", {"rel": "stylesheet", "href": u}) for u in STYLES],
        [h("script", {"src": u, "defer": True}) for u in SCRIPTS]),
        h("body", attrs, nav, h("main", {"id": "main"}, body)))


def header(runs: Sequence[str], run: str | None, active: str | None, snapshot: Any = None) -> Raw:
    """The top bar: rtrace, the run (a switcher when there are several), its tabs, compare,
    and the live status the script keeps up to date."""
    tabs = []
    if run is not None:
        base = "/run/" + _seg(run)
        tabs = [h("a", {"href": f"{base}/{path}", "class_": "on" if name == active else None, "data_tab": name}, label)
                for name, label, path in TABS]
    if len(runs) > 1:
        tabs.append(h("a", {"href": "/compare" + (query_string([("a", run)]) if run else ""),
                            "class_": "on" if active == "compare" else None, "data_tab": "compare"}, "compare runs"))
    switch = None
    if len(runs) > 1 and run is not None:  # the same tab of another run
        tab = active if active in {name for name, _, _ in TABS} else "overview"
        switch = h("details", {"class_": "switch"}, h("summary", None, "other runs"),
                   h("div", None, [h("div", None, h("a", {"href": f"/run/{_seg(r)}/{tab}"}, r))
                                   for r in runs if r != run]))
    live = None
    if snapshot is not None:
        text = "live" if snapshot.problem is None else "waiting"
        live = h("span", {"id": "live", "class_": "live", "title": "the page follows the run as it is written"},
                 h("i", None), " ", text)
    return h("header", {"class_": "top"}, h("a", {"class_": "brand", "href": "/"}, "rtrace"),
             h("span", {"class_": "runname", "title": "the run"}, run) if run else None, switch,
             h("nav", {"class_": "tabs top"}, tabs), live)


def _seg(name: str) -> str:
    from urllib.parse import quote

    return quote(name, safe="")


def runs_page(summaries: Sequence[dict[str, Any]]) -> Raw:
    rows = [h("tr", {"data_run": s["name"]}, h("td", {"class_": "l"}, h("a", {"href": f"/run/{_seg(s['name'])}/overview"},
                                                                        s["name"])),
              h("td", {"class_": "l"}, s["path"]), h("td", None, fmt(s["trajectories"])), h("td", None, fmt(s["steps"])),
              h("td", None, "–" if s["last_step"] is None else fmt(s["last_step"])),
              h("td", {"class_": "l"}, s["problem"] or "ok"))
            for s in summaries]
    compare = None
    if len(summaries) > 1:
        opts = [h("option", {"value": s["name"]}, s["name"]) for s in summaries]
        compare = h("form", {"method": "get", "action": "/compare", "class_": "compareform"}, "compare ",
                    h("select", {"name": "a", "aria_label": "first run"}, opts), " with ",
                    h("select", {"name": "b", "aria_label": "second run"}, opts[1:] + opts[:1]), " ",
                    h("button", {"type": "submit"}, "compare"))
    return join([h("h2", None, "runs"), h("div", {"class_": "scroll"}, h("table", {"class_": "runs"}, h("thead", None, h(
        "tr", None, h("th", {"class_": "l"}, "run"), h("th", {"class_": "l"}, "read from"), h("th", None, "trajectories"),
        h("th", None, "steps"), h("th", None, "last step"), h("th", {"class_": "l"}, "state"))), h("tbody", None, rows))),
        compare])


def nothing_page(run: str, problem: str) -> Raw:
    """A run with nothing to show: why, in words; the page updates itself when data arrives."""
    return h("section", {"id": "nothing", "class_": "nothing"}, h("h2", None, "nothing to show yet"),
             h("p", {"class_": "unknown", "id": "problem"}, problem),
             h("p", {"class_": "muted"}, f"This page follows the run {run}: it shows the run as soon as trajectories "
                                        "are written (the parquet exporter's dataset, or the jsonl exporter's file)."))


def message_page(title: str, message: str, hint: str = "") -> Raw:
    return h("section", {"class_": "message"}, h("h2", None, title), h("p", {"class_": "problem"}, message),
             h("p", {"class_": "muted"}, hint) if hint else None)


def overview(run: str, snapshot: Any, links: views.ServeLinks, offset: int | None, size: int = 50) -> Raw:
    """A run at a glance: the counts, the curves across steps (every step, averaged in
    buckets past 240), and the step table a page of steps at a time, the newest step on top
    (``offset`` counts from it: the first page is the newest 50)."""
    rows = list(snapshot.steps)
    train = [r for r in rows if not r[0]]
    first = 0 if offset is None else max(0, min(offset, max(0, len(train) - 1)))
    base = links.base + "/overview"
    prev_href = base + query_string([("_offset", max(0, first - size) or None)]) if first > 0 else None
    next_href = base + query_string([("_offset", first + size)]) if first + size < len(train) else None
    parts = []
    for validate in (False, True):
        part = [r for r in rows if r[0] == validate]
        if not part:
            continue
        parts.append(h("section", {"class_": "split-" + ("validation" if validate else "training")},
                       views.steps_table(part, links, first if not validate else 0, size if not validate else None,
                                         prev_href, next_href, newest_first=True),
                       h("h3", None, "across steps"),
                       views.run_curves(part, snapshot.extras, snapshot.rates, validate=validate,
                                        components=Q.curve_keys(snapshot.columns))))
    steps_total = len(snapshot.partitions)
    summary = h("p", {"class_": "sub", "id": "summary"},
                f"{snapshot.trajectories:,} trajectories in {steps_total:,} step(s)" +
                (f"; the last training step is {train[-1][1]:,}" if train else ""))
    notes = [h("p", {"class_": "note"}, n) for n in snapshot.notes]
    return h("section", {"id": "run"}, summary, notes, parts)


# ----------------------------------------------------------------------------- one rollout
def _facts(traj: Any, links: views.ServeLinks) -> list[tuple[str, Any]]:
    from ..pipeline.sampling import prompt_key
    from ..report.data import failures as failed, passed
    from ..report.data import FAILURES

    gens = [s for s in traj.spans if s.kind == "generation"]
    tok_in = sum(s.attributes.get("gen_ai.usage.input_tokens") or 0 for s in gens
                 if isinstance(s.attributes.get("gen_ai.usage.input_tokens"), int))
    tok_out = sum(s.attributes.get("gen_ai.usage.output_tokens") or 0 for s in gens
                  if isinstance(s.attributes.get("gen_ai.usage.output_tokens"), int))
    prompt = prompt_key(traj.coordinates)
    verdict = traj.verdict()
    ok = passed(traj)
    facts: list[tuple[str, Any]] = [
        ("step", h("a", {"href": links.step(traj.validate, traj.step if isinstance(traj.step, int) else None)},
                   ("validation step " if traj.validate else "step ") + str(traj.step))),
        ("group", traj.group_id if traj.group_id is not None else fmt(traj.sample_index)),
        ("sample / rollout", f"{fmt(traj.sample_index)} / {fmt(traj.rollout_n)}"),
        ("prompt", "–" if prompt is None else h("a", {"href": links.prompt(str(prompt))}, str(prompt))),
        ("reward", h("span", {"id": "reward"}, fmt(traj.reward))),
        ("verdict", h("span", {"class_": f"verdict v-{verdict}"}, verdict)),
        ("pass", h("span", {"class_": "pass" if ok else "fail" if ok is False else "unk"},
                   "pass" if ok else "fail" if ok is False else "?")),
        ("advantage", fmt(traj.annotations.get("advantage") if isinstance(traj.annotations.get("advantage"), (int, float))
                          else None)),
        ("failed", ", ".join(FAILURES[i] for i in failed(traj)) or "–"),
        ("tokens in / out", f"{tok_in:,} / {tok_out:,}"),
        ("turns / tool calls", f"{traj.num_turns} / {traj.num_tool_calls}"),
        ("latency", fmt(traj.duration_ms, "ms") + " ms"),
        ("finish reason", traj.finish_reason or "–"),
        ("status", traj.status + (f": {traj.error}" if traj.error else "")),
        ("policy version", fmt(traj.policy_version)),
        ("kept", ", ".join(map(str, traj.kept)) or "every trajectory (no cap)"),
    ]
    for name in ("outcome", "annotations", "extra"):
        for key, value in sorted(getattr(traj, name).items()):
            if name == "annotations" and key == "advantage":
                continue
            text = fmt(value) if isinstance(value, (int, float, bool)) and not isinstance(value, str) else (
                value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str))
            facts.append((f"{name}.{key}", text))
    return facts


def _conversation(traj: Any) -> Raw:
    from ..report.data import _content

    out = []
    for m in traj.messages:
        if not isinstance(m, dict):
            continue
        role = str(m.get("role", "?"))
        calls = m.get("tool_calls") if isinstance(m.get("tool_calls"), list) else []
        out.append(h("div", {"class_": f"msg {role}"},
                     h("div", {"class_": "role"}, role + (f" · {m['name']}" if role == "tool" and m.get("name") else "")),
                     h("pre", {"class_": "text"}, _content(m.get("content"))) if m.get("content") not in (None, "")
                     else None,
                     [h("div", {"class_": "call"}, f"→ {(c.get('function') or {}).get('name', '?')}("
                        f"{_content((c.get('function') or {}).get('arguments'))})") for c in calls if isinstance(c, dict)]))
    return join(out) if out else h("p", {"class_": "muted"}, "No conversation was captured.")


def _spans_table(traj: Any) -> Raw:
    t0 = traj.start_ns
    rows = []
    for depth, span in traj.walk():
        reasons = span.attributes.get("gen_ai.response.finish_reasons") or ()
        rows.append(h("tr", {"class_": "err" if span.status == "error" else None},
                      h("td", {"class_": "l"}, h("span", {"style": f"padding-left:{min(depth, 12) * 12}px"}, span.name)),
                      h("td", {"class_": "l"}, span.kind), h("td", None, fmt((span.start_ns - t0) / 1e6, "ms")),
                      h("td", None, fmt(span.duration_ms, "ms")),
                      h("td", None, fmt(span.attributes.get("gen_ai.usage.output_tokens"))),
                      h("td", {"class_": "l"}, ", ".join(map(str, reasons)) if isinstance(reasons, (list, tuple))
                        else str(reasons)),
                      h("td", {"class_": "l"}, span.error or span.status)))
    return h("div", {"class_": "scroll"}, h("table", {"class_": "spans"}, h("thead", None, h("tr", None, [
        h("th", {"class_": "l"}, "span"), h("th", {"class_": "l"}, "kind"), h("th", None, "start ms"),
        h("th", None, "ms"), h("th", None, "tokens out"), h("th", {"class_": "l"}, "finish"),
        h("th", {"class_": "l"}, "status")])), h("tbody", None, rows)))


def rollout_page(traj: Any, links: views.ServeLinks, color: str | None, row: dict[str, Any]) -> Raw:
    """One rollout: its facts, why it failed (in words), its generations' tokens coloured
    by a per-token array (a legend, each token's values on hover), its conversation, its spans."""
    gens = [s for s in traj.spans if s.kind == "generation"]
    names = tokens.available(gens)
    color = color if color in names else tokens.default_color(names)
    contexts = {}
    for i, finding in enumerate(traj.health or ()):
        if finding.get("check") == "retokenization":
            ctx = views.retokenization_context(traj, finding.get("detail") or "")
            if ctx is not None:
                contexts[(traj.trace_id, i)] = ctx
    why = views.reasons(row, contexts)
    parts: list[Any] = [
        h("h2", None, "rollout ", h("code", {"class_": "tid", "id": "trace-id"}, traj.trace_id)),
        h("dl", {"class_": "facts"}, [[h("dt", None, k), h("dd", {"data_fact": k}, v)] for k, v in _facts(traj, links)]),
    ]
    if why:
        parts += [h("h3", None, "why it is listed as a failure"),
                  h("ul", {"class_": "why", "id": "why"}, [h("li", {"class_": f"reason r-{key}"}, words,
                                                           h("div", None, extra) if extra is not None else None)
                                                     for key, words, extra in why])]
    parts.append(h("h3", None, "tokens"))
    if not names:
        parts.append(h("p", {"class_": "muted", "id": "no-token-values"},
                       "No per-token values on this rollout's generations (logprob, advantage, loss_mask ...: "
                       "docs/token-values.md)."))
    else:
        all_values = {n: [v for g in gens for v in tokens.arrays_of(g).get(n, [])] for n in names}
        scale = tokens.scale_for(color, all_values[color]) if color else None
        chooser = h("nav", {"class_": "chips", "id": "colors"}, "colour by: ",
                    [h("a", {"class_": "chip" + (" on" if n == color else ""), "data_color": n,
                             "href": links.rollout(traj.trace_id) + query_string([("color", n)])}, n) for n in names])
        parts += [chooser, tokens.legend(color, scale) if scale else None]
    for i, gen in enumerate(gens, 1):
        scale = tokens.scale_for(color, [v for g in gens for v in tokens.arrays_of(g).get(color or "", [])]) \
            if names and color else None
        parts.append(h("div", {"class_": "turn", "data_turn": str(i)},
                       h("div", {"class_": "muted"}, f"turn {i} · {gen.name} · "
                         f"{len(gen.response_ids or []) or fmt(gen.attributes.get('gen_ai.usage.output_tokens'))} tokens"),
                       tokens.overlay(gen, color, scale) if names or gen.attributes.get("rtrace.response_tokens")
                       else h("pre", {"class_": "text"}, _response_text(gen))))
    parts += [h("h3", None, "conversation"), _conversation(traj), h("h3", None, "spans"), _spans_table(traj)]
    return h("section", {"id": "rollout", "data_trace": traj.trace_id}, parts)


def _response_text(span: Any) -> str:
    from ..trajectory import response_text

    return response_text(span) or "(no response text)"


# ----------------------------------------------------------------------------- two runs
def compare_page(names: Sequence[str], a: str | None, b: str | None, curves: Any, prompts: list[dict[str, Any]],
                 total: int, offset: int, size: int) -> Raw:
    """Two runs: their step metrics overlaid, and the prompts both have, the largest
    difference in pass rate first (each a link to the prompt in both runs side by side)."""
    def select(name: str, current: str | None) -> Raw:
        return h("select", {"name": name, "aria_label": f"run {name}"},
                 [h("option", {"value": n, "selected": n == current}, n) for n in names])

    form = h("form", {"method": "get", "action": "/compare", "class_": "compareform"}, "compare ", select("a", a),
             " with ", select("b", b), " ", h("button", {"type": "submit"}, "compare"))
    if not a or not b:
        return join([h("h2", None, "compare two runs"), form])
    rows = []
    for p in prompts:
        href = "/compare/prompt" + query_string([("a", a), ("b", b), ("key", p["prompt"])])
        rows.append(h("tr", {"data_prompt": p["prompt"]}, h("td", {"class_": "l"}, h("a", {"href": href}, p["prompt"])),
                      h("td", {"class_": "l"}, h("span", {"class_": "txt"}, p["task"] or "–")),
                      h("td", None, fmt(p["n_a"])), h("td", {"class_": "rate"}, _pct(p["pass_a"])),
                      h("td", None, fmt(p["n_b"])), h("td", {"class_": "rate"}, _pct(p["pass_b"])),
                      h("td", {"class_": "delta"}, _delta(p["delta"]))))
    nxt = "/compare" + query_string([("a", a), ("b", b), ("_offset", offset + size)]) if offset + size < total else None
    prv = "/compare" + query_string([("a", a), ("b", b), ("_offset", max(0, offset - size))]) if offset else None
    return join([h("h2", None, f"{a} and {b}"), form, h("h3", None, "step metrics, both runs"), curves,
                 h("h3", None, f"prompts in both runs ({total:,}), the largest difference in pass rate first"),
                 views._pager(offset, len(rows), total, prv, nxt, "prompts"),
                 h("div", {"class_": "scroll"}, h("table", {"class_": "compare"}, h("thead", None, h("tr", None,
                   h("th", {"class_": "l"}, "prompt"), h("th", {"class_": "l"}, "question"), h("th", None, f"{a}: rollouts"),
                   h("th", None, f"{a}: pass"), h("th", None, f"{b}: rollouts"), h("th", None, f"{b}: pass"),
                   h("th", None, "difference"))), h("tbody", None, rows)))])


def _pct(value: float | None) -> str:
    return "–" if value is None else plots.fmt_number(value, "%")


def _delta(value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return "–"
    return ("+" if value > 0 else "") + plots.fmt_number(value * 100) + " pts"


def login_page(next_path: str, failed: bool = False) -> Raw:
    return h("section", {"class_": "login"}, h("h2", None, "sign in"),
             h("p", None, "This server is reachable beyond this machine: give the collector's token "
                          "(RTRACE_COLLECTOR_TOKEN)."),
             h("p", {"class_": "problem"}, "That is not the token.") if failed else None,
             h("form", {"method": "post", "action": "/-/login"},
               h("input", {"type": "password", "name": "token", "aria_label": "token", "autocomplete": "current-password",
                           "autofocus": True}),
               h("input", {"type": "hidden", "name": "next", "value": next_path}),
               h("button", {"type": "submit"}, "sign in")))


def step_part(run_links: views.ServeLinks, validate: bool, step: int | None, partitions: Sequence[Any],
              mismatch: list[dict[str, Any]], metrics_row: Any) -> str:
    """What the served step page shows above the step viewer: the step's neighbours, links
    to it in the run-wide views, and its rollouts with the largest train-inference mismatch."""
    keys = [p for p in partitions if p[0] == validate]
    here = (validate, step)
    i = keys.index(here) if here in keys else -1
    prev_key = keys[i - 1] if i > 0 else None
    next_key = keys[i + 1] if 0 <= i < len(keys) - 1 else None
    filt = [("step", "" if step is None else str(step)), ("validate", "true" if validate else "false")]
    nav = h("nav", {"class_": "stepnav"},
            h("a", {"href": run_links.step(*prev_key), "rel": "prev", "class_": "prev"}, "← " + step_key(*prev_key))
            if prev_key else None,
            h("form", {"method": "get", "action": run_links.base + "/step"}, h("input", {
                "name": "key", "value": step_key(validate, step), "size": "6", "aria_label": "go to step (t12, v3)"}),
              h("button", {"type": "submit"}, "go")),
            h("a", {"href": run_links.step(*next_key), "rel": "next", "class_": "next"}, step_key(*next_key) + " →")
            if next_key else None,
            h("a", {"href": run_links.rollouts(filt if step is not None else [("step__null", "1")])},
              "this step in the rollouts table"),
            h("a", {"href": run_links.failures([("step", step)]) if step is not None else run_links.failures([])},
              "its failures"),
            h("a", {"href": f"{run_links.base}/timeline/{step_key(validate, step)}", "id": "timeline-link"},
              "its timeline (servers, workers, weight updates)") if step is not None else None)
    return str(join([nav, h("h3", None, "largest train-inference mismatch at this step"),
                     views.mismatch_section(mismatch, run_links)]))
