"""token2text: token ids captured on the hot path, decoded to text in rtrace's worker thread."""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
import pytest

import rtrace
from rtrace.demo import build_tokenizer
from rtrace import _setup as token2text  # holds the tokenizer (get_tokenizer)
from rtrace.exporters.jsonl import read_jsonl

PROMPT = "<|im_start|>user\nWhat is 12 + 30?<|im_end|>\n<|im_start|>assistant\n"
ANSWER = "12 + 30 = 42. The answer is 42.<|im_end|>"


class RecordingTokenizer:
    """A real tokenizer, wrapped to record each batch_decode call: thread, time, sizes."""

    def __init__(self, tok):
        self.tok = tok
        self.calls: list[dict] = []

    def batch_decode(self, sequences, **kwargs):
        self.calls.append({"thread": threading.current_thread().name, "time_ns": time.time_ns(),
                           "n": len(sequences), "kwargs": kwargs})
        return self.tok.batch_decode(sequences, **kwargs)


def _configure(path, **kw):
    # export_interval_s is long: the worker processes only at flush, so one flush = one batch.
    kw.setdefault("export_interval_s", 60)
    rtrace.configure(exporter="jsonl", jsonl_path=str(path), token2text=True, **kw)


def _read(path):
    assert rtrace.flush(10)
    return read_jsonl(path)


def _gen_spans(trajs):
    return [s for t in trajs for s in t.spans if s.kind == "generation"]


# ---------------------------------------------------------------------- the tokenizer
def test_demo_tokenizer_is_offline_deterministic_chatml(tok):
    """build_tokenizer gives the same vocabulary every time, ChatML special ids, exact round trips and a tool-call chat template."""
    again = build_tokenizer()
    assert again.get_vocab() == tok.get_vocab()
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]) == [0, 1, 2, 3]
    assert (tok.eos_token, tok.pad_token) == ("<|endoftext|>", "<|pad|>")
    text = "Natalia sold 48 clips ✓ in April: 48 / 2 = 24"
    assert tok.decode(tok(text)["input_ids"]) == text
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": "What is 3 + 4?"},
         {"role": "assistant", "content": "", "tool_calls": [
             {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "3 + 4"}}}]},
         {"role": "tool", "content": "7"}],
        tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"3 + 4\"}}\n"
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")


# ---------------------------------------------------------------------- decoding
def test_decoded_text_equals_tokenizer_decode_skipping_special_tokens(tmp_path, tok):
    """Default options: span text equals tokenizer.decode(ids, skip_special_tokens=True) and the id lists are dropped."""
    path = tmp_path / "t.jsonl"
    _configure(path, tokenizer=tok)
    prompt = tok(PROMPT)["input_ids"]
    answer = tok(ANSWER)["input_ids"]

    torch = pytest.importorskip("torch", reason="a [1, n] tensor output (no CPU torch wheel for this Python)")

    @rtrace.traced_generation
    def generate(prompt_ids):
        return torch.tensor([answer])  # a [1, n] tensor, as HF generate returns

    with rtrace.rollout_context(step=0, sample_index=0):
        generate(prompt_ids=prompt)
    (traj,) = _read(path)
    (span,) = _gen_spans([traj])
    assert span.attributes["rtrace.prompt_text"] == tok.decode(prompt, skip_special_tokens=True)
    assert span.attributes["rtrace.response_text"] == tok.decode(answer, skip_special_tokens=True)
    assert span.attributes["rtrace.response_text"] == "12 + 30 = 42. The answer is 42."
    assert span.prompt_ids is None and span.response_ids is None
    assert span.attributes["gen_ai.usage.input_tokens"] == len(prompt)
    assert span.attributes["gen_ai.usage.output_tokens"] == len(answer)
    assert traj.messages == [{"role": "user", "content": "user\nWhat is 12 + 30?\nassistant\n"},
                             {"role": "assistant", "content": "12 + 30 = 42. The answer is 42."}]


