"""The swimlane's page (``/run/<run>/timeline/t12``): the controls, one canvas, a legend, what it
draws in words, and its first window embedded (:mod:`rtrace.serve.swimlane` makes the data;
static/swimlane.js draws it). Every name on it comes from the traced program (a tool's, a
worker's, a server's): built with :func:`rtrace.report.markup.h`, which escapes every text.
"""

from __future__ import annotations

from typing import Any, Sequence

from ..report.markup import Raw, h, json_script
from ..report.views import fmt, step_key
from .swimlane import StepLanes

__all__ = ["page"]


def page(lanes: StepLanes, links: Any, partitions: Sequence[tuple[bool, int | None]], metrics: dict[str, float],
         first: dict[str, Any]) -> Raw:
    """The swimlane page: the controls, the canvas, a legend, and in words what it draws (every
    name escaped: a tool's or a worker's name is the traced program's text). ``first``: the first
    window's data, embedded (no request before the first draw)."""
    v, step = lanes.validate, lanes.step
    key = step_key(v, step)
    same = sorted(s for val, s in partitions if val == v and s is not None)
    at = same.index(step) if step in same else -1
    prev_key = same[at - 1] if at > 0 else None
    next_key = same[at + 1] if 0 <= at < len(same) - 1 else None
    base = links.base
    nav = h("nav", {"class_": "stepnav"},
            h("a", {"href": f"{base}/timeline/{step_key(v, prev_key)}", "rel": "prev"}, f"← {step_key(v, prev_key)}")
            if prev_key is not None else None,
            h("a", {"href": links.step(v, step)}, f"the step viewer of {key}"),
            h("a", {"href": links.rollouts([("step", step), ("validate", "true" if v else "false")])},
              "its rollouts in the table"),
            h("a", {"href": f"{base}/timeline/{step_key(v, next_key)}", "rel": "next"}, f"{step_key(v, next_key)} →")
            if next_key is not None else None)
    servers = [b for b in lanes.bands if b.kind == "server"]
    workers = [b for b in lanes.bands if b.kind == "worker"]
    facts = [("rollouts", fmt(lanes.total)), ("lasting", f"{fmt(lanes.end / 1e9)} s"),
             ("workers", fmt(len(workers))), ("inference servers", fmt(len(servers))),
             ("weight updates in the step", fmt(len(lanes.events)))]
    metrics = {**metrics, "inflight_peak": lanes.inflight_peak, "slowest_server_share": lanes.slowest_server_share}
    for label, metric, unit in (("in flight at most", "inflight_peak", ""), ("staleness, mean", "staleness_mean", ""),
                                ("staleness, max", "staleness_max", ""), ("waiting per rollout", "wait_ms_mean", " ms"),
                                ("generation per rollout", "generation_ms_mean", " ms"),
                                ("tools per rollout", "tool_ms_mean", " ms"),
                                ("slowest server's share", "slowest_server_share", "%")):
        value = metrics.get(metric)
        if value is not None:
            facts.append((label, f"{value:.0%}" if unit == "%" else fmt(value, "ms") + unit))
    controls = h("div", {"class_": "tools swimtools", "role": "toolbar", "aria_label": "timeline controls"},
                 h("button", {"type": "button", "data_act": "in", "title": "zoom in (+)"}, "zoom in"),
                 h("button", {"type": "button", "data_act": "out", "title": "zoom out (−)"}, "zoom out"),
                 h("button", {"type": "button", "data_act": "left", "title": "earlier (←)"}, "←"),
                 h("button", {"type": "button", "data_act": "right", "title": "later (→)"}, "→"),
                 h("button", {"type": "button", "data_act": "all", "title": "the whole step (0)"}, "whole step"),
                 h("button", {"type": "button", "data_act": "open"}, "open every band"),
                 h("button", {"type": "button", "data_act": "close"}, "close every band"),
                 h("label", None, "lane height ", h("select", {"id": "lanepx"}, [
                     h("option", {"value": str(n), "selected": n == 16}, f"{n} px") for n in (4, 8, 16, 24)])),
                 h("span", {"id": "swimstatus", "class_": "muted small", "aria_live": "polite"}))
    legend = h("p", {"class_": "swimlegend small"},
               [h("span", {"class_": f"sw c-{c}"}, c) for c in ("generation", "tool", "reward", "wait", "other")],
               h("span", {"class_": "sw c-pass"}, "rollout: passed"), h("span", {"class_": "sw c-fail"}, "failed"),
               h("span", {"class_": "sw c-unk"}, "unknown"), h("span", {"class_": "sw c-mixed"}, "several, merged"),
               h("span", {"class_": "sw c-update"}, "weight update"))
    band_rows = [h("tr", None, h("td", {"class_": "l"}, b.kind), h("td", {"class_": "l"}, b.name),
                   h("td", None, fmt(b.lanes)), h("td", None, fmt(b.count)))
                 for b in lanes.bands]
    updates = [h("li", None, f"v{e.version} at {fmt(round((e.time_ns - lanes.origin) / 1e9, 3))} s",
                 f" (step {e.step})" if e.step is not None else None, f", from {e.worker}" if e.worker else None)
               for e in lanes.events]
    return h("section", {"id": "swimlane", "data_src": f"{base}/timeline/{key}.json", "data_rollout": f"{base}/rollout/"},
             h("h2", None, ("validation step " if v else "step ") + str(step), ": the fleet in time"), nav,
             h("dl", {"class_": "swimfacts"}, [[h("dt", None, k), h("dd", None, val)] for k, val in facts]),
             controls,
             h("div", {"class_": "swimwrap"},
               h("canvas", {"id": "lanes", "tabindex": "0", "role": "img",
                            "aria_label": "the step's servers and workers in time; arrow keys pan, + and − zoom, "
                                          "Enter opens the rollout under the pointer"}),
               h("div", {"id": "swimtip", "class_": "swimtip", "role": "tooltip", "hidden": True})),
             h("p", {"class_": "muted small"},
               "Wheel: zoom around the pointer. Drag: pan. Shift+wheel: scroll the lanes. A band's name: open or "
               "close its lanes. A slice: its rollout (a merged slice: zoom into it). Keys: ← → pan, ↑ ↓ scroll, "
               "+ − zoom, 0 the whole step."),
             legend,
             h("noscript", None, h("p", {"class_": "note"}, "The timeline is drawn by a script: enable JavaScript.")),
             [h("p", {"class_": "note"}, n) for n in lanes.notes],
             h("details", {"class_": "swimbands"}, h("summary", None, f"{len(lanes.bands)} bands"),
               h("table", {"class_": "bands"}, h("thead", None, h("tr", None, h("th", {"class_": "l"}, "band"),
                                                                  h("th", {"class_": "l"}, "name"),
                                                                  h("th", None, "lanes"),
                                                                  h("th", None, "rollouts / generations"))),
                 h("tbody", None, band_rows))),
             h("h3", None, "weight updates during the step"),
             h("ul", {"id": "updates"}, updates) if updates else h("p", {"class_": "muted"}, "none marked"),
             json_script("swimdata", first),
             h("link", {"rel": "stylesheet", "href": "/static/swimlane.css"}),
             h("script", {"src": "/static/swimlane.js", "defer": True}))
