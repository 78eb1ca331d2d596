"""``rtrace serve``: the app tested in-process with httpx (no network, no port), over a real run.

tests/serve_job.py traces a small GRPO job with rtrace's decorators into a Parquet dataset
and JSONL at once; the app serves the dataset and the JSONL (copied into a dataset) as
two runs. Expected values come from the job's script, from :class:`StepStats` or from
Python over the trajectories, never from the code under test. The browser test
(tests/ui/test_serve_page.py) drives the same pages in Chromium.
"""

from __future__ import annotations

import asyncio
import html
import json
import math
import os
import re
import shutil
import time
import urllib.parse

import pytest

pytest.importorskip("duckdb")
pytest.importorskip("pyarrow")
pytest.importorskip("starlette")
httpx = pytest.importorskip("httpx")

from rtrace.pipeline.metrics import StepStats  # noqa: E402
from rtrace.report import plots  # noqa: E402
from rtrace.report.load import read_records  # noqa: E402
from rtrace.serve.app import create_app  # noqa: E402
from rtrace.serve.sources import QueryTimeout, RunSource, Sources, sources_from_paths  # noqa: E402
from tests.dataset_run import records_as_read_back  # noqa: E402
from tests import serve_job as job  # noqa: E402


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve-job")
    out = job.run(str(folder))
    out["records"] = read_records([out["jsonl"]])[0]
    out["by_id"] = {r.traj.trace_id: r.traj for r in out["records"]}
    return out


@pytest.fixture(scope="module")
def sources(ran):
    srcs = sources_from_paths([ran["dataset"], "copy=" + ran["jsonl"]])
    srcs.refresh()
    yield srcs
    srcs.close()


def fetch(app, *urls, headers=None, method="GET", data=None):
    """GET (or POST) each url through the ASGI app; the responses in order."""
    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8765") as client:
            out = []
            for url in urls:
                if method == "POST":
                    out.append(await client.post(url, data=data, headers=headers or {}))
                else:
                    out.append(await client.get(url, headers=headers or {"accept": "text/html"}))
            return out
    return asyncio.run(go())


def get(app, url, **kw):
    return fetch(app, url, **kw)[0]


def get_json(app, url):
    r = get(app, url, headers={"accept": "application/json"})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def app(sources):
    return create_app(sources)


def _tid(ran, step, prompt, rollout):
    return ran["trace_ids"][f"{step}-{prompt}-{rollout}"]


