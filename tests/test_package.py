"""The package surface: what `import rtrace` costs and exports."""

from __future__ import annotations

import subprocess
import sys


def test_import_does_not_load_optional_backends():
    """`import rtrace` (and configuring the jsonl sink) loads none of trackio, mlflow, torch, transformers."""
    code = (
        "import sys, rtrace\n"
        "rtrace.configure(exporter='jsonl', jsonl_path='/dev/null')\n"
        "heavy = [m for m in ('trackio', 'mlflow', 'torch', 'transformers', 'numpy') if m in sys.modules]\n"
        "print(','.join(heavy))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""
