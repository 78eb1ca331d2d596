"""The decorators: ``traced_rollout``, ``traced_generation``, ``traced_tool``, ``traced``.

The function's shape (plain, coroutine, generator, async generator) is decided once, at
decoration time, and every wrapper shares :class:`_Call`, the one helper that opens the
span, records the call and closes the span. The wrapper itself starts with one check
(``_runtime is None``, a module global kept equal to ``_state.runtime``): with tracing
off that check and the call are all it does.

On the hot path a decorated call creates its span and records what it saw: references to
its arguments and the lengths of its list arguments (dicts are copied, see
``rtrace.instrumentation.capture``). The record's fields are kept on the span itself when it
is one of rtrace's (:class:`~rtrace.instrumentation.spans.RSpan`), else in one
:class:`~rtrace.pipeline.records.CallRecord`. Attributes, RL coordinates, JSON conversion
and token decoding are all added later, in the worker thread.
"""

from __future__ import annotations

import functools
import inspect
import traceback
from time import time_ns as _time_ns
from typing import Any, Callable, TypeVar, overload

from opentelemetry.trace import Status, StatusCode

from .. import _stats
from ..pipeline.records import CallRecord, CallSpec, Mark, Tally
from . import _state
from ._otel_private import attach_span as _attach_span
from ._otel_private import detach as _detach
from .capture import snapshot
from .spans import RSpan

__all__ = ["traced", "traced_rollout", "traced_generation", "traced_tool"]

F = TypeVar("F", bound=Callable[..., Any])

_FRAME = _state.FRAME
_FRAME_get = _FRAME.get
_list, _dict = list, dict
_UNSET = _state.UNSET
_ERROR = StatusCode.ERROR
# The hot path keeps at most this much of an exception's text (the worker bounds it
# again to max_value_chars): a 200,000-character message is not copied per span.
_MAX_ERROR_CHARS = 65_536
_NO_STR = "<str() of the exception failed>"

# The runtime, mirrored here so the wrappers' off check is a single global lookup.
_runtime: Any = _state.runtime


def _on_runtime(rt: Any) -> None:
    global _runtime
    _runtime = rt


_state._listeners.append(_on_runtime)


def _open(rt: _state.Runtime, spec: CallSpec, args: tuple, kwargs: dict) -> tuple | None:
    """Start the span for one call: ``(span, record, frame)``, or None when this call is
    not traced. ``span`` is None for a root that is not traced (sampled out): its frame
    is still set during the call so the calls inside it are not traced either; ``frame``
    is the Frame this call opened when it is a trajectory root (else None)."""
    frame = _FRAME_get()
    if frame is None:
        # No trajectory is open: this call is the root of a new one.
        span, frame = _state.start_root(rt, spec.name, spec.kind, {})
        if span is None:  # not traced; the root call of a summarized rollout ends its tally
            return None, frame.tally, frame
        opened = frame
    else:
        if frame.state is None:
            tally = frame.tally
            return None if tally is None else _mark(rt, tally, spec, args, kwargs)
        span = rt.start_child(spec.name)
        opened = None
    state = frame.state
    if type(span) is RSpan:  # the span carries what the call saw (no CallRecord, no captures entry)
        record: Any = span
        span.spec = spec
        span.output = span.owner_name = None
        span.has_output = False
    else:
        record = CallRecord(spec, None, None)
        captures = state.captures
        # Bounded: past max_spans_per_trajectory the worker drops the span anyway.
        if len(captures) < rt.registry.max_spans:
            captures[span.get_span_context().span_id] = record
    if spec.capture and rt.capture:
        _capture(record, spec, args, kwargs)
    else:
        record.args = record.kwargs = record.arg_lens = None
    return span, record, opened


def _mark(rt: _state.Runtime, tally: Tally, spec: CallSpec, args: tuple, kwargs: dict) -> tuple | None:
    """A call inside a rollout recorded as a summary only: a :class:`Mark` in its tally
    (no span, nothing made current); ``(None, mark, None)``, or None past the tally's bound."""
    marks = tally.marks
    # the root and max_spans_per_trajectory - 1 calls: what a recorded trajectory keeps
    if len(marks) >= rt.registry.max_spans - 1:
        tally.dropped_marks += 1
        return None
    mark = Mark(spec, _time_ns())
    marks.append(mark)
    if spec.capture and rt.capture:
        _capture(mark, spec, args, kwargs)
    return None, mark, None