class TestTheRolloutsTable:
    @pytest.mark.parametrize("run", ["job", "copy"])
    def test_every_rollout_newest_step_first_with_its_columns(self, app, ran, run):
        """The table holds every rollout (the dataset and the JSONL copy alike), newest step
        first; each reward component is a column; each row links its rollout."""
        data = get_json(app, f"/run/{run}/rollouts.json?_size=100")
        assert data["total"] == 36 and len(data["rows"]) == 36
        assert [r["step"] for r in data["rows"]] == [3] * 12 + [2] * 12 + [1] * 12
        names = [c["name"] for c in data["all_columns"]]
        assert {"outcome.reward/accuracy", "outcome.reward/format", "annotation.logprob_mismatch_k3"} <= set(names)
        by_id = {r["trace_id"]: r for r in data["rows"]}
        for key, tid in ran["trace_ids"].items():
            step, p, r = map(int, key.split("-"))
            row = by_id[tid]
            assert row["reward"] == job.reward_of(step, p, r)
            assert row["outcome.reward/accuracy"] == (None if (step, p, r) == job.CRASH else
                                                      job.components(step, p, r)[0])
            assert row["task"] == job.task_of(step, p)
        page = get(app, f"/run/{run}/rollouts").text
        assert f'href="/run/{run}/rollout/{_tid(ran, 3, 0, 0)}"' in page

    def test_sort_by_any_column_over_all_steps(self, app, ran):
        """_sort / _desc order every step's rollouts; ties by trace id; nulls last."""
        rows = get_json(app, "/run/job/rollouts.json?_sort=reward&_desc=1&_size=100")["rows"]
        rewards = [r["reward"] for r in rows]
        finite = sorted((job.reward_of(*map(int, k.split("-"))) for k in ran["trace_ids"]
                         if job.reward_of(*map(int, k.split("-"))) is not None), reverse=True)
        assert rewards == finite + [None]
        lat = [r["latency"] for r in get_json(app, "/run/job/rollouts.json?_sort=latency&_size=100")["rows"]]
        assert lat == sorted(lat)

    @pytest.mark.parametrize("query, expected", [
        # (filter, which rollouts: a predicate over (step, prompt, rollout) of the job's script)
        ("verdict=wrong", lambda k: k not in (job.CRASH, job.LONG) and not job.passed(*k)),
        ("step__ge=2&pass=true", lambda k: k[0] >= 2 and job.passed(*k)),
        ("truncated=true", lambda k: k == job.LONG),
        ("reward__null=1", lambda k: k == job.CRASH),
        ("outcome.reward/format__lt=0.75", lambda k: k != job.CRASH and job.components(*k)[1] < 0.75),
        ("prompt=q2&rollout__ne=0", lambda k: k[1] == 2 and k[2] != 0),
        ("q=onerror", lambda k: k == job.HOSTILE),                      # text search: answers
        ("q=%3Cb%3Ebold", lambda k: k[:2] == job.HOSTILE[:2]),          # ... and prompts (<b>bold)
        ("q=100%25", lambda k: False),                                  # % is a character, not a wildcard
        ("health=retokenization", lambda k: k == job.RETOK),
    ])
    def test_filter_by_any_column_and_search(self, app, ran, query, expected):
        data = get_json(app, f"/run/job/rollouts.json?_size=100&{query}")
        want = {_tid(ran, *k) for k in (tuple(map(int, key.split("-"))) for key in ran["trace_ids"]) if expected(k)}
        assert {r["trace_id"] for r in data["rows"]} == want and data["total"] == len(want)
        assert data["problems"] == []

    def test_search_reads_the_word_index_and_finds_what_a_scan_finds(self, app, sources, ran):
        """The run's answers are in its word index (built on the refresh); searches through it give
        the rollouts a scan of the run's files gives (task or answer ILIKE '%q%', or a trace id)."""
        from rtrace.dataset.reader import open_run

        source = sources.runs["job"]
        words = source.index.words
        cursor = source.cursor()
        try:
            assert words.upto >= 0 and words.pending(cursor, source.index.table) == 0
        finally:
            cursor.close()
        run = open_run(ran["dataset"])
        tid = sorted(ran["by_id"])[3]
        nonempty = 0
        for q in ["onerror", "ONERROR=", "answer", "is 4", "the answer is", "<b>", "ol", "100%", "_", tid[:10]]:
            data = get_json(app, f"/run/job/rollouts.json?_size=500&q={urllib.parse.quote(q)}")
            pattern = "%" + q.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
            want = {r[0] for r in run.sql("SELECT trace_id FROM trajectories WHERE task ILIKE ? ESCAPE '\\' OR answer "
                                          "ILIKE ? ESCAPE '\\' OR starts_with(trace_id, ?)",
                                          [pattern, pattern, q if q == tid[:10] else "-"]).fetchall()}
            assert {r["trace_id"] for r in data["rows"]} == want and data["total"] == len(want), q
            nonempty += bool(want)
        assert nonempty >= 7
        data = get_json(app, "/run/job/rollouts.json?_size=500&answer__contains=answer+is")
        assert {r["trace_id"] for r in data["rows"]} == {r[0] for r in run.sql(
            "SELECT trace_id FROM trajectories WHERE answer ILIKE '%answer is%'").fetchall()}

    def test_what_is_not_understood_is_said(self, app):
        data = get_json(app, "/run/job/rollouts.json?nope=1&reward__gt=abc&_sort=nope")
        assert data["problems"] == ["no column 'nope' to filter on", "reward: could not convert string to float: 'abc'",
                                    "no column 'nope' to sort by"]
        assert data["total"] == 36

    def test_the_filter_form_and_column_chooser(self, app):
        """The page's GET forms: _f/_op/_v make one filter, _c the shown columns."""
        data = get_json(app, "/run/job/rollouts.json?_f=step&_op=le&_v=1&_c=reward&_c=verdict")
        assert data["total"] == 12 and [c["name"] for c in data["columns"]] == ["verdict", "reward"]  # the table's order
        assert set(data["rows"][0]) == {"trace_id", "reward", "verdict"}
        page = get(app, "/run/job/rollouts?_col=reward,verdict").text
        assert 'name="_c" value="reward" checked' in page and 'name="_c" value="task">' in page

    def test_histograms_bin_as_the_report_does_and_each_bar_filters(self, app, ran):
        """The reward histogram's bars are those plots.histogram draws from the same rewards, and a
        bar's link (an overflow bar's too) narrows the table to that bar's rollouts (its count)."""
        data = get_json(app, "/run/job/rollouts.json")
        rewards = [t.reward for t in ran["by_id"].values()]
        hist = data["histograms"]["reward"]
        titles = re.findall(r"<title>([^<]*)</title>", plots.histogram_bars(
            "reward", [tuple(b) for b in hist["bars"]], under=hist["under"], over=hist["over"]))
        assert titles == re.findall(r"<title>([^<]*)</title>", plots.histogram("reward", rewards))
        assert data["histograms"]["reward"]["missing"] == 1  # the crash
        lat = data["histograms"]["latency"]
        beyond = [b for b in (lat["under"], lat["over"]) if b]
        assert not lat["categorical"] and sum(b[2] for b in lat["bars"] + beyond) == 36
        page = get(app, "/run/job/rollouts").text
        links = re.findall(r'<div class="hist" data-hist="latency">.*?</div>', page, re.S)[0]
        hrefs = [html.unescape(h) for h in re.findall(r'<a href="([^"]+)" class="bar"', links)]
        counts = [b[2] for b in ([lat["under"]] if lat["under"] else []) + lat["bars"] +
                  ([lat["over"]] if lat["over"] else []) if b[2]]
        assert len(hrefs) == len(counts)
        for href, count in zip(hrefs, counts):
            assert get_json(app, href.replace("/rollouts?", "/rollouts.json?"))["total"] == count

    def test_page_weight_does_not_grow_with_the_run(self, tmp_path):
        """The table's page holds one page of rows and fixed-size histograms: 10,000 matching
        rollouts weigh what 5,000 of the same run do; it is the page's size that counts."""
        from tests.ui.big_run import write_run

        write_run(tmp_path / "big", 10_000)
        srcs = Sources([RunSource("big", dataset=str(tmp_path / "big"))])
        srcs.refresh()
        big = create_app(srcs)
        half = get(big, "/run/big/rollouts?step__le=5&validate=false")
        whole = get(big, "/run/big/rollouts?validate=false")
        page100 = get(big, "/run/big/rollouts?validate=false&_size=100")
        srcs.close()
        assert "rollouts 1–50 of 5,000" in half.text and "rollouts 1–50 of 10,000" in whole.text
        assert abs(len(whole.content) - len(half.content)) < 0.1 * len(half.content)
        assert len(whole.content) < 250_000 and len(page100.content) > 1.5 * len(whole.content)


