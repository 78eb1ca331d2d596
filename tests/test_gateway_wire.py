"""What a client of the capture gateway gets on the wire, byte for byte and message for message.

The gateway serves for real on 127.0.0.1 in front of ``tests/fake_vllm.py`` (or a raw-socket
upstream that answers fixed bytes); clients are httpx or a raw TCP socket, so that framing
(chunked bodies, HEAD, ``100 Continue``, upgrades, keep-alive) is seen as it is written.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from urllib.parse import urlsplit

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("httptools")

import rtrace  # noqa: E402
import rtrace.testing  # noqa: E402
from rtrace.gateway import http as gateway_http  # noqa: E402
from rtrace.gateway import start_gateway  # noqa: E402
from rtrace.gateway.protocol import Asked, edit, strip_chunk  # noqa: E402
from tests.test_gateway import (  # noqa: E402,F401 (fixtures)
    QUESTION, TOOLS, SplitUpstream, _post, _raw_exchange, accept_call, captured, chat, fake, gateway, only, sse,
    stream_until_cut, upstream)

BODY = json.dumps({"model": "fake-policy", "messages": QUESTION}).encode()
HEALTH = b"GET /rtrace/health HTTP/1.1\r\nhost: gw\r\n\r\n"


def _answers(got):
    """The status codes of the answers in ``got`` (bytes read from one connection), in order."""
    return [int(a[:3]) for a in got.split(b"HTTP/1.1 ")[1:]]


# ----------------------------------------------------------------------------- what the client asked for stays
class TestWhatTheClientAskedFor:
    def test_ids_the_client_asked_for_are_not_dropped_with_the_gateways_logprobs(self, captured, gateway, fake):
        """The client asks for token ids itself; the gateway adds only logprobs. A chunk that carried a
        token id and no text still carries the client's id after the logprobs are taken out: it is
        kept, so the client gets every id, as from the upstream directly (84 before the fix: 5)."""
        gateway()
        direct = sse(chat(fake.url, stream=True, return_token_ids=True).text)
        with rtrace.rollout_context(step=1):
            access = rtrace.gateway_access()
            via = sse(chat(access.base_url, access.api_key, stream=True, return_token_ids=True).text)
        assert fake.requests[-1]["body"]["logprobs"] is True  # the gateway did add logprobs
        assert via == direct
        ids = [i for e in via if e != "[DONE]" for c in e["choices"] for i in c.get("token_ids") or ()]
        (gen,) = only(captured.trajectories)
        assert ids == gen.response_ids and len(ids) > 20

    def test_a_completions_stream_keeps_every_event(self, captured, gateway, fake):
        """/v1/completions streams: vLLM sends an event per token whatever is asked, with empty text for a
        token that ends mid-character; the client gets every one of them through the gateway, as
        directly (the gateway dropped those: 6 events of 10 against vLLM), and the record has every id."""
        gateway()
        body = {"model": "fake-policy", "prompt": "2 + 40 = é?", "stream": True}
        direct = sse(httpx.post(f"{fake.url}/completions", json=body, timeout=30).text)
        with rtrace.rollout_context(step=1):
            access = rtrace.gateway_access()
            via = sse(httpx.post(f"{access.base_url}/completions", json=body, headers=access.headers,
                                 timeout=30).text)
        assert fake.requests[-1]["body"]["return_token_ids"] is True  # the gateway did ask for ids
        assert via == direct
        assert [e["choices"][0]["text"] for e in via[:-1]] == [" ", "4", "2", "", "é"]
        (gen,) = only(captured.trajectories)
        assert gen.output["text"] == " 42é" and gen.response_ids == [b + 10 for b in " 42é".encode()]

    @pytest.mark.parametrize("chunk, asked", [
        # chat: the client's token ids stay (the gateway asked logprobs only)
        ({"choices": [{"index": 0, "delta": {}, "logprobs": {"content": [{"token": "x", "logprob": -1.0}]},
                       "finish_reason": None, "token_ids": [151]}]}, Asked(False, True)),
        # completions: the client's logprobs stay (the gateway asked ids only): a token with no text yet
        ({"choices": [{"index": 0, "text": "", "logprobs": {"tokens": ["bytes:\\xe6"], "token_logprobs": [-0.2]},
                       "finish_reason": None, "token_ids": [151]}]}, Asked(True, False)),
        # the client's prompt ids at the top of a chunk
        ({"choices": [{"index": 0, "delta": {}, "logprobs": {"content": []}, "finish_reason": None}],
          "prompt_token_ids": [1, 2]}, Asked(False, True)),
    ])
    def test_a_chunk_with_what_the_client_asked_for_is_kept(self, chunk, asked):
        """strip_chunk and edit(chunk=True) agree: kept, with the client's fields as they came."""
        data = json.loads(json.dumps(chunk))
        assert strip_chunk(data, asked)
        for raw in (json.dumps(chunk).encode(), json.dumps(chunk, separators=(",", ":")).encode()):
            out, keep = edit(raw, asked, chunk=True)
            assert keep and json.loads(out) == data


