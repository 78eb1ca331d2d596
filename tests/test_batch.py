"""rtrace.log_rollout_batch: padded tensor batches become one trajectory per sample."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="log_rollout_batch's tests build torch tensors (no CPU torch "
                                           "wheel for this Python here: make test-py)")

import rtrace
from rtrace.exporters.jsonl import read_jsonl

PAD = 3  # <|pad|>
N = 3  # samples per prompt


def _sample_turns(a: int, b: int, r: int) -> list[tuple[bool, str]]:
    """Rollout r of "a + b": r tool calls, then the answer. (is_assistant, text) per turn."""
    turns: list[tuple[bool, str]] = []
    for k in range(r):
        turns.append((True, f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{a} + {b}"}}}}'
                            f"</tool_call><|im_end|>"))
        turns.append((False, f"\n<|im_start|>user\n<tool_response>{a + b + k}</tool_response><|im_end|>\n"
                             "<|im_start|>assistant\n"))
    turns.append((True, f"The answer is {a + b}.<|im_end|>"))
    return turns


def _verl_batch(tok, problems=((12, 30), (7, 5))):
    """veRL layout: prompts left-padded to Pw, responses right-padded to Rw, loss_mask and
    per-token versions over the response part only. Returns the tensors and the expected
    (prompt ids, turns as (is_assistant, ids)) per sample."""
    samples = []
    for a, b in problems:
        prompt = tok(f"<|im_start|>user\nWhat is {a} + {b}?<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
        for r in range(N):
            turns = [(asst, tok(text)["input_ids"]) for asst, text in _sample_turns(a, b, r)]
            samples.append((prompt, turns))
    pw = max(len(p) for p, _ in samples)
    rw = max(sum(len(ids) for _, ids in turns) for _, turns in samples) + 2
    input_ids, attn, loss, versions = [], [], [], []
    for prompt, turns in samples:
        resp = [t for _, ids in turns for t in ids]
        rmask = [int(asst) for asst, ids in turns for _ in ids]
        rvers = [7 + k // 2 if asst else -1 for k, (asst, ids) in enumerate(turns) for _ in ids]
        lpad, rpad = pw - len(prompt), rw - len(resp)
        input_ids.append([PAD] * lpad + prompt + resp + [PAD] * rpad)
        attn.append([0] * lpad + [1] * (len(prompt) + len(resp)) + [0] * rpad)
        loss.append(rmask + [0] * rpad)
        versions.append(rvers + [-1] * rpad)
    tensors = {"input_ids": torch.tensor(input_ids), "attention_mask": torch.tensor(attn),
               "loss_mask": torch.tensor(loss), "versions": torch.tensor(versions)}
    return tensors, samples


def _configure(path, **kw):
    kw.setdefault("export_interval_s", 60)
    rtrace.configure(exporter="jsonl", jsonl_path=str(path), **kw)


def _read(path):
    assert rtrace.flush(10)
    return sorted(read_jsonl(path), key=lambda t: (t.sample_index, t.rollout_n))


def test_two_prompts_three_samples_become_six_trajectories(tmp_path, tok):
    """A padded 2x3 veRL-style batch gives 6 trajectories: conversations, prompt mapping, rewards and versions."""
    path = tmp_path / "t.jsonl"
    _configure(path, token2text=True, tokenizer=tok, experiment="run-1")
    tensors, samples = _verl_batch(tok)
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.5, 1.0], dtype=torch.bfloat16)
    queued = rtrace.log_rollout_batch(**tensors, rewards=rewards, n_samples_per_prompt=N, step=4,
                                      prompt_uids=["uid-a", "uid-b"], sample_ids=[f"s{i}" for i in range(6)])
    assert queued == 6
    trajs = _read(path)
    assert [(t.sample_index, t.rollout_n, t.group_id) for t in trajs] == [
        (p, r, uid) for p, uid in enumerate(["uid-a", "uid-b"]) for r in range(N)]
    assert [t.reward for t in trajs] == [1.0, 0.0, 1.0, 0.0, 0.5, 1.0]
    assert [t.extra["sample_id"] for t in trajs] == [f"s{i}" for i in range(6)]
    assert {(t.step, t.validate, t.experiment, t.policy_version) for t in trajs} == {(4, False, "run-1", 7)}

    def dec(ids):
        return tok.decode(ids, skip_special_tokens=True)

    for traj, (prompt, turns) in zip(trajs, samples):
        expected = [{"role": "user", "content": dec(prompt)}] + [
            {"role": "assistant" if asst else "tool", "content": dec(ids)} for asst, ids in turns]
        assert traj.messages == expected
        assert [s.kind for s in traj.spans] == ["rollout"] + ["generation" if a else "tool" for a, _ in turns]
        gens = traj.spans_of_kind("generation")
        assert gens[0].attributes["rtrace.prompt_text"] == dec(prompt)
        assert [g.attributes["rl.policy_version"] for g in gens] == [7 + k for k in range(len(gens))]
        assert [g.attributes["gen_ai.usage.output_tokens"] for g in gens] == [len(ids) for a, ids in turns if a]
        assert traj.root.attributes["rl.reward"] == traj.reward
        assert all(s.attributes["rl.step"] == 4 and s.attributes["rl.group_id"] == traj.group_id for s in traj.spans)
        assert all(s.prompt_ids is None and s.response_ids is None for s in traj.spans)  # decoded, then dropped
    # the conversation with two tool calls, spelled out
    assert [m["content"] for m in trajs[2].messages] == [
        "user\nWhat is 12 + 30?\nassistant\n",
        '<tool_call>{"name": "calculator", "arguments": {"expression": "12 + 30"}}</tool_call>',
        "\nuser\n<tool_response>42</tool_response>\nassistant\n",
        '<tool_call>{"name": "calculator", "arguments": {"expression": "12 + 30"}}</tool_call>',
        "\nuser\n<tool_response>43</tool_response>\nassistant\n",
        "The answer is 42."]


def test_areal_layout_full_width_masks_prompt_mask_and_token_rewards(tmp_path, tok):
    """Right-padded full-width loss_mask, prompt_mask, token-level rewards and per-token versions (-1 on the prompt)."""
    path = tmp_path / "t.jsonl"
    _configure(path, token2text=True, tokenizer=tok, token2text_keep_ids=True)
    prompt = tok("<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n")["input_ids"]
    a1, obs, a2 = tok("<tool_call>2+2</tool_call>")["input_ids"], tok("4")["input_ids"], tok("It is 4.")["input_ids"]
    seq = prompt + a1 + obs + a2
    width = len(seq) + 4
    pad = width - len(seq)
    row_loss = [0] * len(prompt) + [1] * len(a1) + [0] * len(obs) + [1] * len(a2) + [0] * pad
    row_vers = [-1] * len(prompt) + [3] * len(a1) + [-1] * len(obs) + [5] * len(a2) + [-1] * pad
    token_rewards = [0.0] * (width - 1) + [0.0]
    token_rewards[len(seq) - 1] = 2.5  # reward on the last real token
    rtrace.log_rollout_batch(
        torch.tensor([seq + [PAD] * pad]), attention_mask=torch.tensor([[1] * len(seq) + [0] * pad]),
        loss_mask=torch.tensor([row_loss]), prompt_mask=torch.tensor([[1] * len(prompt) + [0] * (width - len(prompt))]),
        versions=torch.tensor([row_vers]), rewards=torch.tensor([token_rewards]), step=1, validate=True)
    (traj,) = _read(path)
    assert (traj.reward, traj.validate, traj.policy_version, traj.sample_index, traj.rollout_n) == (2.5, True, 3, 0, 0)
    gen1, tool, gen2 = traj.spans[1:]
    assert (gen1.prompt_ids, gen1.response_ids, tool.response_ids, gen2.response_ids) == (prompt, a1, obs, a2)
    assert gen2.prompt_ids is None  # a later turn's context is the turns before it
    assert [gen1.attributes["rl.policy_version"], gen2.attributes["rl.policy_version"]] == [3, 5]
    assert gen2.attributes["gen_ai.usage.input_tokens"] == len(prompt) + len(a1) + len(obs)
    assert [m["content"] for m in traj.messages] == ["user\nWhat is 2 + 2?\n", "<tool_call>2+2</tool_call>", "4",
                                                     "It is 4."]


def test_observation_role_user_and_prompt_lengths_per_prompt(tmp_path, tok):
    """loss_mask=0 turns can be user turns; prompt_lengths may be given once per prompt; the default prompt is before the first 1."""
    path = tmp_path / "t.jsonl"
    _configure(path, token2text=True, tokenizer=tok)
    p, a, u, b = (tok(x)["input_ids"] for x in ("Hi.", " Hello!", " More?", " Sure."))
    seq = p + a + u + b
    loss = [0] * len(p) + [1] * len(a) + [0] * len(u) + [1] * len(b)
    ids = torch.tensor([seq, seq])
    rtrace.log_rollout_batch(ids, loss_mask=torch.tensor([loss, loss]), prompt_lengths=[len(p)],
                             n_samples_per_prompt=2, observation_role="user", step=0)
    rtrace.log_rollout_batch(ids[:1], loss_mask=torch.tensor([loss]), step=1, prompt_offset=10,
                             observation_role="user")
    trajs = _read(path)
    assert [(t.step, t.sample_index, t.rollout_n) for t in trajs] == [(0, 0, 0), (0, 0, 1), (1, 10, 0)]
    for t in trajs:
        assert t.messages == [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": " Hello!"},
                              {"role": "user", "content": " More?"}, {"role": "assistant", "content": " Sure."}]


def test_structured_messages_win_and_sampling_applies(tmp_path, tok):
    """Given messages are exported as-is; the per-step cap admits samples like decorated trajectories."""
    path = tmp_path / "t.jsonl"
    _configure(path, token2text=True, tokenizer=tok, max_traces_per_step=4)
    tensors, _ = _verl_batch(tok)
    msgs = [[{"role": "user", "content": f"q{i // N}"}, {"role": "assistant", "content": f"a{i}"}] for i in range(6)]
    assert rtrace.log_rollout_batch(**tensors, messages=msgs, n_samples_per_prompt=N, step=0) == 4
    trajs = _read(path)
    assert [t.messages for t in trajs] == msgs[:4]
    assert all(t.spans_of_kind("generation")[0].attributes["rtrace.prompt_text"] for t in trajs)
    stats = rtrace.stats()
    assert (stats["trajectories_started"], stats["trajectories_sampled_out"]) == (4, 2)


def test_group_sampling_keeps_whole_groups(tmp_path, tok):
    """With sample_groups a GRPO group (same prompt) is kept or dropped as a whole."""
    path = tmp_path / "t.jsonl"
    _configure(path, max_traces_per_step=2, sample_groups=True)
    tensors, _ = _verl_batch(tok)
    assert rtrace.log_rollout_batch(**tensors, n_samples_per_prompt=N, step=0) == 3
    assert [(t.sample_index, t.rollout_n) for t in _read(path)] == [(0, 0), (0, 1), (0, 2)]


def test_without_token2text_ids_stay_and_messages_have_roles(tmp_path, tok):
    """Without token2text the spans keep the id slices and messages list the roles, each turn saying
    how many tokens it holds and how to see their text."""
    path = tmp_path / "t.jsonl"
    _configure(path)
    tensors, samples = _verl_batch(tok)
    rtrace.log_rollout_batch(**tensors, n_samples_per_prompt=N, step=0)
    trajs = _read(path)
    for traj, (prompt, turns) in zip(trajs, samples):
        assert traj.spans[1].prompt_ids == prompt
        assert [s.response_ids for s in traj.spans[1:]] == [ids for _, ids in turns]
        assert [m["role"] for m in traj.messages] == ["user"] + ["assistant" if a else "tool" for a, _ in turns]
        assert [m["content"] for m in traj.messages] == [
            f"[{len(ids)} tokens, not decoded: set RTRACE_TOKEN2TEXT]" for ids in [prompt] + [t for _, t in turns]]


def test_truncated_sample_is_a_documented_partial_result(tmp_path, tok):
    """A sample cut at the prompt keeps its prompt on an empty generation; a response mask narrower than the response is the response's tail."""
    path = tmp_path / "t.jsonl"
    _configure(path, token2text=True, tokenizer=tok, token2text_keep_ids=True)
    prompt, answer = tok("What is 1 + 1?")["input_ids"], tok(" 2")["input_ids"]
    width = len(prompt) + len(answer)
    ids = torch.tensor([prompt + [PAD] * len(answer), prompt + answer])
    attn = torch.tensor([[1] * len(prompt) + [0] * len(answer), [1] * width])
    rtrace.log_rollout_batch(ids, attention_mask=attn, loss_mask=torch.ones(2, len(answer), dtype=torch.long), step=0)
    empty, full = _read(path)
    assert [(s.kind, s.prompt_ids, s.response_ids) for s in empty.spans[1:]] == [("generation", prompt, [])]
    assert empty.messages == [{"role": "user", "content": "What is 1 + 1?"}, {"role": "assistant", "content": ""}]
    assert full.messages == [{"role": "user", "content": "What is 1 + 1?"}, {"role": "assistant", "content": " 2"}]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"attention_mask": torch.ones(5, 10)}, "attention_mask has 5 rows, input_ids has 6"),
    ({"attention_mask": torch.ones(6, 9)}, "attention_mask row 0 has 9 tokens, input_ids row 0 has 10"),
    ({"loss_mask": torch.ones(6, 11)}, "loss_mask row 0 has 11 tokens, input_ids row 0 has 10"),
    ({"rewards": torch.ones(4)}, r"rewards has 4 entries; expected 6 \(one per sample\) or 2 \(one per prompt\)"),
    ({"versions": torch.ones(6, 12)}, "versions row 0 has 12 tokens"),
    ({"prompt_lengths": [4, 11]}, r"prompt_lengths\[3\]=11 but sample 3 has 10 real tokens"),
    ({"prompt_mask": torch.ones(6, 4)}, "prompt_mask row 0 has 4 tokens"),
    ({"messages": [[]] * 5}, "messages has 5 entries, input_ids has 6 rows"),
    ({"prompt_uids": ["a", "b", "c"]}, "prompt_uids has 3 entries"),
    ({"n_samples_per_prompt": 4}, "n_samples_per_prompt=4 does not divide the batch size 6"),
    ({"input_ids": torch.ones(6, dtype=torch.long)}, r"input_ids must be 2-D \(\[batch, tokens\]\)"),
])
def test_mismatched_inputs_raise_a_clear_value_error(tmp_path, kwargs, message):
    """Every shape mismatch is a ValueError that names the argument, never an IndexError from inside."""
    _configure(tmp_path / "t.jsonl")
    args = {"input_ids": torch.ones(6, 10, dtype=torch.long), "n_samples_per_prompt": N, **kwargs}
    with pytest.raises(ValueError, match=message):
        rtrace.log_rollout_batch(**args)


