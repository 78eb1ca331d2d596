"""The smallest real veRL 0.9.1 agent-loop setup that runs on CPU, for tests/verl.

Everything here is veRL's own code path except the inference engine:

* a model directory written offline: rtrace's demo tokenizer (byte-level BPE, ChatML
  with Qwen-2.5 style ``<tool_call>`` blocks) saved with ``save_pretrained`` next to a
  tiny ``qwen2`` ``config.json`` (no weights: veRL's ``HFModelConfig`` only reads the
  config and the tokenizer). ``model_type=qwen2`` selects veRL's
  ``QwenContinuousTokenBuilder``, as for a real Qwen-2.5 model;
* the trainer config composed by Hydra from veRL's own ``ppo_trainer.yaml``;
* :class:`CalculatorTool`, a real ``verl.tools.base_tool.BaseTool`` subclass, registered
  through veRL's tool config YAML (``multi_turn.tool_config_path``);
* :class:`ScriptedServer`, the stand-in for vLLM: token ids in, token ids out
  (``TokenOutput``), behind veRL's real ``LLMServerClient`` and
  ``GlobalRequestLoadBalancer``. :class:`LocalActor` gives both the ``.remote()`` call
  shape of a Ray actor handle, so no Ray cluster is needed;
* ``AgentLoopWorker`` (a plain class: veRL wraps it with ``ray.remote`` only in
  ``AgentLoopManager``) built in-process and driven through ``generate_sequences``.

This module is imported by the name ``verl_app`` (tests/verl is put on ``sys.path`` by
the conftest) because veRL's tool registry imports the tool class from its dotted name.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import re
from pathlib import Path
from typing import Any, Optional

import numpy as np

# veRL's modules import the tracing helpers by name at import time; the conftest
# installs rtrace's shim before this module (and veRL's agent loop) is first imported.
from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput
from verl.tools.base_tool import BaseTool
from verl.tools.schemas import ToolResponse
from verl.utils import normalize_token_ids
from verl.utils.rollout_trace import rollout_trace_op
from verl.workers.rollout.replica import TokenOutput

EXPERIMENT = "verl-real"
PROJECT = "rtrace-verl"
SERVER_ADDRESS = "127.0.0.1:0"

QUESTION = re.compile(r"What is (\d+) \+ (\d+)\?")


# ----------------------------------------------------------------------------- model dir


def write_model_dir(path: Path) -> Path:
    """A model directory veRL can load offline: the demo tokenizer + a tiny qwen2 config."""
    from rtrace.demo import build_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    tok.save_pretrained(str(path))
    config = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": len(tok),
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
        "bos_token_id": None,
        "eos_token_id": tok.convert_tokens_to_ids("<|im_end|>"),
        "pad_token_id": tok.pad_token_id,
        "torch_dtype": "float32",
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


# ----------------------------------------------------------------------------- the tool


CALCULATOR_SCHEMA = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression of integers and + - *.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 3 + 4"}},
            "required": ["expression"],
        },
    },
}


class CalculatorTool(BaseTool):
    """A stateful veRL tool (``BaseTool``): evaluates ``a + b`` and rewards a well-formed call.

    Returns veRL's tool triple ``(ToolResponse, reward, metrics)``: reward 1.0 and
    ``{"ok": True, "chars": <len of the expression>}`` for an expression it can evaluate.
    """

    @rollout_trace_op
    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        expression = str(parameters.get("expression", ""))
        if not re.fullmatch(r"[\d\s+*-]+", expression):
            return ToolResponse(text=f"cannot evaluate {expression!r}"), 0.0, {"ok": False}
        value = eval(expression, {"__builtins__": {}}, {})  # digits and + - * only (checked above)
        return ToolResponse(text=str(value)), 1.0, {"ok": True, "chars": len(expression)}


def write_tool_config(path: Path) -> Path:
    """veRL's tool config YAML (``multi_turn.tool_config_path``) registering CalculatorTool."""
    path.write_text(
        "tools:\n"
        "  - class_name: verl_app.CalculatorTool\n"
        "    config:\n"
        "      type: native\n"
        f"    tool_schema: {json.dumps(CALCULATOR_SCHEMA)}\n"
    )
    return path


