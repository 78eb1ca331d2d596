"""Rollout health: each check flags a trajectory built to fail it, with the right detail, and
leaves its near miss alone; the findings reach JSONL, trackio, MLflow, OTLP, the step
metrics, the rollouts table and tail keeping."""

from __future__ import annotations

import math

import pytest

import rtrace
import rtrace.testing
from rtrace.exporters.mlflow import trace_tags
from rtrace.exporters.otel import span_attributes
from rtrace.exporters.trackio import trace_metadata
from rtrace.pipeline.health import HealthChecker
from rtrace.trajectory import SpanRecord, Trajectory
from tests.doubles import MetricsSink


@rtrace.traced_generation
def gen(prompt_ids, reply=(9,), finish="stop", content=None):
    out = {"response_ids": list(reply), "finish_reason": finish}
    if content is not None:
        out["content"] = content
    return out


@rtrace.traced_tool(tool_name="calculator")
def calc(expression, result="4"):
    return result


def rollout(turns, step=1, index=0, n=0, reward=1.0, version=None, **coords):
    """One trajectory: ``turns`` is a list of ``(prompt_ids, reply, finish)``; a tool runs after
    every turn but the last."""
    with rtrace.rollout_context(step=step, sample_index=index, rollout_n=n, policy_version=version, **coords):
        for k, (prompt, reply, finish) in enumerate(turns):
            gen(prompt, reply, finish)
            if k < len(turns) - 1:
                calc("2+2")
        if reward is not None:
            rtrace.record_reward(reward)


def health_of(**settings):
    """Run the body's rollouts and return their findings, by sample_index and rollout_n."""
    settings.setdefault("health_checks", "all")
    return rtrace.testing.capture(**settings)


def findings(trajs):
    return {(t.step, t.sample_index, t.rollout_n): [(f["check"], f["detail"]) for f in t.health] for t in trajs}


# a healthy two-turn trajectory: turn 2's prompt = turn 1's prompt + response + tool tokens
HEALTHY = [([1, 2, 3], [4, 5], "tool_calls"), ([1, 2, 3, 4, 5, 6, 7], [8, 0], "stop")]


class TestTokenContinuity:
    def test_a_re_tokenized_turn_is_flagged_at_its_turn_and_position(self):
        """Turn 2's prompt changes turn 1's response (id 5 became 9): flagged at turn 2, token 4."""
        with health_of() as got:
            rollout([([1, 2, 3], [4, 5, 0], "tool_calls"), ([1, 2, 3, 4, 9, 0, 6], [8], "stop")])
            rollout(HEALTHY, index=1)
        f = findings(got.trajectories)
        assert f[(1, 0, 0)] == [("token_continuity", "turn 2: its prompt does not continue turn 1's prompt + "
                                                     "response at token 4 of 6 (expected id 5, got 9)")]
        assert f[(1, 1, 0)] == []

    def test_a_dropped_final_stop_token_is_not_a_break(self, tok):
        """A loop that drops the reply's final end-of-turn token (a special one: <|im_end|> = 2) to
        continue the same assistant message, as SkyRL's single-turn mode does, re-tokenizes
        nothing; dropping another token is."""
        with health_of(tokenizer=tok) as got:
            rollout([([1, 2, 3], [40, 50, 2], "stop"), ([1, 2, 3, 40, 50, 60], [8], "stop")], index=0)
            rollout([([1, 2, 3], [40, 50, 2], "stop"), ([1, 2, 3, 40, 2, 60], [8], "stop")], index=1)
        f = findings(got.trajectories)
        assert f[(1, 0, 0)] == []
        assert [c for c, _ in f[(1, 1, 0)]] == ["token_continuity"]

    @pytest.mark.parametrize("with_tokenizer", [True, False])
    def test_a_replaced_last_content_token_is_a_break(self, tok, with_tokenizer):
        """The reply's last token is a content token (12), and the next prompt has another in its
        place (a reply cut at a stop string, re-rendered with the end token): a break, with or
        without a tokenizer (without one no token is exempt)."""
        with health_of(tokenizer=tok if with_tokenizer else None) as got:
            rollout([([1, 2, 3], [10, 11, 12], "stop"), ([1, 2, 3, 10, 11, 2, 99], [8], "stop")])
        ((check, detail),) = findings(got.trajectories)[(1, 0, 0)]
        assert check == "token_continuity" and detail.startswith(
            "turn 2: its prompt does not continue turn 1's prompt + response at token 5 of 6 (expected id 12, got 2)")

    def test_with_a_tokenizer_the_text_at_the_break_is_shown(self, tok):
        """With token2text, the finding shows the decoded text on both sides of the break."""
        first = tok("What is 2+2?", add_special_tokens=False)["input_ids"]
        reply = tok(" Let me see.  It is 4.", add_special_tokens=False)["input_ids"]
        again = tok(" Let me see. It is 4.", add_special_tokens=False)["input_ids"]  # whitespace merged on re-rendering
        with health_of(token2text=True, tokenizer=tok) as got:
            rollout([(first, reply, "tool_calls"), (first + again + [5], [6], "stop")])
        (traj,) = got.trajectories
        (finding,) = [f for f in traj.health if f["check"] == "token_continuity"]
        expected, actual = first + reply, first + again + [5]
        pos = next(i for i, (a, b) in enumerate(zip(expected, actual)) if a != b)
        assert pos < len(expected) - 1  # inside the reply, not its last token
        assert finding["detail"].startswith(f"turn 2: its prompt does not continue turn 1's prompt + response at "
                                            f"token {pos} of {len(expected)}")
        assert "text at the break: " in finding["detail"] and "me see." in finding["detail"]


