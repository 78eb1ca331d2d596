"""Small stand-ins the tests share (not backends: those are real, see tests/backends.py)."""

from __future__ import annotations

import threading


class BlockingTokenizer:
    """A tokenizer whose ``batch_decode`` holds rtrace's worker thread inside token2text
    until ``release`` is set (``entered`` tells that it is held): the span queue then
    fills, deterministically."""

    def __init__(self, timeout_s: float = 10.0) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.timeout_s = timeout_s

    def batch_decode(self, ids, **kwargs):
        self.entered.set()
        self.release.wait(self.timeout_s)
        return ["x"] * len(ids)
