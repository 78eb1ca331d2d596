"""Drop-in for veRL's ``verl/utils/rollout_trace.py``, backed by rtrace's pipeline and sinks.

A veRL agent loop switches by changing one import::

    # from verl.utils.rollout_trace import RolloutTraceConfig, rollout_trace_attr, rollout_trace_op
    from rtrace.compat.verl import RolloutTraceConfig, rollout_trace_attr, rollout_trace_op

The three names keep veRL's signatures and behaviour (see docs/frameworks/verl.md):

* ``RolloutTraceConfig.init(project_name, experiment_name, backend, token2text=False,
  max_samples_per_step_per_worker=None)`` — a process-wide singleton, initialised once
  (later calls are ignored, as in veRL). ``backend`` is ``"trackio"``, ``"mlflow"``,
  ``"otlp"`` or ``"jsonl"`` (or a comma list of them) and configures rtrace with
  ``rtrace.configure(exporter=backend, project=project_name, experiment=experiment_name,
  token2text=token2text)``; ``None`` and veRL's ``"dummy"`` mean tracing off; any other
  name (veRL's ``"weave"`` included) raises :class:`rtrace.ConfigError`.
  ``get_backend()``, ``get_client()`` (always None: there is no backend client to hand
  out), ``enable_token2text()`` and ``reset()`` behave as veRL's.
* ``rollout_trace_attr(sample_index, step, rollout_n, name, validate, trace=True)`` — a
  context manager: one trajectory (``rtrace.rollout_context``) with those coordinates
  and ``rl.experiment`` = experiment_name. ``trace=False`` runs the block untraced, and
  every ``rollout_trace_op`` inside it calls straight through.
* ``rollout_trace_op`` — decorates a method (sync or async). The span's name is the
  method's ``__qualname__`` (a tool's span: the tool's name, the qualified name kept in
  ``code.function``), its input the bound arguments without ``self`` (defaults
  applied; ``**kwargs`` shown flat, as rtrace's decorators show them), its output the return value, which the caller gets untouched. The span kind
  follows veRL's traced methods: ``generate`` is a generation (prompt ids, response
  ids / ``token_ids``, finish / ``stop_reason``), ``execute`` a tool call (tool name =
  ``self.name``), ``run`` the agent loop, anything else a chain; pass
  ``rollout_trace_op(kind=...)`` to choose.

token2text: when an op's ``self`` carries a ``tokenizer``, rtrace adopts it
(``rtrace.set_tokenizer``) if none is set, so every generation span gets
``rtrace.prompt_text`` / ``rtrace.response_text`` — also the server client's
``generate``, which has no tokenizer in veRL. As in veRL, an op whose result has
``prompt_ids`` / ``response_ids`` (``AgentLoopOutput``) or ``token_ids`` shows
``prompt_text`` / ``response_text`` in its output; decoding happens in rtrace's worker
thread, not on the traced call.

The per-step cap: ``max_samples_per_step_per_worker`` = K keeps, per process (one veRL
agent-loop worker) and per (step, validate), the trajectories of the first K distinct
``sample_index`` values with all their rollouts (a whole GRPO group), as veRL documents;
the others run as ``trace=False``. veRL picks the K samples at random in
``AgentLoopWorker.generate_sequences`` (which reads the same attribute and passes
``trace=False``, so both agree); rtrace admits the first K to start. It is separate from
rtrace's own ``max_traces_per_step`` (``RTRACE_MAX_TRACES_PER_STEP``), which caps
trajectories (not samples) per process across all call sites and still applies on top.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import threading
from collections import OrderedDict
from contextvars import ContextVar
from typing import Any, Callable, Iterator, Optional

import rtrace

from .. import _stats
from ..config import EXPORTERS, ConfigError
from ..instrumentation import _state

__all__ = ["RolloutTraceConfig", "rollout_trace_attr", "rollout_trace_op"]

#: Backend names that mean "tracing off", as in veRL.
OFF_BACKENDS = (None, "dummy")
#: Steps whose sample sets are remembered (older ones are forgotten: bounded memory).
_STEPS_KEPT = 64


def _sinks(backend: Any) -> tuple[str, ...]:
    """The rtrace exporters of a veRL backend name; () for off. Raises ConfigError."""
    if backend is None or (isinstance(backend, str) and backend.strip().lower() == "dummy"):
        return ()
    accepted = ("accepted values: " + ", ".join(n for n in EXPORTERS if n != "console")
                + " (or a comma list of them), None or 'dummy' (tracing off)")
    if not isinstance(backend, str):
        raise ConfigError(f"RolloutTraceConfig.init(backend={backend!r}): not a backend name; {accepted}")
    names = tuple(n.strip().lower() for n in backend.split(",") if n.strip())
    for name in names:
        if name not in EXPORTERS:
            hint = " (rtrace has no weave sink; trackio or mlflow show the same traces)" if name == "weave" else ""
            raise ConfigError(f"RolloutTraceConfig.init(backend={backend!r}): unknown trace backend "
                              f"{name!r}{hint}; {accepted}")
    if not names:
        raise ConfigError(f"RolloutTraceConfig.init(backend={backend!r}): empty backend; {accepted}")
    return names


class RolloutTraceConfig:
    """Rollout tracing configuration: a process-wide singleton, as in veRL.

    Args (of :meth:`init`):
        project_name: trackio project / MLflow experiment.
        experiment_name: run name; stamped as ``rl.experiment`` on every span.
        backend: ``"trackio"`` | ``"mlflow"`` | ``"otlp"`` | ``"jsonl"`` (or a comma list);
            ``None`` / ``"dummy"``: off.
        token2text: decode token ids to text (with the tokenizer of the traced objects).
        max_samples_per_step_per_worker: trace at most this many distinct samples (with
            all their rollouts) per step in this process; None traces all.
    """

    _instance: Optional["RolloutTraceConfig"] = None
    backend: Optional[str] = None
    client: Optional[object] = None
    token2text: bool = False
    _initialized: bool = False
    project_name: Optional[str] = None
    experiment_name: Optional[str] = None
    max_samples_per_step_per_worker: Optional[int] = None

    def __new__(cls, *args: Any, **kwargs: Any) -> "RolloutTraceConfig":
        if cls._instance is None:
            cls._instance = super().__new__(cls)
            cls._instance._initialized = False
            cls._instance._sinks = ()
            cls._instance._lock = threading.Lock()
            cls._instance._samples = OrderedDict()
        return cls._instance

    @classmethod
    def get_instance(cls) -> "RolloutTraceConfig":
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    @classmethod
    def init(cls, project_name: str, experiment_name: str, backend: str, token2text: bool = False,
             max_samples_per_step_per_worker: Optional[int] = None) -> None:
        """Configure tracing once per process (later calls are ignored, as in veRL).

        Raises:
            ConfigError: an unknown backend or a bad cap (nothing is configured then).
        """
        config = cls.get_instance()
        if config._initialized:
            return
        sinks = _sinks(backend)
        cap = max_samples_per_step_per_worker
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 0):
            raise ConfigError(f"RolloutTraceConfig.init(max_samples_per_step_per_worker={cap!r}): "
                              "accepted values: an integer >= 0, or None (trace every sample)")
        if sinks:
            rtrace.configure(exporter=",".join(sinks), project=project_name,
                             experiment=None if experiment_name is None else str(experiment_name),
                             token2text=bool(token2text))
        config.backend = backend
        config.token2text = bool(token2text)
        config.project_name = project_name
        config.experiment_name = experiment_name
        config.max_samples_per_step_per_worker = cap
        config.client = None
        config._sinks = sinks
        config._initialized = True

    @classmethod
    def get_backend(cls) -> Optional[str]:
        return cls.get_instance().backend

    @classmethod
    def get_client(cls) -> Optional[object]:
        """Always None: rtrace's sinks run in its own threads, there is no client to share."""
        return cls.get_instance().client

    @classmethod
    def enable_token2text(cls) -> Optional[bool]:
        return cls.get_instance().token2text

    @classmethod
    def reset(cls) -> None:
        """Forget the configuration (as veRL's; rtrace's own configuration is left as is)."""
        cls._instance = None

    def _admit(self, step: Any, validate: bool, sample_index: Any) -> bool:
        """The per-step sample cap: True while fewer than K distinct samples were admitted."""
        cap = self.max_samples_per_step_per_worker
        if cap is None:
            return True
        key = (bool(validate), step)
        with self._lock:
            seen = self._samples.get(key)
            if seen is None:
                seen = self._samples[key] = set()
                if len(self._samples) > _STEPS_KEPT:
                    self._samples.popitem(last=False)
            if sample_index is not None and sample_index in seen:
                return True
            if len(seen) >= cap:
                return False
            # A trajectory without a sample index is a sample of its own.
            seen.add(object() if sample_index is None else sample_index)
            return True


