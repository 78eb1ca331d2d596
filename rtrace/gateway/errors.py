"""The gateway's own answers: OpenAI-style errors, each counted (``gateway_refused.<code>``)."""

from __future__ import annotations

from starlette.responses import Response

from .. import _stats
from .protocol import dumps

__all__ = ["Refused", "error_body", "error_response"]

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
                405: "invalid_request_error", 413: "invalid_request_error", 502: "api_error", 503: "api_error",
                504: "api_error"}


def error_body(status: int, code: str, message: str) -> bytes:
    """An OpenAI-style error: ``{"error": {"message", "type", "param", "code"}}``."""
    return dumps({"error": {"message": message, "type": _ERROR_TYPES.get(status, "api_error"), "param": None,
                            "code": code}})


def error_response(status: int, code: str, message: str) -> Response:
    """:func:`error_body` as a Starlette response."""
    return Response(error_body(status, code, message), status, media_type="application/json")


class Refused(Exception):
    """A request answered with an OpenAI-style error (counted as ``gateway_refused.<code>``)."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code

    def response(self) -> Response:
        _stats.incr(f"gateway_refused.{self.code}")
        return error_response(self.status, self.code, str(self))

    def body(self) -> bytes:
        """The error's JSON (counted, as :meth:`response`)."""
        _stats.incr(f"gateway_refused.{self.code}")
        return error_body(self.status, self.code, str(self))
