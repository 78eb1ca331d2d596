"""Per-token values: the sampler's logprobs and the trainer's arrays on each generation's
tokens, the logprob_mismatch check, the bad inputs it must say, and what the trainer's
thread does (nothing but keep references)."""

from __future__ import annotations

import gc
import json
import math
import threading
import weakref

import pytest

import rtrace
import rtrace.testing
from rtrace.exporters.jsonl import read_jsonl
from tests.doubles import MetricsSink

np = pytest.importorskip("numpy")


@rtrace.traced_generation
def gen(prompt_ids, reply, logprobs=None):
    out = {"response_ids": list(reply), "finish_reason": "stop"}
    if logprobs is not None:
        out["logprobs"] = logprobs
    return out


@rtrace.traced_tool(tool_name="calculator")
def calc(expression):
    return "4"


# two turns: prompt [1, 2, 3]; reply [4, 5]; tool tokens [6, 7]; reply [8, 9, 10]
SAMPLER = [[-0.1, -0.2], [-0.3, -0.4, -0.5]]
RESPONSE = [-0.1, -0.2, 0.0, 0.0, -0.3, -0.4, -0.5]  # the trainer's row: tool tokens included
LOSS = [1, 1, 0, 0, 1, 1, 1]


def rollout(index, sampler=SAMPLER, step=1):
    with rtrace.rollout_context(step=step, sample_index=index, rollout_n=0):
        gen([1, 2, 3], [4, 5], sampler[0])
        calc("2+2")
        gen([1, 2, 3, 4, 5, 6, 7], [8, 9, 10], sampler[1])
        rtrace.record_reward(1.0)


def values_of(traj):
    return [g.token_values for g in traj.spans_of_kind("generation")]


class TestSampler:
    def test_a_generations_logprobs_are_its_per_token_logprob(self, tmp_path):
        """logprobs in a generation's output (a list, or OpenAI's content form) become its
        float32 `logprob` array, aligned with its response ids, out of its output; JSONL
        writes them as numbers of 6 significant digits."""
        @rtrace.traced_generation
        def openai_style(prompt_ids):
            return {"response_ids": [4, 5], "finish_reason": "stop",
                    "logprobs": {"content": [{"token": "a", "logprob": -0.123456789}, {"token": "b", "logprob": -2.0}]}}

        path = tmp_path / "t.jsonl"
        rtrace.configure(exporter="jsonl", jsonl_path=str(path))
        rollout(0)
        with rtrace.rollout_context(step=1, sample_index=1, rollout_n=0):
            openai_style([1, 2])
        assert rtrace.flush(30)
        lines = {json.loads(line)["sample_index"]: json.loads(line) for line in path.read_text().splitlines()}
        gens = [s for s in lines[0]["spans"] if s["kind"] == "generation"]
        assert [g["token_values"] for g in gens] == [{"logprob": [-0.1, -0.2]}, {"logprob": [-0.3, -0.4, -0.5]}]
        assert all("logprobs" not in (g["output"] or {}) for g in gens)
        (g,) = [s for s in lines[1]["spans"] if s["kind"] == "generation"]
        assert g["token_values"] == {"logprob": [-0.123457, -2.0]}
        back = read_jsonl(path)
        assert [v for t in back for v in values_of(t) if t.sample_index == 1] == [{"logprob": [-0.123457, -2.0]}]

    def test_logprobs_of_another_length_are_left_out_and_said(self):
        """A sampler's list of 3 logprobs for 2 response ids is not laid on the tokens: a
        token_arrays finding says so."""
        with rtrace.testing.capture() as got:
            rollout(0, sampler=[[-0.1, -0.2, -0.3], [-0.3, -0.4, -0.5]])
            (t,) = got.trajectories
        assert values_of(t)[0] is None
        assert {"check": "token_arrays", "detail": "turn 1: logprobs has 3 values for 2 response tokens: left out"} \
            in t.health


