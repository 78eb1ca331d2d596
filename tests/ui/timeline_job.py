"""A small traced step for the speedscope test (tests/ui/test_timeline_speedscope.py): run as
``python -m tests.ui.timeline_job JSONL WORKER`` by two processes with their own
``RTRACE_WORKER_NAME``, appending to one JSONL file. Four concurrent rollouts, each a
generation on one of two inference servers (``server.address`` set on the span, as an engine
adapter does), two tool calls side by side (the second goes to a row of its own), a wait and a
reward; one process also marks a weight update while they run."""

from __future__ import annotations

import asyncio
import sys
import time

import rtrace
from opentelemetry import trace


@rtrace.traced_generation
async def generate(i: int) -> str:
    span = trace.get_current_span()
    span.set_attribute("server.address", f"10.0.0.{1 + i % 2}")
    span.set_attribute("server.port", 8000)
    span.set_attribute("gen_ai.usage.output_tokens", 40 + i)
    await asyncio.sleep(0.03 * (1 + i % 2))
    return "call the tools"


@rtrace.traced_tool
async def search(query: str) -> str:
    await asyncio.sleep(0.02)
    return "found"


@rtrace.traced(kind="reward")
def compute_score() -> float:
    time.sleep(0.005)
    return 1.0


async def rollout(i: int) -> None:
    with rtrace.rollout_context(step=1, sample_index=i, rollout_n=0, policy_version=0):
        await generate(i)
        await asyncio.gather(search("a"), search("b"))
        await asyncio.sleep(0.01)
        rtrace.record_reward(compute_score())


async def main(marks: bool) -> None:
    tasks = []
    for i in range(4):
        tasks.append(asyncio.create_task(rollout(i)))
        await asyncio.sleep(0.005)
    if marks:
        await asyncio.sleep(0.02)
        rtrace.mark_weight_update(1, step=1)
    await asyncio.gather(*tasks)


if __name__ == "__main__":
    rtrace.configure(exporter="jsonl", jsonl_path=sys.argv[1], worker_name=sys.argv[2], health_checks="none")
    asyncio.run(main(sys.argv[2].endswith("a")))
    assert rtrace.flush(30)
