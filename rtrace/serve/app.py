"""``rtrace serve``'s ASGI app (Starlette): every page of the served runs, and each also as JSON.

Routes (``.json`` after a page's path, or ``?_format=json``, gives its data instead):

- ``/``: the runs; ``/run/<run>/overview``: the step table and the curves across steps;
- ``/run/<run>/rollouts``: every rollout of every step, sorted, filtered, searched;
- ``/run/<run>/step/<t3|v3>``: one step (the step viewer of ``rtrace report --html``);
- ``/run/<run>/rollout/<trace id>``: one rollout, its tokens coloured (``?color=advantage``);
- ``/run/<run>/timeline/<t3>``: one step's swimlane (``.json?t0=&t1=&px=&lanes=``: a window of it);
- ``/run/<run>/prompts``, ``/run/<run>/prompt?key=...``: prompts across steps;
- ``/run/<run>/failures``: failed and unhealthy rollouts, why in words;
- ``/compare?a=<run>&b=<run>``, ``/compare/prompt?a=&b=&key=``: two runs;
- ``/-/state.json``: each run's version (the pages' live updates poll it); ``/static/<file>``.

Read-only: no route writes, and no route reads a path from the request (a run is chosen
by its name among those served; a static file by its name among five).
"""

from __future__ import annotations

import json
import math
import time
from importlib import resources
from typing import Any, Callable

from ..report import queries as Q
from ..report import views
from ..report.markup import Raw, h
from . import pages, swimlane, timeline_page
from .sources import NoData, QueryTimeout, RunSource, Sources

__all__ = ["create_app", "STATIC"]

#: the files under /static/: name -> (package, media type)
STATIC = {"report.css": ("rtrace.report", "text/css"), "report.js": ("rtrace.report", "text/javascript"),
          "tokens.js": ("rtrace.report", "text/javascript"),
          "serve.css": ("rtrace.serve", "text/css"), "serve.js": ("rtrace.serve", "text/javascript"),
          "swimlane.css": ("rtrace.serve", "text/css"), "swimlane.js": ("rtrace.serve", "text/javascript")}
#: the default time limit of one query (``rtrace serve --time-limit-ms``)
TIME_LIMIT_MS = 3000.0


