"""Small, offline building blocks for ``rtrace demo`` and the tests (no hub downloads)."""

from .tokenizer import build_tokenizer

__all__ = ["build_tokenizer"]
