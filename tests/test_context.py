"""rollout_context: coordinates on every span, nesting, asyncio, threads, rewards."""

from __future__ import annotations

import asyncio
import json
import random
from concurrent.futures import ThreadPoolExecutor

from opentelemetry import trace as otel_trace
from opentelemetry.sdk.trace import TracerProvider

import rtrace
from tests.conftest import read_back

COORD_KEYS = ("rl.step", "rl.sample_index", "rl.rollout_n", "rl.validate", "rl.group_id", "rl.policy_version")


@rtrace.traced_generation
async def generate(prompt_ids):
    await asyncio.sleep(random.random() / 500)
    return {"response_ids": [len(prompt_ids)]}


@rtrace.traced_tool
def run_tool(tool_call_id, x):
    return x + 1


@rtrace.traced_rollout
async def agent_loop(prompt_ids, pool):
    for turn in range(3):
        out = await generate(prompt_ids)
        prompt_ids = prompt_ids + out["response_ids"]
        await asyncio.sleep(random.random() / 500)
        # the tool runs in a thread pool; wrap_context carries the trajectory there
        fut = pool.submit(rtrace.wrap_context(run_tool), f"c{turn}", turn)
        await asyncio.wrap_future(fut)
    return prompt_ids


class TestCoordinates:
    def test_every_span_carries_the_coordinates(self, jsonl_path):
        """rl.* attributes are on the root and on every nested span; reward and outcome on the root."""
        with rtrace.rollout_context(step=3, sample_index=17, rollout_n=2, group_id="p17",
                                    policy_version=5, dataset="gsm8k") as ctx:
            run_tool("c", 1)
            rtrace.record_reward(0.5, correct=False, parsed="42")
        (traj,) = read_back(jsonl_path)
        assert traj.trace_id == ctx.trace_id
        assert (traj.step, traj.sample_index, traj.rollout_n, traj.group_id, traj.policy_version) == (3, 17, 2, "p17", 5)
        assert traj.validate is False and traj.extra == {"dataset": "gsm8k"}
        for span in traj.spans:
            assert span.attributes["rl.step"] == 3
            assert span.attributes["rl.sample_index"] == 17
            assert span.attributes["rl.extra.dataset"] == "gsm8k"
        assert traj.reward == 0.5 and traj.outcome == {"correct": False, "parsed": "42"}
        assert traj.root.attributes["rl.reward"] == 0.5
        assert traj.root.attributes["rl.outcome.correct"] is False
        assert "rl.reward" not in traj.spans[1].attributes

    def test_nested_contexts_override_and_start_new_trajectories(self, jsonl_path):
        """An inner rollout_context inherits outer values, overrides its own, and is its own trajectory."""
        with rtrace.rollout_context(step=1, sample_index=4, validate=True, tag="outer"):
            with rtrace.rollout_context(rollout_n=3, tag="inner", name="inner"):
                run_tool("c", 1)
            run_tool("c", 2)
        trajs = {t.name: t for t in read_back(jsonl_path)}
        inner, outer = trajs["inner"], trajs["rollout"]
        assert (inner.step, inner.sample_index, inner.rollout_n, inner.validate) == (1, 4, 3, True)
        assert inner.extra == {"tag": "inner"}
        assert outer.rollout_n is None and outer.extra == {"tag": "outer"}
        assert inner.trace_id != outer.trace_id
        assert [s.input["x"] for s in inner.spans[1:]] == [1]
        assert [s.input["x"] for s in outer.spans[1:]] == [2]

    def test_reward_after_agent_loop_returned(self, jsonl_path):
        """record_reward after the decorated loop returned still lands on the open trajectory."""

        @rtrace.traced_rollout
        def loop():
            return "answer"

        with rtrace.rollout_context(step=1):
            answer = loop()
            rtrace.record_reward(1.0 if answer == "answer" else 0.0, exact=True)
        (traj,) = read_back(jsonl_path)
        assert traj.reward == 1.0 and traj.outcome == {"exact": True}
        assert [s.kind for s in traj.spans] == ["rollout", "agent"]

    def test_reward_outside_trajectory_is_counted_not_raised(self, jsonl_path):
        """record_reward with no trajectory open is ignored and counted."""
        rtrace.record_reward(1.0)
        assert rtrace.stats()["rewards_outside_trajectory"] == 1

    def test_odd_rewards_do_not_break(self, jsonl_path):
        """A NaN reward is kept as NaN (written as "NaN" in JSONL); a non-number is recorded as reward_raw."""
        with rtrace.rollout_context(step=1, sample_index=0):
            rtrace.record_reward(float("nan"))
        with rtrace.rollout_context(step=1, sample_index=1):
            rtrace.record_reward("not a number")
        trajs = sorted(read_back(jsonl_path), key=lambda t: t.sample_index)
        lines = [json.loads(line) for line in jsonl_path.read_text().splitlines()]
        assert sorted((line["sample_index"], line["reward"]) for line in lines) == [(0, "NaN"), (1, None)]
        assert trajs[1].reward is None and trajs[1].outcome == {"reward_raw": "'not a number'"}
        stats = rtrace.stats()
        assert stats["rewards_non_finite"] == 1 and stats["reward_errors"] == 1

    def test_rollout_context_inside_application_span_links_it(self, jsonl_path):
        """A rollout started inside an application span is a new trace, linked to it, not its child."""
        app_provider = TracerProvider()
        app_tracer = app_provider.get_tracer("app")
        with app_tracer.start_as_current_span("train_step") as app_span:
            with rtrace.rollout_context(step=1) as ctx:
                run_tool("c", 1)
        (traj,) = read_back(jsonl_path)
        assert ctx.trace_id != format(app_span.get_span_context().trace_id, "032x")
        assert traj.root.parent_id is None

    def test_trace_false_keeps_coordinates_and_traces_nothing(self, jsonl_path):
        """rollout_context(trace=False): coordinates visible, nothing inside traced or sampled."""
        with rtrace.rollout_context(step=5, sample_index=1, trace=False) as ctx:
            assert rtrace.current_coordinates() == {"step": 5, "sample_index": 1}
            assert run_tool("c", 1) == 2
        with rtrace.rollout_context(step=5, sample_index=2):
            run_tool("c", 2)
        (traj,) = read_back(jsonl_path)
        assert not ctx.traced and traj.sample_index == 2
        assert rtrace.stats()["trajectories_started"] == 1

    async def test_async_with(self, jsonl_path):
        """rollout_context also works with `async with`."""
        async with rtrace.rollout_context(step=9):
            await generate([1])
        (traj,) = read_back(jsonl_path)
        assert traj.step == 9 and traj.spans[1].attributes["rl.step"] == 9


