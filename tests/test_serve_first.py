"""What a researcher hits first in ``rtrace serve`` (issue #42): training and validation kept
apart, histograms that one outlier does not flatten, the table's key columns first, rare
outcome keys out of the way, the newest step on top, token tooltips with the token's text,
bidirectional text shown as stored, and the README's query that agrees with the report.

The run is tests/serve_edges.py (JSONL written by the jsonl sink's encoder, copied by the
server into a dataset); the app runs in-process with httpx. Expected values come from the
run's script. The browser sees the same run in tests/ui/test_serve_page.py.
"""

from __future__ import annotations

import html
import re
from pathlib import Path

import pytest

pytest.importorskip("duckdb")
pytest.importorskip("pyarrow")
pytest.importorskip("starlette")

from rtrace.report import plots  # noqa: E402
from rtrace.serve.app import create_app  # noqa: E402
from rtrace.serve.sources import sources_from_paths  # noqa: E402
from tests import serve_edges as edges  # noqa: E402
from tests.test_serve import get, get_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    return edges.write(str(tmp_path_factory.mktemp("serve-edges")))


@pytest.fixture(scope="module")
def sources(ran):
    srcs = sources_from_paths(["edges=" + ran["jsonl"]])
    srcs.refresh()
    yield srcs
    srcs.close()


@pytest.fixture(scope="module")
def app(sources):
    return create_app(sources)


def _train(ran):
    return [t for t in ran["trajectories"].values() if not t.validate]


def _page_text(page: str) -> str:
    """What a person reads of a page: its text, without the markup."""
    return html.unescape(re.sub(r"<[^>]+>", " ", page))


class TestTrainingAndValidation:
    def test_the_table_holds_training_rollouts_unless_switched(self, app, ran):
        """By default the table, its count and its histograms are the training rollouts; the
        switch (``_split``) shows the validation ones, or both; a filter on ``validate`` shows
        what it asks for."""
        n_train, n_val = len(_train(ran)), edges.VALIDATION
        data = get_json(app, "/run/edges/rollouts.json?_size=500&_col=step,validate,reward")
        assert data["split"] == "train" and data["total"] == n_train
        assert {r["validate"] for r in data["rows"]} == {False}
        assert sum(b[2] for b in data["histograms"]["reward"]["bars"]) == n_train
        val = get_json(app, "/run/edges/rollouts.json?_split=val&_size=500&_col=validate")
        assert val["total"] == n_val and {r["validate"] for r in val["rows"]} == {True}
        assert get_json(app, "/run/edges/rollouts.json?_split=all")["total"] == n_train + n_val
        assert get_json(app, "/run/edges/rollouts.json?validate=true")["total"] == n_val
        assert get_json(app, "/run/edges/rollouts.json?_split=nope")["problems"] == ["_split='nope': one of train, val, all"]

    def test_the_switch_is_on_the_page_and_validation_rows_are_marked(self, app, ran):
        page = get(app, "/run/edges/rollouts").text
        switch = re.search(r'<nav class="chips splits" id="split".*?</nav>', page, re.S).group(0)
        chips = re.findall(r'<a href="([^"]*)" class="chip( on)?" data-split="(\w+)"[^>]*>([^<]*)</a>', switch)
        assert [(name, on, text) for _, on, name, text in chips] == [
            ("train", " on", f"training {len(_train(ran))}"), ("val", "", f"validation {edges.VALIDATION}"),
            ("all", "", f"both {len(ran['trajectories'])}")]
        assert "row-val" not in page
        both = get(app, "/run/edges/rollouts?_split=all&_size=500").text
        rows = re.findall(r'<tr class="([^"]*)" data-trace="(\w+)"', both)
        by_id = {t.trace_id: t for t in ran["trajectories"].values()}
        assert {tid for cls, tid in rows if "row-val" in cls} == {tid for tid, t in by_id.items() if t.validate}
        assert both.count('<span class="vbadge" title="a validation rollout">val</span>') == edges.VALIDATION

    def test_the_readme_query_gives_the_reports_training_means(self, sources, ran):
        """The README's one-liner over a run with validation rollouts at its last step gives the
        step table's reward means (the training rollouts'), and so do docs/dataset.md's."""
        import rtrace

        readme = (ROOT / "README.md").read_text()
        (query,) = re.findall(r'rtrace\.open_run\("rtrace_dataset/run-7"\)\.sql\("([^"]+)"\)', readme)
        docs = (ROOT / "docs" / "dataset.md").read_text()
        queries = [query] + re.findall(r'run\.sql\("(SELECT step, avg\(reward\)[^"]+)"\)', docs)
        run = rtrace.open_run(sources.runs["edges"].path)
        train = _train(ran)
        want = {s: sum(t.reward for t in train if t.step == s) / sum(1 for t in train if t.step == s)
                for s in range(1, edges.STEPS + 1)}
        steps = {row[1]: row[2]["reward_mean"] for row in sources.runs["edges"].snapshot.steps if not row[0]}
        assert steps == pytest.approx(want)
        for q in queries:
            got = {step: mean for step, mean in run.sql(q).fetchall()}
            assert got == pytest.approx(want), q