def _capture(record: Any, spec: CallSpec, args: tuple, kwargs: dict) -> None:
    """What the call saw, kept on ``record`` (an RSpan, a CallRecord or a Mark): references,
    a dict copied, a list's length noted (the snapshot is made in the worker)."""
    # The call's own argument tuple is kept as it is when it holds no dict (a dict is
    # copied): a list's length is noted, the snapshot made in the worker. One object
    # less per call for Python's GC to walk while the trajectory waits.
    if _dict in map(type, args):
        record.args, record.arg_lens = tuple(map(snapshot, args)), None
    elif _list in map(type, args):
        record.args, record.arg_lens = args, tuple([len(a) if type(a) is _list else -1 for a in args])
    else:
        record.args, record.arg_lens = args, None
    if kwargs:
        values = kwargs.values()
        record.kwargs = ({k: snapshot(v) for k, v in kwargs.items()}
                         if _list in map(type, values) or _dict in map(type, values) else kwargs)
    else:
        # not the call's own empty dict: one object less per call kept alive for Python's GC
        # (a tally of 20 calls kept 93; the GC's collections come with what is kept)
        record.kwargs = None
    if spec.skip_first and args and spec.kind == "tool":
        owner_name = getattr(args[0], "name", None)
        if isinstance(owner_name, str):
            record.owner_name = owner_name


class _Call:
    """One traced call: its span, its record and, for a root, the trajectory it opened.

    ``enter()`` / ``exit()`` bracket each stretch of the function's own code (the whole
    call, or one step of a generator) so nothing leaks into the caller in between.
    """

    __slots__ = ("span", "record", "frame", "_span_token", "_frame_token")

    def __init__(self, span: Any, record: CallRecord | None, frame: Any) -> None:
        self.span = span
        self.record = record
        #: the Frame this call opened when it is a trajectory root (else None)
        self.frame = frame
        self._span_token = None
        self._frame_token = None

    def enter(self) -> None:
        if self.span is not None:
            self._span_token = _attach_span(self.span)
        if self.frame is not None:
            self._frame_token = _FRAME.set(self.frame)

    def exit(self) -> None:
        if self._frame_token is not None:
            _FRAME.reset(self._frame_token)
            self._frame_token = None
        if self._span_token is not None:
            _detach(self._span_token)
            self._span_token = None

    def set_output(self, value: Any) -> None:
        record = self.record
        if record is not None and record.args is not None:  # captured
            record.output = snapshot(value)
            record.has_output = True

    def fail(self, exc: BaseException) -> None:
        span = self.span
        if span is not None:
            fail_span(span, exc)
        elif self.record is not None:  # a summarized rollout's call (a Mark) or root (its Tally)
            self.record.fail(exc)

    def end(self) -> None:
        if self.span is not None:
            self.span.end()
        elif self.record is not None:
            self.record.end()


def fail_span(span: Any, exc: BaseException) -> None:
    """Mark ``span`` failed by ``exc`` without ever raising: an exception whose
    ``__str__`` raises must still reach the program unchanged (its text is bounded and
    converted in the worker, not here)."""
    try:
        text = str(exc)
    except Exception:
        text = _NO_STR
    try:
        span.set_status(Status(_ERROR, f"{type(exc).__name__}: {text[:_MAX_ERROR_CHARS]}"))
        if text is _NO_STR:
            # The SDK's record_exception calls str(exc) itself: write the same event
            # without it (traceback formatting copes with a failing __str__).
            span.add_event("exception", {
                "exception.type": type(exc).__name__, "exception.message": text, "exception.escaped": "True",
                "exception.stacktrace": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))})
        else:
            span.record_exception(exc, escaped=True)
    except Exception:
        _stats.incr("internal_errors")
        _stats.warn_once("record-exception", "rtrace could not record an exception on a span", exc_info=True)


def _open_or_none(spec: CallSpec, args: tuple, kwargs: dict) -> tuple | None:
    """Slow path of every wrapper: tracing may be on; ``(span, record, frame)`` of the
    call if it is traced (:func:`_open`), else None."""
    rt = _runtime
    if rt is None or rt is _UNSET:
        rt = _state.get_runtime()
        if rt is None:
            return None
    try:
        return _open(rt, spec, args, kwargs)
    except Exception:  # telemetry never breaks the traced program
        _stats.incr("internal_errors")
        _stats.warn_once("open", "rtrace could not open a span; the call runs untraced", exc_info=True)
        return None


def _call_or_none(spec: CallSpec, args: tuple, kwargs: dict) -> _Call | None:
    """:func:`_open_or_none` as a :class:`_Call` (the generator wrappers)."""
    opened = _open_or_none(spec, args, kwargs)
    return None if opened is None else _Call(*opened)