def _plain(value: Any) -> Any:
    """numpy / torch scalars (veRL's batch indices) as Python numbers."""
    item = getattr(value, "item", None)
    return item() if callable(item) and getattr(value, "shape", None) == () else value


@contextlib.contextmanager
def rollout_trace_attr(sample_index: Any = None, step: Any = None, rollout_n: Any = None,
                       name: str = "rollout_trace", validate: bool = False, trace: bool = True) -> Iterator[None]:
    """One traced trajectory with these RL coordinates (veRL's signature).

    Args:
        sample_index: the sample's index in the batch / dataset.
        step: the training step.
        rollout_n: the rollout number (GRPO: several per sample).
        name: the name of the trajectory's root span.
        validate: whether this is a validation rollout.
        trace: False runs the block untraced; the ops inside call straight through.
    """
    config = RolloutTraceConfig.get_instance()
    if config.backend is None or not config._sinks:  # off (None or "dummy")
        yield
        return
    sample_index, step, rollout_n = _plain(sample_index), _plain(step), _plain(rollout_n)
    if trace and not config._admit(step, validate, sample_index):
        _stats.incr("trajectories_sampled_out")
        trace = False
    with rtrace.rollout_context(step=step, sample_index=sample_index, rollout_n=rollout_n,
                                validate=bool(validate), name=name, trace=trace):
        yield


