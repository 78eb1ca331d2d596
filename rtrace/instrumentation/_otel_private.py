"""The OpenTelemetry API internals the hot path reads, each behind one small function.

A decorated call sets its span as the current one and reads its parent from the current
context. Through the public API (``trace.set_span_in_context`` + ``context.attach``,
``trace.get_current_span``) that is 8 Python calls and ~1 µs per span, a fifth of what a
traced call costs. These functions do the same with the ContextVar behind the API:

* ``opentelemetry.context._RUNTIME_CONTEXT._current_context``: the ContextVar holding the
  current ``Context``, when the runtime context is the API's default
  ``ContextVarsRuntimeContext`` (``OTEL_PYTHON_CONTEXT`` can choose another: then the
  public functions are used);
* ``opentelemetry.trace.propagation._SPAN_KEY``: the key of the current span in a Context;
* ``SpanContext``'s layout, a tuple ``(trace_id, span_id, is_remote, trace_flags,
  trace_state, is_valid)``: a child's context is built without the validation of ids
  rtrace made itself.

Nothing else in rtrace touches these names (``tests/test_private_apis.py``), and the
same test checks each of :data:`PRIVATE_NAMES` against the installed opentelemetry-api
and that these functions agree with the public API, so an upgrade that moves one fails
there, naming it. When a name is missing at import, the public API is used instead.
"""

from __future__ import annotations

from contextvars import ContextVar, Token
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace as otel_trace
from opentelemetry.context.context import Context
from opentelemetry.trace import INVALID_SPAN, Span, SpanContext

__all__ = ["PRIVATE_NAMES", "FAST", "current_span", "current_value", "attach_span", "detach", "span_context"]

PRIVATE_NAMES = (
    "opentelemetry.context:_RUNTIME_CONTEXT._current_context",
    "opentelemetry.trace.propagation:_SPAN_KEY",
)

_public_attach = otel_context.attach
_public_detach = otel_context.detach
_set_span_in_context = otel_trace.set_span_in_context
_get_current_span = otel_trace.get_current_span
_dict_set = dict.__setitem__
_tuple_new = tuple.__new__


def _current_var() -> tuple[ContextVar[Context] | None, str | None]:
    try:
        from opentelemetry.context.contextvars_context import ContextVarsRuntimeContext
        from opentelemetry.trace.propagation import _SPAN_KEY

        runtime = otel_context._RUNTIME_CONTEXT
        var = runtime._current_context if type(runtime) is ContextVarsRuntimeContext else None
        if not isinstance(var, ContextVar) or not isinstance(_SPAN_KEY, str):
            return None, None
        return var, _SPAN_KEY
    except (ImportError, AttributeError):
        return None, None


_VAR, _KEY = _current_var()
#: True when the ContextVar is used; False: every function below is the public API.
FAST = _VAR is not None

if _VAR is not None:
    _var_get, _var_set, _var_reset = _VAR.get, _VAR.set, _VAR.reset

    def current_span() -> Span:
        """``trace.get_current_span()``."""
        span = _var_get().get(_KEY)
        return span if isinstance(span, Span) else INVALID_SPAN

    def current_value() -> Any:
        """What the current context holds as its span, unchecked (None when nothing)."""
        return _var_get().get(_KEY)

    def attach_span(span: Span) -> Token[Context]:
        """``context.attach(trace.set_span_in_context(span))``."""
        ctx = Context(_var_get())
        _dict_set(ctx, _KEY, span)
        return _var_set(ctx)

    def detach(token: Token[Context]) -> None:
        """``context.detach(token)``: a token of another context is logged by the API, not raised."""
        try:
            _var_reset(token)
        except Exception:
            _public_detach(token)  # logs "Failed to detach context", as it always did

else:  # pragma: no cover - another runtime context, or the names moved
    def current_span() -> Span:
        return _get_current_span()

    current_value = current_span

    def attach_span(span: Span) -> Any:
        return _public_attach(_set_span_in_context(span))

    detach = _public_detach


def _check_layout() -> bool:
    try:
        ctx = SpanContext(5, 7, False, otel_trace.TraceFlags(1))
        return tuple(ctx) == (5, 7, False, ctx.trace_flags, ctx.trace_state, True)
    except Exception:  # pragma: no cover
        return False


if _check_layout():
    def span_context(trace_id: int, span_id: int, trace_flags: Any, trace_state: Any) -> SpanContext:
        """``SpanContext(trace_id, span_id, False, trace_flags, trace_state)`` for valid,
        non-remote ids (rtrace's own, never 0)."""
        return _tuple_new(SpanContext, (trace_id, span_id, False, trace_flags, trace_state, True))
else:  # pragma: no cover
    def span_context(trace_id: int, span_id: int, trace_flags: Any, trace_state: Any) -> SpanContext:
        return SpanContext(trace_id, span_id, False, trace_flags, trace_state)