class TestTrainerArrays:
    @pytest.mark.parametrize("form", ["padded+mask", "padded+lengths", "ragged"])
    def test_rows_are_cut_into_the_generations(self, form):
        """A [B, T] column joins each trajectory's response (tool tokens included) and is cut
        into its generations: padded with token_mask or token_lengths, or ragged lists."""
        torch = pytest.importorskip("torch")
        rows = [[v + i for v in RESPONSE] for i in range(3)]
        with rtrace.testing.capture(await_annotations="advantage", annotation_timeout_s=30) as got:
            for i in range(3):
                rollout(i)
            kw = {}
            if form == "ragged":
                adv = rows
            else:
                adv = torch.tensor([r + [9.0, 9.0] for r in rows])
                if form == "padded+mask":
                    kw["token_mask"] = torch.tensor([[1] * 7 + [0, 0]] * 3)
                else:
                    kw["token_lengths"] = [7, 7, 7]
            assert rtrace.annotate_batch(step=1, sample_index=[2, 0, 1], rollout_n=[0, 0, 0],
                                         advantage=[adv[i] for i in (2, 0, 1)] if form == "ragged" else adv[[2, 0, 1]],
                                         **kw) == 3
            trajs = {t.sample_index: t for t in got.trajectories}
        for i, t in trajs.items():
            first, second = values_of(t)
            assert first["advantage"].tolist() == pytest.approx([v + i for v in RESPONSE[:2]])
            assert second["advantage"].tolist() == pytest.approx([v + i for v in RESPONSE[4:]])
            assert t.health == [] and "advantage" not in t.annotations

    def test_the_trainers_thread_keeps_references_only(self):
        """annotate_batch reads no per-token value on the caller's thread: the column is read
        on rtrace's worker thread, and let go once read (the trainer's tensor is not kept)."""
        torch = pytest.importorskip("torch")
        readers: list[str] = []

        class Watched(torch.Tensor):
            def numpy(self, *a, **k):
                readers.append(threading.current_thread().name)
                return super().numpy(*a, **k)

            def to(self, *a, **k):
                readers.append(threading.current_thread().name)
                return super().to(*a, **k)

        def annotate():
            column = torch.tensor([RESPONSE]).as_subclass(Watched)
            rtrace.annotate_batch(step=1, sample_index=[0], rollout_n=[0], old_logprob=column)
            return weakref.ref(column)

        with rtrace.testing.capture(await_annotations="old_logprob", annotation_timeout_s=30) as got:
            rollout(0)
            ref = annotate()
            assert readers == []
            (t,) = got.trajectories
        assert readers and set(readers) == {"rtrace-worker"}
        gc.collect()
        assert ref() is None

    def test_rows_of_sampled_out_trajectories_are_let_go(self):
        """Cap 1 with tail keeping: the other trajectories' arrays are dropped with them; the
        trainer's batch is not kept once every row was read."""
        with rtrace.testing.capture(max_traces_per_step=1, keep_errors=1, await_annotations="advantage",
                                    annotation_timeout_s=30) as got:
            for i in range(4):
                rollout(i)
            adv = np.array([RESPONSE] * 4, dtype=np.float32)
            ref = weakref.ref(adv)
            rtrace.annotate_batch(step=1, sample_index=[0, 1, 2, 3], rollout_n=[0] * 4, advantage=adv)
            del adv
            trajs = got.trajectories
        assert len(trajs) == 1 and values_of(trajs[0])[0]["advantage"].tolist() == pytest.approx(RESPONSE[:2])
        gc.collect()
        assert ref() is None

    @pytest.mark.parametrize("order", [("scalar", "row", "rollout"),   # both pending, merged there
                                       ("row", "rollout", "scalar"),   # the row on the trajectory, then the value
                                       ("scalar", "rollout", "row")])  # the value on it, then the row
    def test_a_value_and_a_row_of_one_name_are_both_kept(self, order):
        """annotate(advantage=0.4) and annotate_batch(advantage=[B, T]) for one trajectory, in
        any order (TRL's advantage: one per completion, and on each of its tokens): the
        number stays the trajectory's annotation, the row goes on its tokens."""
        steps = {"scalar": lambda: rtrace.annotate(step=1, sample_index=0, rollout_n=0, advantage=0.4),
                 "row": lambda: rtrace.annotate_batch(step=1, sample_index=[0], rollout_n=[0], advantage=[RESPONSE]),
                 "rollout": lambda: rollout(0)}
        with rtrace.testing.capture(await_annotations="advantage,done", annotation_timeout_s=30) as got:
            for name in order:
                steps[name]()
            rtrace.annotate(step=1, sample_index=0, rollout_n=0, done=1)  # it waits until then
            (t,) = got.trajectories
        assert t.annotations["advantage"] == 0.4
        first, second = values_of(t)
        assert first["advantage"].tolist() == pytest.approx(RESPONSE[:2])
        assert second["advantage"].tolist() == pytest.approx(RESPONSE[4:])
        assert t.health == [] and not any(k.startswith("\x00") for k in t.annotations)