# ----------------------------------------------------------------------------- the server


def tool_call_text(a: int, b: int) -> str:
    return f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{a} + {b}"}}}}\n</tool_call>'


def answer_text(a: int, b: int) -> str:
    return f"The answer is {a + b}."


class ScriptedServer:
    """The inference engine's stand-in: the same ``generate`` signature as veRL's vLLM /
    SGLang server actors, token ids in, ``TokenOutput`` out, deterministic.

    The scripted policy reads the question "What is A + B?" from the prompt; without a
    tool response in the prompt yet it calls the calculator, else it answers. Each reply
    ends with ``<|im_end|>`` (the model's EOS, as Qwen stops). Log probs are a
    deterministic function of the position, so they can be compared across runs.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.calls: list[dict[str, Any]] = []

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any],
                       image_data: Optional[list[Any]] = None, video_data: Optional[list[Any]] = None,
                       **kwargs: Any) -> TokenOutput:
        await asyncio.sleep(0)
        text = self.tokenizer.decode(prompt_ids)
        self.calls.append({"request_id": request_id, "prompt_ids": list(prompt_ids),
                           "sampling_params": dict(sampling_params)})
        match = QUESTION.findall(text)
        a, b = (int(x) for x in match[-1]) if match else (0, 0)
        reply = answer_text(a, b) if "<tool_response>" in text else tool_call_text(a, b)
        ids = self.tokenizer.encode(reply, add_special_tokens=False) + [self.end_id]
        return TokenOutput(token_ids=ids, log_probs=[-0.01 * (i % 7) for i in range(len(ids))],
                           stop_reason="completed", num_preempted=0)


def write_model_weights(path: Path, seed: int = 0) -> Any:
    """Random weights for the model directory's tiny qwen2 config (seeded), saved beside it:
    the sampler (:class:`ModelServer`) and the trainer's log-prob pass load the same ones."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(path)), torch_dtype=torch.float32)
    model.save_pretrained(str(path))
    return model


class ModelServer(ScriptedServer):
    """:class:`ScriptedServer` whose log probs come from a real model: the scripted reply is
    fed to the model token by token with a KV cache, as an inference engine decodes, and each
    token's log prob under the model (temperature 1) is returned in ``TokenOutput.log_probs``.
    The trainer's recompute (veRL's engine forward over the whole sequence) sees the same
    weights: the difference between the two is numerics only.

    The rollouts of a group differ (a GRPO group of identical rollouts would hide a row given
    to the wrong rollout): the k-th call for a question at a turn writes the sum the other
    way round (``B + A``) when k is odd, and answers in other words."""

    def __init__(self, tokenizer: Any, model: Any) -> None:
        super().__init__(tokenizer)
        self.model = model.eval()
        self._seen: dict[tuple[int, int, bool], int] = {}

    def reply(self, prompt_ids: list[int]) -> str:
        text = self.tokenizer.decode(prompt_ids)
        match = QUESTION.findall(text)
        a, b = (int(x) for x in match[-1]) if match else (0, 0)
        answering = "<tool_response>" in text
        k = self._seen.get((a, b, answering), 0)  # the k-th rollout of this question at this turn
        self._seen[(a, b, answering)] = k + 1
        if answering:
            return answer_text(a, b) if k % 2 == 0 else f"So {a} + {b} = {a + b}."
        return tool_call_text(a, b) if k % 2 == 0 else tool_call_text(b, a)

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any],
                       image_data: Optional[list[Any]] = None, video_data: Optional[list[Any]] = None,
                       **kwargs: Any) -> TokenOutput:
        import torch

        await asyncio.sleep(0)
        self.calls.append({"request_id": request_id, "prompt_ids": list(prompt_ids),
                           "sampling_params": dict(sampling_params)})
        ids = self.tokenizer.encode(self.reply(list(prompt_ids)), add_special_tokens=False) + [self.end_id]
        log_probs = []
        with torch.no_grad():
            step_in, past = torch.tensor([list(prompt_ids)]), None
            for token in ids:
                out = self.model(input_ids=step_in, past_key_values=past, use_cache=True)
                past = out.past_key_values
                log_probs.append(float(torch.log_softmax(out.logits[0, -1].float(), dim=-1)[token]))
                step_in = torch.tensor([[token]])
        return TokenOutput(token_ids=ids, log_probs=log_probs, stop_reason="completed", num_preempted=0)


