"""TRL: ``GRPOTrainer(..., callbacks=[RTraceCallback()])`` traces every completion.

::

    from rtrace.compat.trl import RTraceCallback

    trainer = GRPOTrainer(model=..., reward_funcs=[...], args=GRPOConfig(...), train_dataset=...,
                          callbacks=[RTraceCallback()])

Every completion TRL generates — training and evaluation — becomes one trajectory: the
prompt and completion token ids (decoded in rtrace's worker with the trainer's
tokenizer, which the callback hands to rtrace: unless ``RTRACE_TOKEN2TEXT=0``), each tool turn when TRL runs tools (its ``tool_mask``), why it stopped
(``stop``, or ``length`` for a completion cut at ``max_completion_length``), the reward
TRL trains on (each reward function's score weighted and summed) with every function's
own score as ``outcome.reward/<name>``, and the advantage TRL computed
(``annotations.advantage``), each read where it is whole for the batch (an evaluation
batch may be larger than the generation batch that bounds TRL's completions table); a
value TRL did not give is listed in the root's ``rtrace.missing`` and counted
(``trl_values_missing``). Coordinates (docs/frameworks/trl.md):

* ``step``: the optimizer step the generation batch is made for (``global_step + 1`` when
  it is generated; with ``steps_per_generation`` / ``num_iterations`` > 1 one batch feeds
  several steps and carries the first); evaluation: ``global_step``, ``validate=True``;
* ``sample_index``: the prompt's index in the step's gathered batch (TRL repeats each
  prompt ``num_generations`` times in a row); ``rollout_n``: the completion's index in
  its group; ``group_id`` and ``extra.prompt_id``: a hash of the prompt, the same at
  every step the prompt comes back (``RTRACE_SAMPLE_PROMPTS`` follows it);
* ``policy_version``: ``global_step`` when it was generated (the weights' version).

Weight updates: with ``use_vllm``, TRL pushes the trainer's weights to vLLM before a generation
when ``global_step`` moved; the callback marks each push when it returns
(``rtrace.mark_weight_update``: version and step ``global_step``, ``duration_ms``), in the main
process. Without vLLM the trainer generates with its own weights: nothing is published, nothing
marked.

Where it goes: what ``rtrace.configure`` / ``RTRACE_EXPORTER`` say; if rtrace is not
configured, the callback configures it from the trainer's ``report_to``: ``trackio``
writes into TRL's own trackio run (the trajectories, per-step summaries and rollouts
tables beside TRL's metrics), ``mlflow`` into its MLflow run, else JSONL in
``output_dir/rtrace_traces.jsonl``. The callback flushes at each step's end, so a step's
summaries are in the run before the run is finished (HF's trackio callback finishes it
in ``on_train_end``, before user callbacks run).

TRL gives callbacks no view of its completions; the few private names used to get one
are in :mod:`rtrace.compat._trl_private`, checked against the installed TRL.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

from .. import _setup, _stats
from ..instrumentation.turns import Turn, admit, sample_state, submit
from . import _trl_private, token_rows, weight_sync

try:  # a real TrainerCallback when transformers is there (TRL needs it)
    from transformers import TrainerCallback
except ImportError:  # pragma: no cover - then TRL cannot run either
    TrainerCallback = object  # type: ignore[assignment,misc]

__all__ = ["RTraceCallback"]


class RTraceCallback(TrainerCallback):  # type: ignore[misc,valid-type]
    """A ``transformers.TrainerCallback`` that traces a TRL ``GRPOTrainer``'s completions.

    Args:
        **settings: ``rtrace.configure`` settings used when rtrace is not configured yet
            (``exporter``, ``project``, ``max_traces_per_step`` ...); unset ones follow the
            environment and the trainer's ``report_to`` / ``run_name`` / ``output_dir``.
    """

    def __init__(self, **settings: Any) -> None:
        self.settings = settings
        self.trainer: Any = None
        #: running sample_index offset of the current (validate, step): evaluation runs batch by batch
        self._offsets: dict[tuple[bool, int], int] = {}

    # ------------------------------------------------------------------ events
    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        try:
            from trl import GRPOTrainer
        except ImportError:
            return
        trainer = _trl_private.find_trainer(GRPOTrainer)
        if trainer is None:
            _stats.warn_once("trl-trainer", "rtrace.compat.trl: RTraceCallback found no GRPOTrainer calling it; "
                             "nothing is traced (pass it to GRPOTrainer(callbacks=[...]))")
            return
        self.trainer = trainer
        if not _trl_private.wrap_scoring(trainer, self._scored):
            _stats.warn_once("trl-scoring", "rtrace.compat.trl: this TRL has no _generate_and_score_completions; "
                             "nothing is traced")

    def on_train_begin(self, args: Any, state: Any, control: Any, processing_class: Any = None,
                       **kwargs: Any) -> None:
        # after HF's own callbacks opened their runs (trackio.init runs in on_train_begin)
        if not _setup.is_enabled():
            _setup.configure(**self._defaults(args))
        if processing_class is not None:  # token2text decodes with it unless turned off (docs/token2text.md)
            _setup.offer_tokenizer(getattr(processing_class, "tokenizer", processing_class))
        if self.trainer is not None:  # TRL made its vLLM backend after on_init_end: hooked now
            _trl_private.wrap_weight_sync(self.trainer, self._wrap_sync_weights)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        _setup.flush(30)  # the step's trajectories and summaries, into the run while it is open

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        _setup.flush(30)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        _setup.flush(30)

    def _wrap_sync_weights(self, original: Any) -> Any:
        """``sync_weights`` marking a weight update when it returns (the weights are in vLLM):
        version and step ``global_step``, what the completions generated next carry as
        ``policy_version``. Marked by the main process alone (every process takes part in the
        push; one update)."""
        trainer = self.trainer

        def version() -> tuple[int, int] | None:
            if _trl_private.process_index(trainer) != 0:
                return None
            step = int(trainer.state.global_step)
            return step, step

        def sync_weights(*args: Any, **kwargs: Any) -> Any:
            return weight_sync.published(lambda: original(*args, **kwargs), version, name="trl")

        return sync_weights

    # ------------------------------------------------------------------ configuration
    def _defaults(self, args: Any) -> dict[str, Any]:
        settings = dict(self.settings)
        if "exporter" not in settings and not os.environ.get("RTRACE_EXPORTER"):
            report_to = getattr(args, "report_to", None) or []
            report_to = [report_to] if isinstance(report_to, str) else list(report_to)
            names = [n for n in ("trackio", "mlflow") if n in report_to]
            if not names:
                names = ["jsonl"]
                settings.setdefault("jsonl_path", os.path.join(getattr(args, "output_dir", None) or ".",
                                                               "rtrace_traces.jsonl"))
            settings["exporter"] = ",".join(names)
        if "project" not in settings and not os.environ.get("RTRACE_PROJECT"):
            project = getattr(args, "project", None) or os.environ.get("TRACKIO_PROJECT")
            if project:
                settings["project"] = project
        if "experiment" not in settings and not os.environ.get("RTRACE_EXPERIMENT"):
            run_name = getattr(args, "run_name", None)
            if run_name:
                settings["experiment"] = run_name
        return settings

    # ------------------------------------------------------------------ one scored batch
    def _scored(self, trainer: Any, inputs: Any, output: Any, scored: dict[str, Any]) -> None:
        """After TRL scored a generation batch: its completions as trajectories. Never
        raises into TRL (counted, logged once)."""
        try:
            self._log(trainer, inputs, output, scored)
        except Exception:
            _stats.incr("internal_errors")
            _stats.warn_once("trl-log", "rtrace.compat.trl could not trace a batch of completions", exc_info=True)

    def _log(self, trainer: Any, inputs: Any, output: Any, scored: dict[str, Any]) -> None:
        if not _setup.is_enabled():
            return
        validate = not trainer.model.training
        state = trainer.state
        step = int(state.global_step) if validate else int(state.global_step) + 1
        group_size = int(trainer.num_generations_eval if validate else trainer.num_generations)
        local = len(inputs)
        world = _trl_private.num_processes(trainer)
        rank = _trl_private.process_index(trainer)
        # Every value is read where it is whole for this batch: the prompts and completions
        # _calculate_rewards was given (this process's), its scores (the gathered batch: this
        # process's rows from rank * local), the advantages TRL returns (this process's).
        prompts = _local(scored.get("prompts"), local) or _local([_get(x, "prompt") for x in inputs], local)
        completions = _local(scored.get("completions"), local)
        table = _table(scored.get("rewards"), local * world)
        advantages = _local(_tolist(output.get("advantages") if isinstance(output, dict) else None), local)
        weights = [float(w) for w in trainer.reward_weights.tolist()]
        names = list(trainer.reward_func_names)

        key = (validate, step)
        if key not in self._offsets:
            self._offsets = {k: v for k, v in self._offsets.items() if k[1] >= step - 1}
            self._offsets[key] = 0
        offset = self._offsets[key]
        self._offsets[key] = offset + (local * world + group_size - 1) // group_size

        rows = _rows(output)
        eos = _trl_private.eos_token_ids(trainer)
        max_len = getattr(trainer, "max_completion_length", None)
        states = []
        traced: list[tuple[int, dict[str, Any]]] = []  # (local row, coordinates) of the admitted completions
        for j in range(local):
            i = rank * local + j  # index in the gathered batch: groups are consecutive there
            prompt = prompts[j] if prompts is not None else None
            prompt_hash = _prompt_id(prompt) if prompt is not None else None  # never an id made from None
            coords: dict[str, Any] = {"step": step, "sample_index": offset + i // group_size,
                                      "rollout_n": i % group_size, "validate": validate,
                                      "group_id": prompt_hash, "policy_version": int(state.global_step),
                                      "extra": {"prompt_id": prompt_hash} if prompt_hash is not None else {}}
            if not admit(coords):
                continue
            missing = []
            if table is not None:
                per_func = {n: table[i][k] if k < len(table[i]) else None for k, n in enumerate(names)}
                reward = _weighted(per_func, names, weights)
                outcome = {f"reward/{n}": _plain(v) for n, v in per_func.items()}
            else:
                reward, outcome = None, {}
                missing.append("reward")
            advantage = advantages[j] if advantages is not None else None
            if advantage is None:
                missing.append("advantage")
            if prompt_hash is None:
                missing.append("prompt")
            prompt_ids, turns = _turns(rows, j, eos, max_len)
            root = {"rtrace.source": "tensor_batch", "rtrace.trainer": "trl"}
            if missing:
                # what TRL did not let us read for this completion, said on the trajectory and counted
                root[MISSING_ATTR] = missing
                _stats.incr("trl_values_missing")
            st = sample_state(coords, prompt_ids, turns, reward, name="grpo_completion", outcome=outcome,
                              root_attributes=root)
            if advantage is not None:
                st.annotations["advantage"] = float(advantage)
            conversation = _chat(prompt, completions[j] if completions is not None else None)
            if conversation is not None:
                st.messages = conversation
            states.append(st)
            traced.append((j, coords))
        # the per-token tensors, before the trajectories: they are waiting when those arrive
        token_rows.send(traced, token_columns(output),
                        token_lengths=[_length(rows, j, max_len) for j in range(len(rows["completion_ids"]))])
        submit(states)


#: Root attribute listing what TRL did not let rtrace read for a completion (``reward``,
#: ``advantage``, ``prompt``); each such trajectory is counted in ``trl_values_missing``.
MISSING_ATTR = "rtrace.missing"


def _get(item: Any, key: str) -> Any:
    return item.get(key) if isinstance(item, dict) else None


def _tolist(value: Any) -> Any:
    if value is None:
        return None
    if hasattr(value, "detach"):
        value = value.detach().cpu()
    return value.tolist() if hasattr(value, "tolist") else list(value)


def _local(values: Any, n: int) -> list[Any] | None:
    """``values`` when they are one per local sample (else None: not usable)."""
    if values is None:
        return None
    values = list(values)
    return values if len(values) == n else None


def _table(rewards: Any, n: int) -> list[list[Any]] | None:
    """The gathered ``[n, reward functions]`` scores as lists (None: not usable)."""
    rows = _tolist(rewards)
    if not isinstance(rows, list) or len(rows) != n or not all(isinstance(r, list) for r in rows):
        return None
    return rows


def _rows(output: Any) -> dict[str, list]:
    """The local batch's tensors as Python lists (one copy each)."""
    out = {}
    for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "tool_mask"):
        value = output.get(key) if isinstance(output, dict) else None
        if value is not None:
            out[key] = value.detach().cpu().tolist() if hasattr(value, "detach") else list(value)
    return out