class TestHistograms:
    def test_one_huge_answer_is_an_overflow_bar_not_the_scale(self, app, ran):
        """One answer of 185,200 tokens among answers of 30-79: round bins over the others, the
        outlier alone in a bar beyond them; so for the latency. Every rollout is counted once."""
        hist = get_json(app, "/run/edges/rollouts.json")["histograms"]
        n = len(_train(ran))
        length = hist["length"]
        assert length["over"] == [80.0, float(edges.HUGE), 1] and length["under"] is None
        assert [b[0] for b in length["bars"]] == [30.0, 40.0, 50.0, 60.0, 70.0]
        assert max(b[2] for b in length["bars"]) <= n // 4 and sum(b[2] for b in length["bars"]) == n - 1
        latency = hist["latency"]
        assert latency["over"][1:] == [edges.SLOW_MS, 1]
        assert sum(b[2] for b in latency["bars"]) + latency["over"][2] == n
        width = latency["bars"][0][1] - latency["bars"][0][0]
        assert width in (50.0, 100.0, 200.0) and all(b[0] % width == 0 for b in latency["bars"])

    def test_each_bar_and_overflow_filters_to_its_count(self, app):
        page = get(app, "/run/edges/rollouts").text
        for name in ("length", "latency"):
            block = re.search(rf'<div class="hist" data-hist="{name}">(.*?)</div>', page, re.S).group(1)
            bars = [(href, html.unescape(title)) for href, title in
                    re.findall(r'<a href="([^"]+)" class="bar".*?<title>([^<]*)</title>', block)]
            assert bars and any(title.startswith("> ") for _, title in bars)  # the overflow bar links too
            for href, title in bars:
                count = int(title.rsplit(": ", 1)[1].replace(",", ""))
                assert get_json(app, html.unescape(href).replace("/rollouts?", "/rollouts.json?"))["total"] == count

    def test_axis_labels_are_round_and_apart(self):
        """The x axis of a binned histogram: round edges that do not overlap (at 6.4 px a
        character), the overflow named; counts only over bars they fit."""
        values = [30 + i % 50 for i in range(2000)] + [185_200]
        svg = plots.histogram("response length", values)
        labels = re.findall(r'<text class="a" x="([\d.]+)" y="158" text-anchor="(\w+)">([^<]*)</text>', svg)
        labels = [(x, anchor, html.unescape(t)) for x, anchor, t in labels]
        texts = [t for _, _, t in labels]
        assert texts[0] == "30" and texts[-1] == "> 80" and all(re.fullmatch(r"> 80|\d+", t) for t in texts)
        spans = []
        for x, anchor, text in labels:
            w = plots.CHAR_PX * len(text)
            left = float(x) - (w / 2 if anchor == "middle" else 0 if anchor == "start" else w)
            spans.append((left, left + w))
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
        assert "185,200" in svg  # the overflow's tooltip says how far it reaches

    def test_the_python_and_sql_histograms_agree(self, app, ran):
        """The step viewer's histograms (plots.histogram, in Python) and the table's (SQL) bin the
        same values alike: same bars, same overflow."""
        lat = [t.duration_ms for t in _train(ran)]
        want = re.findall(r"<title>([^<]*)</title>", plots.histogram("latency (ms)", lat))
        page = get(app, "/run/edges/rollouts").text
        block = re.search(r'<div class="hist" data-hist="latency">(.*?)</div>', page, re.S).group(1)
        assert re.findall(r"<title>([^<]*)</title>", block) == want

    def test_a_value_on_an_edge_is_in_the_bar_its_filter_finds(self):
        """0.3 / 0.1 is 2.9999999999999996: binning compares with the edges themselves."""
        g = plots.Grid(0, 12, 1, -1)
        assert [g.bin_of(v) for v in (0.0, 0.3, 0.29999999999999993, 0.7, 1.1, 1.2, -0.01, 1.21)] == \
               [0, 3, 2, 7, 11, 11, -1, 12]
        assert [g.edge(j) for j in range(13)] == [round(j / 10, 1) for j in range(13)]

    def test_a_filter_chip_reads_a_rounded_number(self, app):
        page = get(app, f"/run/edges/rollouts?reward__ge={edges.ODD_REWARD!r}").text
        chip = re.search(r'<span class="chip on" data-filter="reward__ge"([^>]*)>([^<]*)<', page)
        assert chip.group(2).strip() == "reward ≥ 1.11"
        assert repr(edges.ODD_REWARD) in chip.group(1)  # the exact value: the chip's tooltip