def test_each_tensor_moves_to_cpu_once(tmp_path, tok):
    """Each tensor argument is copied to the CPU once for the whole batch, not once per sample."""

    class CountingTensor(torch.Tensor):
        cpu_calls = 0

        def cpu(self, *args, **kwargs):
            CountingTensor.cpu_calls += 1
            return super().cpu(*args, **kwargs)

    _configure(tmp_path / "t.jsonl", token2text=True, tokenizer=tok)
    tensors, _ = _verl_batch(tok)
    counted = {k: v.as_subclass(CountingTensor) for k, v in tensors.items()}
    assert rtrace.log_rollout_batch(**counted, rewards=torch.zeros(6).as_subclass(CountingTensor),
                                    n_samples_per_prompt=N, step=0) == 6
    assert CountingTensor.cpu_calls == 5
    assert len(_read(tmp_path / "t.jsonl")) == 6


def test_capture_off_exports_structure_without_ids(tmp_path, tok):
    """With capture=False the trajectories keep turns, lengths and rewards but no token ids."""
    path = tmp_path / "t.jsonl"
    _configure(path, capture=False)
    tensors, samples = _verl_batch(tok)
    rtrace.log_rollout_batch(**tensors, rewards=[1, 0, 0, 0, 0, 1], n_samples_per_prompt=N, step=0)
    trajs = _read(path)
    assert [t.reward for t in trajs] == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    for traj, (_, turns) in zip(trajs, samples):
        assert all(s.prompt_ids is None and s.response_ids is None for s in traj.spans)
        assert [s.attributes.get("gen_ai.usage.output_tokens", s.attributes.get("rtrace.tokens"))
                for s in traj.spans[1:]] == [len(ids) for _, ids in turns]