class TestRetokenization:
    def test_ids_that_do_not_round_trip_are_flagged(self, tok):
        """Response ids spelling "answer" letter by letter decode to text that encodes to other
        ids; ids the tokenizer itself produced round-trip."""
        letters = [tok.convert_tokens_to_ids(c) for c in "answer"]
        assert tok.encode("answer", add_special_tokens=False) != letters
        good = tok.encode("The answer is 4.", add_special_tokens=False)
        with health_of(token2text=True, tokenizer=tok) as got:
            rollout([([1], letters, "stop")])
            rollout([([1], good, "stop")], index=1)
        f = findings(got.trajectories)
        (check, detail), = [x for x in f[(1, 0, 0)] if x[0] == "retokenization"]
        assert detail.startswith("turn 1: decoding the 6 response ids and encoding the text gives")
        assert [x for x in f[(1, 1, 0)] if x[0] == "retokenization"] == []

    def test_off_by_default(self, tok):
        """The default checks leave retokenization out (it costs an encode per generation)."""
        letters = [tok.convert_tokens_to_ids(c) for c in "answer"]
        with rtrace.testing.capture(token2text=True, tokenizer=tok) as got:
            rollout([([1], letters, "stop")])
        (traj,) = got.trajectories
        assert traj.health == []


class TestReward:
    def test_missing_and_non_finite_rewards(self):
        """Once the run has rewards: no reward by export, a reward recorded as None, and a NaN
        reward are flagged; a reward of 0.0 is not."""
        with health_of() as got:
            rollout(HEALTHY, index=2, reward=0.0)
            rollout(HEALTHY, index=0, reward=None)
            rollout(HEALTHY, index=1, reward=float("nan"))
            with rtrace.rollout_context(step=1, sample_index=3, rollout_n=0):
                gen([1, 2, 3], [4])
                rtrace.record_reward(None)  # a reward function that could not parse the answer
            trajs = got.trajectories
        f = findings(trajs)
        assert f[(1, 0, 0)] == [("reward", "no reward recorded or annotated by the time it was written")]
        assert f[(1, 1, 0)] == [("reward", "reward is nan")]
        assert f[(1, 2, 0)] == []
        assert f[(1, 3, 0)] == [("reward", "the reward was recorded as None (a reward function that could not "
                                           "score?)")]

    def test_a_run_without_any_reward_is_said_once(self):
        """A job that records no reward at all (veRL's agent loops by default): no per-rollout
        finding, one counter per trajectory and one log line; a reward recorded as None is
        still a finding, also with keep_unhealthy (kept for it, with the finding)."""
        with health_of(max_traces_per_step=1, keep_unhealthy=4, sample_seed=1) as got:
            for i in range(6):
                rollout(HEALTHY, index=i, reward=None)
            with rtrace.rollout_context(step=1, sample_index=9, rollout_n=0):
                gen([1, 2, 3], [4])
                rtrace.record_reward(None)
            trajs, stats = got.trajectories, got.stats()
        by_index = {t.sample_index: t for t in trajs}
        assert [f["check"] for f in by_index[9].health] == ["reward"] and "unhealthy" in by_index[9].kept
        assert all(t.health == [] for i, t in by_index.items() if i != 9)
        assert stats["health_reward_never_recorded"] == 6

    @pytest.mark.parametrize("kind", ["numpy", "torch"])
    def test_numpy_and_torch_scalars_are_their_values(self, kind):
        """An np.bool_ (or 0-d bool tensor) reward among floats is a bool among numbers; np.int64
        (or 0-d tensor) step and policy_version make a staleness finding like Python ints."""
        if kind == "numpy":
            np = pytest.importorskip("numpy")
            scalar, flag = np.int64, np.bool_
        else:
            torch = pytest.importorskip("torch")
            scalar, flag = torch.tensor, lambda v: torch.tensor(v)
        with health_of() as got:
            for n, r in enumerate([0.5, 1.0, flag(True)]):
                rollout(HEALTHY, step=scalar(5), index=scalar(0), n=n, reward=r, version=scalar(1), group_id="g")
        f = findings(got.trajectories)
        assert [c for c, _ in f[(5, 0, 2)]] == ["reward", "staleness"]
        assert f[(5, 0, 2)][0][1].startswith("reward True is a bool in group 'g'")
        assert f[(5, 0, 0)] == [("staleness", "step 5 - policy_version 1 = 4 > 1 (RTRACE_HEALTH_MAX_STALENESS)")]

    def test_an_annotated_reward_counts(self):
        """A reward annotated by the trainer (awaited) is a reward."""
        with health_of(await_annotations="reward", annotation_timeout_s=30) as got:
            rollout(HEALTHY, reward=None)
            rtrace.annotate(step=1, sample_index=0, rollout_n=0, reward=1.0)
        (traj,) = got.trajectories
        assert traj.reward == 1.0 and traj.health == []

    def test_reward_for_an_empty_last_generation(self):
        """A reward given to a trajectory whose last generation produced nothing is flagged."""
        with health_of() as got:
            rollout([([1], [], "stop")], reward=1.0)
        (traj,) = got.trajectories
        assert ("reward", "reward 1.0 given to a trajectory whose last generation is empty") in \
            [(f["check"], f["detail"]) for f in traj.health]

    def test_a_reward_on_another_scale_than_its_group(self):
        """In a group scored 0/1, a rollout scored 87 is flagged; 0.5 and 5 are not, and neither
        is another group scored 0-100."""
        with health_of() as got:
            for n, r in enumerate((0.0, 1.0, 87.0, 0.5, 5.0)):
                rollout(HEALTHY, index=0, n=n, reward=r, group_id="g0")
            for n, r in enumerate((10.0, 90.0)):
                rollout(HEALTHY, index=1, n=n, reward=r, group_id="g1")
        f = findings(got.trajectories)
        assert f[(1, 0, 2)] == [("reward", "reward 87.0 is on another scale than reward 1.0 of its group 'g0' (a "
                                           "0-1 score and one above 10)")]
        assert [f[(1, 0, n)] for n in (0, 1, 3, 4)] == [[], [], [], []]
        assert f[(1, 1, 0)] == f[(1, 1, 1)] == []

    @pytest.mark.parametrize("rewards", [
        (1.0, 6.0, 10.0),            # a 1-10 judge
        (0.0, 40.0, 75.0, 100.0),    # a 0-100 judge, 0 written first
        (100.0, 0.0, 40.0, 75.0),    # the same, 100 first
        (-1.0, 0.0, 1.0, 0.5),       # a signed 0/1 score
        (0.0, 0.0, 0.0, 0.0),        # all failed
    ])
    def test_a_consistent_reward_scale_is_not_mixed(self, rewards):
        """A consistent reward function is never called mixed, whatever comes first."""
        with health_of() as got:
            for n, r in enumerate(rewards):
                rollout(HEALTHY, index=0, n=n, reward=r, group_id="g")
        assert all(v == [] for v in findings(got.trajectories).values())