class TestBadInput:
    def _one(self, **columns):
        with rtrace.testing.capture(await_annotations=",".join(c for c in columns if c.startswith("x")) or
                                    "old_logprob", annotation_timeout_s=30) as got:
            rollout(0)
            rtrace.annotate_batch(step=1, sample_index=[0], rollout_n=[0], **columns)
            (t,) = got.trajectories
        return t

    def test_a_row_of_another_length_is_not_laid_on(self):
        t = self._one(old_logprob=[RESPONSE + [0.0]])
        assert all(v is None or "old_logprob" not in v for v in values_of(t))
        assert {"check": "token_arrays", "detail": "old_logprob has 8 values for a response of 7 tokens: not "
                                                   "attached"} in t.health

    def test_values_that_are_not_finite_are_said(self):
        row = list(RESPONSE)
        row[1] = math.nan
        t = self._one(old_logprob=[row])
        assert {"check": "token_arrays", "detail": "old_logprob: 1 of 7 values are NaN or infinite"} in t.health

    def test_a_mask_that_selects_nothing_is_counted(self):
        """A loss mask of zeros (a trainer's overlong filtering, masked truncated completions)
        measures nothing: counted, no finding, no mismatch values."""
        with rtrace.testing.capture(await_annotations="old_logprob", annotation_timeout_s=30) as got:
            rollout(0)
            rtrace.annotate_batch(step=1, sample_index=[0], rollout_n=[0], old_logprob=[RESPONSE],
                                  loss_mask=[[0] * 7])
            (t,) = got.trajectories
            stats = got.stats()
        assert t.health == [] and "logprob_mismatch_k3" not in t.annotations
        assert stats["logprob_mismatch_mask_empty"] == 1

    def test_a_column_of_another_batch_size_raises(self):
        with rtrace.testing.capture():
            with pytest.raises(ValueError, match="old_logprob has 2 rows; sample_index has 1"):
                rtrace.annotate_batch(step=1, sample_index=[0], rollout_n=[0], old_logprob=[RESPONSE, RESPONSE])


