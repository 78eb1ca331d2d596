"""A stand-in for ``open_instruct.data_loader`` (open-instruct e6c3044), for the adapter's tests.

open-instruct cannot be imported here (its data loader imports vLLM, olmo_core, torch), so
the tests copy this file to ``<tmp>/open_instruct/data_loader.py`` and import it under the
real name: the module rtrace patches, at the import boundary. It keeps, of the real module,
what the adapter sees and nothing else: the functions it wraps, with the real signatures
(``tests/test_open_instruct.py`` compares them with ``open_instruct_names.json``), called
as the real ones call each other (module globals), the same drops (stale results, zero-std
groups, truncated completions) on the same conditions, and ``DataPreparationActor`` a
``@ray.remote`` class whose loop calls ``accumulate_inference_batches`` as a global and
gathers a step again as the real one does. Dataclasses have the real fields; queues are
``queue.Queue`` (Ray's has the same ``get(timeout=)``).
"""

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np

try:
    from ray import remote
except ImportError:  # as Ray's: the module's name is bound to a wrapper, not to the class
    def remote(cls):
        return SimpleNamespace(cls=cls)

INPUT_IDS_PROMPT_KEY = "input_ids_prompt"
ENV_CONFIG_KEY = "env_config"


@dataclass
class ToolCallStats:
    tool_name: str
    success: bool
    runtime: float


@dataclass
class RequestInfo:
    num_calls: Any = None
    timeouts: Any = None
    tool_errors: Any = None
    tool_outputs: Any = None
    tool_runtimes: Any = None
    tool_calleds: Any = None
    tool_call_stats: Any = None
    rollout_states: Any = None


@dataclass
class GenerationResult:
    responses: Any = None
    finish_reasons: Any = None
    masks: Any = None
    request_info: Any = None
    index: Any = None
    prompt_id: Any = None
    token_statistics: Any = None
    start_time: Any = None
    logprobs: Any = None
    reward_scores: Any = None
    reward_metrics: Any = None
    model_step: Any = None


@dataclass
class Batch:
    queries: Any = None
    ground_truths: Any = None
    datasets: Any = None
    raw_queries: Any = None
    decoded_responses: Any = None
    indices: Any = None
    scores: Any = None
    active_tools: Any = None
    model_steps: Any = None

    def __getitem__(self, key):  # the real Batch's list indexing (what maybe_mask_truncated_completions uses)
        return Batch(**{name: None if value is None else [value[i] for i in key]
                        for name, value in self.__dict__.items()})


@dataclass
class EnvConfigEntry:
    env_name: str
    is_text_env: bool
    kwargs: dict = field(default_factory=dict)


@dataclass
class EnvConfig:
    max_steps: int = 100
    env_configs: dict = field(default_factory=dict)


@dataclass
class StreamingDataLoaderConfig:
    async_steps: int = 8
    filter_zero_std_samples: bool = True
    mask_truncated_completions: bool = False


def _merge_env_config(base_env_config, sample_env_config):
    # open-instruct's, verbatim
    if sample_env_config is None:
        return base_env_config
    max_steps = sample_env_config.get("max_steps", base_env_config.max_steps)
    merged = dict(base_env_config.env_configs)
    for sample_entry in sample_env_config.get("env_configs", []):
        env_name = sample_entry["env_name"]
        base = merged.get(env_name)
        is_text_env = sample_entry.get("is_text_env", base.is_text_env if base else False)
        extra = {k: v for k, v in sample_entry.items() if k not in ("env_name", "is_text_env")}
        merged_kwargs = {**(base.kwargs if base else {}), **extra}
        merged[env_name] = EnvConfigEntry(env_name=env_name, is_text_env=is_text_env, kwargs=merged_kwargs)
    return EnvConfig(max_steps=max_steps, env_configs=merged)


def process_group(result, generation_config, tokenizer, dataset, max_possible_score, no_resampling_pass_rate,
                  iter_dataloader, filter_zero_std_samples, replenish_prompts, param_prompt_Q, base_env_config,
                  ground_truth_overrides=None):
    query = dataset[result.index][INPUT_IDS_PROMPT_KEY]
    if filter_zero_std_samples and np.std(result.reward_scores) == 0:
        return None
    return result, query


def result_is_stale(model_step, training_step, max_result_age_steps):
    if max_result_age_steps is None or training_step is None or model_step is None:
        return False
    return training_step - model_step > max_result_age_steps