def test_special_tokens_kept_and_ids_kept_when_configured(tmp_path, tok):
    """skip_special_tokens=False keeps <|im_end|> in the text; keep_ids=True keeps the exact id lists."""
    path = tmp_path / "t.jsonl"
    _configure(path, tokenizer=tok, token2text_skip_special_tokens=False, token2text_keep_ids=True)
    prompt = np.array(tok(PROMPT)["input_ids"], dtype=np.int64)
    answer = tok(ANSWER)["input_ids"]

    @rtrace.traced_generation
    def generate(prompt_ids):
        return {"response_ids": answer, "finish_reason": "stop"}

    with rtrace.rollout_context(step=0):
        generate(prompt)
    (span,) = _gen_spans(_read(path))
    assert span.attributes["rtrace.prompt_text"] == PROMPT == tok.decode(prompt.tolist())
    assert span.attributes["rtrace.response_text"] == ANSWER == tok.decode(answer)
    assert span.prompt_ids == prompt.tolist() and span.response_ids == answer
    assert span.attributes["gen_ai.response.finish_reasons"] == ["stop"]


def test_field_mapping_from_decorator_arguments(tmp_path, tok):
    """prompt_field/response_field choose where ids are read; an output object's .token_ids is found by default."""
    path = tmp_path / "t.jsonl"
    _configure(path, tokenizer=tok)

    @dataclasses.dataclass
    class TokenOutput:  # veRL's AsyncLLMServerManager.generate returns this shape
        token_ids: list
        log_probs: list | None = None

    @rtrace.traced_generation(prompt_field="input_ids", response_field="output_token_ids")
    def custom(input_ids, sampling_params=None):
        return {"output_token_ids": tok("first")["input_ids"]}

    @rtrace.traced_generation
    def server(request_id, prompt_ids, sampling_params=None):
        return TokenOutput(token_ids=tok("second")["input_ids"])

    with rtrace.rollout_context(step=0):
        custom(tok("p1")["input_ids"])
        server("r1", prompt_ids=tok("p2")["input_ids"], sampling_params={"temperature": 1.0})
    spans = _gen_spans(_read(path))
    assert [(s.attributes["rtrace.prompt_text"], s.attributes["rtrace.response_text"]) for s in spans] == [
        ("p1", "first"), ("p2", "second")]
    # the ids are stored once (in response_ids), also when the output is an object
    assert [s.output for s in spans] == [{}, {"log_probs": None}]


def test_one_batch_decode_per_field_per_batch(tmp_path, tok):
    """Twenty trajectories finished before one flush are decoded with exactly one batch_decode per field."""
    path = tmp_path / "t.jsonl"
    rec = RecordingTokenizer(tok)
    _configure(path, tokenizer=rec)

    @rtrace.traced_generation
    def generate(prompt_ids, i):
        return tok(f"answer {i}")["input_ids"]

    for i in range(20):
        with rtrace.rollout_context(step=0, sample_index=i):
            generate(tok(f"question {i}")["input_ids"], i)
    trajs = _read(path)
    assert [c["n"] for c in rec.calls] == [20, 20]
    assert all(c["kwargs"] == {"skip_special_tokens": True} for c in rec.calls)
    texts = {t.sample_index: _gen_spans([t])[0].attributes for t in trajs}
    assert all(texts[i]["rtrace.prompt_text"] == f"question {i}" and texts[i]["rtrace.response_text"] == f"answer {i}"
               for i in range(20))


def test_decoding_happens_in_worker_after_the_call_ended(tmp_path, tok):
    """batch_decode runs in rtrace's worker thread, after the generation span ended; the traced call never decodes."""
    path = tmp_path / "t.jsonl"
    rec = RecordingTokenizer(tok)
    _configure(path, tokenizer=rec)

    @rtrace.traced_generation
    def generate(prompt_ids):
        return tok(ANSWER)["input_ids"]

    with rtrace.rollout_context(step=0):
        generate(tok(PROMPT)["input_ids"])
        assert rec.calls == []  # nothing decoded while the rollout runs
    (span,) = _gen_spans(_read(path))
    assert len(rec.calls) == 2
    assert {c["thread"] for c in rec.calls} == {"rtrace-worker"}
    assert all(c["time_ns"] > span.end_ns for c in rec.calls)
    assert span.attributes["rtrace.response_text"] == tok.decode(tok(ANSWER)["input_ids"], skip_special_tokens=True)