class LocalActor:
    """A Ray actor handle's call shape for an in-process object: ``handle.m.remote(...)``
    returns an awaitable that runs ``obj.m(...)`` (started at once, as Ray does, so a
    fire-and-forget call like ``release_server.remote`` runs even if never awaited)."""

    def __init__(self, obj: Any) -> None:
        self._obj = obj

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._obj, name)

        async def call(*args: Any, **kwargs: Any) -> Any:
            result = method(*args, **kwargs)
            return await result if inspect.isawaitable(result) else result

        class _Method:
            @staticmethod
            def remote(*args: Any, **kwargs: Any) -> "asyncio.Future[Any]":
                return asyncio.ensure_future(call(*args, **kwargs))

        return _Method


# ----------------------------------------------------------------------------- config


def compose_config(model_dir: Path, tool_config: Path, overrides: list[str] = ()) -> Any:
    """veRL's ``ppo_trainer`` config composed by Hydra, set for the CPU agent loop."""
    import verl
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name="ppo_trainer", overrides=[
            f"actor_rollout_ref.model.path={model_dir}",
            "actor_rollout_ref.rollout.name=vllm",
            "actor_rollout_ref.rollout.prompt_length=512",
            "actor_rollout_ref.rollout.response_length=512",
            "actor_rollout_ref.rollout.agent.num_workers=1",
            "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent",
            "actor_rollout_ref.rollout.multi_turn.enable=True",
            "actor_rollout_ref.rollout.multi_turn.format=hermes",
            "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=4",
            f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tool_config}",
            f"trainer.project_name={PROJECT}",
            f"trainer.experiment_name={EXPERIMENT}",
            *overrides,
        ])


def trace_overrides(backend="jsonl", token2text=True, cap=None, **extra):
    """veRL's own trace config: ``actor_rollout_ref.rollout.trace.*``."""
    # Hydra reads an unquoted comma as a sweep: a comma list of sinks must be quoted.
    value = "null" if backend is None else (f"'{backend}'" if "," in backend else backend)
    out = [f"actor_rollout_ref.rollout.trace.backend={value}",
           f"actor_rollout_ref.rollout.trace.token2text={token2text}"]
    if cap is not None:
        out.append(f"actor_rollout_ref.rollout.trace.max_samples_per_step_per_worker={cap}")
    return out + [f"{k}={v}" for k, v in extra.items()]


#: The span tree of one ToolAgentLoop rollout with one calculator call (tree order).
TOOL_LOOP_TREE = [
    (0, "agent_loop", "rollout"),
    (1, "ToolAgentLoop.run", "agent"),
    (2, "LLMServerClient.generate", "generation"),
    (2, "HermesToolParser.extract_tool_calls", "chain"),
    (2, "calculator", "tool"),
    (2, "LLMServerClient.generate", "generation"),
    (2, "HermesToolParser.extract_tool_calls", "chain"),
]


# ----------------------------------------------------------------------------- batches


def question(i: int) -> tuple[int, int]:
    return i, 10 * i + 1


