"""``rtrace report``: the text table, honest plots, the step viewer's data, the health check, the wheel.

The input is real: tests/ui/report_job.py traces a small GRPO job with rtrace's decorators
into two workers' JSONL files (its script says every reward, failure and finding), the
same job the browser test (tests/ui/test_report_page.py) reads. Expected values come
from that script or from :class:`StepStats`, never from the code under test.
"""

from __future__ import annotations

import base64
import copy
import glob
import gzip
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import rtrace
from rtrace.config import HEALTH_CHECKS
from rtrace.pipeline.metrics import StepStats
from rtrace.pipeline.sampling import StepSelector, prompt_key
from rtrace.report import plots
from rtrace.report.data import FAILURES, page_data
from rtrace.report.health import parse_max_rates, step_health
from rtrace.report.load import ReportInputError, read_records
from rtrace.report.page import STATIC_FILES, decode_data, render
from rtrace.report.table import COLUMNS, step_table
from tests.ui import report_job as job

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run_files(tmp_path_factory):
    """The job's two JSONL files and its trace ids (written by a separate process: real rtrace)."""
    out = tmp_path_factory.mktemp("report-job")
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "ui" / "report_job.py"), str(out)],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def records(run_files):
    recs, notes = read_records(run_files["paths"])
    assert notes == []
    return recs


def _report(*args, check=True):
    return subprocess.run([sys.executable, "-m", "rtrace", "report", *map(str, args)], capture_output=True,
                          text=True, timeout=120, check=check)


def _stats(records, validate, step):
    st = StepStats()
    for rec in records:
        if rec.traj.validate == validate and rec.traj.step == step:
            st.add(rec.traj)
    return st


class TestTable:
    def test_the_table_is_the_step_metrics_of_both_files(self, run_files, records):
        """`rtrace report w0 w1` prints one row per step whose cells are StepStats' values over both files."""
        out = _report(*run_files["paths"]).stdout
        assert out.startswith("38 trajectories from 2 file(s)\n")
        lines = out.splitlines()
        for validate, step in ((False, 1), (False, 2), (False, 3), (True, 3)):
            values = {k.split("/", 1)[1]: v for k, v in _stats(records, validate, step).values("x").items()}
            part = lines[lines.index("validation" if validate else "training"):]
            row = next(line.split() for line in part[2:] if line.split()[0] == str(step))
            expected = [str(step)] + ["-" if values.get(name) is None else fmt.format(values[name])
                                      for _, name, fmt in COLUMNS[1:]]
            assert row[:len(COLUMNS)] == expected
        step2 = _stats(records, False, 2).values("x")
        assert step2["x/trajectories"] == 12 and step2["x/reward_mean"] == pytest.approx(7 / 11)  # the crash has none

    def test_tail_only_trajectories_are_shown_but_not_counted(self, records):
        """A trajectory kept for the tail only (kept=["error"]) is out of the metrics, as in the sinks, but on the page."""
        recs = copy.deepcopy(records)
        tail = next(r for r in recs if r.traj.status == "error")
        tail.traj.kept = ["error"]
        for r in recs:
            if r is not tail:
                r.traj.kept = ["sampled"]
        (row,) = [r for r in step_table(r.traj for r in recs) if r[:2] == (False, 2)]
        assert row[2]["trajectories"] == 11
        data = page_data(recs)
        step = next(s for s in data["steps"] if s["key"] == "t2")
        assert (step["n"], step["sampled"]) == (12, 11)
        f = {name: i for i, name in enumerate(data["fields"])}
        (shown,) = [t for t in data["trajectories"] if t[f["trace_id"]] == tail.traj.trace_id]
        assert shown[f["sampled"]] == 0 and FAILURES.index("error") in shown[f["fail"]]

    def test_a_missing_file_and_a_bad_line_are_named(self, tmp_path, run_files):
        """A missing file or a line that is not a trajectory exits 2 naming it; a half-written last line is skipped."""
        proc = _report(tmp_path / "nope.jsonl", check=False)
        assert proc.returncode == 2 and "nope.jsonl" in proc.stdout
        bad = tmp_path / "bad.jsonl"
        bad.write_text('{"schema": "other"}\n{"x": 1}\n')
        proc = _report(bad, check=False)
        assert proc.returncode == 2 and "bad.jsonl:1: not an rtrace trajectory" in proc.stdout
        unwritable = _report(run_files["paths"][0], "--html", tmp_path / "no" / "dir" / "r.html", check=False)
        assert unwritable.returncode == 2 and "cannot write" in unwritable.stdout
        half = tmp_path / "half.jsonl"
        lines = Path(run_files["paths"][0]).read_text().splitlines(keepends=True)
        half.write_text("".join(lines[:3]) + lines[3][:50])
        recs, notes = read_records([half])
        assert len(recs) == 3 and notes == [f"{half}:4: incomplete last line skipped"]
        with pytest.raises(ReportInputError):
            read_records([tmp_path / "nope.jsonl"])