# ---------------------------------------------------------------------- the tokenizer holder
def test_set_tokenizer_after_configure(tmp_path, tok):
    """token2text without a tokenizer keeps the ids (counted); rtrace.set_tokenizer later makes the next batch decode."""
    path = tmp_path / "t.jsonl"
    _configure(path)

    @rtrace.traced_generation
    def generate(prompt_ids):
        return tok("later")["input_ids"]

    with rtrace.rollout_context(step=0, sample_index=0):
        generate(tok("before")["input_ids"])
    assert rtrace.flush(10)
    assert rtrace.stats()["token2text_no_tokenizer"] == 1
    rtrace.set_tokenizer(tok)  # e.g. the agent loop gets its tokenizer after configure
    with rtrace.rollout_context(step=0, sample_index=1):
        generate(tok("after")["input_ids"])
    first, second = _read(path)
    (s0,), (s1,) = _gen_spans([first]), _gen_spans([second])
    assert "rtrace.prompt_text" not in s0.attributes and s0.prompt_ids == tok("before")["input_ids"]
    assert s1.attributes["rtrace.prompt_text"] == "after" and s1.prompt_ids is None


def test_set_tokenizer_before_configure_with_a_plain_decoder(tmp_path, tok):
    """A plain object with only decode(ids) (no batch_decode, no keyword) works when set before configure."""

    class PlainDecoder:
        def decode(self, ids):
            return "|".join(str(i) for i in ids)

    rtrace.set_tokenizer(PlainDecoder())
    path = tmp_path / "t.jsonl"
    _configure(path)

    @rtrace.traced_generation
    def generate(prompt_ids):
        return [7, 8]

    with rtrace.rollout_context(step=0):
        generate([1, 2, 3])
    (span,) = _gen_spans(_read(path))
    assert (span.attributes["rtrace.prompt_text"], span.attributes["rtrace.response_text"]) == ("1|2|3", "7|8")


def test_set_tokenizer_rejects_objects_that_cannot_decode():
    """set_tokenizer refuses an object with neither batch_decode nor decode, naming its type."""
    with pytest.raises(TypeError, match="object has neither batch_decode nor decode"):
        rtrace.set_tokenizer(object())


def test_tokenizer_from_environment_local_path(tmp_path, tok, monkeypatch):
    """RTRACE_TOKEN2TEXT=1 with RTRACE_TOKENIZER=<saved dir> loads it offline; a bad path is a ConfigError naming the variable."""
    tok_dir = tmp_path / "tok"
    tok.save_pretrained(tok_dir)
    monkeypatch.setenv("RTRACE_TOKEN2TEXT", "1")
    monkeypatch.setenv("RTRACE_TOKENIZER", str(tmp_path / "missing"))
    with pytest.raises(rtrace.ConfigError, match="RTRACE_TOKENIZER=.*missing.*cannot load"):
        rtrace.configure(exporter="jsonl", jsonl_path=str(tmp_path / "x.jsonl"))
    monkeypatch.setenv("RTRACE_TOKENIZER", str(tok_dir))
    path = tmp_path / "t.jsonl"
    rtrace.configure(exporter="jsonl", jsonl_path=str(path), export_interval_s=60)

    @rtrace.traced_generation
    def generate(prompt_ids):
        return tok(ANSWER)["input_ids"]

    with rtrace.rollout_context(step=0):
        generate(tok(PROMPT)["input_ids"])
    (span,) = _gen_spans(_read(path))
    assert span.attributes["rtrace.response_text"] == tok.decode(tok(ANSWER)["input_ids"], skip_special_tokens=True)


