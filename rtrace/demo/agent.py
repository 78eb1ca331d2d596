"""The demo's agent: an async ``ToolAgentLoop`` with a calculator and a lookup tool.

One episode, as in veRL's ToolAgentLoop (token in, token out)::

    render the chat once -> generate -> parse <tool_call> blocks -> run the tools
    concurrently -> prompt ids + the model's own response ids + the tool results' ids
    -> generate ... (up to max_turns)

Each turn's prompt is the previous prompt, the exact ids the model sampled, then the ids
of what the template adds after them (the tool results and the next assistant header):
the conversation is never re-rendered and re-tokenized between turns, so the trainer would
score exactly what was sampled (rtrace's ``token_continuity`` check finds the loops that
re-render; this one passes it).

then the reward function scores the final answer. It is instrumented with rtrace's
public API only: ``@rtrace.traced_rollout`` on the loop, ``@rtrace.traced_generation``
on the LLM call (it takes ``prompt_ids`` and returns ``response_ids`` and
``finish_reason``, which rtrace reads), ``@rtrace.traced_tool`` on each tool (called
with a ``tool_call_id``), and ``@rtrace.traced`` on the reward.

**The policy writes the tool calls.** The demo's policy (:mod:`rtrace.demo.model`) was
trained by :mod:`rtrace.demo.train` on dialogues rendered by the helpers below
(:func:`format_tool_call`, :func:`assistant_message`, :func:`tool_message`,
:func:`render_prompt`, :data:`ANSWER_TEMPLATE`), so it writes ``<tool_call>`` blocks
this loop parses, with the numbers or key copied from the prompt, then answers with
the tool's result. It samples and is small, so it is sometimes wrong: an operand
miscopied into the call, a wrong operator, the tool's result miscopied into the answer.

**The fallback first tool call.** When the first response holds no valid tool call
(typically because ``--max-new-tokens`` cut the call short, or the sample is
malformed), the agent adds the call the task needs — ``calculator`` with the expression
parsed from an arithmetic prompt, ``lookup`` with the key parsed from a lookup prompt —
so that every trajectory still shows the tool path. Such calls are counted in the
episode's ``forced_tool_calls``; calls the policy wrote are counted in
``policy_tool_calls``.
"""

from __future__ import annotations

import ast
import asyncio
import json
import operator
import re
from dataclasses import dataclass
from typing import Any

import rtrace

from .model import MODEL_NAME, Policy

__all__ = ["Task", "ToolAgentLoop", "CalculatorTool", "LookupTool", "compute_reward", "make_tasks",
           "SYSTEM_PROMPT", "ANSWER_TEMPLATE", "FACTS", "format_tool_call", "assistant_message", "tool_message",
           "render_prompt", "calculate"]

#: Short on purpose: every prompt starts with it, and the policy is trained and sampled on CPU.
SYSTEM_PROMPT = "Use the calculator or lookup tool, then give the answer."
#: The final answer the policy was trained to write after a tool result.
ANSWER_TEMPLATE = "The answer is {}."

# ----------------------------------------------------------------------------- tasks

#: Facts the lookup tool knows; lookup prompts ask for one of them.
FACTS = {
    "capital of France": "Paris",
    "capital of Japan": "Tokyo",
    "boiling point of water in celsius": "100",
    "days in a leap year": "366",
    "speed of light in km/s": "299792",
    "number of legs of a spider": "8",
}
_FACTS_BY_KEY = {k.lower(): v for k, v in FACTS.items()}


@dataclass(frozen=True)
class Task:
    """A prompt, its expected answer and its kind (which tool the forced-call rule adds)."""

    question: str
    answer: str
    kind: str  # "arithmetic" | "lookup"


def make_tasks(n: int, rng: Any, validation: bool = False) -> list[Task]:
    """``n`` tasks, alternating arithmetic and lookup, drawn from ``rng`` (a random.Random)."""
    tasks = []
    facts = sorted(FACTS)
    for i in range(n):
        if i % 2 == 0:
            a, b, c = rng.randint(2, 60), rng.randint(2, 30), rng.randint(1, 9)
            op1, op2 = rng.choice(["+", "-", "*"]), rng.choice(["+", "*"])
            expression = f"{a} {op1} {b} {op2} {c}"
            question = f"Evaluate {expression}." if validation else f"What is {expression}?"
            tasks.append(Task(question, _format_number(_safe_eval(expression)), "arithmetic"))
        else:
            key = facts[rng.randrange(len(facts))]
            tasks.append(Task(f"Look up the {key}.", FACTS[key], "lookup"))
    return tasks


# ----------------------------------------------------------------------------- tools

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
        ast.USub: operator.neg, ast.UAdd: operator.pos}


