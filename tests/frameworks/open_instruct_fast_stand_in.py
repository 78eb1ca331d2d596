"""A stand-in for the callers of open-instruct's weight broadcast (open-instruct e6c3044).

Copied by the tests to ``<tmp>/open_instruct/grpo_fast.py`` beside the grpo_utils stand-in.
Of ``grpo_fast``: ``WeightSyncTrigger`` and ``weight_sync_thread`` (the real signature and
loop: the step taken from the trigger into ``target_model_step``, sent to each learner's
``broadcast_to_vllm``, then ``grpo_utils.perform_weight_sync`` looked up in the module); of
``grpo_callbacks``: ``VLLMWeightSyncCallback.post_step`` (the olmo-core trainer's caller, whose
step is ``self.trainer.global_step``); of ``vllm_utils``: a vLLM engine's ``update_weights``
setting ``current_model_step`` and ``add_request`` stamping it on each request, which becomes
the ``GenerationResult``'s ``model_step``. ``open_instruct_names.json`` holds the real lines.
"""

import threading
import time
from queue import Full

from open_instruct import grpo_utils
from open_instruct.grpo_utils import Handle


class WeightSyncTrigger:
    def __init__(self, step):
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._step = step

    def notify(self, step):
        with self._lock:
            self._step = step
        self._event.set()

    def wait(self, timeout=None):
        return self._event.wait(timeout=timeout)

    def get_step_and_clear(self):
        with self._lock:
            step = self._step
            self._event.clear()
            return step


def weight_sync_thread(args, stop_event, weight_sync_trigger, policy_group, vllm_engines, actor_manager,
                       weight_sync_metrics_Q, inflight_updates=False):
    while not stop_event.is_set():
        if not weight_sync_trigger.wait(timeout=1.0):
            continue
        target_model_step = weight_sync_trigger.get_step_and_clear()
        try:
            broadcast_refs = [m.broadcast_to_vllm.remote(target_model_step) for m in policy_group.models]
            sync_time_stats, _ = grpo_utils.perform_weight_sync(
                broadcast_refs, vllm_engines, actor_manager, progress=args.verbose, inflight_updates=inflight_updates
            )
        except Exception as e:
            raise RuntimeError from e
        try:
            weight_sync_metrics_Q.put_nowait(sync_time_stats)
        except Full:
            pass


class LLMRayActor:
    """A vLLM engine: the weights it runs, the step they were sent with, when it woke."""

    def __init__(self):
        self.current_model_step = 0
        self.weights = None
        self.woken_ns = []

    def update_weights(self, update_info, model_step=None):
        self.weights = update_info["weights"]
        if model_step is not None:
            self.current_model_step = model_step

    def wake_up(self):
        self.woken_ns.append(time.time_ns())

    def add_request(self, request):
        """What vllm_utils.add_request keeps of a request: the step stamped on its result."""
        return {"prompt": request, "model_step": self.current_model_step}


class Learner:
    """A policy trainer process: ``broadcast_to_vllm`` returns the engines' update calls (refs)."""

    def __init__(self, engines, weights):
        self.engines, self.weights = engines, weights

    def broadcast_to_vllm(self, model_step):
        return [lambda e=e: e.update_weights({"update_info": None, "weights": self.weights}, model_step)
                for e in self.engines]


class ActorManager:
    def __init__(self):
        self.calls = []

    def set_should_stop(self, should_stop):
        self.calls.append(should_stop)


class VLLMWeightSyncCallback:
    """grpo_callbacks' (olmo-core trainer): after each step, broadcast and sync (in flight)."""

    def __init__(self, trainer, learner, vllm_engines, actor_manager):
        self.trainer, self.learner = trainer, learner
        self.vllm_engines, self.actor_manager = vllm_engines, actor_manager

    def post_step(self):
        # vllm_utils.broadcast_weights_to_vllm: the engines' update RPCs, sent (refs returned)
        broadcast_refs = [call() for call in self.learner.broadcast_to_vllm(model_step=self.trainer.global_step)]
        sync_time_stats, _ = grpo_utils.perform_weight_sync(
            broadcast_refs, self.vllm_engines, self.actor_manager, inflight_updates=True
        )
        return sync_time_stats


def handles(*objs):
    return [Handle(o) for o in objs]
