"""What the browser tests share: the repository, Debian's chromium (Playwright's own browser
download fails here; ``$RTRACE_CHROMIUM`` overrides it) and the screenshots' folder
(``artifacts/ui``, or ``$RTRACE_UI_ARTIFACTS``). The ``browser`` fixture is in conftest.py."""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = os.environ.get("RTRACE_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = Path(os.environ.get("RTRACE_UI_ARTIFACTS") or REPO / "artifacts" / "ui")


@contextmanager
def watched_page(browser, allowed: tuple[str, ...], *, width: int, height: int = 1000, timeout_ms: int = 30_000):
    """A new page of ``browser`` on which every console error or warning, page error, dialog (an
    injected ``alert``) and request to a URL not starting with one of ``allowed`` is recorded:
    none may occur, which is asserted when the block ends."""
    context = browser.new_context(viewport={"width": width, "height": height})
    pg = context.new_page()
    pg.set_default_timeout(timeout_ms)
    problems: list[str] = []
    pg.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type in ("error", "warning")
          else None)
    pg.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    pg.on("dialog", lambda d: (problems.append(f"dialog: {d.message}"), d.dismiss()))
    pg.on("request", lambda r: problems.append(f"request: {r.url}") if not r.url.startswith(allowed) else None)
    try:
        yield pg
    finally:
        context.close()
    assert problems == []