def token_columns(output: Any) -> dict[str, Any]:
    """TRL's per-token tensors of a generation batch (this process's rows), by rtrace's names
    (references, and views: nothing is copied here; docs/frameworks/trl.md):

    * ``logprob``: ``sampling_per_token_logps``, the sampler's (vLLM with importance sampling
      correction, or a ``rollout_func`` that returns ``logprobs``);
    * ``old_logprob``: ``old_per_token_logps``, the trainer's recompute (TRL computes it when
      a generation batch feeds several optimizer steps, or with vLLM's correction);
    * ``advantage``: ``advantages``, one per completion, on each of its tokens;
    * ``loss_mask``: ``completion_mask``, times ``tool_mask`` when tools ran (what TRL's loss
      trains on).
    """
    if not isinstance(output, dict):
        return {}
    mask, tool = output.get("completion_mask"), output.get("tool_mask")
    loss = mask * tool if mask is not None and tool is not None else mask  # TRL's loss mask (a new tensor)
    advantage = output.get("advantages")
    if advantage is not None and mask is not None and getattr(advantage, "ndim", 0) == 1:
        advantage = advantage.unsqueeze(1).expand_as(mask)  # a view: one number per completion, on its tokens
    return {"logprob": output.get("sampling_per_token_logps"), "old_logprob": output.get("old_per_token_logps"),
            "advantage": advantage, "loss_mask": loss}