class TestMismatch:
    def test_equal_logprobs_no_finding_and_a_perturbation_found_at_its_token(self):
        """The trainer's logprobs equal the sampler's: k1 = k3 = 0, no finding. One token
        changed by -2.6 (turn 2, token 1, id 9): found there, with k3 and the share off."""
        with rtrace.testing.capture(await_annotations="old_logprob", annotation_timeout_s=30) as got:
            rollout(0)
            rollout(1)
            bad = list(RESPONSE)
            bad[5] = -3.0
            rtrace.annotate_batch(step=1, sample_index=[0, 1], rollout_n=[0, 0], old_logprob=[RESPONSE, bad],
                                  loss_mask=[LOSS, LOSS])
            trajs = {t.sample_index: t for t in got.trajectories}
        same, off = trajs[0], trajs[1]
        assert same.health == [] and same.annotations["logprob_mismatch_k3"] == 0.0
        assert same.annotations["logprob_mismatch_frac"] == 0.0
        ((check, detail),) = [(f["check"], f["detail"]) for f in off.health]
        assert check == "logprob_mismatch"
        assert detail.startswith("20.0% of 5 tokens outside [1/1.05, 1.05] (max 0.05), k3 0.335")
        assert detail.endswith("worst: turn 2, token 1 (id 9): sampler logprob -0.4, trainer -3 (|Δ| 2.6)")
        d = 2.6
        assert off.annotations["logprob_mismatch_k3"] == pytest.approx((math.exp(-d) - 1 + d) / 5, rel=1e-5)
        assert off.annotations["logprob_mismatch_k1"] == pytest.approx(d / 5, rel=1e-5)
        assert off.annotations["logprob_mismatch_max"] == pytest.approx(d, rel=1e-5)

    def test_the_loss_mask_decides_which_tokens_count(self):
        """A mismatch on a token the loss mask leaves out does not count."""
        with rtrace.testing.capture(await_annotations="old_logprob", annotation_timeout_s=30) as got:
            rollout(0)
            bad = list(RESPONSE)
            bad[5] = -3.0
            rtrace.annotate_batch(step=1, sample_index=[0], rollout_n=[0], old_logprob=[bad],
                                  loss_mask=[[1, 1, 0, 0, 1, 0, 1]])
            (t,) = got.trajectories
        assert t.health == [] and t.annotations["logprob_mismatch_max"] == 0.0

    def test_a_non_finite_logprob_on_a_trained_token_is_the_worst_mismatch(self):
        """The trainer's logprob is NaN (inf) on a trained token, equal elsewhere: the mismatch is not
        a mean over the other tokens (before: k1 = k3 = max = 0, no finding). Its values are
        missing, the trajectory fails the check (health/logprob_mismatch_rate counts it, the
        step's mean leaves it out) and the finding says how many tokens were not finite. A NaN on
        a token the loss mask leaves out changes nothing."""
        metrics_sink = MetricsSink()
        nan, inf, untrained = list(RESPONSE), list(RESPONSE), list(RESPONSE)
        nan[5] = math.nan
        inf[0], inf[4] = -math.inf, math.nan
        untrained[2] = math.nan  # a tool token: loss mask 0
        off = list(RESPONSE)
        off[5] = -3.0
        with rtrace.testing.capture(await_annotations="old_logprob", annotation_timeout_s=30, health_checks="all",
                                    sinks=[metrics_sink]) as got:
            for i in range(5):
                rollout(i)
            rtrace.annotate_batch(step=1, sample_index=list(range(5)), rollout_n=[0] * 5,
                                  old_logprob=[RESPONSE, nan, inf, untrained, off], loss_mask=[LOSS] * 5)
            trajs = {t.sample_index: t for t in got.trajectories}
            stats = got.stats()
        findings = {i: [f for f in t.health if f["check"] == "logprob_mismatch"] for i, t in trajs.items()}
        assert findings[1] == [{"check": "logprob_mismatch", "detail": (
            "1 of 5 trained tokens have a logprob that is not finite (trainer 1, sampler 0): the mismatch is not "
            "measured (k1, k3, max and share left out); first: turn 2, token 1 (id 9): sampler logprob -0.4, "
            "trainer nan")}]
        assert findings[2][0]["detail"].startswith("2 of 5 trained tokens have a logprob that is not finite "
                                                   "(trainer 2, sampler 0)")
        assert findings[2][0]["detail"].endswith("first: turn 1, token 0 (id 4): sampler logprob -0.1, trainer -inf")
        for i in (1, 2):
            assert not [k for k in trajs[i].annotations if k.startswith("logprob_mismatch")]
        assert findings[0] == findings[3] == [] and trajs[3].annotations["logprob_mismatch_max"] == 0.0
        assert stats["logprob_mismatch_nonfinite"] == 2
        (m,) = metrics_sink.metrics
        assert m.values["rollout/health/logprob_mismatch_rate"] == pytest.approx(3 / 5)  # 1, 2 and the -3.0 one
        # the step's mean is over the three measured rollouts (0, 3, 4): rollout 4's k3 / 3
        assert m.values["rollout/logprob_mismatch_k3_mean"] == pytest.approx(
            trajs[4].annotations["logprob_mismatch_k3"] / 3, rel=1e-6)

    def test_keep_mismatch_keeps_the_worst_past_the_cap_and_step_metrics(self):
        """Cap 2, keep_mismatch 2: the sample and the two worst by k3 among the others;
        the step metrics have the mismatch's mean, p90 and max."""
        metrics_sink = MetricsSink()
        with rtrace.testing.capture(max_traces_per_step=2, keep_mismatch=2, sample_seed=3,
                                    await_annotations="old_logprob", annotation_timeout_s=30,
                                    sinks=[metrics_sink]) as got:
            rows = []
            for i in range(10):
                rollout(i)
                row = list(RESPONSE)
                row[5] = -0.4 - 0.1 * i  # rollout i is off by 0.1 * i at one token
                rows.append(row)
            rtrace.annotate_batch(step=1, sample_index=list(range(10)), rollout_n=[0] * 10, old_logprob=rows)
            trajs = got.trajectories
        tail = sorted(t.sample_index for t in trajs if t.kept == ["mismatch"])
        sampled = [t.sample_index for t in trajs if "sampled" in t.kept]
        assert len(sampled) == 2 and tail == sorted([i for i in range(9, -1, -1) if i not in sampled][:2])
        (m,) = metrics_sink.metrics
        assert {"rollout/logprob_mismatch_k3_mean", "rollout/logprob_mismatch_k3_p90",
                "rollout/logprob_mismatch_k3_max"} <= set(m.values)


