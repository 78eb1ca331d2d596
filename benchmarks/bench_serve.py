"""``rtrace serve`` at 1,000,000 trajectories: each view's time on the server, against the same
queries over the Parquet files without the flat index (the baseline, measured in the same run).

The run is tests/ui/big_run.py's (1,000 steps x 1,000 rollouts and a validation step every
100; cached under ``$RTRACE_UI_CACHE`` or ``~/.cache/rtrace``). The app runs in this process
and is called through httpx's ASGI transport (no network). For each page: the median of 5
requests (the first, cold, apart; the page caches emptied before each: a new filter), the SQL
time the page reports, and its bytes; "ratio" is the page's time over its time without the
flat index (the Parquet files only). The
issue's targets: a first render <= 1.5 s (the browser's, measured by tests/ui), a sort or
filter over all steps <= 300 ms on the server, the page's weight independent of the run's
size. Also: the server's start (listing and the flat index's build), the text search's word
index (built after the start, a slice per refresh: timed here until it has caught up), and
copying JSONL.

Run: ``.venv/bin/python benchmarks/bench_serve.py [--n 1000000]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import httpx  # noqa: E402
from _machine import reference_line  # noqa: E402

from rtrace.serve.app import create_app  # noqa: E402
from rtrace.serve.sources import RunSource, Sources  # noqa: E402
from tests.ui import big_run  # noqa: E402

PAGES = [
    ("first page (newest step first)", "/run/big/rollouts"),
    ("sort by reward, all steps", "/run/big/rollouts?_sort=reward&_desc=1"),
    ("sort by latency, all steps", "/run/big/rollouts?_sort=latency&_desc=1"),
    ("filter verdict = wrong", "/run/big/rollouts?verdict=wrong"),
    ("filter step >= 500 and reward >= 1", "/run/big/rollouts?step__ge=500&reward__ge=1"),
    ("filter a reward component, sort by length", "/run/big/rollouts?outcome.reward/format=0.5&_sort=length"),
    ("filter one prompt", "/run/big/rollouts?prompt=gsm8k-17"),
    ("text search in prompts and answers", "/run/big/rollouts?q=Question+1999%3A"),
    ("search: a word of few answers", "/run/big/rollouts?q=6011"),
    ("search: a phrase with a rare word", "/run/big/rollouts?q=answer+is+6011"),
    ("search: a word of every prompt", "/run/big/rollouts?q=apples"),
    ("search: a phrase of common words", "/run/big/rollouts?q=the+answer+is"),
    ("answer contains a phrase", "/run/big/rollouts?answer__contains=is+6011."),
    ("overview (1,000 steps)", "/run/big/overview"),
    ("a step (1,000 rollouts, the step viewer)", "/run/big/step/t500"),
    ("prompts", "/run/big/prompts"),
    ("one prompt across steps", "/run/big/prompt?key=gsm8k-17"),
    ("failures", "/run/big/failures"),
]


def fetch(app, url: str) -> tuple[float, int, float | None]:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as c:
            t0 = time.perf_counter()
            r = await c.get(url)
            return time.perf_counter() - t0, r
    dt, r = asyncio.run(go())
    assert r.status_code == 200, (url, r.status_code, r.text[:300])
    m = re.search(r'id="timing">\d+ queries, ([\d,.]+) ms in SQL', r.text)
    return dt * 1000, len(r.content), float(m.group(1).replace(",", "")) if m else None


def measure(app, source, repeat: int = 5) -> dict[str, tuple[float, float, float | None, int]]:
    """Per page: the first request, then the median of ``repeat`` with the run's page caches
    emptied before each (a new filter: its histograms computed again), its SQL time, its bytes."""
    out = {}
    for label, url in PAGES:
        cold, size, _ = fetch(app, url)
        fresh = []
        for _ in range(repeat):
            source._cache.clear()
            fresh.append(fetch(app, url))
        sql = [w[2] for w in fresh if w[2] is not None]
        out[label] = (cold, statistics.median(w[0] for w in fresh), statistics.median(sql) if sql else None, size)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    print(reference_line())
    t0 = time.perf_counter()
    path = big_run.ensure(args.n)
    files = sum(len(f) for _, _, f in os.walk(path))
    print(f"run: {path} ({files:,} files; {time.perf_counter() - t0:.0f} s to generate or find)")
    results = {}
    for label, index in (("flat index", True), ("Parquet files only (baseline)", False)):
        srcs = Sources([RunSource("big", dataset=str(path), index=index)])
        t0 = time.perf_counter()
        srcs.refresh()
        start = time.perf_counter() - t0
        source = srcs.runs["big"]
        words = ""
        if index and hasattr(source, "index_words"):  # the word index: a slice per refresh; here back to back
            t0 = time.perf_counter()
            while source.index_words(budget_s=2.0):
                pass
            cursor = source.cursor()
            postings = cursor.execute(f"SELECT count(*) FROM {source.index.words.words}").fetchall()[0][0]
            cursor.execute(f"CHECKPOINT {source.index.alias}")
            cursor.close()
            words = (f"; word index {time.perf_counter() - t0:.1f} s more ({source.index.words.build_s:.1f} s in "
                     f"slices, {postings:,} postings; index file {os.path.getsize(source.index.path) / 1e6:,.0f} MB)")
        t0 = time.perf_counter()
        srcs.refresh()
        again = time.perf_counter() - t0
        print(f"\n{label}: start (listing, step table, flat index) {start:.1f} s{words}; a refresh with nothing new "
              f"{again * 1000:.0f} ms; {source.snapshot.trajectories:,} trajectories", flush=True)
        app = create_app(srcs, time_limit_ms=60_000)
        results[label] = measure(app, srcs.runs["big"], args.repeat)
        srcs.close()
    print(f"\n{'page':45} {'first ms':>9} {'index ms':>9} {'SQL ms':>7} {'bytes':>9} {'files ms':>9} {'ratio':>6}")
    base = results["Parquet files only (baseline)"]
    for label, _ in PAGES:
        cold, warm, sql, size = results["flat index"][label]
        b = base[label]
        print(f"{label:45} {cold:9.0f} {warm:9.0f} {sql if sql is not None else float('nan'):7.0f} {size:9,} "
              f"{b[1]:9.0f} {warm / b[1]:6.2f}")
    # copying JSONL into a dataset (rtrace serve on JSONL files)
    from rtrace.serve.sources import sources_from_paths
    from tests import serve_job

    with tempfile.TemporaryDirectory() as tmp:
        out = serve_job.run(tmp, steps=3)
        lines = open(out["jsonl"], "rb").read()
        big = os.path.join(tmp, "many.jsonl")
        with open(big, "wb") as f:
            for _ in range(200):  # 7,200 trajectories
                f.write(lines)
        srcs = sources_from_paths([big])
        t0 = time.perf_counter()
        srcs.refresh()
        dt = time.perf_counter() - t0
        n = next(iter(srcs.runs.values())).snapshot.trajectories
        print(f"\nJSONL copied into a dataset and indexed: {n:,} trajectories in {dt:.1f} s ({n / dt:,.0f}/s)")
        srcs.close()


if __name__ == "__main__":
    main()