def test_tokenizer_failure_exports_without_text(tmp_path, tok):
    """A sequence the tokenizer cannot decode is exported with its ids and counted; the rest of the batch is decoded."""

    class Strict:
        def batch_decode(self, seqs, skip_special_tokens=True):
            return [self.decode(s, skip_special_tokens) for s in seqs]

        def decode(self, ids, skip_special_tokens=True):
            if any(i >= len(tok) for i in ids):
                raise IndexError(f"token id out of range: {max(ids)}")
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    path = tmp_path / "t.jsonl"
    _configure(path, tokenizer=Strict())

    @rtrace.traced_generation
    def generate(prompt_ids, bad):
        return [10**6] if bad else tok("fine")["input_ids"]

    for i, bad in enumerate([False, True, False]):
        with rtrace.rollout_context(step=0, sample_index=i):
            generate(tok(f"q{i}")["input_ids"], bad)
    trajs = sorted(_read(path), key=lambda t: t.sample_index)
    assert len(trajs) == 3
    spans = _gen_spans(trajs)
    assert [s.attributes.get("rtrace.response_text") for s in spans] == ["fine", None, "fine"]
    assert spans[1].response_ids == [10**6]
    assert [s.attributes["rtrace.prompt_text"] for s in spans] == ["q0", "q1", "q2"]
    assert rtrace.stats()["token2text_errors"] == 1
    assert token2text.get_tokenizer() is not None


# ---------------------------------------------------------------------- turns without text
@pytest.mark.parametrize("token2text, why", [
    (False, "set RTRACE_TOKEN2TEXT"),
    (True, "token2text has no tokenizer or could not decode, see rtrace.stats()")])
def test_undecoded_turns_say_what_they_hold(tmp_path, token2text, why):
    """Without decoded text, the prompt and each assistant turn read "[N tokens, not decoded: ...]"
    (never an empty string), with the way to see the text."""
    path = tmp_path / "t.jsonl"
    rtrace.configure(exporter="jsonl", jsonl_path=str(path), token2text=token2text, export_interval_s=60)

    @rtrace.traced_generation
    def generate(prompt_ids):
        return {"response_ids": [5] * 16, "finish_reason": "length"}

    with rtrace.rollout_context(step=0):
        generate(list(range(40)))
        generate(list(range(60)))
    (traj,) = _read(path)
    assert traj.messages == [{"role": "user", "content": f"[40 tokens, not decoded: {why}]"},
                             {"role": "assistant", "content": f"[16 tokens, not decoded: {why}]"},
                             {"role": "assistant", "content": f"[16 tokens, not decoded: {why}]"}]


def test_generations_point_at_their_assistant_turns(tmp_path, tok):
    """Each generation span carries rtrace.message_index: the assistant message it produced, the
    one with the tool calls that followed it, also for turns read from captured chat messages."""
    path = tmp_path / "t.jsonl"
    _configure(path, tokenizer=tok)
    calls = [{"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": '{"e": "1+1"}'}}]

    @rtrace.traced_generation
    def generate(messages, prompt_ids):
        return {"response_ids": tok(" 2" if len(messages) > 2 else "calc")["input_ids"]}

    @rtrace.traced_tool(tool_name="calculator")
    def calculator(e, tool_call_id):
        return "2"

    with rtrace.rollout_context(step=0):
        chat = [{"role": "user", "content": "1+1?"}]
        generate(list(chat), [1, 2])
        chat += [{"role": "assistant", "content": "calc", "tool_calls": calls},
                 {"role": "tool", "tool_call_id": "c1", "content": calculator("1+1", tool_call_id="c1")}]
        generate(list(chat), [1, 2, 3])
    (traj,) = _read(path)
    first, second = _gen_spans([traj])
    assert traj.messages[first.attributes["rtrace.message_index"]] == chat[1]
    assert traj.messages[second.attributes["rtrace.message_index"]] == {"role": "assistant", "content": " 2"}
    assert second.attributes["rtrace.message_index"] == len(traj.messages) - 1 == 3