def _plain_json(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _plain_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain_json(v) for v in value]
    if isinstance(value, Q.Column):
        return {"name": value.name, "label": value.label, "kind": value.kind, "doc": value.doc}
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def create_app(sources: Sources, token: str | None = None, loopback: bool = True, secure: bool = False,
               time_limit_ms: float = TIME_LIMIT_MS) -> Any:
    """The app over ``sources`` (wrapped in :class:`rtrace.serve.security.Guard`)."""
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse, RedirectResponse, Response
    from starlette.routing import Route

    from .security import Guard

    names = list(sources.runs)
    swimlanes = swimlane.SwimlaneCache()

    def respond(request: Any, title: str, body: Any, data: Any, run: RunSource | None = None,
                active: str | None = None, status: int = 200, swap: bool = True) -> Any:
        if request.url.path.endswith(".json") or request.query_params.get("_format") == "json":
            text = json.dumps(_plain_json(data), ensure_ascii=False, separators=(",", ":"))
            return Response(text, status, media_type="application/json")
        snap = run.snapshot if run is not None else None
        nav = pages.header(names, run.name if run else None, active, snap)
        html = pages.document(title, body, nav, run.name if run else None, snap.version if snap else None, swap)
        return Response(html, status, media_type="text/html; charset=utf-8")

    def run_of(request: Any) -> RunSource:
        name = request.path_params["run"]
        if name not in sources.runs:
            raise _NotFound(f"no run named {name!r} here; runs: {', '.join(names)}")
        return sources.runs[name]

    def links(run: RunSource) -> views.ServeLinks:
        return views.ServeLinks("/run/" + pages._seg(run.name))

    def guarded(fn: Callable[..., Any], active: str | None = None) -> Callable[[Any], Any]:
        """A page of a run: the run looked up, nothing-to-show and time-limit pages in words."""
        def endpoint(request: Any) -> Any:
            try:
                run = run_of(request) if "run" in request.path_params else None
                if run is not None and run.snapshot.problem is not None:
                    return respond(request, f"rtrace · {run.name}", pages.nothing_page(run.name, run.snapshot.problem),
                                   {"run": run.name, "problem": run.snapshot.problem}, run, active)
                db = run.db(time_limit_ms) if run is not None else None
                return fn(request, run, db)
            except _NotFound as exc:
                return respond(request, "rtrace · not found", pages.message_page("not found", str(exc)),
                               {"error": str(exc)}, None, None, 404)
            except QueryTimeout as exc:
                run = sources.runs.get(request.path_params.get("run", ""))
                return respond(request, "rtrace · too slow", pages.message_page(
                    "this query took too long", str(exc), "Narrow it (a step, a filter) or start the server with a "
                    "larger --time-limit-ms."), {"error": str(exc)}, run, active, 503)
            except NoData as exc:
                return respond(request, "rtrace · nothing yet", pages.message_page("nothing to show", str(exc)),
                               {"error": str(exc)}, None, None, 200)
        return endpoint

    # ----------------------------------------------------------------- pages
    def index(request: Any) -> Any:
        summaries = []
        for name, run in sources.runs.items():
            snap = run.snapshot
            train = [r[1] for r in snap.steps if not r[0]]
            summaries.append({"name": name, "path": run.shown_path, "trajectories": snap.trajectories,
                              "steps": len(snap.partitions), "last_step": train[-1] if train else None,
                              "problem": snap.problem, "version": snap.version})
        if len(summaries) == 1 and not request.url.path.endswith(".json") and request.query_params.get("_format") != "json":
            return RedirectResponse(f"/run/{pages._seg(names[0])}/overview", 307)
        return respond(request, "rtrace · runs", pages.runs_page(summaries), {"runs": summaries})

    def overview(request: Any, run: RunSource, db: Any) -> Any:
        snap = run.snapshot
        offset = _int(request.query_params.get("_offset"))
        body = pages.overview(run.name, snap, links(run), offset)
        data = {"run": run.name, "version": snap.version, "trajectories": snap.trajectories,
                "steps": [{"validate": v, "step": s, "metrics": m, "slowest": sl, **snap.extras.get((v, s), {}),
                           "health": snap.rates.get((v, s), {})} for v, s, m, sl in snap.steps]}
        return respond(request, f"rtrace · {run.name}", body, data, run, "overview")

    def rollouts(request: Any, run: RunSource, db: Any) -> Any:
        snap = run.snapshot
        state = Q.parse_state(_pairs(request), snap.columns)
        t0 = time.perf_counter()
        result = Q.rollouts(db, state, snap.columns)
        hist = run.cached(("hist", tuple(state.filters), state.q, state.rows_of),
                          lambda: Q.histograms(db, state, snap.columns))
        ms = (time.perf_counter() - t0) * 1000
        counts = snap.splits if not state.filters and not state.q else None  # the run's, when nothing narrows it
        body = views.rollouts_section(result, hist, state, snap.columns, links(run), split_counts=counts)
        body = Raw(body + h("p", {"class_": "muted small", "id": "timing"},
                             f"{db.queries} queries, {db.spent_ms:,.0f} ms in SQL"))
        data = {"run": run.name, "split": state.rows_of, "total": hist["total"], "offset": state.offset,
                "more": result["more"],
                "columns": result["columns"], "all_columns": snap.columns, "problems": state.problems,
                "rows": [{"trace_id": r["trace_id"], **r["cells"]} for r in result["rows"]],
                "histograms": hist["hist"], "sql_ms": round(ms, 1)}
        return respond(request, f"rtrace · {run.name} · rollouts", body, data, run, "rollouts")

    def step_redirect(request: Any, run: RunSource, db: Any) -> Any:
        key = request.query_params.get("key", "")
        if views.parse_step_key(key) is None:
            raise _NotFound(f"{key!r} is not a step: t<step> (training) or v<step> (validation), e.g. t12")
        return RedirectResponse(f"/run/{pages._seg(run.name)}/step/{key}", 303)

    def step(request: Any, run: RunSource, db: Any) -> Any:
        from ..report.load import Record
        from ..report.page import Live, render

        key, as_json = _suffix(request.path_params["key"])
        parsed = views.parse_step_key(key)
        if parsed is None or parsed not in run.snapshot.partitions:
            raise _NotFound(f"no step {key!r} in run {run.name!r} (steps are t<step> for training, v<step> for "
                            "validation: t12, v3)")
        validate, number = parsed
        where = "validate = ? AND " + ("step IS NULL" if number is None else "step = ?")
        params = [validate] + ([] if number is None else [number])
        mismatch = Q.mismatch_top(db, validate, number)
        metrics = next((r for r in run.snapshot.steps if (r[0], r[1]) == parsed), None)
        if as_json:
            return respond(request, "", "", {"run": run.name, "step": number, "validate": validate,
                                             "metrics": metrics[2] if metrics else {},
                                             **run.snapshot.extras.get(parsed, {}),
                                             "health": run.snapshot.rates.get(parsed, {}), "mismatch": mismatch})
        trajs = Q.load_trajectories(db, where, params, where, params)
        nav = pages.header(names, run.name, "step", run.snapshot)
        live = Live(base="/run/" + pages._seg(run.name), nav=str(nav),
                    run=pages.step_part(links(run), validate, number, run.snapshot.partitions, mismatch, metrics),
                    body={"data-run": run.name, "data-version": str(run.snapshot.version)})
        html = render([Record(t, t.health) for t in trajs], [f"{run.name}, {views.step_key(validate, number)}"],
                      live=live)
        return Response(html, media_type="text/html; charset=utf-8")

    def rollout(request: Any, run: RunSource, db: Any) -> Any:
        trace, _ = _suffix(request.path_params["trace"])
        if not Q.trace_id_ok(trace):
            raise _NotFound(f"{trace!r} is not a trace id (32 hexadecimal digits)")
        # its step first (the flat index: one column), then its row and spans from that step's files only
        _, where_is = db.rows(f"SELECT validate, step FROM {db.table} WHERE trace_id = ? LIMIT 1", [trace])
        if not where_is:
            raise _NotFound(f"no rollout {trace} in run {run.name!r}")
        validate, number = where_is[0]
        where = "trace_id = ? AND validate = ? AND " + ("step IS NULL" if number is None else "step = ?")
        params = [trace, validate] + ([] if number is None else [number])
        found = Q.load_trajectories(db, where, params, where, params, limit=1)
        if not found:
            raise _NotFound(f"no rollout {trace} in run {run.name!r}")
        traj = found[0]
        _, rows = db.rows("SELECT output_tokens, truncated, partial, status, error, reward, health, "
                          f"{Q.FIELDS['_correct']} AS correct, {Q.FIELDS['_expected']} AS expected "
                          f"FROM trajectories WHERE {where} LIMIT 1", params)
        row = dict(zip(("output_tokens", "truncated", "partial", "status", "error", "reward", "health", "correct",
                        "expected"), rows[0])) if rows else {}
        row["trace_id"] = trace
        body = pages.rollout_page(traj, links(run), request.query_params.get("color"), row)
        data = traj.to_dict()
        return respond(request, f"rtrace · rollout {trace[:8]}", body, data, run, "rollout", swap=False)

    def timeline(request: Any, run: RunSource, db: Any) -> Any:
        key, as_json = _suffix(request.path_params["key"])
        parsed = views.parse_step_key(key)
        if parsed is None or parsed[1] is None or parsed not in run.snapshot.partitions:
            raise _NotFound(f"no step {key!r} with a timeline in run {run.name!r} (steps are t<step> for training, "
                            "v<step> for validation: t12, v3)")
        validate, number = parsed
        try:
            lanes = swimlanes.get((run.name, parsed, run.files_of(parsed)),
                                  lambda: swimlane.StepLanes(db, run.name, validate, number))
        except ValueError as exc:  # no rollout of the step (its files changed since the listing)
            raise _NotFound(f"{exc} in run {run.name!r}") from None
        base = "/run/" + pages._seg(run.name)
        if as_json or request.query_params.get("_format") == "json":
            body, headers = swimlane.encoded(swimlane.window_json(lanes, db, request.query_params, base),
                                             request.headers.get("accept-encoding", ""))
            return Response(body, media_type="application/json", headers=headers)
        metrics = next((r[2] for r in run.snapshot.steps if (r[0], r[1]) == parsed), {})
        first = lanes.window(db, links_base=base + "/rollout/")
        body = timeline_page.page(lanes, links(run), run.snapshot.partitions, metrics, first)
        return respond(request, f"rtrace · {run.name} · {key} timeline", body, None, run, "step", swap=False)

    def prompts(request: Any, run: RunSource, db: Any) -> Any:
        qp = request.query_params
        q, sort = qp.get("q", "").strip()[:200], qp.get("_sort", "last")
        desc, offset = qp.get("_desc", "1") != "0", _int(qp.get("_offset")) or 0
        result = Q.prompt_list(db, q, sort if sort in Q.PROMPT_SORTS else "last", desc, offset)
        body = views.prompt_list_section(result, links(run), q, sort, desc, offset)
        return respond(request, f"rtrace · {run.name} · prompts", body, {"run": run.name, **result}, run, "prompts")

    def prompt(request: Any, run: RunSource, db: Any) -> Any:
        key = request.query_params.get("key")
        if not key:
            raise _NotFound("which prompt? /prompt?key=<prompt id>")
        result = Q.prompt_steps(db, key)
        if not result["steps"]:
            raise _NotFound(f"no prompt {key!r} in run {run.name!r}")
        return respond(request, f"rtrace · prompt {key}", views.prompt_section(result, links(run)),
                       {"run": run.name, **result}, run, "prompts")

    def failures(request: Any, run: RunSource, db: Any) -> Any:
        qp = request.query_params
        reason = qp.get("reason") if qp.get("reason") in Q.FAILURE_REASONS else None
        check, offset, step_ = qp.get("check") or None, _int(qp.get("_offset")) or 0, _int(qp.get("step"))
        result = Q.failures(db, reason, check, step_, offset)
        contexts = _retokenization(db, result["rows"])
        body = views.failures_section(result, links(run), reason, check, contexts, offset, step=step_)
        data = {"run": run.name, "counts": result["counts"], "checks": result["checks"], "more": result["more"],
                "rows": [{**r, "why": [w for _, w, _ in views.reasons(r)]} for r in result["rows"]]}
        return respond(request, f"rtrace · {run.name} · failures", body, data, run, "failures")

    def compare(request: Any, run: Any, db: Any) -> Any:
        qp = request.query_params
        a, b = qp.get("a"), qp.get("b")
        for name in (a, b):
            if name is not None and name not in sources.runs:
                raise _NotFound(f"no run named {name!r} here; runs: {', '.join(names)}")
        if not a or not b:
            return respond(request, "rtrace · compare", pages.compare_page(names, a, b, None, [], 0, 0, 50),
                           {"runs": names}, None, "compare")
        ra, rb = sources.runs[a], sources.runs[b]
        offset = _int(qp.get("_offset")) or 0
        curves = views.run_curves([], compare=[(a, ra.snapshot.steps, ra.snapshot.extras),
                                               (b, rb.snapshot.steps, rb.snapshot.extras)],
                                  components=Q.curve_keys(ra.snapshot.columns) | Q.curve_keys(rb.snapshot.columns))
        both = _prompts_in_both(ra, rb, time_limit_ms)
        body = pages.compare_page(names, a, b, curves, both[offset: offset + 50], len(both), offset, 50)
        data = {"a": a, "b": b, "prompts": both[offset: offset + 50], "total": len(both),
                "steps": {n: [{"validate": v, "step": s, "metrics": m} for v, s, m, _ in r.snapshot.steps]
                          for n, r in ((a, ra), (b, rb))}}
        return respond(request, f"rtrace · {a} and {b}", body, data, None, "compare")

    def compare_prompt(request: Any, run: Any, db: Any) -> Any:
        qp = request.query_params
        a, b, key = qp.get("a"), qp.get("b"), qp.get("key")
        if a not in sources.runs or b not in sources.runs or not key:
            raise _NotFound("give two served runs and a prompt: /compare/prompt?a=RUN&b=RUN&key=PROMPT")
        ra, rb = sources.runs[a], sources.runs[b]
        res_a = Q.prompt_steps(ra.db(time_limit_ms), key)
        res_b = Q.prompt_steps(rb.db(time_limit_ms), key)
        body = h("div", None, h("p", None, h("a", {"href": "/compare" + _qs(a=a, b=b)}, f"← {a} and {b}")),
                 views.prompt_section(res_a, views.ServeLinks("/run/" + pages._seg(a)), res_b, (a, b)))
        return respond(request, f"rtrace · prompt {key}: {a} and {b}", body, {"a": res_a, "b": res_b}, None, "compare")

    def state(request: Any) -> Any:
        data = {"runs": {name: {"version": r.snapshot.version, "trajectories": r.snapshot.trajectories,
                                "steps": len(r.snapshot.partitions), "problem": r.snapshot.problem}
                         for name, r in sources.runs.items()}, "refresh_s": sources.refresh_s}
        return Response(json.dumps(data), media_type="application/json")

    def static(request: Any) -> Any:
        name = request.path_params["name"]
        if name not in STATIC:
            return PlainTextResponse("not found", 404)
        package, media = STATIC[name]
        text = resources.files(package).joinpath("static", name).read_text(encoding="utf-8")
        return Response(text, media_type=media + "; charset=utf-8")

    def login(request: Any) -> Any:
        nxt = request.query_params.get("next", "/")
        body = pages.login_page(nxt if nxt.startswith("/") and not nxt.startswith("//") else "/",
                                request.query_params.get("failed") == "1")
        return Response(pages.document("rtrace · sign in", body, pages.header([], None, None)),
                        media_type="text/html; charset=utf-8")

    routes = [Route("/", index), Route("/index.json", index), Route("/-/state.json", state),
              Route("/-/login", login), Route("/static/{name}", static),
              Route("/run/{run}", lambda r: RedirectResponse(f"/run/{pages._seg(r.path_params['run'])}/overview", 307)),
              Route("/compare", guarded(compare, "compare")), Route("/compare.json", guarded(compare, "compare")),
              Route("/compare/prompt", guarded(compare_prompt, "compare")),
              Route("/compare/prompt.json", guarded(compare_prompt, "compare"))]
    for path, fn, active in (("overview", overview, "overview"), ("rollouts", rollouts, "rollouts"),
                             ("prompts", prompts, "prompts"), ("prompt", prompt, "prompts"),
                             ("failures", failures, "failures")):
        routes += [Route(f"/run/{{run}}/{path}", guarded(fn, active)),
                   Route(f"/run/{{run}}/{path}.json", guarded(fn, active))]
    routes += [Route("/run/{run}/step", guarded(step_redirect, "step")),
               Route("/run/{run}/step/{key}", guarded(step, "step")),
               Route("/run/{run}/rollout/{trace}", guarded(rollout, "rollout")),
               Route("/run/{run}/timeline/{key}", guarded(timeline, "step"))]
    app = Starlette(routes=routes)
    return Guard(app, token, loopback, secure)