def _length(rows: dict[str, list], j: int, max_len: Any) -> int:
    """How many of completion ``j``'s tokens are real (its response, tool tokens included)."""
    ids, mask = rows["completion_ids"][j], rows.get("completion_mask")
    n = sum(mask[j]) if mask is not None else len(ids)
    if n == 0:  # mask_truncated_completions zeroed a truncated completion's mask: all of it is real
        n = min(len(ids), int(max_len)) if max_len else len(ids)
    return n


def _turns(rows: dict[str, list], j: int, eos: set[int], max_len: Any) -> tuple[list[int], list[Turn]]:
    """Sample ``j``'s prompt ids and its turns: the completion, cut into the model's tokens
    and the tool's where TRL ran tools (``tool_mask`` 0), with its finish reason."""
    prompt_row, prompt_mask = rows["prompt_ids"][j], rows.get("prompt_mask")
    prompt = [t for t, m in zip(prompt_row, prompt_mask[j]) if m] if prompt_mask is not None else list(prompt_row)
    n = _length(rows, j, max_len)
    ids = rows["completion_ids"][j][:n]
    finish = "stop" if ids and ids[-1] in eos else "length"
    tool = rows.get("tool_mask")
    flags = tool[j][:n] if tool is not None else [1] * n
    runs: list[tuple[bool, int, int]] = []  # (written by the model, start, end)
    start = 0
    for k in range(1, n + 1):
        if k == n or flags[k] != flags[start]:
            runs.append((bool(flags[start]), start, k))
            start = k
    last = max((i for i, run in enumerate(runs) if run[0]), default=None)
    turns = [Turn("assistant", ids[lo:hi], finish_reason=finish if i == last else None) if model
             else Turn("tool", ids[lo:hi], name="tool") for i, (model, lo, hi) in enumerate(runs)]
    return prompt, turns