def test_tracing_off_returns_immediately(tmp_path):
    """With tracing off the call returns 0 without looking at its arguments."""
    rtrace.configure(exporter="none")
    assert rtrace.log_rollout_batch(object(), loss_mask="not even a tensor", n_samples_per_prompt=7) == 0
    assert rtrace.stats().get("batch_trajectories") is None


def test_trainer_random_state_untouched_and_extra_made_plain(tmp_path, tok):
    """Logging a batch does not move the trainer's seeded `random` state; tensor/numpy coordinates become plain values."""
    import random

    import numpy as np

    path = tmp_path / "t.jsonl"
    _configure(path)
    tensors, _ = _verl_batch(tok)
    random.seed(1234)
    expected = random.random()
    random.seed(1234)
    rtrace.log_rollout_batch(**tensors, n_samples_per_prompt=N, step=0, sample_ids=torch.arange(6),
                             extra={"epoch": np.int64(2), "temp": torch.tensor(0.5), "cfg": {"a": 1}})
    assert random.random() == expected
    trajs = _read(path)
    assert [t.extra for t in trajs] == [{"epoch": 2, "temp": 0.5, "cfg": "{'a': 1}", "sample_id": i} for i in range(6)]
    assert trajs[0].root.attributes["rl.extra.epoch"] == 2


