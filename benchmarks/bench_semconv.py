"""What the GenAI conventions cost the OTLP sink: its CPU per trajectory with
``RTRACE_SEMCONV=rtrace`` (rtrace's names only) against ``both`` (GenAI names, messages and
evaluation events next to rtrace's) and ``genai``.

The trajectories are real ones: an agent loop (root, agent, 2 generations, 2 tool calls)
given chat messages, with token2text on (the demo's tokenizer), a reward with two outcome
components, recorded through the decorators and kept in memory. Each round hands the same
batches (256 trajectories, the pipeline's export batch) to a real ``OtlpSink.export``: the
one conversion to OTel spans, rtrace's OTLP encoder (``otel.encode_request``), and an HTTP
POST to a receiver in another process (a minimal OTLP/HTTP server that answers 200). The
figure is this thread's CPU time per trajectory (``time.thread_time``: the receiver's CPU
and the network wait are not in it), median of alternating rounds. Target: ``both`` costs
at most 1.10x ``rtrace``.

Two more measurements, in the same rounds:

* **before**: what the sink did until it encoded its requests itself: the same conversion
  as SDK ``ReadableSpan`` objects, sent by the OTel SDK's OTLP/HTTP exporter (its encoder
  and its transport);
* **floor**: ``both`` with the GenAI values (attributes and evaluation events) computed
  before the round, so that only writing them is measured: what dual-writing would cost if
  building its values were free.

Run: ``HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_semconv.py [--n 1024] [--rounds 7]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import textwrap
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import rtrace  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _machine import reference_line  # noqa: E402

_RECEIVER = textwrap.dedent("""
    import sys
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class H(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers.get("content-length") or 0))
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), H)
    print(server.server_address[1], flush=True)
    server.serve_forever()
""")


def trajectories(n: int) -> list:
    """``n`` six-span trajectories recorded through the decorators (chat messages given,
    token2text on, reward with components), kept in memory."""
    from rtrace.demo import build_tokenizer
    from rtrace.testing import capture

    tok = build_tokenizer()
    system = {"role": "system", "content": "You are a calculator. Call the calculator, then answer."}

    @rtrace.traced_generation(model="toy-policy")
    def generate(messages, prompt_ids):
        text = "calculator(6*7)" if len(messages) == 2 else "The answer is 42."
        return {"response_ids": tok(text, add_special_tokens=False)["input_ids"], "finish_reason": "stop"}

    @rtrace.traced_tool
    def calculator(tool_call_id, expression):
        return "42"

    @rtrace.traced_rollout
    def agent(question):
        messages = [system, {"role": "user", "content": question}]
        ids = tok(question, add_special_tokens=False)["input_ids"]
        generate(list(messages), ids)
        messages.append({"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "6*7"}'}}]})
        messages.append({"role": "tool", "tool_call_id": "c1", "content": calculator("c1", "6*7")})
        generate(list(messages), ids + [5, 6])
        calculator("c2", "6*7")
        return "The answer is 42."

    with capture(token2text=True, tokenizer=tok) as got:
        for i in range(n):
            with rtrace.rollout_context(step=i // 64, sample_index=i, rollout_n=0, group_id=f"q{i}"):
                agent(f"What is 6 * 7 (question {i})?")
                rtrace.record_reward(1.0, correct=True, format=0.5)
        out = got.trajectories
    assert len(out) == n, len(out)
    return out


def sink(endpoint: str, semconv: str):
    from rtrace.config import load_settings
    from rtrace.exporters.otlp import OtlpSink

    return OtlpSink(load_settings({"exporter": "otlp", "otlp_endpoint": endpoint, "semconv": semconv}, environ={}))


class SdkPath:
    """The sink as it was: the one conversion as ReadableSpans, the SDK's OTLP/HTTP exporter."""

    def __init__(self, endpoint: str, semconv: str) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope

        self.exporter = OTLPSpanExporter(endpoint=endpoint + "/v1/traces", timeout=10)
        self.resource = Resource.create({"service.name": "rtrace"})
        self.scope = InstrumentationScope("rtrace", rtrace.__version__)
        self.semconv = semconv

    def export(self, batch: list) -> None:
        from rtrace.exporters.otel import DEFAULT_MAX_VALUE_CHARS, to_readable_spans

        spans = to_readable_spans(batch, self.resource, self.scope, DEFAULT_MAX_VALUE_CHARS, self.semconv)
        self.exporter.export(spans)

    def shutdown(self) -> None:
        self.exporter.shutdown()