class TestSteps:
    def test_the_step_table_is_the_step_metrics(self, app, ran):
        """The overview's step metrics equal StepStats over each step's trajectories, with the pass
        rate and each reward component's mean per step."""
        data = get_json(app, "/run/job/overview.json")
        assert [s["step"] for s in data["steps"]] == [1, 2, 3]
        for s in data["steps"]:
            st = StepStats()
            trajs = [t for t in ran["by_id"].values() if t.step == s["step"]]
            for t in trajs:
                st.add(t)
            expected = {k.split("/", 1)[1]: v for k, v in st.values("x").items()}
            for name, value in s["metrics"].items():
                assert value == pytest.approx(expected[name], rel=1e-9, abs=1e-12), name
            fmt = [t.outcome["reward/format"] for t in trajs if "reward/format" in t.outcome]
            assert s["outcome.reward/format"] == pytest.approx(sum(fmt) / len(fmt))
            judged = [job.passed(s["step"], t.sample_index, t.rollout_n) for t in trajs
                      if (s["step"], t.sample_index, t.rollout_n) != job.CRASH]  # no reward, no verdict: not judged
            assert s["pass_rate"] == pytest.approx(sum(judged) / len(judged))
        page = get(app, "/run/job/overview").text
        assert 'aria-label="reward/accuracy (mean)"' in page and 'aria-label="pass rate"' in page
        assert 'aria-label="train-inference mismatch (k3)"' in page

    def test_a_step_is_the_report_step_viewer_with_its_mismatch(self, app, ran):
        """/step/t2 is the report's page for step 2's trajectories (its data block), with its
        script and stylesheet as files, and the rollout with the largest mismatch listed first."""
        from rtrace.report.data import page_data
        from rtrace.report.page import decode_data

        page = get(app, "/run/job/step/t2").text
        block = re.search(r'id="rtrace-data"[^>]*>([^<]*)<', page).group(1)
        data = decode_data(block)
        assert sorted(t[0] for t in data["trajectories"]) == sorted(_tid(ran, 2, p, r) for p in range(3) for r in range(4))
        expected = page_data(records_as_read_back(r for r in ran["records"] if r.traj.step == 2))
        assert data["steps"][0]["metrics"] == expected["steps"][0]["metrics"]
        assert '<script src="/static/report.js"></script>' in page and "<style>" not in page
        mismatch = get_json(app, "/run/job/step/t2.json")["mismatch"]
        assert mismatch[0]["trace_id"] == _tid(ran, *job.MISMATCH) and mismatch[0]["k3"] > 0.2
        assert get(app, "/run/job/step/t9").status_code == 404

    def test_prompts_across_steps(self, app, ran):
        data = get_json(app, "/run/job/prompts.json")
        assert {p["prompt"]: (p["steps"], p["n"]) for p in data["prompts"]} == {f"q{p}": (3, 12) for p in range(3)}
        q1 = get_json(app, "/run/job/prompt.json?key=q1")
        assert [s["step"] for s in q1["steps"]] == [1, 2, 3]
        for s in q1["steps"]:
            judged = [job.passed(s["step"], 1, r) for r in range(4) if (s["step"], 1, r) != job.CRASH]
            assert (s["passed"], s["judged"]) == (sum(judged), len(judged))
            assert [a["trace_id"] for a in s["answers"]] == [_tid(ran, s["step"], 1, r) for r in range(4)]
        assert get(app, "/run/job/prompt?key=nope").status_code == 404