class TestLateRows:
    """The trainer's rows after their trajectory was written: the check measured nothing. That is
    said once per run and counted, never silent (before: only annotations_late showed it)."""

    def _said(self, caplog):
        return [r.getMessage() for r in caplog.records if "old_logprob rows" in r.getMessage()]

    def test_rows_after_the_trajectories_are_said_once_and_counted(self, caplog):
        """RTRACE_AWAIT_ANNOTATIONS=none: every late row is a check that measured nothing."""
        with caplog.at_level("WARNING", logger="rtrace"), rtrace.testing.capture(await_annotations="none") as got:
            rtrace.annotate_batch(step=1, sample_index=[0], rollout_n=[0], old_logprob=[RESPONSE])
            rollout(0)  # its row came first: measured
            for i in (1, 2):
                rollout(i)
                assert rtrace.flush(10)
                rtrace.annotate_batch(step=1, sample_index=[i], rollout_n=[0], old_logprob=[RESPONSE])
            assert rtrace.flush(10)
            trajs = {t.sample_index: t for t in got.trajectories}
            stats = got.stats()
        assert trajs[0].annotations["logprob_mismatch_k3"] == 0.0
        assert all("logprob_mismatch_k3" not in trajs[i].annotations for i in (1, 2))
        assert stats["logprob_mismatch_unchecked"] == 2 and stats["annotations_late"] == 2
        (said,) = self._said(caplog)
        assert "the logprob_mismatch check does not measure those trajectories" in said
        assert "RTRACE_AWAIT_ANNOTATIONS=old_logprob" in said

    def test_by_default_the_first_late_row_makes_later_trajectories_wait(self, caplog):
        """RTRACE_AWAIT_ANNOTATIONS unset: once a row comes after its trajectory was written, later
        training trajectories wait for theirs (said once, counted), so the check measures them."""
        with caplog.at_level("WARNING", logger="rtrace"), rtrace.testing.capture(annotation_timeout_s=30) as got:
            rollout(1)
            assert rtrace.flush(10)
            rtrace.annotate_batch(step=1, sample_index=[1], rollout_n=[0], old_logprob=[RESPONSE])  # late
            assert rtrace.flush(10)
            rollout(2)  # waits for its row now
            rtrace.annotate_batch(step=1, sample_index=[2], rollout_n=[0], old_logprob=[RESPONSE])
            assert rtrace.flush(10)
            trajs = {t.sample_index: t for t in got.trajectories}
            stats = got.stats()
        assert "logprob_mismatch_k3" not in trajs[1].annotations
        assert trajs[2].annotations["logprob_mismatch_k3"] == 0.0
        assert stats["logprob_mismatch_unchecked"] == 1 and stats["logprob_mismatch_await_learned"] == 1
        assert "trajectories_missing_annotations" not in stats
        said = [r.getMessage() for r in caplog.records if "from now on training trajectories wait" in r.getMessage()]
        assert len(said) == 1

    def test_rows_after_the_wait_say_the_timeout(self, caplog):
        with caplog.at_level("WARNING", logger="rtrace"), rtrace.testing.capture(
                await_annotations="old_logprob", annotation_timeout_s=0) as got:
            rollout(0)
            assert rtrace.flush(10)
            rtrace.annotate_batch(step=1, sample_index=[0], rollout_n=[0], old_logprob=[RESPONSE])
            assert rtrace.flush(10)
            stats = got.stats()
        assert stats["logprob_mismatch_unchecked"] == 1
        (said,) = self._said(caplog)
        assert "they came after 0 s of waiting (raise RTRACE_ANNOTATION_TIMEOUT_S)" in said

    def test_an_adapter_that_sends_its_rows_first_needs_no_wait(self, caplog):
        """The TRL callback's order (rtrace/compat/trl.py): the batch's rows, then its completions,
        from one call. The rows are waiting when the trajectories arrive: measured with no
        RTRACE_AWAIT_ANNOTATIONS (which would hold every completion for the timeout when TRL
        keeps no old_per_token_logps, its default)."""
        from rtrace.compat import token_rows
        from rtrace.instrumentation.turns import Turn, sample_state, submit

        coords = [{"step": 1, "sample_index": i, "rollout_n": 0, "validate": False} for i in range(2)]
        with caplog.at_level("WARNING", logger="rtrace"), rtrace.testing.capture() as got:
            token_rows.send(list(enumerate(coords)), {"logprob": [[-0.1, -0.2, -0.3]] * 2,
                                                      "old_logprob": [[-0.1, -0.2, -0.3], [-0.1, -3.0, -0.3]]},
                            token_lengths=[3, 3])
            submit([sample_state(c, [1, 2], [Turn("assistant", [5, 6, 7], finish_reason="stop")]) for c in coords])
            assert rtrace.flush(10)
            trajs = {t.sample_index: t for t in got.trajectories}
            stats = got.stats()
        assert trajs[0].annotations["logprob_mismatch_k3"] == 0.0
        assert trajs[1].annotations["logprob_mismatch_max"] == pytest.approx(2.8, rel=1e-6)
        assert "logprob_mismatch_unchecked" not in stats and self._said(caplog) == []

    def test_other_late_values_are_not_about_the_check(self, caplog):
        with caplog.at_level("WARNING", logger="rtrace"), rtrace.testing.capture() as got:
            rollout(0)
            assert rtrace.flush(10)
            rtrace.annotate_batch(step=1, sample_index=[0], rollout_n=[0], advantage=[RESPONSE])
            assert rtrace.flush(10)
            stats = got.stats()
        assert stats["annotations_late"] == 1 and "logprob_mismatch_unchecked" not in stats
        assert self._said(caplog) == []