class TestConcurrency:
    async def test_200_concurrent_trajectories_no_misattribution(self, tmp_path):
        """200 rollouts with random awaits and a thread pool: every span carries exactly its own coordinates."""
        path = tmp_path / "c.jsonl"
        rtrace.configure(exporter="jsonl", jsonl_path=str(path), export_interval_s=0.05)
        pool = ThreadPoolExecutor(max_workers=8)

        async def one(i):
            with rtrace.rollout_context(step=i % 4, sample_index=i, rollout_n=i % 3, group_id=f"g{i}",
                                        policy_version=i % 4, validate=i % 5 == 0) as ctx:
                await agent_loop([i], pool)
                rtrace.record_reward(float(i))
                return ctx.trace_id

        trace_ids = await asyncio.gather(*(one(i) for i in range(200)))
        pool.shutdown()
        trajs = read_back(path)
        assert len(trajs) == 200
        by_trace = {t.trace_id: t for t in trajs}
        assert set(by_trace) == set(trace_ids)
        misattributed = 0
        for i, tid in enumerate(trace_ids):
            traj = by_trace[tid]
            expect = {"rl.step": i % 4, "rl.sample_index": i, "rl.rollout_n": i % 3, "rl.group_id": f"g{i}",
                      "rl.policy_version": i % 4, "rl.validate": i % 5 == 0}
            assert traj.reward == float(i)
            # 1 root + 1 agent + 3 generations + 3 tools
            assert len(traj.spans) == 8
            assert traj.spans[2].prompt_ids == [i]
            for span in traj.spans:
                got = {k: span.attributes.get(k) for k in COORD_KEYS}
                misattributed += got != expect
        assert misattributed == 0

    def test_thread_without_wrap_context_is_not_part_of_the_trajectory(self, jsonl_path):
        """Threads do not inherit the context: without wrap_context the call is a trajectory of its own."""
        with rtrace.rollout_context(step=1) as ctx:
            with ThreadPoolExecutor(1) as pool:
                pool.submit(run_tool, "c", 1).result()
                pool.submit(rtrace.wrap_context(run_tool), "c", 2).result()
        trajs = read_back(jsonl_path)
        ours = next(t for t in trajs if t.trace_id == ctx.trace_id)
        assert [s.input["x"] for s in ours.spans[1:]] == [2]
        alone = next(t for t in trajs if t.trace_id != ctx.trace_id)
        assert alone.step is None and alone.root.kind == "tool"


class TestApplicationProvider:
    def test_adds_processor_to_the_applications_global_provider(self, tmp_path):
        """An application SDK provider set globally gets rtrace's processor; its own spans pass through."""
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        provider = TracerProvider()
        app_spans = InMemorySpanExporter()
        provider.add_span_processor(SimpleSpanProcessor(app_spans))
        old = otel_trace._TRACER_PROVIDER
        otel_trace._TRACER_PROVIDER = provider  # set_tracer_provider only works once per process
        try:
            path = tmp_path / "app.jsonl"
            rtrace.configure(exporter="jsonl", jsonl_path=str(path))
            tracer = provider.get_tracer("app")
            with tracer.start_as_current_span("unrelated"):
                pass
            with rtrace.rollout_context(step=1):
                with tracer.start_as_current_span("http-call"):  # another instrumentation's span
                    run_tool("c", 1)
            (traj,) = read_back(path)
            assert [s.name for s in traj.spans] == ["rollout", "http-call", "run_tool"]
            assert traj.spans[1].kind == "span" and traj.spans[2].parent_id == traj.spans[1].span_id
            assert traj.spans[1].attributes["rl.step"] == 1
            # the application's exporter still sees everything, rtrace's spans included
            names = sorted(s.name for s in app_spans.get_finished_spans())
            assert names == ["http-call", "rollout", "run_tool", "unrelated"]
        finally:
            rtrace.shutdown()
            otel_trace._TRACER_PROVIDER = old
