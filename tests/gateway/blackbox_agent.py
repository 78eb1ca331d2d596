"""A black-box tool-using agent: it knows only OPENAI_BASE_URL and OPENAI_API_KEY.

Run as ``python blackbox_agent.py "What is 12 + 7?"``: the official openai SDK, a calculator
it runs itself, at most three model calls; prints its conversation as JSON. With
``TRACEPARENT`` in its environment it is an OpenTelemetry-instrumented agent: its turn is a
span of the OTel SDK, child of that context, and each model call carries the span's
``traceparent`` (the W3C propagator), as an instrumented HTTP client would send it; it
prints that span's id too.
"""

from __future__ import annotations

import json
import os
import sys

from openai import OpenAI

MODEL = "rtrace-demo-policy"
SYSTEM = "Use the calculator or lookup tool, then give the answer."
TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate an arithmetic expression.",
                                           "parameters": {"type": "object", "properties": {"expression": {
                                               "type": "string"}}, "required": ["expression"]}}}]


def calculator(expression: str) -> str:
    allowed = set("0123456789+-*/(). ")
    if not expression or set(expression) - allowed:
        return "error: not an arithmetic expression"
    try:
        return str(eval(expression, {"__builtins__": {}}))  # digits and operators only
    except Exception as exc:  # noqa: BLE001
        return f"error: {exc}"


def run(question: str, headers: dict[str, str] | None = None) -> list[dict]:
    client = OpenAI(default_headers=headers or None)  # OPENAI_BASE_URL / OPENAI_API_KEY from the environment
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    for _ in range(3):
        reply = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, temperature=0,
                                               max_tokens=60).choices[0].message
        turn = {"role": "assistant", "content": reply.content}
        if reply.tool_calls:
            turn["tool_calls"] = [{"id": c.id, "type": "function",
                                   "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                  for c in reply.tool_calls]
        messages.append(turn)
        if not reply.tool_calls:
            break
        for call in reply.tool_calls:
            try:
                expression = json.loads(call.function.arguments).get("expression", "")
            except ValueError:
                expression = ""
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calculator(str(expression))})
    return messages


def main() -> None:
    question = sys.argv[1]
    if os.environ.get("TRACEPARENT"):
        from opentelemetry.propagate import extract, inject
        from opentelemetry.sdk.trace import TracerProvider

        tracer = TracerProvider().get_tracer("blackbox-agent")
        carrier = {"traceparent": os.environ["TRACEPARENT"], "baggage": os.environ.get("BAGGAGE", "")}
        with tracer.start_as_current_span("agent.run", context=extract(carrier)) as span:
            headers: dict[str, str] = {}
            inject(headers)
            messages = run(question, headers)
            span_id = format(span.get_span_context().span_id, "016x")
        print(json.dumps({"messages": messages, "span_id": span_id}))
        return
    print(json.dumps({"messages": run(question)}))


if __name__ == "__main__":
    main()