class TestEveryMode:
    def test_through_a_collector_both_ways(self, tmp_path, monkeypatch):
        """Through a collector: a worker's sampler logprobs travel with its spans, and the
        trainer's rows from a process without the collector travel as annotation spans:
        the written trajectories equal one process's."""
        pytest.importorskip("grpc")
        from rtrace.pipeline import annotations
        from tests.test_fidelity import _both_ways

        def produce():
            rollout(0)
            bad = list(RESPONSE)
            bad[5] = -3.0
            monkeypatch.setattr(annotations, "local_target", None)  # as from another process: over OTLP
            rtrace.annotate_batch(step=1, sample_index=[0], rollout_n=[0], old_logprob=[bad])
            monkeypatch.undo()

        one, through = _both_ways(produce, tmp_path, await_annotations="old_logprob", annotation_timeout_s=30)
        assert [f["check"] for f in one[0]["health"]] == ["logprob_mismatch"]
        assert through == one


def test_trackio_keeps_them_compact_with_the_summary_in_the_header(trackio_mod):
    """trackio: each generation's values as one base64 float32 field of its metadata (read
    back exactly as float32), the mismatch values in the trace header."""
    import uuid

    from trackio.sqlite_storage import SQLiteStorage

    from rtrace.trajectory import TOKEN_ENCODING, read_token_field

    project = f"tv-{uuid.uuid4().hex[:8]}"
    rtrace.configure(exporter="trackio", project=project, experiment="tv", await_annotations="old_logprob",
                     annotation_timeout_s=30)
    rollout(0)
    rtrace.annotate_batch(step=1, sample_index=[0], rollout_n=[0], old_logprob=[RESPONSE])
    assert rtrace.flush(60)
    (trace,) = SQLiteStorage.get_traces(project, run="tv")
    assert trace["metadata"]["logprob_mismatch_k3"] == 0.0
    gens = [s for s in trace["spans"] if s["kind"] == "generation"]
    fields = [g["metadata"]["rtrace.token_values"] for g in gens]
    assert [f["encoding"] for f in fields] == [TOKEN_ENCODING] * 2
    assert read_token_field(fields[1]) == {
        "logprob": np.float32(SAMPLER[1]).tolist(), "old_logprob": np.float32(RESPONSE[4:]).tolist()}