def prompt(i: int) -> list[dict[str, str]]:
    a, b = question(i)
    return [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": f"What is {a} + {b}?"}]


def make_batch(samples: list[int], n: int, step: int, validate: bool = False, agent: str = "tool_agent") -> Any:
    """A rollout batch as the trainer hands it to ``generate_sequences``: each sample
    repeated ``n`` times (interleaved, as ``DataProto.repeat(interleave=True)``), with
    the dataset's ``index``, and ``global_steps`` / ``validate`` in ``meta_info``."""
    from verl.protocol import DataProto

    rows = [i for i in samples for _ in range(n)]
    raw = np.empty(len(rows), dtype=object)
    raw[:] = [prompt(i) for i in rows]
    return DataProto(
        non_tensor_batch={
            "raw_prompt": raw,
            "index": np.array(rows, dtype=np.int64),
            "agent_name": np.array([agent] * len(rows), dtype=object),
            "data_source": np.array(["arith"] * len(rows), dtype=object),
        },
        meta_info={"global_steps": step, "validate": validate},
    )


# ----------------------------------------------------------------------------- the worker


def make_worker(config: Any, tokenizer: Any, server: Optional[ScriptedServer] = None) -> tuple[Any, ScriptedServer]:
    """veRL's ``AgentLoopWorker`` with a real ``LLMServerClient`` whose load balancer and
    server are in-process (:class:`LocalActor`); the server is a :class:`ScriptedServer`
    unless given."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
    from verl.workers.rollout.llm_server import LLMServerClient
    from verl.workers.rollout.router import GlobalRequestLoadBalancer

    server = server or ScriptedServer(tokenizer)
    balancer = GlobalRequestLoadBalancer(servers={SERVER_ADDRESS: LocalActor(server)})
    client = LLMServerClient(config=config, load_balancer_handle=LocalActor(balancer))
    return AgentLoopWorker(config, client), server


# ----------------------------------------------------------------------------- a custom loop


class ChatAgentLoop(AgentLoopBase):
    """A custom agent loop on chat messages, as veRL's recipes write them (registered
    through ``rollout.agent.agent_loop_config_path``): its traced ``chat`` op takes the
    conversation as ``messages`` and returns the assistant message; tool calls go to the
    same veRL tools as ToolAgentLoop's."""

    def __init__(self, *args: Any, tools: Any = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tools = {t.name: t for t in (tools.tools if tools else [])}
        self._last: list[int] = []

    def _ids(self, messages: list[dict[str, Any]]) -> list[int]:
        return normalize_token_ids(self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True))

    @rollout_trace_op
    async def chat(self, messages: list[dict[str, Any]], sampling_params: dict[str, Any]) -> dict[str, Any]:
        output = await self.server_manager.generate(
            request_id=f"chat-{id(self)}", prompt_ids=self._ids(messages), sampling_params=sampling_params)
        self._last = list(output.token_ids)
        return {"role": "assistant", "content": self.tokenizer.decode(output.token_ids, skip_special_tokens=True)}

    def arguments(self, call: dict[str, Any]) -> Any:
        """The call's arguments as the conversation keeps them (the template renders them)."""
        return call["arguments"]

    @rollout_trace_op
    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        messages = [dict(m) for m in kwargs["raw_prompt"]]
        prompt_ids = self._ids(messages)
        for turn in range(3):
            reply = await self.chat(list(messages), sampling_params)
            calls = re.findall(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", reply["content"], re.S)
            if not calls:
                break
            call = json.loads(calls[0])
            messages.append({"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": call["name"], "arguments": self.arguments(call)}}]})
            response, _reward, _metrics = await self.tools[call["name"]].execute(f"chat-{turn}", call["arguments"])
            messages.append({"role": "tool", "content": response.text})
        response_ids = (self._ids(messages) + self._last)[len(prompt_ids):]
        return AgentLoopOutput(prompt_ids=prompt_ids, response_ids=response_ids,
                               response_mask=[1] * len(response_ids), num_turns=len(messages) + 1, metrics={})


class CompactChatAgentLoop(ChatAgentLoop):
    """ChatAgentLoop whose tool parser re-serializes the call's arguments compactly (as some
    parsers do) before the template renders the conversation again: the next prompt no
    longer holds the tokens the model sampled (the rollout-health test's broken loop)."""

    def arguments(self, call: dict[str, Any]) -> Any:
        return json.dumps(call["arguments"], separators=(",", ":"))


def write_agent_loop_config(path: Path) -> Path:
    """veRL's custom agent loop registry file (``rollout.agent.agent_loop_config_path``)."""
    path.write_text("- name: chat_agent\n  _target_: verl_app.ChatAgentLoop\n"
                    "- name: compact_chat_agent\n  _target_: verl_app.CompactChatAgentLoop\n")
    return path


# ----------------------------------------------------------------------------- the trainer


