"""Session fixtures for real backends that need care at import (a pytest plugin, loaded
by tests/conftest.py)."""

from __future__ import annotations

import sys
import tempfile

import pytest


@pytest.fixture(scope="session")
def trackio_mod(tmp_path_factory):
    """trackio imported with TRACKIO_DIR in a temporary directory (HF_HUB_OFFLINE=1).

    trackio reads ``TRACKIO_DIR`` once, at import: every test of the session shares this
    directory and uses its own project."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        if "trackio" not in sys.modules:
            mp.setenv("TRACKIO_DIR", str(tmp_path_factory.mktemp("trackio")))
        import trackio
        from trackio import utils

        if not str(utils.TRACKIO_DIR).startswith(tempfile.gettempdir()):
            pytest.fail(f"trackio was imported before this fixture with TRACKIO_DIR={utils.TRACKIO_DIR}")
        yield trackio
