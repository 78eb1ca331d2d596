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


def make_worker(config: Any, tokenizer: Any) -> tuple[Any, ScriptedServer]:
    """veRL's ``AgentLoopWorker`` with a real ``LLMServerClient`` whose load balancer and
    server are in-process (:class:`LocalActor`)."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
    from verl.workers.rollout.llm_server import LLMServerClient
    from verl.workers.rollout.router import GlobalRequestLoadBalancer

    server = ScriptedServer(tokenizer)
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
