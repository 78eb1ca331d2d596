"""rtrace.__all__ is the public API of DESIGN.md, complete and nothing more."""

import rtrace

PUBLIC = [
    "Collector", "ConfigError", "annotate", "annotate_batch", "start_collector", "Settings", "Sink", "SpanRecord", "Trajectory",
    "configure", "current_coordinates", "current_settings", "extract", "flush", "gateway_access", "inject",
    "is_enabled", "log_rollout_batch", "mark_weight_update", "open_run", "record_reward", "rollout_context", "set_tokenizer",
    "shutdown", "stats", "traced", "traced_generation", "traced_rollout", "traced_tool",
    "wrap_context",
]


def test_all_is_pinned():
    """__all__ lists exactly the public names, each importable from rtrace."""
    assert sorted(rtrace.__all__) == sorted(PUBLIC)
    for name in PUBLIC:
        assert getattr(rtrace, name) is not None


def test_public_callables_have_docstrings():
    """Every public function and class has a docstring."""
    missing = [n for n in PUBLIC if not (getattr(rtrace, n).__doc__ or "").strip()]
    assert missing == []