class WriteOnly:
    """``both`` with the GenAI attributes and evaluation events looked up, computed before
    (the conversion's two GenAI functions replaced, for its rounds only, by table lookups)."""

    def __init__(self, endpoint: str, trajectories: list) -> None:
        from rtrace.exporters import semconv as sc

        self.sink = sink(endpoint, "both")
        self.attrs, self.events = {}, {}
        for traj in trajectories:
            conv = sc.Conversation(traj, 200_000)
            for i, rec in enumerate(traj.spans):
                self.attrs[id(rec)] = sc.genai_attributes(conv, rec, i == 0)
                self.events[id(rec)] = sc.evaluation_events(traj, rec, i == 0)

    def export(self, batch: list) -> None:
        from rtrace.exporters import otel

        real = otel.genai_attributes, otel.evaluation_events
        otel.genai_attributes = lambda conv, rec, is_root: self.attrs[id(rec)]
        otel.evaluation_events = lambda traj, rec, is_root: self.events[id(rec)]
        try:
            self.sink.export(batch)
        finally:
            otel.genai_attributes, otel.evaluation_events = real

    def shutdown(self) -> None:
        self.sink.shutdown()


def one_round(s, batches: list) -> float:
    """CPU seconds of this thread to export every batch."""
    start = time.thread_time()
    for batch in batches:
        s.export(batch)
    return time.thread_time() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    trajs = trajectories(args.n)
    batches = [trajs[i:i + 256] for i in range(0, len(trajs), 256)]
    receiver = subprocess.Popen([sys.executable, "-c", _RECEIVER], stdout=subprocess.PIPE, text=True)
    try:
        endpoint = f"http://127.0.0.1:{receiver.stdout.readline().strip()}"
        modes = ("rtrace", "both", "genai")
        sinks = {m: sink(endpoint, m) for m in modes}
        sinks["before: rtrace"] = SdkPath(endpoint, "rtrace")
        sinks["before: both"] = SdkPath(endpoint, "both")
        sinks["floor: both"] = WriteOnly(endpoint, trajs)
        for s in sinks.values():  # warm: imports, the HTTP session, the encoders
            one_round(s, batches[:1])
        times: dict[str, list[float]] = {m: [] for m in sinks}
        for _ in range(args.rounds):
            for m, s in sinks.items():
                times[m].append(one_round(s, batches) / len(trajs) * 1e6)
        for s in sinks.values():
            s.shutdown()
    finally:
        receiver.terminate()
        receiver.wait(10)
    med = {m: statistics.median(v) for m, v in times.items()}
    print(reference_line())
    print(f"{args.n} six-span trajectories, {args.rounds} alternating rounds, CPU per trajectory of one "
          "export (median; range):")
    for m in sinks:
        label = m if ":" in m else f"RTRACE_SEMCONV={m}"
        base = med["before: rtrace"] if m.startswith("before") else med["rtrace"]
        print(f"  {label:<22} {med[m]:7.1f} us  ({min(times[m]):.1f}-{max(times[m]):.1f})  "
              f"{med[m] / base:.2f}x {'before: rtrace' if m.startswith('before') else 'rtrace'}")
    print(f"the sink now costs {med['before: rtrace'] / med['rtrace']:.2f}x less with rtrace's names, "
          f"{med['before: both'] / med['both']:.2f}x less with both")
    print(f"dual-write (both) costs {100 * (med['both'] / med['rtrace'] - 1):+.1f}% of the sink's CPU "
          f"(target <= +10%; {100 * (med['before: both'] / med['before: rtrace'] - 1):+.1f}% before); writing the "
          f"GenAI values alone costs {100 * (med['floor: both'] / med['rtrace'] - 1):+.1f}%")


if __name__ == "__main__":
    main()