class TestFailures:
    def test_each_failure_with_why_in_words(self, app, ran):
        data = get_json(app, "/run/job/failures.json")
        why = {r["trace_id"]: r["why"] for r in data["rows"]}
        crash = why[_tid(ran, *job.CRASH)]
        assert f"error: RuntimeError: {job.CRASH_ERROR}" in crash and any(w.startswith("no reward") for w in crash)
        assert why[_tid(ran, *job.LONG)][0].startswith("truncated: a generation stopped at the length limit")
        wrong = why[_tid(ran, 1, 0, 2)]
        assert wrong == ["wrong answer"]
        assert any(w.startswith("logprob_mismatch: 25.0% of 4 tokens") for w in why[_tid(ran, *job.MISMATCH)])
        assert data["counts"]["error"] == 1 and data["counts"]["truncated"] == 1
        only = get_json(app, "/run/job/failures.json?check=retokenization")["rows"]
        assert [r["trace_id"] for r in only] == [_tid(ran, *job.RETOK)]

    def test_a_retokenization_finding_shows_the_text_that_changed(self, app, ran):
        """Not only ids: the response's tokens around the first different one, that one marked."""
        page = get(app, "/run/job/failures?check=retokenization").text
        pieces = re.search(r'<span class="pieces">(.*?)</span> \(token 3', page).group(1)
        texts = [html.unescape(t) for t in re.findall(r">([^<]*)</span>", pieces)]
        assert texts == ["The", "␣answer", "␣is", "␣4", "2", "."]
        assert re.search(r'<span class="tk at" title="token 3[^"]*">␣4</span>', pieces)