class _NotFound(Exception):
    pass


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text not in (None, "") else None
    except ValueError:
        return None


def _suffix(text: str) -> tuple[str, bool]:
    return (text[:-5], True) if text.endswith(".json") else (text, False)


def _qs(**params: Any) -> str:
    from ..report.markup import query_string

    return query_string(list(params.items()))


def _pairs(request: Any) -> list[tuple[str, str]]:
    """The query string's pairs; the forms' fields (``_f``/``_op``/``_v``: one filter; ``_c``:
    the chosen columns) turned into the table's own parameters."""
    items = list(request.query_params.multi_items())
    out, chosen, f = [], None, {}
    for key, value in items:
        if key == "_c":
            chosen = (chosen or []) + ([value] if value else [])
        elif key in ("_f", "_op", "_v"):
            f[key] = value
        elif key not in ("_format",):
            out.append((key, value))
    if chosen is not None:
        out = [(k, v) for k, v in out if k != "_col"] + [("_col", ",".join(chosen))]
    if f.get("_f"):
        op = f.get("_op") or "eq"
        if f.get("_v", "") != "" or op in ("null", "notnull"):
            out.append((f["_f"] if op == "eq" else f"{f['_f']}__{op}", f.get("_v", "") or "1"))
    return out


def _retokenization(db: Any, rows: list[dict[str, Any]]) -> dict[tuple[str, int], Any]:
    """The token context of each retokenization finding on the page (its trajectories' spans, read once)."""
    wanted = [r for r in rows if any((f or {}).get("check") == "retokenization" for f in r.get("health") or ())]
    if not wanted:
        return {}
    marks = ", ".join("?" for _ in wanted)
    steps = sorted({r["step"] for r in wanted if r["step"] is not None})
    where = f"trace_id IN ({marks}) AND " + (f"(step IN ({', '.join(str(int(s)) for s in steps)}) OR step IS NULL)"
                                             if steps else "step IS NULL")  # those steps' files only
    ids = [r["trace_id"] for r in wanted]
    out = {}
    for traj in Q.load_trajectories(db, where, ids, where, ids):
        for i, finding in enumerate(traj.health or ()):
            if finding.get("check") == "retokenization":
                ctx = views.retokenization_context(traj, finding.get("detail") or "")
                if ctx is not None:
                    out[(traj.trace_id, i)] = ctx
    return out