# ----------------------------------------------------------------------------- answers over the size cap
class TestLargeAnswers:
    LONG = [{"role": "user", "content": "What is " + " + ".join(["1"] * 300) + "?"}]
    SHORT = [{"role": "user", "content": "What is 1 + 2?"}]

    def test_an_answer_over_the_cap_is_still_stripped(self, captured, gateway, fake):
        """Over RTRACE_GATEWAY_MAX_RESPONSE_BYTES (1 KiB here) but within 4x: the client gets exactly
        the upstream's answer to its own request (no ids, no logprobs it did not ask for); the call
        is recorded with a too_large gap, counted."""
        gateway(gateway_max_response_bytes=1024)
        direct = chat(fake.url, messages=self.SHORT, tools=None)
        with rtrace.rollout_context(step=1):
            access = rtrace.gateway_access()
            via = chat(access.base_url, access.api_key, messages=self.SHORT, tools=None)
        sent = fake.requests[-1]["body"]
        assert sent["return_token_ids"] is True and sent["logprobs"] is True
        assert via.status_code == 200 and via.json() == direct.json()
        assert via.json()["prompt_token_ids"] is None and via.json()["choices"][0]["logprobs"] is None
        (gen,) = only(captured.trajectories)
        assert gen.attributes["rtrace.capture_gap.codes"] == ["too_large"] and gen.response_ids is None
        stats = captured.stats()
        assert stats["gateway_responses_too_large"] == 1 and "gateway_responses_refused_too_large" not in stats

    def test_an_answer_too_large_to_strip_is_refused_not_leaked(self, captured, gateway, fake):
        """Over 4x the cap with fields the gateway added: 502 with an error that says why, counted,
        the span an error; never the answer with the gateway's own fields in it."""
        gateway(gateway_max_response_bytes=1024)
        with rtrace.rollout_context(step=1):
            access = rtrace.gateway_access()
            via = chat(access.base_url, access.api_key, messages=self.LONG, tools=None)
        assert via.status_code == 502
        error = via.json()["error"]
        assert error["code"] == "upstream_response_too_large" and "4096 bytes" in error["message"]
        assert b"token_ids\":[" not in via.content
        (gen,) = only(captured.trajectories)
        assert gen.status == "error" and "larger than 4096 bytes" in gen.error
        assert gen.attributes["rtrace.capture_gap.codes"] == ["too_large"]
        assert captured.stats()["gateway_responses_refused_too_large"] == 1

    def test_an_answer_with_nothing_to_take_out_passes_through_at_any_size(self, captured, gateway, fake):
        """The client asked for ids and logprobs itself: nothing is added, so an answer of any size is
        passed through as it came (not recorded past the cap)."""
        gateway(gateway_max_response_bytes=1024)
        direct = chat(fake.url, messages=self.LONG, tools=None, return_token_ids=True, logprobs=True)
        with rtrace.rollout_context(step=1):
            access = rtrace.gateway_access()
            via = chat(access.base_url, access.api_key, messages=self.LONG, tools=None, return_token_ids=True,
                       logprobs=True)
        assert len(direct.content) > 4096 and via.status_code == 200 and via.json() == direct.json()
        assert "gateway_responses_refused_too_large" not in captured.stats()