class TestGeneration:
    def test_empty_response_and_truncated_final_turn(self):
        """An empty response and a final turn stopped by length are flagged; length on a turn
        that is not the last is not."""
        with health_of() as got:
            rollout([([1], [], "stop")], index=0, reward=None)
            rollout([([1, 2], [3], "tool_calls"), ([1, 2, 3, 4], [5, 6], "length")], index=1)
            rollout([([1, 2], [3], "length"), ([1, 2, 3, 4], [5, 6], "stop")], index=2)
        f = findings(got.trajectories)
        assert ("generation", "turn 1: empty response (0 tokens)") in f[(1, 0, 0)]
        assert f[(1, 1, 0)] == [("generation", "turn 2 (the final one) was truncated: finish reason length")]
        assert f[(1, 2, 0)] == []

    def test_empty_tool_result(self):
        """A tool that returned "" is flagged; one that returned "0" is not."""
        with health_of() as got:
            with rtrace.rollout_context(step=1, sample_index=0, rollout_n=0):
                calc("2-2", result="")
                rtrace.record_reward(1.0)
            with rtrace.rollout_context(step=1, sample_index=1, rollout_n=0):
                calc("2-2", result="0")
                rtrace.record_reward(1.0)
        f = findings(got.trajectories)
        assert f[(1, 0, 0)] == [("generation", "tool calculator: empty result")] and f[(1, 1, 0)] == []

    def test_tool_call_markup_after_which_no_tool_ran(self):
        """A response with <tool_call> markup and no tool after it (a call the loop failed to
        parse) is flagged; the same response followed by the tool is not."""
        call = '<tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>'
        with health_of() as got:
            with rtrace.rollout_context(step=1, sample_index=0, rollout_n=0):
                gen([1, 2], [3, 4], "stop", content=call)
                rtrace.record_reward(0.0)
            with rtrace.rollout_context(step=1, sample_index=1, rollout_n=0):
                gen([1, 2], [3, 4], "tool_calls", content=call)
                calc("2+2")
                gen([1, 2, 3, 4, 5], [6], "stop", content="It is 4.")
                rtrace.record_reward(1.0)
        f = findings(got.trajectories)
        assert f[(1, 0, 0)] == [("generation", "turn 1: tool-call markup in the response but no tool ran (a call "
                                               "that failed to parse?)")]
        assert f[(1, 1, 0)] == []

    def test_ids_without_text_and_a_call_without_result(self):
        """Response ids that decode to no text, and an assistant tool call with no tool message,
        are flagged (checked on a trajectory as the worker holds it)."""
        checker = HealthChecker(["generation"])
        gen_span = SpanRecord("b" * 16, "a" * 16, "gen", "generation", 1, 2,
                              attributes={"gen_ai.usage.output_tokens": 3, "rtrace.response_text": ""})
        traj = Trajectory("c" * 32, "rollout", [SpanRecord("a" * 16, None, "rollout", "rollout", 0, 3), gen_span],
                          messages=[{"role": "user", "content": "2+2?"},
                                    {"role": "assistant", "content": "", "tool_calls": [
                                        {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": "{}"}}]}],
                          health=[])
        checker.check_text([traj])
        assert [(f["check"], f["detail"]) for f in traj.health] == [
            ("generation", "turn 1: 3 response tokens decode to no text"),
            ("generation", "tool call c1 (calc) has no tool result")]
        traj.messages.append({"role": "tool", "tool_call_id": "c1", "content": "4"})
        gen_span.attributes["rtrace.response_text"] = "It is 4."
        traj.health = []
        checker.check_text([traj])
        assert traj.health == []


class TestStaleness:
    def test_above_the_bound_is_flagged_and_every_root_has_the_number(self):
        """step - policy_version above RTRACE_HEALTH_MAX_STALENESS (1) is flagged; each root carries
        rl.staleness."""
        with health_of() as got:
            rollout(HEALTHY, step=5, index=0, version=3)
            rollout(HEALTHY, step=5, index=1, version=4)
        f = findings(got.trajectories)
        assert f[(5, 0, 0)] == [("staleness", "step 5 - policy_version 3 = 2 > 1 (RTRACE_HEALTH_MAX_STALENESS)")]
        assert f[(5, 1, 0)] == []
        assert sorted(t.root.attributes["rl.staleness"] for t in got.trajectories) == [1, 2]

    def test_the_bound_is_a_setting(self):
        with health_of(health_max_staleness=2) as got:
            rollout(HEALTHY, step=5, version=3)
        assert got.trajectories[0].health == []


class TestCoordinates:
    def test_same_coordinates_twice_in_a_step(self):
        """The second trajectory with a step's (sample_index, rollout_n, validate) is flagged,
        naming the first; another rollout_n, another step or validation are not."""
        with health_of() as got:
            with rtrace.rollout_context(step=1, sample_index=0, rollout_n=0) as first:
                rtrace.record_reward(1.0)
            rollout([], step=1, index=0, n=0)
            rollout([], step=1, index=0, n=1)
            rollout([], step=2, index=0, n=0)
            rollout([], step=1, index=0, n=0, validate=True)
        dupes = [t for t in got.trajectories if t.health]
        assert len(dupes) == 1 and dupes[0].trace_id != first.trace_id
        assert dupes[0].health == [{"check": "coordinates", "detail": f"same (step 1, sample_index 0, rollout_n 0, "
                                                                     f"validate False) as trace {first.trace_id}"}]

    def test_a_group_of_an_odd_size_in_the_step_metrics_and_table(self):
        """Three groups of two and one of three: the step's coordinates rate counts the odd group's
        members and the rollouts table notes them; under a cap the same, every rollout being counted
        (summaries), and nothing without summaries (the metrics then see the sample: groups cut)."""
        sink = MetricsSink()
        with health_of(sinks=[sink]):
            for index, size in enumerate((2, 2, 2, 3)):
                for n in range(size):
                    rollout([], index=index, n=n, group_id=f"g{index}")
        (m,) = sink.metrics
        assert m.values["rollout/health/coordinates_rate"] == 3 / 9
        # "slowest" marks the step's slowest rollout, which may be any of the nine (3.10 in CI: one of g3's)
        assert [r["note"].removeprefix("slowest; ") for r in m.rows if r["group"] == "g3"] == [
            "group of 3 (usual 2)"] * 3
        assert all(r["note"] in ("", "slowest") for r in m.rows if r["group"] != "g3")
        assert sum("slowest" in r["note"] for r in m.rows) == 1
        for summaries, rate in ((True, 3 / 9), (False, 0.0)):
            capped = MetricsSink()
            with health_of(sinks=[capped], max_traces_per_step=4, summaries=summaries):
                for index, size in enumerate((2, 2, 2, 3)):
                    for n in range(size):
                        rollout([], index=index, n=n, group_id=f"g{index}")
            assert capped.metrics[0].values["rollout/health/coordinates_rate"] == rate


class TestWhereItShows:
    def test_step_rates_and_checks_off(self):
        """Each enabled check has a health/<check>_rate per step; RTRACE_HEALTH_CHECKS=none runs none
        and says so (health None, no rates)."""
        sink = MetricsSink()
        with health_of(sinks=[sink], health_checks="reward,staleness") as got:
            rollout(HEALTHY, index=1)
            rollout(HEALTHY, index=0, reward=None)
        (m,) = sink.metrics
        rates = {k: v for k, v in m.values.items() if "/health/" in k}
        assert rates == {"rollout/health/reward_rate": 0.5, "rollout/health/staleness_rate": 0.0}
        off = MetricsSink()
        with rtrace.testing.capture(sinks=[off], health_checks="none") as got:
            rollout(HEALTHY, reward=None)
            trajs = got.trajectories
        assert trajs[0].health is None and not any("/health/" in k for k in off.metrics[0].values)

    def test_findings_in_trackio_mlflow_and_otlp(self):
        """The trackio header has `health` (searchable text), MLflow the `health` tag (failed
        checks, comma list), the OTLP root `rtrace.health.checks` and `rtrace.health`."""
        with health_of() as got:
            rollout(HEALTHY, step=4, version=4)  # the run has a reward: a rollout without one is a finding
            rollout(HEALTHY, step=5, version=1, reward=None)
        (traj,) = [t for t in got.trajectories if t.step == 5]
        assert [f["check"] for f in traj.health] == ["reward", "staleness"]
        meta = trace_metadata(traj)
        assert meta["health"] == ("reward: no reward recorded or annotated by the time it was written; staleness: "
                                  "step 5 - policy_version 1 = 4 > 1 (RTRACE_HEALTH_MAX_STALENESS)")
        assert trace_tags(traj)["health"] == "reward,staleness"
        attrs = span_attributes(traj, traj.root, True)
        assert attrs["rtrace.health.checks"] == ["reward", "staleness"]
        assert '"check": "staleness"' in attrs["rtrace.health"]
        healthy = Trajectory("d" * 32, "rollout", [traj.root], health=[])
        assert "health" not in trace_metadata(healthy) and "health" not in trace_tags(healthy)

    def test_jsonl_round_trip(self, jsonl_path):
        """health is a top-level JSONL field; Trajectory.from_dict reads it back."""
        from rtrace.exporters.jsonl import read_jsonl

        rtrace.configure(exporter="jsonl", jsonl_path=str(jsonl_path), health_checks="all")
        rollout(HEALTHY, index=1)
        rollout(HEALTHY, reward=None)
        assert rtrace.flush(30)
        (traj,) = [t for t in read_jsonl(jsonl_path) if t.sample_index == 0]
        assert traj.health == [{"check": "reward", "detail": "no reward recorded or annotated by the time it was "
                                                              "written"}]

    def test_unhealthy_ones_are_kept_past_the_cap(self):
        """With a cap of 2 and keep_unhealthy 1, the step keeps its sample plus one unhealthy
        trajectory, marked `unhealthy`."""
        with health_of(max_traces_per_step=2, keep_unhealthy=1, sample_seed=5) as got:
            for i in range(8):
                rollout(HEALTHY, index=i, reward=None if i == 6 else 1.0)
        trajs = got.trajectories
        unhealthy = [t for t in trajs if t.health]
        assert [t.sample_index for t in unhealthy] == [6] and "unhealthy" in unhealthy[0].kept
        assert sum("sampled" in t.kept for t in trajs) == 2
        assert len(trajs) == 2 + ("sampled" not in unhealthy[0].kept)

    def test_bad_setting_fails_at_configure(self):
        with pytest.raises(rtrace.ConfigError, match=r"RTRACE_HEALTH_CHECKS\): unknown check 'continuity'; "
                                                     r"accepted values: `all`, `none` or a comma list of"):
            rtrace.configure(exporter="none", health_checks="reward,continuity")


@pytest.mark.integration
def test_collector_rates_equal_one_process_rates(tmp_path):
    """Two worker processes stream a job with findings (a duplicate made by both workers
    included) to one collector: its health/<check>_rate per step equal those of the same job
    run in one process."""
    import multiprocessing as mp

    from tests import collector_workers as workers

    def rates(rows):
        return {(m.validate, m.step): {k: v for k, v in m.values.items() if "/health/" in k} for m in rows}

    one = MetricsSink()
    with rtrace.testing.capture(sinks=[one]):
        workers.health_job(0)
        workers.health_job(1)
    job = MetricsSink()
    c = rtrace.start_collector(exporter="jsonl", jsonl_path=str(tmp_path / "t.jsonl"), sinks=[job], settle_s=0.3)
    try:
        spawn = mp.get_context("spawn")
        procs = [spawn.Process(target=workers.health_worker, args=(c.env, w)) for w in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        assert c.flush(30)
    finally:
        c.stop()
    expected = rates(one.metrics)
    assert set(expected) == {(False, 0), (False, 1), (False, 2)}
    assert expected[(False, 1)]["rollout/health/coordinates_rate"] > 0  # the duplicate and its odd group
    assert all(v["rollout/health/token_continuity_rate"] > 0 for v in expected.values())
    assert rates(job.metrics) == expected


class TestRoundTwoFindings:
    """Findings added after the first audit: structured tool calls, reward kinds, a reward
    that came while the sample held the trajectory."""

    @staticmethod
    def _call_turn(ran_tool: bool, index: int):
        @rtrace.traced_generation
        def chat(prompt_ids):
            return {"response_ids": [4, 5], "finish_reason": "tool_calls", "content": "",
                    "tool_calls": [{"id": "c1", "type": "function",
                                    "function": {"name": "calculator", "arguments": "{\"expression\": \"2+2\"}"}}]}

        with rtrace.rollout_context(step=1, sample_index=index, rollout_n=0):
            chat([1, 2, 3])
            if ran_tool:
                calc("2+2")
            gen([1, 2, 3, 4, 5, 6], [8], "stop")
            rtrace.record_reward(1.0)

    def test_a_parsed_tool_call_that_no_tool_ran_is_flagged(self):
        """A generation returned an OpenAI-style tool call and the loop went on without running
        it: flagged; with the tool span between, nothing (and an empty content beside a tool
        call is no 'tokens decode to no text')."""
        with health_of() as got:
            self._call_turn(ran_tool=False, index=0)
            self._call_turn(ran_tool=True, index=1)
        f = findings(got.trajectories)
        assert f[(1, 0, 0)] == [("generation", "turn 1: the model called 1 tool(s) (calculator) but no tool ran")]
        assert f[(1, 1, 0)] == []

    def test_a_bool_reward_in_a_group_of_scores_is_flagged(self):
        """One rollout's reward is a bool where its group's are numbers: flagged; a group of
        bools only is not."""
        with health_of() as got:
            rollout(HEALTHY, index=0, n=0, reward=0.5, group_id="g")
            rollout(HEALTHY, index=0, n=1, reward=True, group_id="g")
            rollout(HEALTHY, index=1, n=0, reward=True, group_id="h")
            rollout(HEALTHY, index=1, n=1, reward=False, group_id="h")
        f = findings(got.trajectories)
        assert f[(1, 0, 1)] == [("reward", "reward True is a bool in group 'g', whose first reward was a number "
                                           "(a correctness flag mixed with scores?)")]
        assert f[(1, 0, 0)] == f[(1, 1, 0)] == f[(1, 1, 1)] == []

    def test_a_reward_annotated_while_the_sample_held_it_is_no_finding(self):
        """With tail keeping the step's trajectories are held until the step is done; a reward
        annotated meanwhile is on the trajectory, and 'no reward' is not among its findings."""
        import time

        with health_of(max_traces_per_step=1, keep_errors=1, sample_seed=1, export_interval_s=0.01) as got:
            rollout(HEALTHY, index=0, reward=None)
            time.sleep(0.3)  # the worker checked it ("no reward" then) and the sample holds it
            rtrace.annotate(step=1, sample_index=0, rollout_n=0, reward=0.25)
        (t,) = got.trajectories
        assert t.reward == 0.25
        assert [c for c, _ in findings([t])[(1, 0, 0)]] == []


class TestToolCallsMatched:
    """Audit round 3: tool results matched by the tool spans too, every parsed call without
    a run flagged (a loop that runs only the first of parallel calls)."""

    @staticmethod
    def _calls(*ids):
        return [{"id": cid, "type": "function", "function": {"name": name, "arguments": "{}"}} for cid, name in ids]

    def test_a_tool_message_without_tool_call_id_answers_its_call(self):
        """The conversation's tool messages omit tool_call_id (Qwen and Hermes templates allow
        it): the call is answered by position, or by the tool span that ran it (its
        gen_ai.tool.call.id) when the conversation has no tool message at all; a call that
        neither answers is still flagged."""
        calls = self._calls(("c1", "calculator"))

        @rtrace.traced_generation
        def chat(messages, reply):
            return {"response_ids": [4, 5], "finish_reason": "stop", "content": reply}

        @rtrace.traced_tool(tool_name="calculator")
        def calculator(tool_call_id, expression):
            return "4"

        user = {"role": "user", "content": "2+2?"}
        asked = {"role": "assistant", "content": "", "tool_calls": calls}
        with health_of() as got:
            for index, (tool_msgs, run) in enumerate([([{"role": "tool", "content": "4"}], True),  # by position
                                                      ([], True),                                   # by the span
                                                      ([], False)]):                                # unanswered
                with rtrace.rollout_context(step=1, sample_index=index, rollout_n=0):
                    if run:
                        calculator("c1", "2+2")
                    chat([user, asked, *tool_msgs], "4")
                    rtrace.record_reward(1.0)
        f = findings(got.trajectories)
        assert f[(1, 0, 0)] == f[(1, 1, 0)] == []
        assert f[(1, 2, 0)] == [("generation", "tool call c1 (calculator) has no tool result")]

    def test_a_dropped_parallel_call_is_flagged(self):
        """Two parallel calls, one run: flagged with the one not run, from the generation's own
        tool_calls and from a tool parser's output (veRL's extract_tool_calls returns
        [text, calls]); both run: nothing."""
        @rtrace.traced_generation
        def chat(prompt_ids, calls):
            out = {"response_ids": [4, 5], "finish_reason": "tool_calls", "content": ""}
            if calls:
                out["tool_calls"] = calls
            else:  # the calls are in the text, for the parser
                out["content"] = '<tool_call>{"name": "calculator"}</tool_call><tool_call>{"name": "search"}</tool_call>'
            return out

        @rtrace.traced(kind="chain", name="HermesToolParser.extract_tool_calls")
        def extract_tool_calls(responses_ids):
            return ["", [{"name": "calculator", "arguments": "{}"}, {"name": "search", "arguments": "{}"}]]

        @rtrace.traced_tool(tool_name="search")
        def search(tool_call_id, query):
            return "found"

        with health_of() as got:
            for index, (own, ran) in enumerate([(True, 1), (True, 2), (False, 1), (False, 2)]):
                with rtrace.rollout_context(step=1, sample_index=index, rollout_n=0):
                    chat([1, 2, 3], self._calls(("c1", "calculator"), ("c2", "search")) if own else None)
                    if not own:
                        extract_tool_calls([4, 5])
                    calc("2+2")
                    if ran == 2:
                        search("c2", "x")
                    gen([1, 2, 3, 4, 5, 6, 7], [8], "stop")
                    rtrace.record_reward(1.0)
        f = findings(got.trajectories)
        assert f[(1, 0, 0)] == [("generation", "turn 1: the model called 2 tools but 1 ran; not run: search (c2)")]
        assert f[(1, 2, 0)] == [("generation", "turn 1: the model called 2 tools but 1 ran; not run: search")]
        assert f[(1, 1, 0)] == f[(1, 3, 0)] == []