def test_the_dataset_keeps_them_as_float32_lists(tmp_path):
    """The Parquet dataset: a generation's per-token values in spans.token_values (FLOAT[] per
    name), queryable in SQL and read back onto the spans; health_checks on the trajectory."""
    pytest.importorskip("duckdb")
    rtrace.configure(exporter="parquet", parquet_path=str(tmp_path), experiment="tv",
                     await_annotations="old_logprob", annotation_timeout_s=30)
    rollout(0)
    rtrace.annotate_batch(step=1, sample_index=[0], rollout_n=[0], old_logprob=[RESPONSE])
    assert rtrace.flush(60)
    rtrace.shutdown()
    run = rtrace.open_run(tmp_path / "tv")
    rows = run.sql("SELECT t.name, t.values FROM spans, unnest(token_values) AS u(t) WHERE kind = 'generation' "
                   "ORDER BY start_time, t.name").fetchall()
    assert rows == [("logprob", pytest.approx(SAMPLER[0])), ("old_logprob", pytest.approx(RESPONSE[:2])),
                    ("logprob", pytest.approx(SAMPLER[1])), ("old_logprob", pytest.approx(RESPONSE[4:]))]
    (t,) = run.load()
    assert "logprob_mismatch" in t.health_checks
    second = t.spans_of_kind("generation")[1]
    assert second.token_values["old_logprob"] == pytest.approx(RESPONSE[4:])