def _wrap_function(func: Callable, spec: CallSpec) -> Callable:
    # _Call's enter / fail / exit / end / set_output, written out: the usual call of a
    # traced program, where four method calls are a tenth of what tracing costs
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _runtime is None:
            return func(*args, **kwargs)
        opened = _open_or_none(spec, args, kwargs)
        if opened is None:
            return func(*args, **kwargs)
        span, record, frame = opened
        span_token = None if span is None else _attach_span(span)
        frame_token = None if frame is None else _FRAME.set(frame)
        try:
            result = func(*args, **kwargs)
        except BaseException as exc:
            if span is not None:
                fail_span(span, exc)
            elif record is not None:  # a summarized rollout's call (a Mark) or root (its Tally)
                record.fail(exc)
            raise
        else:
            # before the span ends: once ended, the worker may read its record any time
            if record is not None and record.args is not None:  # captured
                record.output = snapshot(result)
                record.has_output = True
        finally:
            if frame_token is not None:
                _FRAME.reset(frame_token)
            if span_token is not None:
                _detach(span_token)
            if span is not None:
                span.end()
            elif record is not None:
                record.end()
        return result

    return wrapper


def _wrap_coroutine(func: Callable, spec: CallSpec) -> Callable:
    @functools.wraps(func)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _runtime is None:
            return await func(*args, **kwargs)
        opened = _open_or_none(spec, args, kwargs)
        if opened is None:
            return await func(*args, **kwargs)
        span, record, frame = opened
        span_token = None if span is None else _attach_span(span)
        frame_token = None if frame is None else _FRAME.set(frame)
        try:
            result = await func(*args, **kwargs)
        except BaseException as exc:
            if span is not None:
                fail_span(span, exc)
            elif record is not None:  # a summarized rollout's call (a Mark) or root (its Tally)
                record.fail(exc)
            raise
        else:
            # before the span ends: once ended, the worker may read its record any time
            if record is not None and record.args is not None:  # captured
                record.output = snapshot(result)
                record.has_output = True
        finally:
            if frame_token is not None:
                _FRAME.reset(frame_token)
            if span_token is not None:
                _detach(span_token)
            if span is not None:
                span.end()
            elif record is not None:
                record.end()
        return result

    return wrapper


def _wrap_generator(func: Callable, spec: CallSpec) -> Callable:
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _runtime is None:
            return (yield from func(*args, **kwargs))
        call = _call_or_none(spec, args, kwargs)
        if call is None:
            return (yield from func(*args, **kwargs))
        # `yield from` would keep our span attached while the caller runs between items;
        # instead each step of the inner generator runs with the span attached, and the
        # caller never sees it.
        gen = func(*args, **kwargs)
        items = 0
        to_send: Any = None
        to_throw: BaseException | None = None
        try:
            while True:
                call.enter()
                try:
                    if to_throw is not None:
                        exc, to_throw = to_throw, None
                        item = gen.throw(exc)
                    else:
                        item = gen.send(to_send)
                except StopIteration as stop:
                    call.set_output({"yielded": items, "return": stop.value})
                    return stop.value
                finally:
                    call.exit()
                items += 1
                try:
                    to_send = yield item
                except GeneratorExit:
                    raise
                except BaseException as exc:  # caller's .throw(): pass it to the inner generator
                    to_throw = exc
        except GeneratorExit:
            # Closed early (break, .close(), garbage collection): close the inner one too.
            call.enter()
            try:
                gen.close()
            finally:
                call.exit()
            call.set_output({"yielded": items, "closed": True})
            raise
        except BaseException as exc:
            call.fail(exc)
            raise
        finally:
            call.end()

    return wrapper


def _wrap_async_generator(func: Callable, spec: CallSpec) -> Callable:
    @functools.wraps(func)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        call = None if _runtime is None else _call_or_none(spec, args, kwargs)
        agen = func(*args, **kwargs)
        # `yield from` does not exist for async generators: this loop forwards every item,
        # asend() value, athrow() exception and aclose(), traced or not, so the caller
        # sees exactly what the undecorated generator would do.
        items = 0
        to_send: Any = None
        to_throw: BaseException | None = None
        try:
            while True:
                if call is not None:
                    call.enter()
                try:
                    if to_throw is not None:
                        exc, to_throw = to_throw, None
                        item = await agen.athrow(exc)
                    else:
                        item = await agen.asend(to_send)
                except StopAsyncIteration:
                    if call is not None:
                        call.set_output({"yielded": items})
                    return
                finally:
                    if call is not None:
                        call.exit()
                items += 1
                try:
                    to_send = yield item
                except GeneratorExit:
                    raise
                except BaseException as exc:  # caller's athrow(): pass it to the inner generator
                    to_throw = exc
        except GeneratorExit:
            # Closed early (break, aclose(), garbage collection): close the inner one too.
            if call is not None:
                call.enter()
            try:
                await agen.aclose()
            finally:
                if call is not None:
                    call.exit()
                    call.set_output({"yielded": items, "closed": True})
            raise
        except BaseException as exc:
            if call is not None:
                call.fail(exc)
            raise
        finally:
            if call is not None:
                call.end()

    return wrapper