# ----------------------------------------------------------------------------- ops

#: The original (args, kwargs) of the op call in progress, for the traced function.
_CALL: ContextVar[tuple] = ContextVar("rtrace_verl_call")

#: veRL's traced methods and the span kind each one is.
KIND_BY_METHOD = {"generate": "generation", "execute": "tool", "run": "agent"}


class _Shown:
    """The output a trace shows for an op's result: the result as a dict plus
    ``prompt_text`` / ``response_text``. rtrace's converter calls :meth:`model_dump` in
    its worker thread, so the decoding happens there, never on the traced call."""

    __slots__ = ("result", "tokenizer")

    def __init__(self, result: Any, tokenizer: Any) -> None:
        self.result = result
        self.tokenizer = tokenizer

    def model_dump(self) -> dict[str, Any]:
        r = self.result
        dump = getattr(r, "model_dump", None)
        if callable(dump):
            view = dump()
        elif dataclasses.is_dataclass(r):
            view = {f.name: getattr(r, f.name) for f in dataclasses.fields(r)}
        else:
            view = dict(vars(r)) if hasattr(r, "__dict__") else {}
        settings = rtrace.current_settings()
        skip = settings.token2text_skip_special_tokens if settings is not None else True
        for source, target in (("prompt_ids", "prompt_text"), ("response_ids", "response_text")):
            if hasattr(r, source):
                view[target] = self._decode(getattr(r, source), skip)
        if hasattr(r, "token_ids") and not hasattr(r, "prompt_ids"):  # TokenOutput of generate
            view["response_text"] = self._decode(r.token_ids, skip)
        return view

    def _decode(self, ids: Any, skip: bool) -> Any:
        try:
            return self.tokenizer.decode(ids, skip_special_tokens=skip)
        except Exception:
            _stats.incr("token2text_errors")
            return None


def _active() -> bool:
    """True when an op call should be traced (configured, on, not inside trace=False)."""
    config = RolloutTraceConfig._instance
    if config is None or not config._sinks or _state.runtime is None:
        return False
    frame = _state.FRAME.get()
    return frame is None or frame.state is not None


def _adopt_tokenizer(owner: Any) -> None:
    from .._setup import get_tokenizer

    if get_tokenizer() is None:
        tok = getattr(owner, "tokenizer", None)
        if tok is not None and (hasattr(tok, "batch_decode") or hasattr(tok, "decode")):
            rtrace.set_tokenizer(tok)


