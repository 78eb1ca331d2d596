"""tests/verl: rtrace's veRL shim against the real veRL (``make test-verl``).

Needs ``verl`` installed (``make test-verl`` makes a venv with verl==0.9.1); every test
module here starts with ``pytest.importorskip("verl")``, so the default ``make test``
reports them as skipped. When veRL is importable, this conftest routes
``verl.utils.rollout_trace`` to ``rtrace.compat.verl`` (``rtrace.compat.verl.install()``)
before any test module imports veRL's agent loop, and puts this directory on
``sys.path`` so veRL's tool registry can import ``verl_app.CalculatorTool`` by its
dotted name.
"""

from __future__ import annotations

import importlib.util
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

if importlib.util.find_spec("verl") is not None:
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import rtrace.compat.verl

    rtrace.compat.verl.install()
