"""The README's quick start is a file that runs: examples/quickstart.py, shown whole in the
README, writes its trajectory to a real trackio."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "quickstart.py"


def test_the_readme_shows_the_file():
    """The README's code block is the example's code, as it is in the file."""
    code = EXAMPLE.read_text()
    code = code[code.index("import asyncio"):]
    assert f"```python\n{code}```\n" in (ROOT / "README.md").read_text()


def test_the_quick_start_runs_and_writes_its_trace(tmp_path):
    """Run as a user would (python examples/quickstart.py): trackio holds one trajectory with
    the tool call, its result, the answer and the reward, read back with trackio's own CLI."""
    env = {**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio"), "HF_HUB_OFFLINE": "1"}
    env = {k: v for k, v in env.items() if not k.startswith("RTRACE_")}
    proc = subprocess.run([sys.executable, str(EXAMPLE)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    listed = subprocess.run([str(Path(sys.executable).parent / "trackio"), "list", "traces", "--project",
                             "quickstart", "--json"], env=env, capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0, listed.stderr
    (trace,) = json.loads(listed.stdout)["traces"]
    assert [m["role"] for m in trace["messages"]] == ["user", "assistant", "tool", "assistant"]
    assert trace["messages"][2]["content"] == "42" and trace["messages"][3]["content"] == "The answer is 42."
    assert trace["metadata"]["reward"] == 1.0 and trace["metadata"]["status"] == "✓ correct reward=1.0"