def _prompts_in_both(a: RunSource, b: RunSource, limit_ms: float) -> list[dict[str, Any]]:
    """The prompts both runs have, with each run's rollouts and pass rate, the largest
    difference first."""
    def sql(db: Any) -> str:
        prompt, ok = Q._x(db, "_prompt"), Q._x(db, "_pass")
        return (f"SELECT {prompt} AS prompt, count(*) AS n, left(any_value(task), 200) AS task, "
                f"avg(CASE WHEN {ok} THEN 1.0 WHEN NOT {ok} THEN 0.0 END) AS pass FROM {db.table} "
                f"WHERE {prompt} IS NOT NULL GROUP BY 1")

    db_a, db_b = a.db(limit_ms), b.db(limit_ms)
    _, rows_a = db_a.rows(sql(db_a))
    _, rows_b = db_b.rows(sql(db_b))
    by_b = {r[0]: r for r in rows_b}
    out = []
    for prompt, n, task, pass_a in rows_a:
        other = by_b.get(prompt)
        if other is None:
            continue
        pass_b = other[3]
        delta = None if pass_a is None or pass_b is None else pass_b - pass_a
        out.append({"prompt": prompt, "task": task, "n_a": n, "pass_a": pass_a, "n_b": other[1], "pass_b": pass_b,
                    "delta": delta})
    out.sort(key=lambda p: (-(abs(p["delta"]) if p["delta"] is not None else -1), p["prompt"]))
    return out