def _reference_turns(row, attn, loss, vers):
    """Per-token reference of the documented layout (prompt = before the first loss 1)."""
    width = len(row)
    real = [t for t in range(width) if attn[t]]
    off = width - len(loss)
    flag = [bool(t >= off and loss[t - off]) for t in range(width)]
    n_prompt = next((i for i, t in enumerate(real) if flag[t]), len(real)) if off == 0 else sum(t < off for t in real)
    turns = []
    for t in real[n_prompt:]:
        if turns and turns[-1][0] == flag[t]:
            turns[-1][1].append(t)
        else:
            turns.append((flag[t], [t]))
    out = []
    for asst, cols in turns:
        vs = [vers[t - (width - len(vers))] for t in cols if t >= width - len(vers)]
        vs = [v for v in vs if v >= 0]
        out.append((asst, [row[t] for t in cols], min(vs) if asst and vs else None))
    return [row[t] for t in real[:n_prompt]], out


def test_run_based_slicing_matches_a_per_token_reference():
    """The run-based slicing of masks (holes, narrow masks, -1 versions) equals a per-token reference on 300 random rows."""
    import random

    from rtrace.instrumentation import batch

    rng = random.Random(7)
    for _ in range(300):
        width = rng.randint(1, 40)
        row = [rng.randint(4, 99) for _ in range(width)]
        attn = [int(rng.random() > 0.2) for _ in range(width)]
        loss = [rng.choice([0, 1, True, False, 1.0]) for _ in range(rng.choice([width, rng.randint(0, width)]))]
        vers = [rng.choice([-1, 2, 3, 5]) for _ in range(rng.choice([width, len(loss)]))]
        real = [(lo, hi) for v, lo, hi in batch._runs(attn) if v]
        n_prompt = batch._prompt_len(0, width, real, None, None, [loss])
        prompt_iv, resp_iv = batch._split(real, n_prompt)
        turns = [(t.role == "assistant", t.ids, t.version) for t in batch._turns(row, resp_iv, loss, vers)]
        assert (batch._gather(row, prompt_iv), turns) == _reference_turns(row, attn, loss, vers), (row, attn, loss, vers)


