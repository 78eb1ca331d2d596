"""The browser tests' one Chromium per module (tests/ui/browser.py says which)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.ui.browser import CHROMIUM


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="make test-ui installs playwright")
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no chromium at {CHROMIUM} (make test-ui installs it)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()
