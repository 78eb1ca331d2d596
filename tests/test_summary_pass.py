"""A collector-mode worker's summary of a tallied rollout, made in one pass over its marks
(``summaries.summary_of_tally``), says what the same rollout recorded in full says.

The pass reads a prompt grown in place from turn to turn (veRL's ``prompt_ids += ...``) once:
each turn checks only the ids that are new, and the continuity check compares only what follows
the previous prompt. These tests run agents whose prompts grow in place, are cut, gain a value
that is no token id, or change list, through the real decorators: once recorded in full (no
cap) and once tallied (cap 0, the tallies taken from the pipeline before its worker reads
them), and compare each rollout's summary field by field, health findings included.
"""

from __future__ import annotations

import numpy as np
import pytest

import rtrace
import rtrace.testing
from rtrace import _setup
from rtrace._serialize import ListSnapshot
from rtrace.pipeline.builder import SpanConverter, call_input, call_inputs
from rtrace.pipeline.records import CallRecord, CallSpec
from rtrace.pipeline.summaries import state_of_tally, summary_of_state, summary_of_tally
from rtrace.summary import summarize
from tests.test_summaries import Probe, fields

#: the checks a worker runs on a tallied rollout's calls (the others run in the collector)
CALL_CHECKS = "token_continuity,generation,token_arrays"


def build(rtrace):
    """``loop(kind)``: the body of one rollout, its prompt grown as ``kind`` says."""

    @rtrace.traced_generation
    def gen(prompt_ids, n=3, reason="stop", first=100):
        return {"response_ids": list(range(first, first + n)), "finish_reason": reason}

    @rtrace.traced_generation
    def gen_kw(*, prompt_ids):
        return [7, 8, 9]

    @rtrace.traced_generation
    def gen_logprobs(prompt_ids):
        return {"response_ids": [5, 6, 7], "logprobs": [-0.1, -0.2], "finish_reason": "stop"}

    @rtrace.traced_tool(tool_name="search")
    def search(query):
        return "" if query == "empty" else "found " + query

    def loop(kind: str) -> None:
        prompt = [1, 2, 3, 4, 5]
        if kind == "in_place":  # continues: no finding
            for turn in range(4):
                out = gen(prompt, first=100 + 10 * turn)
                search(f"q{turn}")
                prompt += out["response_ids"]
                prompt += [50, 51]
        elif kind == "broken_response":  # the second turn's prompt replaces a response token
            out = gen(prompt, n=5)
            prompt += out["response_ids"][:3] + [999] + out["response_ids"][4:]
            gen(prompt)
            prompt += [60]
            gen(prompt, reason="length")
        elif kind == "dropped_last":  # the reply's last token left out (no tokenizer: a break)
            out = gen(prompt, n=4)
            prompt += out["response_ids"][:-1]
            gen(prompt)
        elif kind == "short_prompt":  # a prompt shorter than the one before + its response
            out = gen(prompt)
            prompt += out["response_ids"][:1]
            gen(prompt)
        elif kind == "not_ids":  # a value that is no token id enters the list: no prompt ids from then on
            out = gen(prompt)
            prompt += out["response_ids"]
            gen(prompt)
            prompt += [np.int64(7)]
            gen(prompt)
            prompt += [8]
            gen(prompt)
        elif kind == "bool":
            prompt += [True]
            gen(prompt)
            gen(prompt)
        elif kind == "cut_in_place":  # the list cut and grown again after a turn
            out = gen(prompt, n=4)
            prompt += out["response_ids"]
            gen(prompt)
            del prompt[-6:]
            prompt += [70, 71]
            gen(prompt)
        elif kind == "new_lists":  # in place, then a new list, then in place again
            out = gen(prompt)
            prompt += out["response_ids"]
            out = gen(prompt)
            prompt = prompt + out["response_ids"]
            out = gen(prompt)
            prompt += out["response_ids"][:1] + [998]
            gen(prompt)
        elif kind == "two_lists":  # two conversations in one rollout, turn by turn
            other = [9, 9, 9]
            for turn in range(3):
                out = gen(prompt, first=200 + turn)
                prompt += out["response_ids"]
                out = gen(other, first=300 + turn)
                other += out["response_ids"]
        elif kind == "keyword":
            gen_kw(prompt_ids=prompt)
            prompt += [7, 8, 9]
            gen_kw(prompt_ids=prompt)
            prompt += [1]
            gen_kw(prompt_ids=prompt)
        elif kind == "tuple_and_empty":
            gen(tuple(prompt), n=0)
            search("empty")
            gen(tuple(prompt))
        elif kind == "logprobs":  # 2 logprobs for 3 tokens: a token_arrays finding
            gen_logprobs(prompt)
            prompt += [5, 6, 7]
            gen_logprobs(prompt)
        else:
            raise AssertionError(kind)

    return loop


KINDS = ("in_place", "broken_response", "dropped_last", "short_prompt", "not_ids", "bool", "cut_in_place",
         "new_lists", "two_lists", "keyword", "tuple_and_empty", "logprobs")