class TestPlots:
    @pytest.mark.parametrize("low, high, expected", [
        (0.625, 0.875, [0, 0.25, 0.5, 0.75, 1.0]),  # issue #22: 0.625 -> 0.875 no longer fills the height
        (1650.0, 1650.0, [0, 500, 1000, 1500, 2000]),  # one latency: from zero
        (-0.3, 0.8, [-0.5, 0, 0.5, 1.0]),  # negative values: the axis goes below zero, zero is a tick
        (0.0, 0.0, [0, 0.25, 0.5, 0.75, 1.0]),  # all zero: still an axis
        (-4.0, -1.0, [-4, -3, -2, -1, 0]),  # all negative: up to zero
    ])
    def test_ticks_are_round_and_include_zero(self, low, high, expected):
        """The y ticks are round numbers from zero (or below) that cover the values."""
        assert plots.ticks(low, high) == pytest.approx(expected)

    @pytest.mark.parametrize("value, unit, text", [
        (1650.0, "", "1,650"),  # issue #22: not 1.65e+03
        (1650.25, "", "1,650.2"),
        (0.625, "", "0.625"),
        (3.14159, "", "3.142"),
        (0.000123456, "", "0.0001235"),
        (-1.2e-17, "", "-1.2e-17"),  # rounding noise is shown as such, not as -0
        (0.125, "%", "12.5%"),
        (0.0001, "%", "0.01%"),
        (1.0, "%", "100%"),
    ])
    def test_numbers_in_plain_notation(self, value, unit, text):
        assert plots.fmt_number(value, unit) == text

    def test_one_step_is_one_point_over_its_label(self):
        """A single step draws one point labelled with that step and its value; no invented axis or step."""
        svg = plots.line_plot("reward mean", [("mean", [(4, 0.625)])])
        x_labels = re.findall(r'<text class="a" x="[\d.]+" y="158" text-anchor="middle">([^<]*)</text>', svg)
        assert x_labels == ["4"]
        assert re.findall(r'<text class="v"[^>]*>([^<]*)</text>', svg) == ["0.625"]
        y_labels = re.findall(r'text-anchor="end">([^<]*)</text>', svg)
        assert y_labels[0] == "0.0" and "step 5" not in svg and "step 3" not in svg

    def test_latency_axis_has_thousands_separators(self):
        svg = plots.line_plot("latency (ms)", [("p50", [(1, 1200.0), (2, 1650.0)]), ("p90", [(1, 2500.0), (2, 2900.0)])])
        assert "e+" not in svg and ">0<" in svg and ">3,000<" in svg
        assert "<title>p90: step 2: 2,900</title>" in svg

    def test_rates_are_percentages_from_zero(self):
        svg = plots.line_plot("errors", [("error", [(1, 0.0), (2, 0.02)])], "%")
        assert re.findall(r'text-anchor="end">([^<]*)</text>', svg) == ["0.0%", "0.5%", "1.0%", "1.5%", "2.0%", "step"]

    def test_histogram_of_binary_rewards_has_two_bars(self):
        svg = plots.histogram("reward", [0.0, 1.0, 1.0, 0.0, 1.0, float("nan")])
        assert re.findall(r"<rect[^>]*><title>([^<]*)</title>", svg) == ["0: 2", "1: 3"]

    def test_histogram_of_many_values_bins_them_all(self):
        """100 values from 0 to 14.14: bins of a round width (2), every value in one, the last bin closed."""
        values = [i / 7 for i in range(100)]
        titles = re.findall(r"<rect[^>]*><title>([^<]*)</title>", plots.histogram("advantage", values))
        assert sum(int(t.rsplit(": ", 1)[1]) for t in titles) == 100
        assert titles[0] == "[0, 2): 14" and titles[-1] == "[14, 16]: 2" and len(titles) == 8