class TestARollout:
    def test_tokens_coloured_by_each_array_with_values_on_hover(self, app, ran):
        """The mismatch rollout: its tokens, a colour per token from the chosen array, a legend;
        mismatch = trainer - sampler. Each token's tooltip (``data-tip``, shown at once by
        tokens.js; not a native ``title``): its position, id (when kept), exact text and every
        array's value."""
        tid = _tid(ran, *job.MISMATCH)
        page = get(app, f"/run/job/rollout/{tid}?color=mismatch").text
        toks = re.findall(r'<span class="tk (\w+)" data-tip="([^"]*)">([^<]*)</span>', page)
        assert [html.unescape(t) for _, _, t in toks] == ["The", " answer", " is", " 4", "."]
        assert [c for c, _, _ in toks] == ["d5", "d5", "d5", "d0", "d5"]  # -2 at token 3: the darkest blue
        tip = html.unescape(toks[3][1]).split("\n")
        assert tip[:2] == ["token 3", '" 4"']  # token2text dropped the ids (RTRACE_TOKEN2TEXT_KEEP_IDS keeps them)
        assert {"mismatch -2", "logprob -0.2", "old_logprob -2.2"} <= set(tip)
        assert '<script src="/static/tokens.js" defer>' in page and ' title="token' not in page
        assert 'data-color="mismatch"' in page and "trainer − sampler" in page
        def tokens(color):
            page = get(app, f"/run/job/rollout/{tid}?color={color}").text
            div = re.search(r'<div class="tokens"[^>]*>(.*?)</div>', page, re.S)  # a tooltip holds newlines
            return re.findall(r'<span class="tk (\w+)"', div.group(1))

        assert tokens("loss_mask") == ["m0", "m1", "m1", "m1", "m1"]  # the first token is not trained on
        entropy = tokens("entropy")
        assert entropy == ["q0", "q3", "q5", "q8", "q0"]  # 0, .25, .5, .75, 0 of 0.75
        assert get_json(app, f"/run/job/rollout/{tid}.json")["trace_id"] == tid

    def test_unknown_and_malformed_ids_are_refused(self, app):
        for url in ("/run/job/rollout/" + "0" * 32, "/run/job/rollout/not-an-id", "/run/job/rollout/%2e%2e%2f%2e%2e"):
            assert get(app, url).status_code == 404


class TestUntrustedText:
    PAGES = ["/run/job/rollouts", "/run/job/rollouts?q=script", "/run/job/failures", "/run/job/prompts",
             "/run/job/prompt?key=q1", "/run/job/step/t2", "/compare?a=job&b=copy", "/compare/prompt?a=job&b=copy&key=q1"]

    def test_html_in_answers_prompts_and_errors_is_text_on_every_page(self, app, ran):
        """No page holds the job's markup as markup: only escaped (or inside the step viewer's
        encoded data block); the rollout page shows it as text too."""
        hostile = ["<script>alert(\"x\")</script>", "<img src=x onerror=alert(1)>", "<svg onload=alert(1)>",
                   "<b>bold</b>", "<script>alert(\"task\")</script>"]
        pages = self.PAGES + [f"/run/job/rollout/{_tid(ran, *job.HOSTILE)}", f"/run/job/rollout/{_tid(ran, *job.CRASH)}"]
        seen = set()
        for url in pages:
            text = get(app, url).text
            for h in hostile:
                assert h not in text, (url, h)
                if html.escape(h, quote=False) in text or html.escape(h) in text:
                    seen.add(h)
            scripts = re.findall(r"<script\b[^>]*>", text)
            assert all('src="/static/' in s or 'type="application/octet-stream"' in s for s in scripts), (url, scripts)
        assert seen == set(hostile)  # every one was shown, as text

    def test_json_pages_hold_the_text_as_it_was(self, app, ran):
        row = get_json(app, f"/run/job/rollouts.json?q=onerror")["rows"][0]
        assert row["answer"].endswith('</pre><script>alert("x")</script><img src=x onerror=alert(1)>')

    def test_every_response_forbids_inline_script(self, app, ran):
        for url in ["/", "/run/job/overview", "/run/job/step/t1", "/static/report.js", "/nope"]:
            r = get(app, url)
            csp = r.headers["content-security-policy"]
            assert "script-src 'self'" in csp and "unsafe-inline" not in csp.split("script-src")[1].split(";")[0]
            assert r.headers["x-content-type-options"] == "nosniff"


class TestPaths:
    @pytest.mark.parametrize("url", ["/static/../../pyproject.toml", "/static/..%2f..%2fpyproject.toml",
                                     "/static/report.html", "/run/..%2f..%2fetc/overview",
                                     "/run/%2e%2e/overview", "/run/nope/rollouts", "/run/job/step/..%2fx",
                                     "/run/job/nope", "/etc/passwd"])
    def test_nothing_outside_the_served_runs(self, app, url):
        r = get(app, url)
        assert r.status_code == 404, url
        assert "[project]" not in r.text and "root:" not in r.text

    def test_a_run_is_chosen_by_name_among_those_served(self, app):
        assert get_json(app, "/index.json")["runs"][0]["name"] == "job"
        assert [r["name"] for r in get_json(app, "/index.json")["runs"]] == ["job", "copy"]