def test_a_turn_the_loop_inserted_between_generations_is_in_the_conversation(tmp_path, tok):
    """A retry prompt the loop appends as token ids between two generations (AReaL's
    MultiTurnWorkflow, no tool span) is a user message of the conversation, not lost:
    user, assistant, user (the retry), assistant."""
    path = tmp_path / "t.jsonl"
    _configure(path, tokenizer=tok)
    def template(msgs, **kw):
        out = tok.apply_chat_template(msgs, tokenize=True, **kw)
        return list(out if isinstance(out, list) else out["input_ids"])

    chat = [{"role": "user", "content": "What is 2+2?"}]
    first = template(chat, add_generation_prompt=True)
    wrong = tok("It is 5.<|im_end|>", add_special_tokens=False)["input_ids"]
    retry_chat = [{"role": "assistant", "content": "x"}, {"role": "user", "content": "Wrong, try again."}]
    s1 = template(retry_chat[:1])
    retry = template(retry_chat, add_generation_prompt=True)[len(s1):]
    right = tok("It is 4.<|im_end|>", add_special_tokens=False)["input_ids"]

    @rtrace.traced_generation
    def generate(prompt_ids, answer):
        return {"response_ids": answer, "finish_reason": "stop"}

    with rtrace.rollout_context(step=0, sample_index=0):
        generate(first, wrong)
        generate(first + wrong + retry, right)
    (traj,) = _read(path)
    assert traj.messages == [{"role": "user", "content": tok.decode(first, skip_special_tokens=True)},
                             {"role": "assistant", "content": "It is 5."},
                             {"role": "user", "content": "Wrong, try again."},
                             {"role": "assistant", "content": "It is 4."}]


# ---------------------------------------------------------------------- the trainer's tokenizer (issue 31)
def _batch(step=1):
    rtrace.log_rollout_batch([[1, 2, 3, 10, 11, 12]], prompt_lengths=[3], rewards=[1.0], step=step)


class TestTrainerTokenizer:
    """token2text unset decodes once a trainer adapter offered its tokenizer; false never does."""

    @pytest.mark.parametrize("token2text, offer, user, decoded", [
        (None, True, False, True),     # the adapters' case: the switch alone writes text
        (None, False, False, False),   # no adapter: nothing, as before
        (None, False, True, False),    # a tokenizer of your own still needs token2text=True
        (False, True, False, False),   # turned off explicitly: an adapter's tokenizer changes nothing
        (True, True, False, True),
    ])
    def test_who_decides(self, tmp_path, tok, token2text, offer, user, decoded):
        path = tmp_path / "t.jsonl"
        rtrace.configure(exporter="jsonl", jsonl_path=str(path), token2text=token2text, export_interval_s=60)
        if user:
            rtrace.set_tokenizer(tok)
        if offer:
            assert token2text_offer(tok)
        _batch()
        (t,) = _read(path)
        gen = t.spans_of_kind("generation")[0]
        if decoded:
            assert gen.attributes["rtrace.response_text"] == tok.decode([10, 11, 12], skip_special_tokens=True)
            assert t.messages[-1]["content"] == gen.attributes["rtrace.response_text"]
        else:
            assert "rtrace.response_text" not in gen.attributes and gen.response_ids == [10, 11, 12]
        assert rtrace.stats().get("token2text_no_tokenizer", 0) == 0  # unset: no warning, no counter

    def test_from_the_environment_too(self, tmp_path, tok, monkeypatch):
        """RTRACE_TOKEN2TEXT=0 is explicit: an adapter's tokenizer does not turn decoding on."""
        monkeypatch.setenv("RTRACE_TOKEN2TEXT", "0")
        path = tmp_path / "t.jsonl"
        rtrace.configure(exporter="jsonl", jsonl_path=str(path), export_interval_s=60)
        assert rtrace.current_settings().token2text is False
        token2text_offer(tok)
        _batch()
        (t,) = _read(path)
        assert "rtrace.response_text" not in t.spans_of_kind("generation")[0].attributes

    def test_the_user_s_tokenizer_wins(self, tok):
        """An adapter's tokenizer does not replace one set by the user; one that cannot decode is
        refused and counted, a name is ignored (no I/O on the trainer's thread)."""
        mine = RecordingTokenizer(tok)
        rtrace.set_tokenizer(mine)
        assert token2text_offer(tok) and token2text.get_tokenizer() is mine
        assert not token2text_offer(object()) and rtrace.stats()["token2text_tokenizer_refused"] == 1
        assert not token2text_offer("Qwen/Qwen2.5-7B-Instruct")