class InProcessActor:
    """veRL's actor worker group in this process: ``compute_log_prob`` runs veRL's own FSDP
    engine code (``FSDPEngineWithLMHead.forward_step``: its input preparation, the model's
    forward, ``logprobs_from_logits`` / ``entropy_from_logits`` and the no-padding layout)
    on the plain model, as one micro-batch, without FSDP or a process group (veRL's engine
    has no CPU platform: its device helpers are pointed at the CPU); ``update_actor`` returns
    metrics and trains nothing. ``dp`` data-parallel ranks for ``_balance_batch``."""

    def __init__(self, model: Any, dp: int = 2) -> None:
        import torch
        from omegaconf import OmegaConf
        from verl.workers.engine.fsdp import transformer_impl

        transformer_impl.get_device_id = lambda: "cpu"
        transformer_impl.get_device_name = lambda: "cpu"

        class Engine(transformer_impl.FSDPEngineWithLMHead):
            def __init__(self, module: Any) -> None:  # the attributes forward_step reads
                self.module = module
                self.engine_config = OmegaConf.create({"entropy_checkpointing": False,
                                                       "entropy_from_logits_chunk_size": 0})
                self.use_ulysses_sp = False
                self.pad_to_length = None
                self._autocast_dtype = torch.float32

        self.engine = Engine(model)
        self._dispatch_info = {"actor": list(range(dp))}

    def compute_log_prob(self, data: Any) -> Any:
        import torch
        from verl.utils import tensordict_utils as tu

        # padded batches (veRL's use_remove_padding=False path): packed sequences need flash attention
        tu.assign_non_tensor(data, use_remove_padding=False, temperature=1.0)
        with torch.no_grad():
            _, output = self.engine.forward_step(data, loss_function=None, forward_only=True)
        model_output = output["model_output"]
        return tu.get_tensordict(tensor_dict={"log_probs": model_output["log_probs"],
                                              "entropy": model_output["entropy"]},
                                 non_tensor_dict={"metrics": {"mfu": 0.0}})

    def update_actor(self, data: Any) -> Any:
        from verl.utils import tensordict_utils as tu

        return tu.get_tensordict(tensor_dict={}, non_tensor_dict={"metrics": {"mfu": 0.0}})


def make_trainer(config: Any, model: Any, step: int, dp: int = 2) -> Any:
    """veRL's ``RayPPOTrainer`` with its actor in this process (:class:`InProcessActor`): the
    attributes ``fit`` gives the methods it calls between rollout and update."""
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    trainer = object.__new__(RayPPOTrainer)
    trainer.config = config
    trainer.actor_rollout_wg = InProcessActor(model, dp)
    trainer.global_steps = step
    return trainer


def length_rewards(batch: Any) -> Any:
    """veRL's token-level scores: one reward per rollout on its last response token (as its
    reward loop's rm_scores), here a function of the response's length, so that the rollouts
    of a group differ and GRPO's advantages are not all 0."""
    import torch

    prompt_len = batch.batch["prompts"].shape[1]
    lengths = batch.batch["attention_mask"][:, prompt_len:].sum(dim=1)
    scores = torch.zeros_like(batch.batch["response_mask"], dtype=torch.float32)
    scores[torch.arange(len(lengths)), lengths - 1] = (lengths % 5).float() / 4
    return scores


def train_step(trainer: Any, batch: Any, rewards: Any = length_rewards) -> tuple[Any, Any]:
    """What ``RayPPOTrainer.fit`` does with a generated batch, in its order: balance the batch
    across ranks, recompute the log probs (and the entropy, which fit drops after its metric),
    compute GRPO advantages from token-level rewards, update the actor. Returns the batch
    (as the update saw it) and the entropy."""
    from verl.trainer.ppo import ray_trainer

    trainer._balance_batch(batch, metrics={})
    old_log_prob, _ = trainer._compute_old_log_prob(batch)
    entropy = old_log_prob.batch.pop("entropys")
    batch = batch.union(old_log_prob)
    batch.batch["token_level_scores"] = rewards(batch)
    batch.batch["token_level_rewards"] = batch.batch["token_level_scores"]
    algorithm = trainer.config.algorithm
    batch = ray_trainer.compute_advantage(batch, adv_estimator=algorithm.adv_estimator, gamma=algorithm.gamma,
                                          lam=algorithm.lam, num_repeat=trainer.config.actor_rollout_ref.rollout.n,
                                          norm_adv_by_std_in_grpo=algorithm.get("norm_adv_by_std_in_grpo", True),
                                          config=algorithm)
    trainer._update_actor(batch)
    return batch, entropy