class TestLive:
    def test_a_missing_then_empty_then_written_dataset(self, tmp_path):
        """A path with nothing yet: a page that says so; then the run writes and the next refresh
        shows it (its version moves, so pages update)."""
        where = tmp_path / "later" / "ds" / "job"
        srcs = Sources([RunSource("job", dataset=str(where))])
        srcs.refresh()
        app = create_app(srcs)
        page = get(app, "/run/job/rollouts").text
        assert "nothing to show yet" in page and f"no dataset at {where} yet" in page
        assert get(app, "/run/job/overview").status_code == 200
        before = get_json(app, "/-/state.json")["runs"]["job"]["version"]
        job.run(str(tmp_path / "later"), steps=1, jsonl=False)
        assert srcs.refresh()
        assert get_json(app, "/-/state.json")["runs"]["job"]["version"] > before
        assert get_json(app, "/run/job/rollouts.json")["total"] == 12
        srcs.close()

    def test_a_new_step_appears_after_a_refresh_jsonl_too(self, tmp_path):
        """JSONL growing line by line: complete lines are copied at each refresh, a line still
        being written waits for its newline, a bad line is counted, a cut file is read again."""
        folder = tmp_path / "j"
        folder.mkdir()
        out = job.run(str(folder), steps=2)
        lines = open(out["jsonl"], "rb").read().splitlines(keepends=True)
        grow = tmp_path / "grow.jsonl"
        first = [ln for ln in lines if b'"step":1' in ln or b'"step": 1' in ln]
        assert len(first) == 12
        grow.write_bytes(b"".join(first))
        srcs = sources_from_paths([str(grow)])
        srcs.refresh()
        app = create_app(srcs)
        (name,) = srcs.runs
        assert get_json(app, f"/run/{name}/overview.json")["trajectories"] == 12
        rest = [ln for ln in lines if ln not in first]
        with open(grow, "ab") as f:
            f.write(b"".join(rest[:5]) + rest[5][:40])  # half a line: not read yet
        srcs.refresh()
        data = get_json(app, f"/run/{name}/overview.json")
        assert data["trajectories"] == 17
        with open(grow, "ab") as f:
            f.write(rest[5][40:] + b"".join(rest[6:]) + b"not json\n")
        srcs.refresh()
        assert [s["step"] for s in get_json(app, f"/run/{name}/overview.json")["steps"]] == [1, 2]
        assert get_json(app, f"/run/{name}/rollouts.json")["total"] == 24
        assert "1 lines of" in get(app, f"/run/{name}/overview").text
        grow.write_bytes(b"".join(first))  # cut: the copy starts again
        srcs.refresh()
        assert get_json(app, f"/run/{name}/rollouts.json")["total"] == 12
        srcs.close()

    def test_a_query_past_its_time_limit_is_stopped(self, sources):
        db = sources.runs["job"].db(limit_ms=200)
        t0 = time.perf_counter()
        with pytest.raises(QueryTimeout, match="longer than 200 ms"):
            db.rows("SELECT count(*) FROM trajectories, range(100000000000)")
        assert time.perf_counter() - t0 < 20


class TestCompare:
    def test_two_runs_overlaid_and_a_prompt_side_by_side(self, app, ran):
        data = get_json(app, "/compare.json?a=job&b=copy")
        assert data["total"] == 3 and {p["prompt"] for p in data["prompts"]} == {"q0", "q1", "q2"}
        assert all(p["delta"] == 0 for p in data["prompts"])  # the same run twice
        page = get(app, "/compare?a=job&b=copy").text
        assert "job: mean" not in page and re.search(r'aria-label="reward mean"', page)
        assert page.count("&#9632; job") >= 1 and page.count("&#9632; copy") >= 1
        side = get(app, "/compare/prompt?a=job&b=copy&key=q0").text
        assert side.count(_tid(ran, 1, 0, 0)) >= 2  # the same rollout in both columns
        assert get(app, "/compare?a=job&b=nope").status_code == 404