def _show(owner: Any, result: Any, kind: str) -> Any:
    """What the span records as output: ``result``, or a :class:`_Shown` view (token2text)."""
    if kind == "generation" or isinstance(result, dict):
        return result  # generation spans are decoded by rtrace's token2text
    config = RolloutTraceConfig._instance
    if config is None or not config.token2text:
        return result
    tok = getattr(owner, "tokenizer", None)
    if tok is None or not hasattr(tok, "decode"):
        return result
    if not any(hasattr(result, f) for f in ("prompt_ids", "response_ids", "token_ids")):
        return result
    return _Shown(result, tok)


def rollout_trace_op(func: Optional[Callable] = None, /, *, kind: Optional[str] = None) -> Any:
    """Trace a method (sync or async) as a span of the current trajectory (veRL's decorator).

    The span is named ``func.__qualname__`` (a tool span: the tool's ``self.name``, the
    qualified name kept in ``code.function``); its input is the bound arguments without
    ``self`` (defaults applied, ``**kwargs`` shown flat); the caller gets the return value
    untouched.

    Args:
        kind: the span kind (``generation``, ``tool``, ``agent``, ``chain``); default from
            the method name (:data:`KIND_BY_METHOD`), else ``chain``.
    """
    if func is None:
        return functools.partial(rollout_trace_op, kind=kind)
    sig = inspect.signature(func)
    if not sig.parameters:
        raise TypeError(f"rollout_trace_op decorates methods; {func.__qualname__} takes no self")
    first = next(iter(sig.parameters))
    name = func.__qualname__.rsplit("<locals>.", 1)[-1]
    kind = kind or KIND_BY_METHOD.get(func.__name__, "chain")

    var_kw = next((p.name for p in sig.parameters.values() if p.kind is p.VAR_KEYWORD), None)

    def bind(owner: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
        bound = sig.bind(owner, *args, **kwargs)
        bound.apply_defaults()
        inputs = dict(bound.arguments)
        del inputs[first]
        if var_kw is not None:  # **kwargs shown flat, as rtrace's own decorators show them
            inputs.update(inputs.pop(var_kw))
        return inputs

    # The traced function takes the bound arguments as keywords, so rtrace records
    # exactly them as the span's input, and returns what the span shows as output. The
    # original call reaches it through _CALL (read before its first await), unchanged.
    if inspect.iscoroutinefunction(func):
        async def op(self: Any, /, **inputs: Any) -> Any:
            args, kwargs = _CALL.get()
            return _show(self, await func(self, *args, **kwargs), kind)

        traced_op = _decorate(op, kind, name)

        @functools.wraps(func)
        async def async_wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            if not _active():
                return await func(self, *args, **kwargs)
            if RolloutTraceConfig._instance.token2text:
                _adopt_tokenizer(self)
            inputs = bind(self, args, kwargs)
            token = _CALL.set((args, kwargs))
            try:
                out = await traced_op(self, **inputs)
            finally:
                _CALL.reset(token)
            return out.result if type(out) is _Shown else out

        return async_wrapper

    def sync_op(self: Any, /, **inputs: Any) -> Any:
        args, kwargs = _CALL.get()
        return _show(self, func(self, *args, **kwargs), kind)

    traced_sync = _decorate(sync_op, kind, name)

    @functools.wraps(func)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not _active():
            return func(self, *args, **kwargs)
        if RolloutTraceConfig._instance.token2text:
            _adopt_tokenizer(self)
        inputs = bind(self, args, kwargs)
        token = _CALL.set((args, kwargs))
        try:
            out = traced_sync(self, **inputs)
        finally:
            _CALL.reset(token)
        return out.result if type(out) is _Shown else out

    return wrapper


def _decorate(op: Callable, kind: str, name: str) -> Callable:
    # The op takes the method's qualified name as its own, and no name= is given: the
    # span is named as rtrace names any decorated method (a tool after its tool name,
    # a generation after its model, when known; the qualified name otherwise).
    op.__qualname__ = name
    if kind == "generation":
        return rtrace.traced_generation(op)
    if kind == "tool":
        return rtrace.traced_tool(op)
    if kind == "agent":
        return rtrace.traced_rollout(op)
    return rtrace.traced(op, kind=kind)