def token2text_offer(tokenizer):
    return token2text.offer_tokenizer(tokenizer)


class TestCollectorLoadsTheWorkersTokenizer:
    """In collector mode the worker names its trainer's tokenizer on each root; a collector with
    none of its own loads it (offline) and decodes; the name never reaches the sinks."""

    @staticmethod
    def _run(tmp_path, worker_tok, **collector_settings):
        from rtrace.pipeline.collector import start_collector  # no in-process trainer tokenizer: the name route

        out = tmp_path / "collector.jsonl"
        collector = start_collector(exporter="jsonl", jsonl_path=str(out), settle_s=0.1, **collector_settings)
        try:
            rtrace.configure(exporter="collector", collector_endpoint=collector.endpoint, export_interval_s=0.05)
            token2text_offer(worker_tok)
            _batch()
            assert rtrace.flush(30)
            rtrace.shutdown()
            assert collector.flush(30)
        finally:
            collector.stop()
        (t,) = read_jsonl(out)
        return t

    def test_by_name(self, tmp_path, tok):
        pytest.importorskip("grpc")
        from transformers import AutoTokenizer

        tok.save_pretrained(tmp_path / "tokenizer")
        named = AutoTokenizer.from_pretrained(str(tmp_path / "tokenizer"))
        t = self._run(tmp_path, named)
        gen = t.spans_of_kind("generation")[0]
        assert gen.attributes["rtrace.response_text"] == tok.decode([10, 11, 12], skip_special_tokens=True)
        assert not [k for s in t.spans for k in s.attributes if k.startswith("rtrace.carried.")]

    def test_a_name_it_cannot_load_is_counted(self, tmp_path, tok):
        pytest.importorskip("grpc")
        pytest.importorskip("transformers")

        class Elsewhere(RecordingTokenizer):
            name_or_path = str(tmp_path / "on-another-node")

        t = self._run(tmp_path, Elsewhere(tok))
        assert "rtrace.response_text" not in t.spans_of_kind("generation")[0].attributes
        assert rtrace.stats()["token2text_tokenizer_unloadable"] == 1

    def test_not_when_turned_off(self, tmp_path, tok):
        pytest.importorskip("grpc")
        from transformers import AutoTokenizer

        tok.save_pretrained(tmp_path / "tokenizer")
        t = self._run(tmp_path, AutoTokenizer.from_pretrained(str(tmp_path / "tokenizer")), token2text=False)
        assert "rtrace.response_text" not in t.spans_of_kind("generation")[0].attributes
        assert not [k for s in t.spans for k in s.attributes if k.startswith("rtrace.carried.")]

    def test_a_tokenizer_made_in_code_with_the_collector_s_own(self, tmp_path, tok):
        """A worker's trainer tokenizer without a name (made in code) cannot be loaded, but tells
        the collector a trainer gave one: token2text unset, the collector decodes with its own."""
        pytest.importorskip("grpc")
        t = self._run(tmp_path, RecordingTokenizer(tok), tokenizer=tok)
        assert "rtrace.response_text" in t.spans_of_kind("generation")[0].attributes
        assert rtrace.stats().get("token2text_tokenizer_unloadable", 0) == 0