class TestSecurity:
    TOKEN = "s3cret-token-0123456789"

    @pytest.fixture
    def guarded(self, sources):
        return create_app(sources, token=self.TOKEN, loopback=False)

    def test_loopback_answers_local_names_only(self, app):
        """Bound to loopback: a request for another host name (DNS rebinding) is refused."""
        assert get(app, "/run/job/overview", headers={"host": "attacker.example"}).status_code == 403
        for host in ("localhost:8765", "127.0.0.1", "[::1]:8765"):
            assert get(app, "/run/job/overview", headers={"host": host}).status_code == 200

    def test_beyond_loopback_the_token_is_required(self, guarded):
        assert get(guarded, "/run/job/rollouts.json", headers={"accept": "application/json"}).status_code == 401
        r = get(guarded, "/run/job/rollouts?q=x", headers={"accept": "text/html"})
        assert r.status_code == 303 and r.headers["location"] == "/-/login?next=%2Frun%2Fjob%2Frollouts%3Fq%3Dx"
        bad = get(guarded, "/run/job/rollouts.json", headers={"authorization": "Bearer nope"})
        assert bad.status_code == 401
        ok = get(guarded, "/run/job/rollouts.json", headers={"authorization": f"Bearer {self.TOKEN}"})
        assert ok.status_code == 200 and ok.json()["total"] == 36
        assert get(guarded, "/-/login").status_code == 200 and get(guarded, "/static/serve.css").status_code == 200
        assert get(guarded, "/static/serve.js", headers={"accept": "*/*"}).status_code == 401

    def test_signing_in_sets_a_cookie_that_is_not_the_token(self, guarded):
        r = get(guarded, "/-/login", method="POST", data={"token": "wrong", "next": "/run/job/overview"})
        assert r.status_code == 303 and r.headers["location"].startswith("/-/login?failed=1")
        r = get(guarded, "/-/login", method="POST", data={"token": self.TOKEN, "next": "/run/job/overview"})
        assert r.status_code == 303 and r.headers["location"] == "/run/job/overview"
        cookie = r.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and self.TOKEN not in cookie
        value = cookie.split(";")[0]
        assert get(guarded, "/run/job/overview", headers={"cookie": value}).status_code == 200
        r = get(guarded, "/-/login", method="POST", data={"token": self.TOKEN, "next": "//evil.example/x"})
        assert r.headers["location"] == "/"  # only this server's own pages

    def test_rtrace_serve_refuses_beyond_loopback_without_a_token(self, tmp_path, monkeypatch, capsys):
        from rtrace.cli import main

        monkeypatch.delenv("RTRACE_COLLECTOR_TOKEN", raising=False)
        assert main(["serve", str(tmp_path), "--host", "0.0.0.0", "--port", "0"]) == 2
        assert "set RTRACE_COLLECTOR_TOKEN" in capsys.readouterr().out
        monkeypatch.setenv("RTRACE_COLLECTOR_TOKEN", "short")
        assert main(["serve", str(tmp_path), "--host", "0.0.0.0", "--port", "0"]) == 2
        assert "RTRACE_COLLECTOR_TOKEN" in capsys.readouterr().out


def test_the_static_report_has_the_same_rollouts_table(ran, tmp_path):
    """rtrace report --html: a snapshot of the run-wide table (the newest step first, the same
    columns and histograms as the server draws), its rows linking the page's own step viewer."""
    from rtrace.report import run as report

    page = tmp_path / "r.html"
    with open(os.devnull, "w") as devnull:
        assert report([ran["jsonl"]], devnull, str(page)) == 0
    text = page.read_text()
    table = re.search(r'<table class="rollouts"[^>]*>(.*?)</table>', text, re.S).group(1)
    rows = re.findall(r'<tr class="r-\w+ row-\w+" data-trace="(\w+)"', table)
    assert len(rows) == 36 and rows[0] in {_tid(ran, 3, p, r) for p in range(3) for r in range(4)}
    assert f'href="#trace={rows[0]}"' in table and "/rollouts?" not in table  # no server links
    assert 'data-hist="reward"' in text and 'aria-label="reward/format (mean)"' in text
    assert "<script>alert" not in text