def _weighted(per_func: dict[str, Any], names: list[str], weights: list[float]) -> float | None:
    """TRL's reward: each function's score times its weight, summed (None scores left out;
    None when every function returned None)."""
    total, seen = 0.0, False
    for name, weight in zip(names, weights):
        value = per_func.get(name)
        if value is None or value != value:  # None, or NaN: TRL's "unscorable"
            continue
        total += float(value) * weight
        seen = True
    return total if seen else None


def _chat(prompt: Any, completion: Any) -> list[dict[str, Any]] | None:
    """The conversation when TRL's prompt and completion are chat messages (a conversational
    dataset); None for plain text (the decoded turns make it then)."""
    def msgs(value: Any) -> bool:
        return isinstance(value, list) and all(isinstance(m, dict) and "role" in m for m in value)

    if msgs(prompt) and msgs(completion):
        return [dict(m) for m in prompt] + [dict(m) for m in completion]
    if isinstance(prompt, str) and isinstance(completion, str):
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
    return None


def _prompt_id(prompt: Any) -> str:
    """A short stable id of a prompt (its text or chat messages)."""
    text = prompt if isinstance(prompt, str) else repr(prompt)
    return "p-" + hashlib.blake2b(text.encode("utf-8", "replace"), digest_size=6).hexdigest()


def _plain(value: Any) -> Any:
    return None if value is None else float(value)
