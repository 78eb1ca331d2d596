"""Hot-path instrumentation: decorators, RL context, captured arguments."""

from .context import current_coordinates, record_reward, rollout_context, wrap_context
from .decorators import traced, traced_generation, traced_rollout, traced_tool

__all__ = [
    "current_coordinates",
    "record_reward",
    "rollout_context",
    "traced",
    "traced_generation",
    "traced_rollout",
    "traced_tool",
    "wrap_context",
]
