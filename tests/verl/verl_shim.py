"""Route veRL's ``verl.utils.rollout_trace`` to rtrace's shim in this process.

``install()`` calls ``rtrace.compat.verl.install()`` when it exists (issue #15 asks for
it); until then it does what that function is to do: make the module name
``verl.utils.rollout_trace`` resolve to ``rtrace.compat.verl``. It must run before any
veRL module that imports the tracing helpers (agent_loop, tool_agent_loop,
single_turn_agent_loop, tool_parser, tools.base_tool, workers.rollout.llm_server) is
imported, since they bind the names at import time. Usable as a Ray
``worker_process_setup_hook`` (``verl_shim.install``), with tests/verl on PYTHONPATH.
"""

from __future__ import annotations

import sys

VERL_MODULE = "verl.utils.rollout_trace"


def install() -> None:
    import rtrace.compat.verl as shim

    real_install = getattr(shim, "install", None)
    if callable(real_install):
        real_install()
    else:
        sys.modules[VERL_MODULE] = shim
    assert sys.modules[VERL_MODULE] is shim