def _safe_eval(expression: str) -> float:
    """Arithmetic only (numbers, + - * / // % **, parentheses): no names, no calls."""
    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            if isinstance(node.op, ast.Pow) and abs(ev(node.right)) > 64:
                raise ValueError("exponent too large")
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError(f"unsupported expression: {ast.dump(node)[:60]}")

    return ev(ast.parse(expression, mode="eval"))


def _format_number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def calculate(expression: str) -> str:
    """What the calculator tool returns for ``expression`` (raises on a bad expression)."""
    return _format_number(_safe_eval(expression))


class CalculatorTool:
    """Evaluates an arithmetic expression."""

    name = "calculator"
    schema = {"type": "function", "function": {
        "name": "calculator", "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]}}}

    @rtrace.traced_tool
    async def execute(self, tool_call_id: str, expression: str) -> str:
        """The value of ``expression``; a bad expression raises (the span records it)."""
        return calculate(expression)


class LookupTool:
    """Looks a fact up in a small table (a stand-in for a search or database tool)."""

    name = "lookup"
    schema = {"type": "function", "function": {
        "name": "lookup", "description": "Look a fact up by key.",
        "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}}}

    def __init__(self, latency_s: float = 0.005) -> None:
        self.latency_s = latency_s

    @rtrace.traced_tool
    async def execute(self, tool_call_id: str, key: str) -> str:
        """The fact stored under ``key`` (case-insensitive), or ``not found``."""
        await asyncio.sleep(self.latency_s)  # a remote lookup would wait on I/O here
        return _FACTS_BY_KEY.get(key.strip().lower().rstrip("."), "not found")


# ----------------------------------------------------------------------------- reward

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_WORD = re.compile(r"\w+")


@rtrace.traced(kind="chain", name="reward")
def compute_reward(task: Task, answer: str) -> float:
    """1.0 when the final answer is right, else 0.0.

    Arithmetic: the last number in the answer equals the expected value. Lookup: the
    last word of the answer is the expected fact.
    """
    if task.kind == "arithmetic":
        numbers = _NUMBER.findall(answer)
        return 1.0 if numbers and numbers[-1] == task.answer else 0.0
    words = _WORD.findall(answer)
    return 1.0 if words and words[-1].lower() == task.answer.lower() else 0.0


# ----------------------------------------------------------------------------- chat format
# The loop below and the training script (rtrace.demo.train) build conversations with
# these helpers, so the policy is trained on exactly what the loop renders and parses.


def format_tool_call(name: str, arguments: dict[str, Any]) -> str:
    """The text of one tool call, as the policy writes it (Qwen-2.5 style)::

        <tool_call>
        {"name": "calculator", "arguments": {"expression": "3 + 4"}}
        </tool_call>
    """
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def assistant_message(text: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
    """The assistant turn appended to the chat: the response text (without the tool-call
    blocks that parsed) and, when it called tools, the calls (each ``{"id", "name",
    "arguments"}``) in OpenAI format."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = [{"id": c["id"], "type": "function",
                                  "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
                                 for c in calls]
    return message


def tool_message(call: dict[str, Any], result: str) -> dict[str, Any]:
    """The tool turn holding ``call``'s result."""
    return {"role": "tool", "tool_call_id": call["id"], "name": call["name"], "content": result}


def render_prompt(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    """The prompt ids of the next assistant turn: the chat template, then the tokenizer."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# ----------------------------------------------------------------------------- the loop

_TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)
_EXPRESSION = re.compile(r"([-\d.()\s]+(?:[-+*/][-\d.()\s]+)+)")
_LOOKUP_KEY = re.compile(r"look up the (.+?)\.?$", re.I)


class ToolAgentLoop:
    """generate -> parse tool calls -> run tools -> append results -> generate, up to ``max_turns``."""

    def __init__(self, policy: Policy, max_turns: int = 3, tools: list[Any] | None = None) -> None:
        self.policy = policy
        self.tokenizer = policy.tokenizer
        self.max_turns = max_turns
        self.tools = {t.name: t for t in (tools or [CalculatorTool(), LookupTool()])}

    @rtrace.traced_rollout
    async def run(self, question: str, kind: str, seed: int, temperature: float = 1.0) -> dict[str, Any]:
        """One episode for ``question``: the final answer, turns, tool calls and finish reason.

        Safe to run concurrently on one instance: all episode state is local.
        """
        messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM_PROMPT},
                                          {"role": "user", "content": question}]
        tool_calls = forced = written = 0
        text, finish = "", "stop"
        turn = 0
        prompt_ids = self._render(messages)  # once: later turns extend these ids
        while turn < self.max_turns:
            turn += 1
            out = await self.generate(messages, prompt_ids, seed=seed * 1000 + turn, temperature=temperature)
            finish = out["finish_reason"]
            text = self.tokenizer.decode(out["response_ids"], skip_special_tokens=True)
            content, calls = self._split_tool_calls(text)
            written += len(calls)
            if not calls and turn == 1:
                calls = self._forced_call(question, kind)
                forced += len(calls)
            for k, call in enumerate(calls):
                call["id"] = f"call_{turn}_{k}"
            messages.append(assistant_message(content, calls))
            if not calls or turn == self.max_turns:
                break
            results = await asyncio.gather(*(self._call_tool(c) for c in calls))
            tool_calls += len(calls)
            before = list(messages)
            messages.extend(tool_message(c, r) for c, r in zip(calls, results))
            prompt_ids = prompt_ids + self._closed(out["response_ids"]) + self._continuation(before, messages)
        return {"answer": text, "turns": turn, "tool_calls": tool_calls, "forced_tool_calls": forced,
                "policy_tool_calls": written, "finish_reason": finish}

    @rtrace.traced_generation(model=MODEL_NAME)
    async def generate(self, messages: list[dict[str, Any]], prompt_ids: list[int], seed: int,
                       temperature: float = 1.0) -> dict[str, Any]:
        """One LLM call: ``prompt_ids`` in, ``{"response_ids", "finish_reason"}`` out.

        ``messages`` is the conversation the prompt was rendered from; rtrace shows it as
        the trajectory's chat (token2text adds the decoded prompt and response).
        """
        return await self.policy.generate(prompt_ids, seed=seed, temperature=temperature)

    async def _call_tool(self, call: dict[str, Any]) -> str:
        tool = self.tools.get(call["name"])
        if tool is None:
            return f"error: unknown tool {call['name']!r}"
        try:
            return await tool.execute(call["id"], **call["arguments"])
        except Exception as exc:  # a bad tool call is part of the episode, not a crash
            return f"error: {type(exc).__name__}: {exc}"

    def _render(self, messages: list[dict[str, Any]]) -> list[int]:
        return render_prompt(self.tokenizer, messages)

    def _closed(self, response_ids: list[int]) -> list[int]:
        """The model's own ids, with the end-of-turn token added when generation was cut
        before it (the template closes every assistant turn)."""
        end = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        return list(response_ids) if response_ids and response_ids[-1] == end else list(response_ids) + [end]

    def _continuation(self, before: list[dict[str, Any]], after: list[dict[str, Any]]) -> list[int]:
        """The ids the chat template adds after the assistant turn that ends ``before``:
        ``after``'s rendering past ``before``'s (the newline after the end-of-turn token,
        the tool results, the next assistant header), encoded alone: the model's own ids
        before them are kept as sampled."""
        done = self.tokenizer.apply_chat_template(before, tokenize=False)
        text = self.tokenizer.apply_chat_template(after, add_generation_prompt=True, tokenize=False)
        if not (text.startswith(done) and done.endswith("<|im_end|>\n")):
            raise ValueError("the chat template does not render the conversation as a prefix of its continuation")
        # from the template's newline after <|im_end|> on (the model's ids end at <|im_end|>)
        return self.tokenizer(text[len(done) - 1:], add_special_tokens=False)["input_ids"]

    def _parse_tool_calls(self, text: str) -> list[dict[str, Any]]:
        """Well-formed ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks
        naming a known tool; anything else is plain text."""
        return self._split_tool_calls(text)[1]

    def _split_tool_calls(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """``(content, calls)``: the well-formed tool calls of ``text`` and the text without
        them, like an inference server's tool-call parser (vLLM's ``hermes``). The chat
        template renders the calls back, so the next prompt holds each call once."""
        calls, kept, end = [], [], 0
        for match in _TOOL_CALL.finditer(text):
            try:
                data = json.loads(match.group(1))
            except ValueError:
                continue
            if isinstance(data, dict) and data.get("name") in self.tools and isinstance(data.get("arguments"), dict):
                calls.append({"name": data["name"], "arguments": data["arguments"]})
                kept.append(text[end:match.start()])
                end = match.end()
        kept.append(text[end:])
        return ("".join(kept).strip() if calls else text), calls

    @staticmethod
    def _forced_call(question: str, kind: str) -> list[dict[str, Any]]:
        """The documented fallback (see the module docstring): the call the task needs."""
        if kind == "arithmetic":
            match = _EXPRESSION.search(question)
            if match:
                return [{"name": "calculator", "arguments": {"expression": match.group(1).strip().rstrip(".")}}]
        elif kind == "lookup":
            match = _LOOKUP_KEY.search(question.strip())
            if match:
                return [{"name": "lookup", "arguments": {"key": match.group(1)}}]
        return []
