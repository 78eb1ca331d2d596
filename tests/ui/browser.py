"""What the browser tests share: the repository, Debian's chromium (Playwright's own browser
download fails here; ``$RTRACE_CHROMIUM`` overrides it) and the screenshots' folder
(``artifacts/ui``, or ``$RTRACE_UI_ARTIFACTS``). The ``browser`` fixture is in conftest.py."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = os.environ.get("RTRACE_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = Path(os.environ.get("RTRACE_UI_ARTIFACTS") or REPO / "artifacts" / "ui")
