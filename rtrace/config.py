"""Settings: the one place that reads ``RTRACE_*`` / ``OTEL_*`` environment variables.

Each setting is declared once in :data:`PARAMS` with its environment variable, parser,
default and a one-line description; the configuration reference in
``docs/configuration.md`` is checked against this table by the tests.

Lookup order for every setting: the keyword argument given to ``rtrace.configure()``,
then the environment variable, then the default. A bad value, from either source,
raises :class:`ConfigError` at ``configure()`` time, naming the variable and the
accepted values: a typo in ``RTRACE_EXPORTER`` must not silently turn tracing off.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Mapping

__all__ = ["ConfigError", "Settings", "PARAMS", "EXPORTERS", "load_settings"]

#: Sink names accepted by ``RTRACE_EXPORTER`` (besides ``none``).
EXPORTERS = ("console", "jsonl", "trackio", "mlflow", "otlp")

DEFAULT_REDACT_KEYS = (
    "api_key",
    "apikey",
    "authorization",
    "password",
    "passwd",
    "secret",
    "access_token",
    "refresh_token",
    "token_secret",
    "private_key",
    "cookie",
    "credentials",
)


class ConfigError(ValueError):
    """A setting has a value rtrace cannot accept; the message names the variable."""


# ----------------------------------------------------------------------------- parsers
# Each parser takes the raw value (a string from the environment, or any Python value
# from configure()) and returns the parsed value or raises ValueError with the accepted
# values; _parse() adds the variable's name.


def _exporters(raw: Any) -> tuple[str, ...]:
    if raw is None:
        return ()
    items = raw.split(",") if isinstance(raw, str) else list(raw)
    names: list[str] = []
    for item in items:
        if not isinstance(item, str):
            raise ValueError(f"expected exporter names, got {item!r}")
        name = item.strip().lower()
        if not name or name == "none":
            continue
        if name not in EXPORTERS:
            raise ValueError(f"unknown exporter {name!r}")
        if name not in names:
            names.append(name)
    return tuple(names)


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


def _bool(raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, str):
        value = raw.strip().lower()
        if value in _TRUE:
            return True
        if value in _FALSE:
            return False
    raise ValueError(f"not a boolean: {raw!r}")


def _int(minimum: int, optional: bool = False) -> Callable[[Any], int | None]:
    def parse(raw: Any) -> int | None:
        if optional and (raw is None or (isinstance(raw, str) and raw.strip().lower() in ("", "none"))):
            return None
        if isinstance(raw, bool):
            raise ValueError(f"not an integer: {raw!r}")
        if isinstance(raw, int):
            value = raw
        elif isinstance(raw, str) and raw.strip().lstrip("+-").isdigit():
            value = int(raw.strip())
        else:
            raise ValueError(f"not an integer: {raw!r}")
        if value < minimum:
            raise ValueError(f"{value} is below the minimum {minimum}")
        return value

    return parse


def _float(minimum: float) -> Callable[[Any], float]:
    def parse(raw: Any) -> float:
        if isinstance(raw, bool):
            raise ValueError(f"not a number: {raw!r}")
        try:
            value = float(raw)
        except (TypeError, ValueError):
            raise ValueError(f"not a number: {raw!r}") from None
        if not math.isfinite(value) or value < minimum:
            raise ValueError(f"{raw!r} is not a finite number >= {minimum}")
        return value

    return parse


def _str(raw: Any) -> str | None:
    if raw is None:
        return None
    if not isinstance(raw, (str, os.PathLike)):
        raise ValueError(f"not a string: {raw!r}")
    value = os.fspath(raw).strip()
    return value or None


def _str_list(raw: Any) -> tuple[str, ...]:
    if raw is None:
        return ()
    items = raw.split(",") if isinstance(raw, str) else list(raw)
    if not all(isinstance(i, str) for i in items):
        raise ValueError(f"expected a comma-separated list of names, got {raw!r}")
    return tuple(i.strip().lower() for i in items if i.strip())


def _headers(raw: Any) -> dict[str, str]:
    """OTLP headers: ``k1=v1,k2=v2`` (W3C baggage-like, values URL-decoded) or a mapping."""
    if raw is None:
        return {}
    if isinstance(raw, Mapping):
        return {str(k): str(v) for k, v in raw.items()}
    if not isinstance(raw, str):
        raise ValueError(f"expected 'key=value,key2=value2', got {raw!r}")
    from urllib.parse import unquote

    headers: dict[str, str] = {}
    for part in raw.split(","):
        if not part.strip():
            continue
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"expected 'key=value,key2=value2', got {raw!r}")
        headers[unquote(key.strip()).lower()] = unquote(value.strip())
    return headers


def _choice(*choices: str) -> Callable[[Any], str]:
    def parse(raw: Any) -> str:
        if not isinstance(raw, str) or raw.strip().lower() not in choices:
            raise ValueError(f"got {raw!r}")
        return raw.strip().lower()

    parse.choices = choices  # type: ignore[attr-defined]
    return parse


# ----------------------------------------------------------------------------- the table


@dataclass(frozen=True)
class Param:
    """One setting: its keyword name, environment variable, parser, default and meaning."""

    name: str
    env: str | None
    parse: Callable[[Any], Any]
    default: Any
    accepted: str
    doc: str
    #: The environment value is multiplied by this (OTEL_EXPORTER_OTLP_TIMEOUT is in ms).
    env_scale: float = 1.0


PARAMS: tuple[Param, ...] = (
    Param("exporter", "RTRACE_EXPORTER", _exporters, (),
          "comma list of none, " + ", ".join(EXPORTERS),
          "Sinks that receive finished trajectories. Unset or `none`: tracing off, zero cost."),
    Param("project", "RTRACE_PROJECT", _str, "rtrace", "a name",
          "trackio project / MLflow experiment the trajectories go to."),
    Param("experiment", "RTRACE_EXPERIMENT", _str, None, "a name",
          "Run name (trackio run, MLflow run name); stamped as `rl.experiment` on every span."),
    Param("token2text", "RTRACE_TOKEN2TEXT", _bool, False, "true/false (1/0, yes/no, on/off)",
          "Decode captured prompt/response token ids to text in the exporter thread."),
    Param("tokenizer", "RTRACE_TOKENIZER", lambda v: v if not isinstance(v, str) else _str(v), None,
          "a tokenizer object, or a tokenizer name / local path for AutoTokenizer",
          "Tokenizer for token2text (objects only through configure() or set_tokenizer())."),
    Param("token2text_skip_special_tokens", "RTRACE_TOKEN2TEXT_SKIP_SPECIAL_TOKENS", _bool, True,
          "true/false", "Drop special tokens when decoding."),
    Param("token2text_keep_ids", "RTRACE_TOKEN2TEXT_KEEP_IDS", _bool, False, "true/false",
          "Keep the token id lists on spans after decoding them."),
    Param("max_traces_per_step", "RTRACE_MAX_TRACES_PER_STEP", _int(0, optional=True), None,
          "an integer >= 0, or none",
          "Training trajectories kept per RL step, across the whole process. Unset: keep all."),
    Param("max_val_traces_per_step", "RTRACE_MAX_VAL_TRACES_PER_STEP", _int(0, optional=True), None,
          "an integer >= 0, or none",
          "Validation trajectories kept per step (counted apart from training). Unset: same as max_traces_per_step."),
    Param("sample_groups", "RTRACE_SAMPLE_GROUPS", _bool, False, "true/false",
          "Sample whole GRPO groups (same step, group_id or sample_index) together."),
    Param("capture", "RTRACE_CAPTURE", _bool, True, "true/false",
          "Capture arguments and return values of decorated calls (off: names and timings only)."),
    Param("max_value_chars", "RTRACE_MAX_VALUE_CHARS", _int(16), 20_000, "an integer >= 16",
          "Captured values longer than this (as JSON text) are truncated."),
    Param("redact_keys", "RTRACE_REDACT_KEYS", _str_list, DEFAULT_REDACT_KEYS,
          "comma list of key fragments",
          "Argument / dict keys containing one of these fragments are replaced by '[REDACTED]'."),
    Param("max_queue_size", "RTRACE_MAX_QUEUE_SIZE", _int(1), 65_536, "an integer >= 1",
          "Ended spans waiting for the worker thread; beyond it spans are dropped and counted."),
    Param("max_open_trajectories", "RTRACE_MAX_OPEN_TRAJECTORIES", _int(1), 20_000, "an integer >= 1",
          "Trajectories started but not finished; beyond it new ones are not traced (counted)."),
    Param("max_spans_per_trajectory", "RTRACE_MAX_SPANS_PER_TRAJECTORY", _int(1), 2_000, "an integer >= 1",
          "Spans kept per trajectory; the rest are dropped and counted."),
    Param("orphan_timeout_s", "RTRACE_ORPHAN_TIMEOUT_S", _float(0.0), 1800.0, "seconds >= 0",
          "A trajectory whose root has not ended after this long is written as partial."),
    Param("export_interval_s", "RTRACE_EXPORT_INTERVAL_S", _float(0.001), 0.5, "seconds > 0",
          "How often the worker thread assembles and exports what has ended."),
    Param("max_export_batch_size", "RTRACE_MAX_EXPORT_BATCH_SIZE", _int(1), 256, "an integer >= 1",
          "Trajectories handed to a sink per call."),
    Param("sink_queue_size", "RTRACE_SINK_QUEUE_SIZE", _int(1), 64, "an integer >= 1",
          "Batches waiting per sink; a slow sink beyond it loses batches (counted)."),
    Param("sink_timeout_s", "RTRACE_SINK_TIMEOUT_S", _float(0.0), 30.0, "seconds >= 0",
          "How long flush()/shutdown() wait for each sink."),
    Param("jsonl_path", "RTRACE_JSONL_PATH", _str, "rtrace_traces.jsonl", "a file path",
          "Where the jsonl sink appends one trajectory per line."),
    Param("service_name", "OTEL_SERVICE_NAME", _str, "rtrace", "a name",
          "OTel resource service.name of rtrace's own TracerProvider."),
    # trackio sink
    Param("trackio_trace_key", "RTRACE_TRACKIO_TRACE_KEY", _str, "rollout/traces", "a log key",
          "trackio key for training trajectories."),
    Param("trackio_eval_trace_key", "RTRACE_TRACKIO_EVAL_TRACE_KEY", _str, "eval/traces", "a log key",
          "trackio key for validation trajectories."),
    Param("space_id", "TRACKIO_SPACE_ID", _str, None, "a Hugging Face Space id",
          "Send the trackio run to a Space, as trackio does."),
    Param("summary_metrics", "RTRACE_SUMMARY_METRICS", _bool, True, "true/false",
          "Log per-step summary metrics (reward, turns, latency...) next to the traces (trackio)."),
    # MLflow sink
    Param("mlflow_tracking_uri", "MLFLOW_TRACKING_URI", _str, None, "an MLflow tracking URI",
          "Where the mlflow sink writes. Unset: sqlite:///<cwd>/.rtrace/mlflow.db."),
    Param("mlflow_run_id", "RTRACE_MLFLOW_RUN_ID", _str, None, "an MLflow run id",
          "Run the traces are linked to. Unset: the active run of this process, if any."),
    # OTLP sink
    Param("otlp_endpoint", "OTEL_EXPORTER_OTLP_ENDPOINT", _str, None, "a URL",
          "OTLP collector base URL (http: 'http://127.0.0.1:4318'; grpc: '127.0.0.1:4317')."),
    Param("otlp_traces_endpoint", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", _str, None, "a URL",
          "Full traces URL; overrides otlp_endpoint."),
    Param("otlp_protocol", "OTEL_EXPORTER_OTLP_PROTOCOL", _choice("http/protobuf", "grpc"), "http/protobuf",
          "http/protobuf or grpc", "OTLP transport."),
    Param("otlp_headers", "OTEL_EXPORTER_OTLP_HEADERS", _headers, {}, "key=value,key2=value2",
          "Headers sent with every OTLP request."),
    # The OTel spec gives OTEL_EXPORTER_OTLP_TIMEOUT in milliseconds; configure() takes seconds.
    Param("otlp_timeout_s", "OTEL_EXPORTER_OTLP_TIMEOUT", _float(0.001), 10.0,
          "milliseconds in the environment, seconds in configure()", "Per-request OTLP timeout.",
          env_scale=0.001),
)

_PARAMS_BY_NAME = {p.name: p for p in PARAMS}


@dataclass(frozen=True)
class Settings:
    """Validated settings. Build with :func:`load_settings`; every field is in :data:`PARAMS`."""

    exporter: tuple[str, ...] = ()
    project: str = "rtrace"
    experiment: str | None = None
    token2text: bool = False
    tokenizer: Any = None
    token2text_skip_special_tokens: bool = True
    token2text_keep_ids: bool = False
    max_traces_per_step: int | None = None
    max_val_traces_per_step: int | None = None
    sample_groups: bool = False
    capture: bool = True
    max_value_chars: int = 20_000
    redact_keys: tuple[str, ...] = DEFAULT_REDACT_KEYS
    max_queue_size: int = 65_536
    max_open_trajectories: int = 20_000
    max_spans_per_trajectory: int = 2_000
    orphan_timeout_s: float = 1800.0
    export_interval_s: float = 0.5
    max_export_batch_size: int = 256
    sink_queue_size: int = 64
    sink_timeout_s: float = 30.0
    jsonl_path: str = "rtrace_traces.jsonl"
    service_name: str = "rtrace"
    trackio_trace_key: str = "rollout/traces"
    trackio_eval_trace_key: str = "eval/traces"
    space_id: str | None = None
    summary_metrics: bool = True
    mlflow_tracking_uri: str | None = None
    mlflow_run_id: str | None = None
    otlp_endpoint: str | None = None
    otlp_traces_endpoint: str | None = None
    otlp_protocol: str = "http/protobuf"
    otlp_headers: dict = field(default_factory=dict)
    otlp_timeout_s: float = 10.0
    #: Keyword arguments that are not settings of the table but objects handed to sinks
    #: (e.g. a custom Sink instance). Not read from the environment.
    sinks: tuple = ()

    @property
    def enabled(self) -> bool:
        """True when at least one sink is configured."""
        return bool(self.exporter) or bool(self.sinks)

    @property
    def val_cap(self) -> int | None:
        """The per-step cap that applies to validation trajectories."""
        if self.max_val_traces_per_step is not None:
            return self.max_val_traces_per_step
        return self.max_traces_per_step


def _parse(param: Param, raw: Any, source: str) -> Any:
    try:
        return param.parse(raw)
    except ValueError as exc:
        where = param.env if source == "env" else f"configure({param.name}=...)"
        env = f" (env {param.env})" if source != "env" and param.env else ""
        raise ConfigError(f"{where}{env}: {exc}; accepted values: {param.accepted}") from None


def load_settings(overrides: Mapping[str, Any] | None = None,
                  environ: Mapping[str, str] | None = None) -> Settings:
    """Build :class:`Settings` from keyword overrides, then the environment, then defaults.

    Args:
        overrides: values given to ``configure()``; ``None`` values are ignored.
        environ: the environment to read (default ``os.environ``).

    Raises:
        ConfigError: an unknown keyword, or a value that does not parse.
    """
    overrides = dict(overrides or {})
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    sinks = overrides.pop("sinks", None)
    unknown = sorted(k for k in overrides if k not in _PARAMS_BY_NAME)
    if unknown:
        raise ConfigError(
            f"configure() got unknown setting(s) {', '.join(unknown)}; "
            f"accepted: {', '.join(sorted(_PARAMS_BY_NAME))}, sinks")
    for param in PARAMS:
        if overrides.get(param.name) is not None:
            values[param.name] = _parse(param, overrides[param.name], "arg")
        elif param.env and environ.get(param.env) is not None:
            value = _parse(param, environ[param.env], "env")
            values[param.name] = value * param.env_scale if param.env_scale != 1.0 else value
    if sinks is not None:
        values["sinks"] = tuple(sinks) if isinstance(sinks, (list, tuple)) else (sinks,)
    known = {f.name for f in fields(Settings)}
    return Settings(**{k: v for k, v in values.items() if k in known})


def reference_markdown() -> str:
    """The settings table as Markdown (docs/configuration.md embeds it; a test keeps them equal)."""

    def fmt(value: Any) -> str:
        if value is None or value == () or value == {}:
            return "unset"
        if isinstance(value, tuple):
            return "`" + ",".join(value) + "`"
        if isinstance(value, bool):
            return "`true`" if value else "`false`"
        return f"`{value}`"

    rows = ["| configure() keyword | environment variable | default | accepted values | meaning |",
            "| --- | --- | --- | --- | --- |"]
    for p in PARAMS:
        rows.append(f"| `{p.name}` | `{p.env}` | {fmt(p.default)} | {p.accepted} | {p.doc} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":  # python -m rtrace.config: print the reference table
    print(reference_markdown(), end="")
