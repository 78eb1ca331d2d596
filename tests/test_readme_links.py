"""Every file the README and docs/performance.md name (docs/..., examples/..., benchmarks/...) exists, and every page
of docs/ is in its documentation list."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_every_path_the_readme_names_exists():
    """The README and docs/performance.md (whose commands reproduce the README's figures)."""
    text = README + (ROOT / "docs" / "performance.md").read_text()
    named = set(re.findall(r"\b((?:docs|examples|benchmarks|deploy)/[\w./-]*\w)", text))
    assert "benchmarks/bench_gateway.py" in named
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert missing == []


def test_every_doc_page_is_listed():
    listed = set(re.findall(r"^- (docs/[\w./-]+)", README, re.M)) | set(re.findall(r"docs/[\w-]+\.md", README))
    pages = {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")}
    assert sorted(pages - listed) == []