# ----------------------------------------------------------------------------- streamed events' bytes
EVENTS = [
    # nothing to take out (the gateway's fields are null): passed as it came, the big integer too
    b'id: 1\nevent: chunk\ndata: {"id":"c","seed":123456789012345678901234567890,"choices":[{"index":0,'
    b'"delta":{"role":"assistant","content":"Hi"},"logprobs":null,"finish_reason":null,"token_ids":null}]}',
    # something to take out: re-encoded, its id: / event: lines kept
    b'id: 2\nevent: chunk\ndata: {"id":"c","choices":[{"index":0,"delta":{"content":"!"},'
    b'"logprobs":{"content":[{"token":"!","logprob":-0.5}]},"finish_reason":"stop","token_ids":[43]}]}',
    b": a comment\ndata: [DONE]",
]


def test_streamed_events_keep_their_bytes_and_their_other_lines(captured):
    """An event with nothing to take out reaches the client byte for byte (an integer of more than
    64 bits stays one); one that had something taken out keeps its ``id:`` and ``event:`` lines."""
    body = b"".join(e + b"\n\n" for e in EVENTS)
    up = SplitUpstream(body, [])
    gw = start_gateway(up.url)
    try:
        with rtrace.rollout_context(step=1):
            access = rtrace.gateway_access()
            got = chat(access.base_url, access.api_key, stream=True, tools=None)
    finally:
        gw.stop()
    events = got.content.split(b"\n\n")
    assert events[0] == EVENTS[0] and events[2] == EVENTS[2] and events[3:] == [b""]
    head, data = events[1].rsplit(b"\n", 1)
    assert head == b"id: 2\nevent: chunk"
    assert json.loads(data[6:]) == {"id": "c", "choices": [{"index": 0, "delta": {"content": "!"}, "logprobs": None,
                                                            "finish_reason": "stop", "token_ids": None}]}
    (gen,) = only(captured.trajectories)
    assert gen.output["content"] == "Hi!" and gen.response_ids == [43]


class CutSplitUpstream(SplitUpstream):
    """SplitUpstream whose client (the gateway) may close the connection before it has sent all."""

    def _serve(self):
        try:
            super()._serve()
        except OSError:
            pass


def test_a_streamed_event_too_large_to_strip_cuts_the_stream(captured):
    """One event of a stream that grows past 4x RTRACE_GATEWAY_MAX_RESPONSE_BYTES before it ends: it
    cannot be held to take out what the gateway asked for, so the client's stream is cut after the
    events before it (never the event unstripped), counted; the span is an error."""
    first = {"id": "c", "choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hi"}, "logprobs": None,
                                     "finish_reason": None, "token_ids": [1]}]}
    huge = {"id": "c", "choices": [{"index": 0, "delta": {"content": "x"}, "logprobs": None, "finish_reason": None,
                                    "token_ids": list(range(100000, 104000))}]}
    body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in (first, huge)) + b"data: [DONE]\n\n"
    up = CutSplitUpstream(body, list(range(2000, len(body), 2000)))
    gw = start_gateway(up.url, gateway_max_response_bytes=1024)
    try:
        with rtrace.rollout_context(step=1):
            access = rtrace.gateway_access()
            got = stream_until_cut(access, {"model": "m", "messages": QUESTION, "stream": True})
    finally:
        gw.stop()
    assert [json.loads(e[6:]) for e in got.split(b"\n\n") if e] == [
        {**first, "choices": [{**first["choices"][0], "token_ids": None}]}]
    (gen,) = only(captured.trajectories)
    assert gen.status == "error" and "larger than 4096 bytes" in gen.error
    assert captured.stats()["gateway_responses_refused_too_large"] == 1


