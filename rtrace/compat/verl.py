"""Drop-in for veRL's ``verl/utils/rollout_trace.py``, backed by rtrace's pipeline and sinks.

Switch veRL over without touching its code, once per process, before veRL's agent loop is
imported::

    import rtrace.compat.verl
    rtrace.compat.verl.install()          # verl.utils.rollout_trace is now this module

or, for the Ray workers of a training job, as Ray's setup hook (every worker runs it at
start)::

    +ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=rtrace.compat.verl.install

A module of your own can also import the names from here directly
(``from rtrace.compat.verl import RolloutTraceConfig, rollout_trace_attr, rollout_trace_op``).

The three names keep veRL's signatures and behaviour (see docs/frameworks/verl.md):

* ``RolloutTraceConfig.init(project_name, experiment_name, backend, token2text=False,
  max_samples_per_step_per_worker=None)`` — a process-wide singleton, initialised once
  (later calls are ignored, as in veRL). ``backend`` is ``"trackio"``, ``"mlflow"``,
  ``"otlp"``, ``"jsonl"`` or ``"collector"`` (or a comma list of them) and configures
  rtrace with ``rtrace.configure(exporter=backend, project=project_name,
  experiment=experiment_name, token2text=token2text)``. ``None`` and veRL's ``"dummy"``
  mean tracing off. ``"weave"`` (rtrace has no weave sink) is left out with a warning: the
  other names of the list are traced to, or, alone, tracing is off — a worker never fails
  to start over it. Any other name raises :class:`rtrace.ConfigError`. When the
  environment says ``RTRACE_EXPORTER=collector`` (a worker started with
  ``collector.env``), every backend that is not off streams to that collector, whose
  sinks decide where the traces go. ``get_backend()``, ``get_client()`` (always None:
  there is no backend client to hand out), ``enable_token2text()`` and ``reset()`` behave
  as veRL's.
* ``rollout_trace_attr(sample_index, step, rollout_n, name, validate, trace=True)`` — a
  context manager: one trajectory (``rtrace.rollout_context``) with those coordinates
  and ``rl.experiment`` = experiment_name. ``trace=False`` runs the block untraced, and
  every ``rollout_trace_op`` inside it calls straight through.
* ``rollout_trace_op`` — decorates a method (sync or async). The span's name is the
  method's ``__qualname__`` (a tool's span: the tool's name, the fully-qualified name kept
  in ``code.function.name``), its input the bound arguments without ``self`` (defaults
  applied; ``**kwargs`` shown flat, as rtrace's decorators show them), its output the
  return value, which the caller gets untouched. The span kind follows veRL's traced
  methods: ``generate`` is a generation (prompt ids, response ids / ``token_ids``,
  finish / ``stop_reason``), ``execute`` a tool call (tool name = ``self.name``), ``run``
  the agent loop, anything else a chain; pass ``rollout_trace_op(kind=...)`` to choose.

token2text: when an op's ``self`` carries a ``tokenizer``, rtrace adopts it
(``rtrace.set_tokenizer``) if none is set. rtrace's token2text (in its worker thread, or
the collector's) then decodes every generation span and, as veRL shows it, adds
``prompt_text`` / ``response_text`` to an op output that has ``prompt_ids`` /
``response_ids`` (``AgentLoopOutput``).

The per-step cap ``max_samples_per_step_per_worker`` is veRL's own:
``AgentLoopWorker.generate_sequences`` reads it from the config, picks the samples of each
call and passes ``trace=False`` for the others; the shim follows that choice and keeps
no cap of its own. rtrace's ``max_traces_per_step`` (``RTRACE_MAX_TRACES_PER_STEP``) still
applies on top, in rtrace's sampler.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.util
import inspect
import sys
import threading
from contextvars import ContextVar
from typing import Any, Callable, Iterator, Optional

import rtrace

from .. import _stats
from ..config import EXPORTERS, ConfigError, env_exporters
from ..instrumentation import _state
from . import verl_trainer
from .verl_trainer import annotate_batch

__all__ = ["RolloutTraceConfig", "rollout_trace_attr", "rollout_trace_op", "install", "annotate_batch"]

#: The veRL module this one replaces.
VERL_MODULE = "verl.utils.rollout_trace"
#: Backend names that mean "tracing off", as in veRL.
OFF_BACKENDS = (None, "dummy")
#: veRL backends rtrace has no sink for: left out with a warning.
UNSUPPORTED_BACKENDS = ("weave",)
_ACCEPTED = ("accepted values: " + ", ".join(n for n in EXPORTERS if n != "console")
             + " (or a comma list of them), None or 'dummy' (tracing off); 'weave' is left out with a warning")


def _sinks(backend: Any) -> tuple[str, ...]:
    """The rtrace exporters of a veRL backend name; () for off. Raises ConfigError."""
    if backend is None:
        return ()
    if not isinstance(backend, str):
        raise ConfigError(f"RolloutTraceConfig.init(backend={backend!r}): not a backend name; {_ACCEPTED}")
    names = [n.strip().lower() for n in backend.split(",") if n.strip()]
    if not names:
        raise ConfigError(f"RolloutTraceConfig.init(backend={backend!r}): empty backend; {_ACCEPTED}")
    for name in names:
        if name not in EXPORTERS and name not in UNSUPPORTED_BACKENDS and name != "dummy":
            raise ConfigError(f"RolloutTraceConfig.init(backend={backend!r}): unknown trace backend {name!r}; "
                              f"{_ACCEPTED}")
    sinks = tuple(dict.fromkeys(n for n in names if n in EXPORTERS))
    unsupported = [n for n in names if n in UNSUPPORTED_BACKENDS]
    if (sinks or unsupported) and "collector" in env_exporters():
        # A worker started with collector.env: the job's collector owns the sinks.
        return ("collector",)
    if unsupported:
        instead = f"tracing to {', '.join(sinks)} only" if sinks else "tracing is off"
        _stats.warn_once(f"verl-backend-{backend}", "rtrace.compat.verl: veRL trace backend %r: rtrace has no "
                         "%s sink, %s (trackio or mlflow show the same traces: trace.backend=trackio)",
                         backend, "/".join(unsupported), instead)
    return sinks


class RolloutTraceConfig:
    """Rollout tracing configuration: a process-wide singleton, as in veRL.

    Args (of :meth:`init`):
        project_name: trackio project / MLflow experiment.
        experiment_name: run name; stamped as ``rl.experiment`` on every span.
        backend: ``"trackio"`` | ``"mlflow"`` | ``"otlp"`` | ``"jsonl"`` | ``"collector"``
            (or a comma list); ``None`` / ``"dummy"``: off; ``"weave"``: left out (warning).
        token2text: decode token ids to text (with the tokenizer of the traced objects).
        max_samples_per_step_per_worker: read by veRL's ``AgentLoopWorker``, which traces
            at most this many distinct samples (with all their rollouts) per
            ``generate_sequences`` call; None traces all. The shim itself does not cap.
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
            cls._instance._tokenizer = None
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
        cap = max_samples_per_step_per_worker
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 0):
            raise ConfigError(f"RolloutTraceConfig.init(max_samples_per_step_per_worker={cap!r}): "
                              "accepted values: an integer >= 0, or None (trace every sample)")
        sinks = _sinks(backend)
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
        """Always None: rtrace's sinks run in their own threads, there is no client to share."""
        return cls.get_instance().client

    @classmethod
    def enable_token2text(cls) -> Optional[bool]:
        return cls.get_instance().token2text

    @classmethod
    def reset(cls) -> None:
        """Forget the configuration (as veRL's), and the tokenizer the shim handed to
        rtrace if it is still the one in use; rtrace's own configuration is left as is."""
        config = cls._instance
        if config is not None and config._tokenizer is not None:
            from .._setup import get_tokenizer

            if get_tokenizer() is config._tokenizer:
                rtrace.set_tokenizer(None)
        cls._instance = None


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
        trace: False runs the block untraced (veRL's per-call sample choice); the ops
            inside call straight through.
    """
    config = RolloutTraceConfig.get_instance()
    if config.backend is None or not config._sinks:  # off (None, "dummy", weave alone)
        yield
        return
    with rtrace.rollout_context(step=_plain(step), sample_index=_plain(sample_index), rollout_n=_plain(rollout_n),
                                validate=bool(validate), name=name, trace=trace):
        yield


# ----------------------------------------------------------------------------- ops

#: The original (args, kwargs) of the op call in progress, for the traced function.
_CALL: ContextVar[tuple] = ContextVar("rtrace_verl_call")

#: veRL's traced methods and the span kind each one is.
KIND_BY_METHOD = {"generate": "generation", "execute": "tool", "run": "agent"}


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
            RolloutTraceConfig.get_instance()._tokenizer = tok


def rollout_trace_op(func: Optional[Callable] = None, /, *, kind: Optional[str] = None) -> Any:
    """Trace a method (sync or async) as a span of the current trajectory (veRL's decorator).

    The span is named ``func.__qualname__`` (a tool span: the tool's ``self.name``, the
    fully-qualified name kept in ``code.function.name``); its input is the bound arguments without
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
    # exactly them as the span's input, and returns the result, which rtrace records as
    # the output. The original call reaches it through _CALL (read before its first
    # await), unchanged.
    if inspect.iscoroutinefunction(func):
        async def op(self: Any, /, **inputs: Any) -> Any:
            args, kwargs = _CALL.get()
            return await func(self, *args, **kwargs)

        traced_op = _decorate(op, kind, func)

        @functools.wraps(func)
        async def async_wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            if not _active():
                return await func(self, *args, **kwargs)
            if RolloutTraceConfig._instance.token2text:
                _adopt_tokenizer(self)
            inputs = bind(self, args, kwargs)
            token = _CALL.set((args, kwargs))
            try:
                return await traced_op(self, **inputs)
            finally:
                _CALL.reset(token)

        async_wrapper.__rtrace_verl_op__ = True  # type: ignore[attr-defined]
        return async_wrapper

    def sync_op(self: Any, /, **inputs: Any) -> Any:
        args, kwargs = _CALL.get()
        return func(self, *args, **kwargs)

    traced_sync = _decorate(sync_op, kind, func)

    @functools.wraps(func)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not _active():
            return func(self, *args, **kwargs)
        if RolloutTraceConfig._instance.token2text:
            _adopt_tokenizer(self)
        inputs = bind(self, args, kwargs)
        token = _CALL.set((args, kwargs))
        try:
            return traced_sync(self, **inputs)
        finally:
            _CALL.reset(token)

    wrapper.__rtrace_verl_op__ = True  # type: ignore[attr-defined]
    return wrapper


def _decorate(op: Callable, kind: str, func: Callable) -> Callable:
    # The op takes the method's qualified name and module as its own, and no name= is given:
    # the span is named as rtrace names any decorated method (a tool after its tool name,
    # a generation after its model, when known; the qualified name otherwise), and
    # code.function.name is the method's.
    op.__qualname__ = func.__qualname__
    op.__module__ = func.__module__
    if kind == "generation":
        return rtrace.traced_generation(op)
    if kind == "tool":
        return rtrace.traced_tool(op)
    if kind == "agent":
        return rtrace.traced_rollout(op)
    return rtrace.traced(op, kind=kind)


# ----------------------------------------------------------------------------- install

_install_lock = threading.Lock()
#: this module's own spec (importing it under veRL's name would replace it)
_OWN_SPEC = __spec__


class _VerlFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves ``import verl.utils.rollout_trace`` to this module. Going through the import
    system (rather than only a ``sys.modules`` entry) also sets the ``rollout_trace``
    attribute of ``verl.utils``, as importing the real module would."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != VERL_MODULE:
            return None
        return importlib.util.spec_from_loader(fullname, self, origin=__name__)

    def create_module(self, spec: Any) -> Any:
        return sys.modules[__name__]

    def exec_module(self, module: Any) -> None:
        module.__spec__ = _OWN_SPEC  # the import system set veRL's name on it


def install() -> None:
    """Make ``verl.utils.rollout_trace`` resolve to this module in this process.

    No arguments, idempotent, cheap (veRL is not imported): usable as Ray's
    ``worker_process_setup_hook`` (``rtrace.compat.verl.install``). Call it before
    veRL's agent loop is imported: veRL's modules bind the names at import time. If
    veRL's own module was imported already, the names are rebound in every module that
    imported them, and the methods already decorated by veRL's ``rollout_trace_op`` in
    those modules are decorated again with rtrace's (from the original function); a
    warning says so once. Objects created before (an initialised veRL
    ``RolloutTraceConfig``) are not carried over.
    """
    verl_trainer.install_hook()  # the trainer's per-token values (verl_trainer.py), in the driver
    with _install_lock:
        me = sys.modules[__name__]
        if not any(isinstance(f, _VerlFinder) for f in sys.meta_path):
            sys.meta_path.insert(0, _VerlFinder())
        current = sys.modules.get(VERL_MODULE)
        if current is me:
            return
        if current is not None:
            _rebind(current, me)
        utils = sys.modules.get("verl.utils")
        if current is not None or utils is not None:
            sys.modules[VERL_MODULE] = me
            if utils is not None:
                setattr(utils, "rollout_trace", me)


def _rebind(verl_mod: Any, me: Any) -> None:
    """Replace veRL's three names wherever they were imported, and re-decorate the
    methods veRL's ``rollout_trace_op`` wrapped in those modules."""
    names = ("RolloutTraceConfig", "rollout_trace_attr", "rollout_trace_op")
    theirs = {n: getattr(verl_mod, n, None) for n in names}
    ours = {n: getattr(me, n) for n in names}
    codes = set()
    if callable(theirs["rollout_trace_op"]):
        # veRL's decorator returns one of two wrapper functions: recognise them by code object
        async def _a(self: Any) -> None: ...
        def _s(self: Any) -> None: ...
        for probe in (_a, _s):
            code = getattr(theirs["rollout_trace_op"](probe), "__code__", None)
            if code is not None:
                codes.add(code)
    modules = methods = 0
    for mod in list(sys.modules.values()):
        namespace = getattr(mod, "__dict__", None)
        if mod is verl_mod or mod is me or not isinstance(namespace, dict):
            continue
        hit = [n for n in names if theirs[n] is not None and namespace.get(n) is theirs[n]]
        if not hit:
            continue
        modules += 1
        for n in hit:
            namespace[n] = ours[n]
        for cls in [v for v in namespace.values() if isinstance(v, type) and v.__module__ == mod.__name__]:
            for attr, fn in list(vars(cls).items()):
                wrapped = getattr(fn, "__wrapped__", None)
                if wrapped is not None and getattr(fn, "__code__", None) in codes:
                    setattr(cls, attr, rollout_trace_op(wrapped))
                    methods += 1
    _stats.warn_once("verl-install-late", "rtrace.compat.verl.install(): veRL's own %s was imported first; its "
                     "names were rebound in %d module(s) and %d traced method(s) re-decorated. Call install() "
                     "before veRL's agent loop is imported (Ray: worker_process_setup_hook) to route it from "
                     "the start", VERL_MODULE, modules, methods)
