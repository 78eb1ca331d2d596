"""A stand-in for ``open_instruct.grpo_utils`` (open-instruct e6c3044): its weight broadcast.

Copied by the tests to ``<tmp>/open_instruct/grpo_utils.py`` and imported under the real name,
as ``open_instruct_stand_in.py`` is for the data loader. ``perform_weight_sync`` has the real
signature (``tests/test_open_instruct.py`` compares it with ``open_instruct_names.json``) and
makes the real remote calls in the real order (``perform_remote_calls`` there): the generation
actors paused, the learners' broadcasts awaited, then the engines' update calls (unless
``inflight_updates``), the engines woken, the actors resumed. Ray's ``.remote`` / ``ray.get`` are
:class:`Handle`'s synchronous calls (open_instruct_fast_stand_in.py's engines and learners).
"""

import itertools
import time


class Handle:
    """A Ray actor handle's call shape over a local object: ``handle.method.remote(*a)`` runs
    ``method(*a)`` and returns its value (the "object ref"); :func:`ray_get` returns it."""

    def __init__(self, obj):
        self._obj = obj

    def __getattr__(self, name):
        method = getattr(self._obj, name)
        return type("_Method", (), {"remote": staticmethod(method)})


def ray_get(refs):
    return refs


def perform_weight_sync(broadcast_refs, vllm_engines, actor_manager, *, progress=False, inflight_updates=False):
    start = time.perf_counter()
    ray_get(actor_manager.set_should_stop.remote(True))
    try:
        results = ray_get(broadcast_refs)
        actor_sync_times = []
        if not inflight_updates:
            ray_get([call() for call in itertools.chain.from_iterable(results)])  # the engines' update RPCs
        ray_get([e.wake_up.remote() for e in vllm_engines])
    finally:
        ray_get(actor_manager.set_should_stop.remote(False))
    sync_time_stats = {"time/weight_sync": time.perf_counter() - start}
    if actor_sync_times:
        sync_time_stats["time/weight_sync_mean"] = sum(actor_sync_times) / len(actor_sync_times)
    return sync_time_stats, results