def _make_batch_from_groups(groups):
    """make_batch_from_groups's shape: one GenerationResult and a Batch of the kept groups."""
    results = [r for r, _ in groups]
    result = GenerationResult(
        responses=[x for r in results for x in r.responses], masks=[x for r in results for x in r.masks],
        finish_reasons=[x for r in results for x in r.finish_reasons],
        logprobs=[x for r in results for x in (r.logprobs or [[] for _ in r.responses])],
        request_info=RequestInfo(num_calls=[x for r in results for x in r.request_info.num_calls],
                                 tool_call_stats=[x for r in results for x in r.request_info.tool_call_stats or
                                                  [[] for _ in r.responses]]),
        index=None, prompt_id=results[0].prompt_id)
    batch = Batch(queries=[q for r, q in groups for _ in r.responses],
                  indices=[r.index for r, _ in groups for _ in r.responses],
                  scores=[s for r, _ in groups for s in r.reward_scores],
                  model_steps=[r.model_step for r, _ in groups for _ in r.responses])
    return result, batch, {}, None


def accumulate_inference_batches(inference_results_Q, generation_config, num_prompts, model_dims, tokenizer, dataset,
                                 base_env_config, training_step, actor_manager=None, timeout=None,
                                 active_sampling=False, filter_zero_std_samples=False, replenish_prompts=False,
                                 no_resampling_pass_rate=None, iter_dataloader=None, param_prompt_Q=None,
                                 verbose=False, max_possible_score=1.0, requeue_on_timeout=True,
                                 ground_truth_overrides=None, max_result_age_steps=None):
    groups = []
    num_prompts_sampled = 0
    while num_prompts_sampled < num_prompts:
        result = inference_results_Q.get(timeout=timeout)
        if result_is_stale(result.model_step, training_step, max_result_age_steps):
            continue
        group = process_group(result=result, generation_config=generation_config, tokenizer=tokenizer,
                              dataset=dataset, max_possible_score=max_possible_score,
                              no_resampling_pass_rate=no_resampling_pass_rate, iter_dataloader=iter_dataloader,
                              filter_zero_std_samples=filter_zero_std_samples, replenish_prompts=replenish_prompts,
                              param_prompt_Q=param_prompt_Q, base_env_config=base_env_config,
                              ground_truth_overrides=ground_truth_overrides)
        if group is None:
            if not active_sampling:
                num_prompts_sampled += 1
            continue
        num_prompts_sampled += 1
        groups.append(group)
    if len(groups) == 0:
        return None, None, None, None
    return _make_batch_from_groups(groups)


def maybe_mask_truncated_completions(result, batch, enabled):
    # open-instruct's, verbatim but for its log line
    if not enabled:
        return batch
    stop_idxes = [i for i, fr in enumerate(result.finish_reasons) if fr == "stop"]
    result.responses = [result.responses[i] for i in stop_idxes]
    result.masks = [result.masks[i] for i in stop_idxes]
    result.finish_reasons = [result.finish_reasons[i] for i in stop_idxes]
    result.logprobs = [result.logprobs[i] for i in stop_idxes]
    return batch[stop_idxes]


class DataPreparationActor:
    def __init__(self, dataset, inference_results_Q, tokenizer, config, base_env_config, num_training_steps,
                 global_batch_size):
        self.dataset, self.inference_results_Q, self.tokenizer = dataset, inference_results_Q, tokenizer
        self.config, self.base_env_config = config, base_env_config
        self.num_training_steps, self.global_batch_size = num_training_steps, global_batch_size
        self.training_step = 0
        self.prepared_data = {}

    def _data_preparation_loop(self):
        while self.training_step < self.num_training_steps:
            result, batch, reward_metrics, batch_stats = accumulate_inference_batches(
                self.inference_results_Q, None, num_prompts=self.global_batch_size, model_dims=None,
                tokenizer=self.tokenizer, dataset=self.dataset, actor_manager=None,
                active_sampling=False, filter_zero_std_samples=self.config.filter_zero_std_samples,
                replenish_prompts=True, training_step=self.training_step, base_env_config=self.base_env_config,
                max_result_age_steps=self.config.async_steps)
            if result is None:
                continue  # every group filtered: gathered again at the same step
            batch = maybe_mask_truncated_completions(result, batch, self.config.mask_truncated_completions)
            if len(result.responses) == 0:
                continue  # nothing left after the truncation filter: gathered again at the same step
            self.prepared_data[self.training_step] = (result, batch)
            self.training_step += 1
        return sorted(self.prepared_data)


#: the class itself: open-instruct writes ``@ray.remote`` above it, which binds the module's name
#: to Ray's wrapper (next line), so Ray pickles the class by value when it creates the actor
ACTOR_CLASS = DataPreparationActor
DataPreparationActor = remote(DataPreparationActor)