class TestWhoWroteItAndExactCoordinates:
    """log_rollout_batch for trainers whose loss mask is not "written by the policy" and whose
    batches do not divide into groups (SkyRL's overlong filtering, its evaluation batches)."""

    def test_assistant_mask_cuts_turns_and_loss_mask_counts_what_is_trained(self, tmp_path):
        """A truncated response whose loss mask is all zeros (apply_overlong_filtering) still shows
        its two policy turns and its tool turn; rl.loss_tokens says none of it is trained on."""
        path = tmp_path / "t.jsonl"
        _configure(path)
        prompt, a1, obs, a2 = [1, 2, 3], [10, 11], [20, 21, 22], [30, 31, 32]
        ids = [prompt + a1 + obs + a2, prompt + a1 + obs + a2]
        who = [[0] * 3 + [1] * 2 + [0] * 3 + [1] * 3] * 2
        loss = [[0] * 11, [0] * 3 + [1] * 2 + [0] * 3 + [1] * 3]
        rtrace.log_rollout_batch(ids, assistant_mask=who, loss_mask=loss, prompt_lengths=3, step=1,
                                 sample_indices=[0, 0], rollout_ns=[0, 1], finish_reasons=["length", "stop"])
        filtered, trained = _read(path)
        for traj in (filtered, trained):
            assert [(s.attributes["rtrace.role"], s.response_ids) for s in traj.spans[1:]] == [
                ("assistant", a1), ("tool", obs), ("assistant", a2)]
            assert traj.spans[1].prompt_ids == prompt
        assert [s.attributes["rl.loss_tokens"] for s in filtered.spans] == [0, 0, 0, 0]
        assert [s.attributes["rl.loss_tokens"] for s in trained.spans] == [5, 2, 0, 3]
        assert filtered.finish_reason == "length" and trained.finish_reason == "stop"
        assert filtered.verdict() == "truncated"

    def test_exact_coordinates_need_no_divisibility(self, tmp_path):
        """Four evaluation samples of three prompts (one, two, one rollouts), their coordinates given
        per sample: no divisibility rule, each trajectory where it belongs."""
        path = tmp_path / "t.jsonl"
        _configure(path)
        rtrace.log_rollout_batch([[1, 5], [2, 5], [2, 6], [3, 5]], prompt_lengths=1, n_samples_per_prompt=3,
                                 step=2, validate=True, sample_indices=[0, 1, 1, 2], rollout_ns=[0, 0, 1, 0],
                                 prompt_uids=["a", "b", "b", "c"])
        trajs = _read(path)
        assert [(t.sample_index, t.rollout_n, t.group_id, t.validate) for t in trajs] == [
            (0, 0, "a", True), (1, 0, "b", True), (1, 1, "b", True), (2, 0, "c", True)]

    def test_without_them_the_divisibility_error_says_what_to_do(self, tmp_path):
        _configure(tmp_path / "t.jsonl")
        with pytest.raises(ValueError, match="does not divide the batch size 4 .*give sample_indices"):
            rtrace.log_rollout_batch([[1, 5]] * 4, n_samples_per_prompt=3, step=1)


