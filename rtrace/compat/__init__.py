"""Drop-in replacements for the tracing helpers of RL frameworks.

* :mod:`rtrace.compat.verl` — ``verl.utils.rollout_trace`` (``RolloutTraceConfig``,
  ``rollout_trace_attr``, ``rollout_trace_op``) backed by rtrace's sinks;
  ``rtrace.compat.verl.install()`` routes veRL's module name to it (a Ray
  ``worker_process_setup_hook``).

Each module is imported on its own (``from rtrace.compat.verl import ...``); nothing here
imports a framework.
"""
