"""``rtrace serve``'s swimlane at 10,000 rollouts x 20 spans: the server's side of a step's timeline.

The step is tests/ui/fleet_run.py's (16 workers of 64 slots, 4 inference servers, one a
straggler, two weight updates; cached under ``$RTRACE_UI_CACHE`` or ``~/.cache/rtrace``). The app
runs in this process, called through httpx's ASGI transport (no network). Timed, each the median
of 5 (the first, cold, apart):

- the page: the step laid out (its rollouts read and packed onto their workers' lanes, each
  server's generation times read) on the first request, from the cache after;
- windows the page asks for: the whole step with the bands closed (the bands' profiles only), one
  worker's 64 lanes open (their rollouts' calls read and laid out on the first request), a server's
  lanes (its generations read and packed on the first), and a zoomed-in window;
- each window's weight: its JSON and what crosses the network gzipped.

The browser's side (the first draw from navigation, each frame of zoom and pan) is measured by
tests/ui/test_serve_swimlane.py (``artifacts/ui/swimlane-timings.json``).

Run: ``.venv/bin/python benchmarks/bench_swimlane.py [--n 10000]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import httpx  # noqa: E402
from _machine import reference_line  # noqa: E402

from rtrace.serve.app import create_app  # noqa: E402
from rtrace.serve.sources import RunSource, Sources  # noqa: E402
from tests.ui import fleet_run  # noqa: E402

WINDOWS = [
    ("the whole step, bands closed", ""),
    ("a worker's 64 lanes open (1,750 px)", "lanes=4:0-63&px=1750&lane_px=16"),
    ("a server's first 60 lanes (1,750 px)", "lanes=0:0-59&px=1750&lane_px=16"),
    ("2 s of a worker's 64 lanes (1,750 px)", "lanes=4:0-63&px=1750&lane_px=16&t0=40000&t1=42000"),
]


async def _get(client: httpx.AsyncClient, url: str) -> tuple[float, int, int]:
    t0 = time.perf_counter()
    r = await client.get(url, headers={"accept-encoding": "gzip", "accept": "application/json"})
    ms = (time.perf_counter() - t0) * 1000
    assert r.status_code == 200, r.text[:500]
    return ms, len(r.content), r.num_bytes_downloaded


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=10_000)
    args = ap.parse_args()
    run = fleet_run.ensure(args.n)
    print(reference_line())

    async def go() -> None:
        sources = Sources([RunSource("fleet", dataset=str(run))])
        sources.refresh()
        app = create_app(sources)
        base = f"/run/fleet/timeline/t{fleet_run.STEP}"
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as c:
                print(f"{'what':44} {'first ms':>9} {'then ms':>8} {'JSON KB':>8} {'gzip KB':>8}")
                times = [(await _get(c, base))[0] for _ in range(6)]
                print(f"{'the page (the step laid out on the first)':44} {times[0]:9.0f} "
                      f"{statistics.median(times[1:]):8.0f}")
                for label, query in WINDOWS:
                    got = [await _get(c, base + ".json" + ("?" + query if query else "")) for _ in range(6)]
                    print(f"{label:44} {got[0][0]:9.0f} {statistics.median(g[0] for g in got[1:]):8.0f} "
                          f"{got[0][1] / 1024:8.0f} {got[0][2] / 1024:8.0f}")
        finally:
            sources.close()

    asyncio.run(go())


if __name__ == "__main__":
    main()