class TestPromptIndex:
    def test_dense_indices_per_step_across_calls(self):
        """A uid gets the next free index of its (validate, step), the same one when seen again."""
        from rtrace.instrumentation.turns import PromptIndex

        idx = PromptIndex()
        got = [idx.index(False, 1, u) for u in ("q7", "q3", "q7", "q9")]
        assert got == [0, 1, 0, 2]
        assert [idx.index(True, 1, "q7"), idx.index(False, 2, "q3"), idx.index(False, 1, "q3")] == [0, 0, 1]

    def test_rollout_numbers_count_on_across_calls(self):
        """claim: a uid's rollout numbers start at 0 in each (validate, step) and count on when it
        comes again; index() takes none."""
        from rtrace.instrumentation.turns import PromptIndex

        idx = PromptIndex()
        got = [idx.claim(False, 1, u) for u in ("q7", "q7", "q3", "q7")]
        assert got == [(0, 0), (0, 1), (1, 0), (0, 2)]
        assert idx.claim(False, 1, "q3", 4) == (1, 1) and idx.claim(False, 1, "q3") == (1, 5)
        assert [idx.claim(True, 1, "q7"), idx.claim(False, 2, "q7")] == [(0, 0), (0, 0)]
        assert idx.index(False, 1, "q7") == 0 and idx.claim(False, 1, "q7") == (0, 3)