# ----------------------------------------------------------------------------- HTTP framing
class FixedUpstream:
    """An upstream that answers each request on one connection with the same fixed bytes."""

    def __init__(self, answer):
        self.answer = answer
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen()
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}/v1"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        conn, data = accept_call(self.listener)
        while True:
            while b"\r\n\r\n" not in data:
                more = conn.recv(65536)
                if not more:
                    return
                data += more
            head, _, data = data.partition(b"\r\n\r\n")
            length = [int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")]
            while len(data) < (length or [0])[0]:
                data += conn.recv(65536)
            data = data[(length or [0])[0]:]
            conn.sendall(self.answer)


class TestFraming:
    def test_head_on_a_streamed_route_has_no_body(self, captured, gateway, fake):
        """HEAD /v1/models (a streamed answer for GET): no last chunk after the head, so the next
        request on the kept-alive connection is answered in step."""
        gw = gateway(gateway_untraced="forward")
        got, closed = _raw_exchange(gw.url, b"HEAD /v1/models HTTP/1.1\r\nhost: gw\r\n\r\n" + HEALTH,
                                    until=b'"status":"ok"')
        head, _, rest = got.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 ") and rest.startswith(b"HTTP/1.1 200 OK\r\n")
        assert _answers(got) == [200, 200] and not closed

    @pytest.mark.parametrize("status", [204, 304])
    def test_an_upstream_answer_without_a_body_gets_no_framing(self, captured, gateway, status):
        """An upstream's 204 / 304 is passed on with neither content-length nor a (chunked) body; the
        next request on the connection is answered in step."""
        up = FixedUpstream(b"HTTP/1.1 %d No Body\r\nx-up: 1\r\n\r\n" % status)
        gw = start_gateway(up.url, gateway_untraced="forward")
        try:
            got, closed = _raw_exchange(gw.url, _post("/v1/chat/completions", BODY) + HEALTH,
                                        until=b'"status":"ok"')
        finally:
            gw.stop()
        head, _, rest = got.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 %d " % status) and b"x-up: 1" in head
        assert b"content-length" not in head and b"transfer-encoding" not in head
        assert rest.startswith(b"HTTP/1.1 200 OK\r\n") and not closed

    def test_an_h2c_upgrade_is_ignored_and_the_request_served(self, captured, gateway, fake):
        """``Upgrade: h2c`` (curl --http2): the request is answered as HTTP/1.1, a body too, and the
        connection goes on."""
        gw = gateway(gateway_untraced="forward")
        upgrade = "connection: Upgrade, HTTP2-Settings", "upgrade: h2c", "http2-settings: AAMAAABkAAQCAAAAAAIAAAAA"
        get = ("GET /rtrace/health HTTP/1.1\r\nhost: gw\r\n" + "\r\n".join(upgrade) + "\r\n\r\n").encode()
        got, closed = _raw_exchange(gw.url, get + _post("/v1/chat/completions", BODY, *upgrade) + HEALTH,
                                    until=lambda got: got.count(b'"status":"ok"') == 2)
        assert _answers(got) == [200, 200, 200] and not closed
        assert b"chat.completion" in got.split(b"HTTP/1.1 ")[2]
        assert fake.requests[-1]["body"]["messages"] == QUESTION
        assert "upgrade" not in fake.requests[-1]["headers"]

    def test_100_continue_waits_for_the_answer_in_progress(self, captured, gateway, fake):
        """A request with ``Expect: 100-continue`` whose head comes while a stream is being answered on
        the same connection: its ``100 Continue`` comes after that answer's end, never inside it."""
        gw = gateway(gateway_untraced="forward")
        fake.chunk_delay_s = 0.1
        stream = json.dumps({"model": "fake-policy", "messages": QUESTION, "tools": None, "stream": True}).encode()
        second = _post("/v1/chat/completions", BODY, "expect: 100-continue")
        head, body = second.split(b"\r\n\r\n", 1)
        parts = urlsplit(gw.url)
        sock = socket.create_connection((parts.hostname, parts.port), timeout=20)
        try:
            sock.sendall(_post("/v1/chat/completions", stream))
            got = b""
            while b"data: {" not in got:  # the stream has begun
                got += sock.recv(65536)
            sock.sendall(head + b"\r\n\r\n")
            while b"100 Continue" not in got:
                got += sock.recv(65536)
            sock.sendall(body)
            while b'"object":"chat.completion"' not in got:
                got += sock.recv(65536)
        finally:
            sock.close()
        first, _, after = got.partition(b"HTTP/1.1 100 Continue\r\n\r\n")
        assert first.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")  # the whole stream, then the 100
        assert after.startswith(b"HTTP/1.1 200 OK\r\n")


# ----------------------------------------------------------------------------- slow and stalled clients
class TestSlowClients:
    def test_a_request_still_arriving_is_not_swept_as_idle(self, captured, gateway, fake, monkeypatch):
        """A request whose body trickles in over several keep-alive periods is answered: the idle
        sweep leaves a connection alone while a request is arriving on it."""
        monkeypatch.setattr(gateway_http, "KEEP_ALIVE_S", 0.2)
        gw = gateway(gateway_untraced="forward")
        parts = urlsplit(gw.url)
        sock = socket.create_connection((parts.hostname, parts.port), timeout=20)
        try:
            data = _post("/v1/chat/completions", BODY)
            step = len(data) // 8 + 1
            for i in range(0, len(data), step):
                sock.sendall(data[i:i + step])
                time.sleep(0.15)  # 8 x 0.15 s: several keep-alive periods and sweeps
            got = b""
            while b"chat.completion" not in got:
                more = sock.recv(65536)
                assert more, got
                got += more
        finally:
            sock.close()
        assert got.startswith(b"HTTP/1.1 200 OK")

    def test_a_request_that_stalls_is_cut_with_408(self, captured, gateway, fake, monkeypatch):
        """A request whose head (or body) stops arriving is answered 408 after READ_TIMEOUT_S and the
        connection closed, counted; it never reaches the upstream."""
        monkeypatch.setattr(gateway_http, "READ_TIMEOUT_S", 0.3)
        gw = gateway(gateway_untraced="forward")
        for partial in (b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\n",
                        _post("/v1/chat/completions", BODY)[:-10]):
            got, closed = _raw_exchange(gw.url, partial, timeout=20)
            assert got.startswith(b"HTTP/1.1 408 ") and closed
        assert fake.requests == [] and captured.stats()["gateway_refused.request_timeout"] == 2


# ----------------------------------------------------------------------------- the upstream URL's credentials
def test_the_upstream_urls_credentials_are_never_shown(captured):
    """The upstream URL's user:password and query are not in /rtrace/health nor in a 502's body."""
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()  # nothing listens there: the upstream is unreachable
    gw = start_gateway(f"http://alice:s3cret@127.0.0.1:{port}/v1?api_key=t0ken", gateway_untraced="forward")
    try:
        health = httpx.get(f"{gw.url}/rtrace/health").json()
        down = httpx.post(f"{gw.url}/v1/chat/completions", content=BODY)
    finally:
        gw.stop()
    assert health["upstream"] == f"http://127.0.0.1:{port}/v1"
    assert down.status_code == 502 and f"upstream http://127.0.0.1:{port}/v1:" in down.json()["error"]["message"]
    for text in (json.dumps(health), down.text):
        assert "s3cret" not in text and "alice" not in text and "t0ken" not in text