def test_otlp_and_mlflow_get_the_compact_field():
    """The one OTel conversion (OTLP, the collector's output, MLflow) writes a generation's
    values as rtrace.token_values (base64 float32, read back exactly), never one attribute per
    token; arrays past the bound are named in rtrace.token_values.left_out."""
    from rtrace.exporters.otel import span_attributes
    from rtrace.trajectory import read_token_field

    with rtrace.testing.capture(await_annotations="old_logprob", annotation_timeout_s=30) as got:
        rollout(0)
        rtrace.annotate_batch(step=1, sample_index=[0], rollout_n=[0], old_logprob=[RESPONSE])
        (t,) = got.trajectories
    second = t.spans_of_kind("generation")[1]
    attrs = span_attributes(t, second, False)
    assert read_token_field(json.loads(attrs["rtrace.token_values"])) == {
        "logprob": np.float32(SAMPLER[1]).tolist(), "old_logprob": np.float32(RESPONSE[4:]).tolist()}
    assert not any(k.startswith("rtrace.token_values.") for k in attrs)
    small = span_attributes(t, second, False, max_value_chars=8)  # room for one array: 128 characters
    assert set(read_token_field(json.loads(small["rtrace.token_values"]))) | set(
        small["rtrace.token_values.left_out"]) == {"logprob", "old_logprob"}
    assert len(small["rtrace.token_values.left_out"]) == 1


def test_token_texts_for_the_views(tok):
    """With token2text, a generation with per-token values gets each response token's own
    text (rtrace.response_tokens), one per id, for views that colour tokens."""
    ids = tok.encode("The answer is 4.", add_special_tokens=False)
    with rtrace.testing.capture(token2text=True, tokenizer=tok) as got:
        with rtrace.rollout_context(step=1, sample_index=0, rollout_n=0):
            gen([1, 2], ids, [-0.5] * len(ids))
            gen([1, 2, 3], [7])
        (t,) = got.trajectories
    first, second = t.spans_of_kind("generation")
    pieces = first.attributes["rtrace.response_tokens"]
    assert len(pieces) == len(ids) and "".join(pieces) == "The answer is 4."
    assert "rtrace.response_tokens" not in second.attributes


def test_the_static_report_colours_the_worst_rollouts_tokens(tmp_path, tok):
    """rtrace report --html: the rollouts with the largest mismatch, each generation's tokens
    coloured by it (trainer - sampler) with a legend and the values in each token's tooltip,
    the worst first; their text escaped (an answer's markup stays text)."""
    import re

    from rtrace.report import run

    path = tmp_path / "t.jsonl"
    rtrace.configure(exporter="jsonl", jsonl_path=str(path), token2text=True, tokenizer=tok,
                     await_annotations="old_logprob", annotation_timeout_s=30)
    ids = tok.encode("<b>The answer is 4.</b>", add_special_tokens=False)
    rows = []
    for i in range(3):
        with rtrace.rollout_context(step=1, sample_index=i, rollout_n=0):
            gen([1, 2, 3], ids, [-0.5] * len(ids))
            rtrace.record_reward(1.0)
        row = [-0.5] * len(ids)
        row[2] = -0.5 - i  # rollout i is off by i at its third token
        rows.append(row)
    rtrace.annotate_batch(step=1, sample_index=[0, 1, 2], rollout_n=[0, 0, 0], old_logprob=rows)
    assert rtrace.flush(30)
    page = tmp_path / "r.html"
    import io
    assert run([str(path)], io.StringIO(), str(page)) == 0
    text = page.read_text()
    section = text[text.index('<section id="tokens">'):]
    order = re.findall(r'class="token-rollout" data-trace="([0-9a-f]{32})"', section)
    k3 = {t.trace_id: t.annotations["logprob_mismatch_k3"] for t in read_jsonl(path)}
    assert order == sorted(k3, key=k3.get, reverse=True)  # the worst first
    assert "tlegend" in section and 'data-color="mismatch"' in section
    assert "mismatch -2" in section  # the worst token's value in its tooltip
    assert ">&lt;</span>" in section and "<b>The" not in section  # each token's text escaped