class TestPageData:
    def test_step_metrics_equal_step_stats(self, records):
        """Every metric the page shows for a step is StepStats' value, exactly, in the same order."""
        data = page_data(records)
        assert [s["key"] for s in data["steps"]] == ["t1", "t2", "t3", "v3"]
        for s in data["steps"]:
            expected = {k.split("/", 1)[1]: v for k, v in _stats(records, s["validate"], s["step"]).values("x").items()}
            assert [(name, value) for name, value, _ in s["metrics"]] == list(expected.items())
        texts = {name: text for name, _, text in data["steps"][1]["metrics"]}
        assert texts["reward_mean"] == "0.6364" and texts["error_rate"] == "8.3%" and texts["trajectories"] == "12"

    def test_trajectories_carry_the_scripted_values(self, run_files, records):
        """Reward, advantage, group, prompt (extra.prompt_id), failures and answers are the job's."""
        data = page_data(records)
        f = {name: i for i, name in enumerate(data["fields"])}
        s = data["strings"]
        rows = {t[f["trace_id"]]: t for t in data["trajectories"]}
        for key, trace_id in run_files["trace_ids"].items():
            if key.startswith("val"):
                continue
            step, prompt, rollout = map(int, key.split("-"))
            t = rows[trace_id]
            assert t[f["reward"]] == job.reward_of(step, prompt, rollout)
            assert t[f["advantage"]] == job.advantages(step, prompt)[rollout]
            assert (s[t[f["group"]]], s[t[f["prompt"]]]) == (f"s{step}-q{prompt}", f"arith-{prompt}")
            assert s[t[f["answer"]]] == job.answer_text(step, prompt, rollout) or (step, prompt, rollout) == job.ERROR
            expected = set()
            if (step, prompt, rollout) == job.ERROR:
                expected = {"error", "no reward"}
            elif not job.reward_of(step, prompt, rollout):
                expected = {"incorrect", "reward ≤ 0"} | ({"truncated"} if (step, prompt, rollout) == job.TRUNCATED
                                                         else set())
            assert {FAILURES[i] for i in t[f["fail"]]} == expected, key
        slow = rows[run_files["trace_ids"]["-".join(map(str, job.SLOW))]]
        assert slow[f["tool_ms"]] >= 400 and data["steps"][0]["slowest"] == slow[f["trace_id"]]

    def test_zero_variance_groups_are_named(self, records):
        data = page_data(records)
        zero = {s["key"]: s["zero_var"] for s in data["steps"]}
        assert zero == {"t1": [["s1-q2", 0.0, 4]], "t2": [["s2-q0", 1.0, 4]],
                        "t3": [["s3-q0", 1.0, 4], ["s3-q1", 1.0, 4]], "v3": []}
        assert [s["groups_2"] for s in data["steps"]] == [3, 3, 3, 0]
        for s in data["steps"][:3]:  # named groups / groups of 2 or more = the metric
            frac = dict((name, v) for name, v, _ in s["metrics"])["zero_variance_groups_frac"]
            assert len(s["zero_var"]) / s["groups_2"] == frac

    def test_prompt_key_is_the_samplers(self, records):
        """The report follows prompts with the rule sample_prompts hashes: prompt_id, else group_id, else sample_index."""
        assert [prompt_key(c) for c in ({"extra": {"prompt_id": "p"}, "group_id": "g", "sample_index": 1},
                                        {"group_id": "g", "sample_index": 1}, {"sample_index": 1},
                                        {"extra": {}, "group_id": None, "sample_index": 0}, {})] == ["p", "g", 1, 0, None]
        selector = StepSelector(cap=1, val_cap=1, groups=False, seed=0, linger_s=0, prompts=True)
        a, b = ({"step": 1, "sample_index": 1, "group_id": "x", "extra": {"prompt_id": "p"}, "rollout_n": 0},
                {"step": 2, "sample_index": 9, "group_id": "y", "extra": {"prompt_id": "p"}, "rollout_n": 0})
        assert selector.priority(a) == selector.priority(b)  # same prompt_id: same hash at every step
        data = page_data(records)
        f = {name: i for i, name in enumerate(data["fields"])}
        assert [data["strings"][t[f["prompt"]]] for t in data["trajectories"]] == [
            str(prompt_key(r.traj.coordinates)) for s in ("t1", "t2", "t3", "v3") for r in records
            if f"{'v' if r.traj.validate else 't'}{r.traj.step}" == s]

    def test_texts_are_stored_once_and_bounded(self, records):
        """The system prompt is one string for every trajectory; long contents and conversations are cut with the marker."""
        data = page_data(records)
        assert data["strings"].count(job.SYSTEM) == 1
        long = copy.deepcopy(records[:1])
        traj = long[0].traj
        traj.messages = [{"role": "user", "content": "x" * 50}] + [{"role": "assistant", "content": f"m{i}"}
                                                                   for i in range(10)]
        small = page_data(long, max_chars=20, max_messages=5)
        f = {name: i for i, name in enumerate(small["fields"])}
        conv = [(small["strings"][m[0]], small["strings"][m[1]]) for m in small["trajectories"][0][f["conv"]]]
        assert conv == [("user", "x" * 20 + "…[truncated, 50 chars]"), ("assistant", "m0"),
                        ("…", "…[truncated, 6 messages]"), ("assistant", "m7"), ("assistant", "m8"),
                        ("assistant", "m9")]

    def test_page_embeds_the_data_safely_and_nothing_external(self, records, run_files):
        """The page's data block decodes to page_data; a message with </script> stays data (and text in the
        run-wide snapshot's table: escaped); no external resource."""
        recs, _ = read_records(run_files["paths"])
        recs[0].traj.messages.append({"role": "assistant", "content": "</script><script>alert(1)</script><!--"})
        page = render(recs, run_files["paths"])
        block = re.search(r'<script type="application/octet-stream" id="rtrace-data"[^>]*>([^<]*)</script>', page)
        assert decode_data(block.group(1)) == page_data(recs)
        assert "<script>alert(1)" not in page
        assert "&lt;/script&gt;&lt;script&gt;alert(1)&lt;/script&gt;&lt;!--" in page  # the answer, as text
        assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)
        assert "<link rel=\"stylesheet\"" not in page and "<script src" not in page
        for name in STATIC_FILES[1:]:
            assert (Path(__file__).resolve().parents[1] / "rtrace" / "report" / "static" / name).read_text() in page

    def test_html_flag_writes_the_page(self, tmp_path, run_files):
        html = tmp_path / "r.html"
        out = _report(*run_files["paths"], "--html", html).stdout
        assert f"wrote {html}" in out and "step 1" not in out.splitlines()[0]
        data = decode_data(re.search(r'id="rtrace-data"[^>]*>([^<]*)<', html.read_text()).group(1))
        assert len(data["trajectories"]) == 38