class TestColumns:
    def test_the_key_columns_lead_and_stay_in_view(self, app):
        """step, group, the rollout's number, verdict, reward, then length and truncation; the
        first six cells of each row are pinned (their widths and offsets in the table's style),
        no two headers share a name."""
        data = get_json(app, "/run/edges/rollouts.json")
        assert [c["name"] for c in data["columns"]][:7] == ["step", "group", "rollout", "verdict", "reward", "length",
                                                           "truncated"]
        page = get(app, "/run/edges/rollouts").text
        table = re.search(r'<table class="rollouts" style="([^"]*)">(.*?)</table>', page, re.S)
        heads = re.findall(r"<th(?: [^>]*)?>(?:<a[^>]*>)?([^<]*)", table.group(2).split("</thead>")[0])
        assert len(heads) == len(set(heads)) and heads[:2] == ["rollout", "step"]
        pinned = re.findall(r'<th class="(?:l )?pin c(\d)"', table.group(2))
        assert pinned == ["0", "1", "2", "3", "4", "5"]
        assert "--l5:" in table.group(1) and "--w5:" in table.group(1)

    def test_a_key_one_rollout_set_has_no_default_column_and_no_curve(self, app):
        data = get_json(app, "/run/edges/rollouts.json")
        names = [c["name"] for c in data["columns"]]
        assert "outcome.reward/format" in names and f"outcome.{edges.RARE}" not in names
        assert f"outcome.{edges.RARE}" in [c["name"] for c in data["all_columns"]]  # in the chooser
        overview = get(app, "/run/edges/overview").text
        assert 'aria-label="reward/format (mean)"' in overview and f"{edges.RARE} (mean)" not in overview


class TestNewestFirstAndTokens:
    def test_the_overview_lists_the_newest_step_first(self, app):
        page = get(app, "/run/edges/overview").text
        training = page.split('class="split-training"')[1].split("</table>")[0]
        assert re.findall(r'<tr data-step="(t\d+)"', training) == ["t3", "t2", "t1"]


class TestBidirectionalText:
    def test_bidi_visible(self):
        from rtrace._serialize import bidi_visible

        assert bidi_visible("\u202egnp.exe") == "⟨U+202E⟩gnp.exe"
        assert bidi_visible("a\u2066b\u2069 \u200f\u061c") == "a⟨U+2066⟩b⟨U+2069⟩ ⟨U+200F⟩⟨U+061C⟩"
        assert bidi_visible("plain ascii, עברית") == "plain ascii, עברית"  # right-to-left letters are not controls

    @pytest.mark.parametrize("url", ["/run/edges/rollouts?q=file", "/run/edges/rollout/{tid}", "/run/edges/failures",
                                     "/run/edges/prompt?key=g0"])
    def test_every_view_shows_the_override(self, app, ran, url):
        """A file name stored as RLO + "gnp.exe" (a browser shows "exe.png") is shown with its
        override visible on every page; the JSON keeps the text as stored."""
        tid = ran["trajectories"][edges.key(*edges.BIDI_AT)].trace_id
        page = get(app, url.format(tid=tid)).text
        text = _page_text(page)
        assert not any(c in text for c in "\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")
        assert "⟨U+202E⟩gnp.exe" in text or "⟨U+2067⟩report⟨U+2069⟩" in text
        data = get_json(app, f"/run/edges/rollout/{tid}.json")
        assert data["messages"][3]["content"] == edges.BIDI_FILE