def _param_names(func: Callable) -> tuple[str, ...]:
    try:
        params = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):
        return ()
    return tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


def _decorate(func: Any, kind: str, name: str | None, capture: bool, options: dict[str, Any]) -> Any:
    if isinstance(func, (classmethod, staticmethod)):
        # Applied above @classmethod / @staticmethod: wrap the function inside.
        return type(func)(_decorate(func.__func__, kind, name, capture, options))
    if not callable(func):
        raise TypeError(f"rtrace decorators apply to functions, not {type(func).__name__}")
    names = _param_names(func)
    # Default span name: the qualified name, without the "f.<locals>." of nested functions.
    qualname = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
    module = getattr(func, "__module__", None)
    spec = CallSpec(kind=kind, name=name or qualname.rsplit("<locals>.", 1)[-1],
                    capture=capture, param_names=names,
                    skip_first=bool(names) and names[0] in ("self", "cls"), options=options,
                    default_name=not name, function=f"{module}.{qualname}" if module else qualname)
    if inspect.isasyncgenfunction(func):
        wrapper = _wrap_async_generator(func, spec)
    elif inspect.iscoroutinefunction(func):
        wrapper = _wrap_coroutine(func, spec)
    elif inspect.isgeneratorfunction(func):
        wrapper = _wrap_generator(func, spec)
    else:
        wrapper = _wrap_function(func, spec)
    wrapper.__rtrace_spec__ = spec  # type: ignore[attr-defined]
    return wrapper


def _decorator(kind: str, func: Any, name: str | None, capture: bool, **options: Any) -> Any:
    if func is not None:  # used bare: @traced_tool
        return _decorate(func, kind, name, capture, options)
    return lambda f: _decorate(f, kind, name, capture, options)


@overload
def traced(func: F, /) -> F: ...
@overload
def traced(*, kind: str = "chain", name: str | None = None, capture: bool = True) -> Callable[[F], F]: ...
def traced(func: Any = None, /, *, kind: str = "chain", name: str | None = None,
           capture: bool = True) -> Any:
    """Trace any function as a span of kind ``kind`` (default ``chain``).

    Works bare (``@traced``) or with arguments, on functions, methods,
    classmethods/staticmethods, async functions, generators and async generators.

    Args:
        kind: the span kind shown by the sinks (``chain``, ``agent``, ``retriever`` ...).
        name: the span name; default the function's ``__qualname__`` (a tool span: the
            tool's name, a generation span: the model's name, when known; the function's
            fully-qualified name is then kept in the ``code.function.name`` attribute).
        capture: record arguments (without ``self``/``cls``) and the return value.
            ``False`` records names and timings only.
    """
    return _decorator(kind, func, name, capture)


def traced_rollout(func: Any = None, /, *, name: str | None = None, capture: bool = True) -> Any:
    """Trace an agent loop (kind ``agent``).

    Inside a ``rollout_context`` it is a child of the trajectory's root; called with no
    trajectory open, it is the root of a new trajectory (without RL coordinates).
    """
    return _decorator("agent", func, name, capture)


def traced_generation(func: Any = None, /, *, name: str | None = None, capture: bool = True,
                      model: str | None = None, prompt_field: str = "prompt_ids",
                      response_field: str = "response_ids", messages_field: str = "messages") -> Any:
    """Trace an LLM call (kind ``generation``).

    Token ids are read in the worker thread, never on the call: ``prompt_ids`` is the
    argument named ``prompt_field``; ``response_ids`` is the return value when it is a
    list/array/tensor of ids, else its ``response_field`` item or attribute (then
    ``token_ids``, ``output_ids``). ``messages_field`` names the chat-messages argument.
    Usage (``gen_ai.usage.*``) and finish reason are derived from them. See
    docs/token2text.md for the full mapping.

    Args:
        model: recorded as ``gen_ai.request.model`` (else a ``model`` argument, if any);
            without ``name=``, the span is named after it.
    """
    return _decorator("generation", func, name, capture, model=model, prompt_field=prompt_field,
                      response_field=response_field, messages_field=messages_field)


def traced_tool(func: Any = None, /, *, name: str | None = None, capture: bool = True,
                tool_name: str | None = None) -> Any:
    """Trace a tool call (kind ``tool``).

    The tool's name (``gen_ai.tool.name``) is ``tool_name``, else the ``name`` attribute
    of the method's instance (``self.name``), else the span name. Without ``name=`` the
    span is named after the tool (``calculator``, not ``CalculatorTool.execute``). A
    ``tool_call_id`` / ``call_id`` argument becomes ``gen_ai.tool.call.id``.
    """
    return _decorator("tool", func, name, capture, tool_name=tool_name)