class TestHealth:
    def test_rates_count_the_checked_trajectories(self, records):
        """health/<check>_rate = failing / trajectories of the step with health; lines without it are unknown."""
        by_key = {(h.validate, h.step): h for h in step_health(records)}
        step2 = by_key[(False, 2)]
        assert (step2.checked, step2.unknown, step2.failing) == (12, 0, {"token_continuity": 1})
        assert step2.rates()["health/token_continuity_rate"] == 1 / 12
        # a file written before trajectories listed their checks: every check is taken to have run
        assert set(step2.rates()) == {f"health/{c}_rate" for c in HEALTH_CHECKS}
        val = by_key[(True, 3)]
        assert (val.checked, val.unknown, val.rates()) == (0, 2, {})
        assert [(c, d) for _, c, d in by_key[(False, 3)].findings] == [
            ("retokenization", "response re-encodes to 3 tokens fewer")]

    @pytest.mark.parametrize("specs, expected", [
        ([], (0.0, {})),  # default: any finding fails
        (["0.05"], (0.05, {})),
        (["token_continuity=0.01", "0.1"], (0.1, {"token_continuity": 0.01})),
        (["reward=0.2", "reward=0.3"], (0.0, {"reward": 0.3})),  # the later one wins
    ])
    def test_max_rates(self, specs, expected):
        assert parse_max_rates(specs) == expected

    @pytest.mark.parametrize("spec, message", [
        ("token_continuity=x", "is not a number"),
        ("1.5", "between 0 and 1"),
        ("token_continuty=0.1", "unknown check 'token_continuty'"),  # a typo must not pass CI
    ])
    def test_bad_max_rates_are_refused(self, spec, message):
        with pytest.raises(ValueError, match=message):
            parse_max_rates([spec])

    def test_check_exit_codes(self, tmp_path, run_files):
        """--check exits 1 on a finding by default, 0 under thresholds, 2 on a bad threshold, 3 without health."""
        paths = run_files["paths"]
        failed = _report("--check", *paths, check=False)
        assert failed.returncode == 1
        tc = run_files["trace_ids"]["2-1-0"]
        assert (f"  step 2: health/token_continuity_rate = 0.08333 > 0 (1 of 12); e.g. trace {tc}: turn 2: prompt "
                "ids do not extend turn 1's at 57") in failed.stdout
        assert "validation step 3: no health data (2 trajectories without health)" in failed.stdout
        ok = _report("--check", *paths, "--max-rate", "0.1", check=False)
        assert ok.returncode == 0 and ok.stdout.endswith("health check passed\n")
        one = _report("--check", *paths, "--max-rate", "0.1", "--max-rate", "retokenization=0.05", check=False)
        assert one.returncode == 1 and "step 3: FAIL retokenization 1/12 = 8.33% > 0.05" in one.stdout
        assert "token_continuity" not in one.stdout.split("health check FAILED")[1]
        alone = _report(*paths, "--max-rate", "0.1", check=False)  # a threshold without --check checks nothing
        assert alone.returncode == 2 and "--max-rate and --require-reward are options of --check" in alone.stderr
        bad = _report("--check", *paths, "--max-rate", "nope=0.1", check=False)
        assert bad.returncode == 2 and "unknown check 'nope'" in bad.stdout
        old = tmp_path / "old.jsonl"  # written before the health checks: no `health` key
        old.write_text("".join(json.dumps({k: v for k, v in json.loads(line).items() if k != "health"}) + "\n"
                               for line in Path(paths[0]).read_text().splitlines()))
        none = _report("--check", old, check=False)
        assert none.returncode == 3 and "nothing was checked" in none.stdout

    def test_checks_that_never_ran_and_a_run_without_rewards(self, tmp_path):
        """Default checks (retokenization off) on a run that records no reward: the check lists
        retokenization as "not run" (never a 0% rate) and says once that no rollout has a
        reward, passing; --require-reward fails on it."""
        import io

        from rtrace.report import run

        path = tmp_path / "t.jsonl"
        rtrace.configure(exporter="jsonl", jsonl_path=str(path))

        @rtrace.traced_generation
        def gen(prompt_ids):
            return {"response_ids": [4, 5], "finish_reason": "stop"}

        for i in range(4):
            with rtrace.rollout_context(step=1, sample_index=i, rollout_n=0):
                gen([1, 2, 3])
        assert rtrace.flush(30)
        (h,) = step_health(read_records([str(path)])[0])
        assert "health/retokenization_rate" not in h.rates() and h.not_run() == ["retokenization"]
        out = io.StringIO()
        assert run([str(path)], out, health_check=True) == 0
        text = out.getvalue()
        assert "step 1: ok (4 checked; not run: retokenization)" in text
        assert "reward: no rollout of the run recorded a reward" in text and text.endswith("health check passed\n")
        out = io.StringIO()
        assert run([str(path)], out, health_check=True, require_reward=True) == 1
        assert "  the run: no rollout recorded a reward (--require-reward)" in out.getvalue()

    def test_exit_codes_are_in_the_help(self):
        out = _report("--help").stdout
        assert "--check exit codes:" in out and "3  no trajectory carries health" in out