def run(cap: int | None) -> tuple[Probe, list]:
    """Each kind once, recorded in full (cap None) or tallied (cap 0: the tallies, taken before
    the worker reads them); (the probe, the tallies)."""
    probe = Probe()
    rtrace.testing.reset()
    rtrace.configure(sinks=[probe], export_interval_s=3600, max_traces_per_step=cap, health_checks=CALL_CHECKS)
    loop = build(rtrace)
    try:
        for i, kind in enumerate(KINDS):
            with rtrace.rollout_context(step=0, sample_index=i, rollout_n=0):
                loop(kind)
                rtrace.record_reward(1.0)
        pipeline = _setup._pipeline
        tallies = [pipeline._tallies.popleft() for _ in range(len(pipeline._tallies))]
        settings, health = pipeline.settings, pipeline.health
        summaries = [summary_of_tally(t, settings, SpanConverter(settings), health) for t in tallies]
        # the one-process path over the same tallies: its light state, checked, then summarized
        light = []
        for t in tallies:
            state = state_of_tally(t, settings, SpanConverter(settings))
            health.check_state(state, rollout=False)
            light.append(summary_of_state(state, settings, SpanConverter(settings).conv))
        assert rtrace.flush(30)
    finally:
        rtrace.shutdown()
    return probe, [summaries, light]


def test_a_summary_made_in_one_pass_says_what_the_recorded_rollout_says():
    """Field by field (tokens in and out, finish reasons, turns, tool calls, health findings
    with their positions), for every kind of prompt growth, and the same as the one-process
    path's summary of the same tally."""
    recorded, _ = run(None)
    _, (one_pass, light) = run(0)
    expected = {t.sample_index: fields(summarize(t)) for t in recorded.trajectories}
    assert len(expected) == len(one_pass) == len(KINDS)
    for summary, other in zip(one_pass, light):
        kind = KINDS[summary.sample_index]
        assert fields(summary) == expected[summary.sample_index], kind
        assert fields(other) == fields(summary), kind
    by_kind = {KINDS[s.sample_index]: s for s in one_pass}
    # what the kinds are: each finding (or none) is one the comparison covers
    checks = {kind: [f["check"] for f in s.health] for kind, s in by_kind.items()}
    assert checks["in_place"] == [] and by_kind["in_place"].tokens_in == 5 + 10 + 15 + 20
    assert checks["broken_response"] == ["token_continuity", "token_continuity", "generation"]
    assert "at token 8 of 10 (expected id 103, got 999)" in by_kind["broken_response"].health[0]["detail"]
    assert checks["dropped_last"] == checks["short_prompt"] == ["token_continuity"]
    assert by_kind["not_ids"].tokens_in == 5 + 8  # the prompts after the np.int64 have no ids
    assert by_kind["bool"].tokens_in == 0
    # read at export as a recorded call's prompt is: the list as cut, up to each call's length
    assert checks["cut_in_place"] == ["token_continuity"] * 2 and by_kind["cut_in_place"].tokens_in == 5 + 5 + 5
    assert checks["new_lists"] == ["token_continuity"]
    assert checks["two_lists"] == ["token_continuity"] * 5  # each turn follows the other list's
    assert by_kind["keyword"].tokens_in == 5 + 8 + 9 and checks["keyword"] == ["token_continuity"]
    assert by_kind["tuple_and_empty"].tokens_in == 10
    assert sorted(f["detail"] for f in by_kind["tuple_and_empty"].health) == [
        "tool search: empty result", "turn 1: empty response (0 tokens)"]
    assert checks["logprobs"] == ["token_arrays", "token_arrays"]


def _spec(names: tuple[str, ...], skip_first: bool = False) -> CallSpec:
    return CallSpec(kind="generation", name="g", capture=True, param_names=names, skip_first=skip_first,
                    options={}, default_name=True, function="g")


@pytest.mark.parametrize("names, skip_first, args, kwargs", [
    (("prompt_ids", "n"), False, ([1, 2], 3), {}),  # positional, a list
    (("prompt_ids", "n"), False, ([1, 2],), {"n": 4}),  # fewer arguments than names
    (("n",), False, (3,), {"prompt_ids": [5]}),  # by keyword
    (("self", "prompt_ids"), True, ("obj", [1]), {}),  # a method: self left out
    (("self", "prompt_ids"), True, (), {}),  # nothing given
    (("a",), False, (1, [2], 3), {}),  # *args: arg1, arg2
    (("arg2",), False, (1, 2, [3]), {}),  # a parameter named like a position, and the position
], ids=["positional", "short", "keyword", "method", "none", "varargs", "clash"])
def test_one_argument_is_read_as_the_call_s_inputs_read_it(names, skip_first, args, kwargs):
    """call_input(rec, name) is call_inputs(rec).get(name), for every name and arg<i>."""
    rec = CallRecord(_spec(names, skip_first), tuple(args), dict(kwargs))
    rec.arg_lens = tuple(len(a) if type(a) is list else -1 for a in args)
    inputs = call_inputs(rec)
    for name in {*names, *inputs, "arg0", "arg1", "arg2", "arg3", "prompt_ids", "missing"}:
        got, want = call_input(rec, name), inputs.get(name)
        assert type(got) is type(want), name
        if type(want) is ListSnapshot:  # a list argument: the list and its length at the call
            assert (got.ref, got.length) == (want.ref, want.length), name
        else:
            assert got == want, name