class TestPackage:
    def test_the_wheel_ships_the_page(self, tmp_path):
        """The built wheel holds the page's template, stylesheet and script, and the installed copy renders a page."""
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                        "--disable-pip-version-check", "-w", str(tmp_path / "dist"), str(REPO)],
                       check=True, capture_output=True, timeout=300)
        (wheel,) = glob.glob(str(tmp_path / "dist" / "rtrace-*.whl"))
        names = zipfile.ZipFile(wheel).namelist()
        assert {f"rtrace/report/static/{n}" for n in STATIC_FILES} <= set(names)
        assert {"rtrace/serve/static/serve.js", "rtrace/serve/static/serve.css"} <= set(names)  # rtrace serve's
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--disable-pip-version-check",
                        "--target", str(tmp_path / "site"), wheel], check=True, capture_output=True, timeout=300)
        code = ("import rtrace.report.page as p, sys; from rtrace.report.load import Record;"
                "from rtrace.trajectory import Trajectory, SpanRecord;"
                "t = Trajectory('a' * 32, 'rollout', [SpanRecord('b' * 16, None, 'rollout', 'rollout', 0, 10)], step=1);"
                "print(p.__file__); print(len(p.render([Record(t, [])], ['x.jsonl'])))")
        out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(tmp_path / "site")},
                             capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        where, size = out.stdout.split()
        assert where.startswith(str(tmp_path / "site")) and int(size) > 10_000


def test_decode_data_is_gzip_base64_json():
    text = base64.b64encode(gzip.compress(json.dumps({"a": [1, "<"]}).encode())).decode()
    assert decode_data(text) == {"a": [1, "<"]}
