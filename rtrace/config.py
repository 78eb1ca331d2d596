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
import re
import tempfile
from dataclasses import dataclass, field, make_dataclass
from typing import Any, Callable, Mapping

__all__ = ["ConfigError", "Settings", "PARAMS", "EXPORTERS", "load_settings", "env_exporters", "env_setting",
           "writable_path", "dataset_path", "uri_scheme", "warn_unknown_env"]

#: Sink names accepted by ``RTRACE_EXPORTER`` (besides ``none``).
EXPORTERS = ("console", "jsonl", "trackio", "mlflow", "otlp", "collector", "parquet")

#: The longest timeout / interval accepted (a week): larger values overflow thread waits.
MAX_SECONDS = 7 * 24 * 3600.0

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
    "api_token",
    "auth_token",
    "hf_token",
    "github_token",
    "session_token",
    "bearer",
)


class ConfigError(ValueError):
    """A setting has a value rtrace cannot accept; the message names the variable.

    ``setting``, ``problem`` and ``accepted`` (when known) let a command line name its own
    flag instead (``rtrace demo --exporter``)."""

    def __init__(self, message: str, setting: str | None = None, problem: str | None = None,
                 accepted: str | None = None) -> None:
        super().__init__(message)
        self.setting, self.problem, self.accepted = setting, problem, accepted


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
_FALSE = ("0", "false", "no", "off")


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


def _auto_bool(raw: Any) -> bool | str:
    """``auto``, or a boolean."""
    if isinstance(raw, str) and raw.strip().lower() == "auto":
        return "auto"
    try:
        return _bool(raw)
    except ValueError:
        raise ValueError(f"not auto or a boolean: {raw!r}") from None


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
        if value > 2**31:
            raise ValueError(f"{value} is above the maximum {2**31}")
        return value

    return parse


def _float(minimum: float, maximum: float = MAX_SECONDS) -> Callable[[Any], float]:
    def parse(raw: Any) -> float:
        if isinstance(raw, bool):
            raise ValueError(f"not a number: {raw!r}")
        try:
            value = float(raw)
        except (TypeError, ValueError, OverflowError):
            raise ValueError(f"not a number: {raw!r}") from None
        if not math.isfinite(value) or not minimum <= value <= maximum:
            raise ValueError(f"{raw!r} is not a number from {minimum} to {maximum:g}")
        return value

    return parse


def _str(raw: Any) -> str:
    """A non-empty string. An empty value is an error, never a silent 'unset': unset
    the variable instead."""
    if not isinstance(raw, (str, os.PathLike)):
        raise ValueError(f"not a string: {raw!r}")
    value = os.fspath(raw).strip()
    if not value:
        raise ValueError("empty value (unset the variable to use the default)")
    return value


def _provider(raw: Any) -> str:
    """A GenAI provider name as the OTel conventions write them: lower case letters, digits,
    ``.`` and ``_`` (``vllm``, ``sglang``, ``openai``, ``aws.bedrock``)."""
    value = _str(raw).lower()
    if not re.fullmatch(r"[a-z0-9_.]+", value):
        raise ValueError(f"got {raw!r}")
    return value


def _str_list(raw: Any) -> tuple[str, ...]:
    """A comma list of names; ``none`` is the empty list. An empty string is an error."""
    items = raw.split(",") if isinstance(raw, str) else list(raw)
    if not all(isinstance(i, str) for i in items):
        raise ValueError(f"expected a comma-separated list of names, got {raw!r}")
    names = tuple(i.strip().lower() for i in items if i.strip())
    if not names:
        raise ValueError("empty value (use 'none' for an empty list, or unset the variable for the default)")
    return () if names == ("none",) else names


#: The rollout-health checks (rtrace/pipeline/health.py; kept here so config imports nothing
#: of the pipeline): all but ``retokenization`` are on by default.
HEALTH_CHECKS = ("token_continuity", "retokenization", "reward", "generation", "staleness", "coordinates",
                 "logprob_mismatch", "token_arrays", "capture_gap")


def _health_checks(raw: Any) -> tuple[str, ...]:
    """``all``, ``none`` or a comma list of :data:`HEALTH_CHECKS`."""
    names = _str_list(raw)
    if names == ("all",):
        return HEALTH_CHECKS
    unknown = [n for n in names if n not in HEALTH_CHECKS]
    if unknown:
        raise ValueError(f"unknown check {unknown[0]!r}")
    return tuple(n for n in HEALTH_CHECKS if n in names)


def writable_path(raw: Any) -> str:
    """A file path whose directory exists (or can be created) and is writable; raises
    ValueError saying why not."""
    value = _str(raw)
    directory = os.path.dirname(os.path.abspath(value))
    probe = directory
    while not os.path.exists(probe):  # the first existing ancestor must be a writable directory
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if os.path.isdir(value):
        raise ValueError(f"{value!r} is a directory")
    if os.path.islink(value) and not os.path.exists(value):
        # the sink would start, then fail every batch (open() follows the link)
        raise ValueError(f"{value!r} is a symbolic link to {os.readlink(value)!r}, which does not exist")
    if not os.path.isdir(probe):
        raise ValueError(f"{probe!r} is not a directory")
    # A real probe, not os.access: root passes every access() check, yet cannot create
    # files on a read-only filesystem or in /proc. The sink creates missing directories
    # (the first existing ancestor must take them); nothing is left behind here.
    try:
        fd, name = tempfile.mkstemp(prefix=".rtrace-probe-", dir=probe)
        os.close(fd)
        os.unlink(name)
    except OSError as exc:
        what = directory if probe == directory else f"{directory!r} cannot be created: {probe!r}"
        raise ValueError(f"{what} is not writable ({exc.strerror})") from None
    if os.path.exists(value) and not os.access(value, os.W_OK):
        raise ValueError(f"{value!r} is not writable")
    return value


#: URL schemes pyarrow opens itself (the others need an fsspec filesystem)
_ARROW_SCHEMES = ("s3", "gs", "gcs", "hdfs", "viewfs", "abfs", "abfss")


def dataset_path(raw: Any) -> str:
    """Where the parquet sink writes: a local folder that exists or can be created (a probe
    file proves it writable), or a URL with a scheme pyarrow or an installed fsspec
    filesystem knows (``s3://bucket/prefix``, ``gs://...``, ``hf://...``). A URL is not
    contacted here (no slow I/O at configure time)."""
    value = _str(raw)
    scheme, sep, rest = value.partition("://")
    if sep and len(scheme) > 1:
        scheme = scheme.lower()
        if scheme == "file":
            return dataset_path(rest)
        if not rest.strip("/"):
            raise ValueError(f"{value!r} names no bucket or folder")
        if scheme not in _ARROW_SCHEMES:
            try:
                from fsspec.registry import known_implementations
            except ImportError:
                known_implementations = {}
            if scheme not in known_implementations:
                raise ValueError(f"unknown scheme {scheme!r} in {value!r} (pyarrow opens "
                                 f"{', '.join(_ARROW_SCHEMES)}; others need fsspec)")
        return value
    if os.path.exists(value) and not os.path.isdir(value):
        raise ValueError(f"{value!r} is not a folder")
    writable_path(os.path.join(value, ".rtrace-dataset-probe"))
    return value


def uri_scheme(uri: str | None) -> str:
    """The lower-case scheme of a tracking URI (``postgresql+psycopg2`` for
    ``postgresql+psycopg2://...``); "" for a path, a Windows drive letter included."""
    scheme = uri.split(":", 1)[0].lower() if uri and ":" in uri else ""
    return scheme if len(scheme) > 1 else ""


def _tracking_uri(raw: Any) -> str:
    """An MLflow tracking URI with a scheme MLflow knows (its own, or one an installed
    plugin registers, e.g. ``azureml``). A path or ``file:`` URI selects MLflow's file
    store, which MLflow 3 refuses (maintenance mode) unless ``MLFLOW_ALLOW_FILE_STORE``
    is true: refused here too, so a typo (``not a url``) fails now, not at the first export."""
    value = _str(raw)
    scheme = uri_scheme(value)
    if scheme in ("", "file") and os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").strip().lower() not in (
            "1", "true", "yes"):
        raise ValueError(f"{value!r} is a path (MLflow's file store, refused by MLflow 3 unless "
                         "MLFLOW_ALLOW_FILE_STORE=true); use sqlite:///path/to/mlflow.db or http://host:port")
    known = ("http", "https", "file", "sqlite", "postgresql", "mysql", "mssql", "databricks", "databricks-uc",
             "uc")
    if scheme and scheme.split("+", 1)[0] not in known and scheme not in _plugin_schemes():
        raise ValueError(f"unknown scheme {scheme!r} in {value!r}")
    return value


def _plugin_schemes() -> set[str]:
    """Tracking-store URI schemes registered by installed MLflow plugins."""
    from importlib.metadata import entry_points

    try:
        return {ep.name.lower() for ep in entry_points(group="mlflow.tracking_store")}
    except Exception:  # a broken distribution's metadata: no plugin schemes
        return set()


def _url(raw: Any) -> str:
    """An OTLP endpoint: ``http(s)://host[:port][/path]`` or ``host:port`` (gRPC)."""
    from urllib.parse import urlsplit

    value = _str(raw)
    parts = urlsplit(value if "://" in value else f"grpc://{value}")
    try:
        port = parts.port
    except ValueError:
        port = None
        raise ValueError(f"bad port in {value!r}") from None
    if parts.scheme not in ("http", "https", "grpc") or not parts.hostname:
        raise ValueError(f"{value!r} is not 'http(s)://host:port' or 'host:port'")
    if parts.scheme == "grpc" and port is None:
        raise ValueError(f"{value!r} has no port")
    return value


def _endpoints(raw: Any) -> str:
    """One rtrace collector endpoint, or a comma list of them (placement by group key across
    several, rtrace/placement.py): each entry as :func:`_url` accepts it, no endpoint twice
    (``https://h:1`` and ``h:1`` are one). Kept as the entries joined by commas."""
    from .placement import endpoint_name

    value = _str(raw)
    entries = [entry.strip() for entry in value.split(",")]
    if any(not entry for entry in entries):
        raise ValueError(f"{value!r} has an empty entry")
    names: set[str] = set()
    for entry in entries:
        try:
            _url(entry)
        except ValueError as exc:
            raise ValueError(f"entry {entry!r}: {exc}") from None
        name = endpoint_name(entry)
        if name in names:
            raise ValueError(f"{name!r} is listed twice")
        names.add(name)
    return ",".join(entries)


class Secret(str):
    """A string that does not show itself: ``repr`` (and so the repr of :class:`Settings`,
    tracebacks, logs) says ``'<secret>'``; the value is the string itself."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "'<secret>'"


def _secret(raw: Any) -> Secret:
    """A non-empty secret string (an API key), kept as a :class:`Secret`."""
    return Secret(_str(raw))


def _token(raw: Any) -> Secret:
    """A bearer token: at least 16 printable ASCII characters, no spaces; ``none``: no
    token, even beyond loopback (an empty :class:`Secret`)."""
    value = _str(raw)
    if value.lower() == "none":
        return Secret("")
    if len(value) < 16 or not all(33 <= ord(c) < 127 for c in value):
        raise ValueError("a token must be at least 16 printable ASCII characters without spaces "
                         f"(got {len(value)} characters)")
    return Secret(value)


def _http_url(raw: Any) -> str:
    """An ``http(s)://host[:port][/path]`` URL."""
    from urllib.parse import urlsplit

    value = _str(raw)
    parts = urlsplit(value)
    try:
        parts.port
    except ValueError:
        raise ValueError(f"bad port in {value!r}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{value!r} is not 'http(s)://host[:port][/path]'")
    return value.rstrip("/")


def _pem_file(raw: Any) -> str:
    """A readable PEM file."""
    value = os.path.abspath(_str(raw))
    try:
        with open(value, "rb") as f:
            head = f.read(1 << 20)
    except OSError as exc:
        raise ValueError(f"cannot read {value!r} ({exc.strerror})") from None
    if b"-----BEGIN " not in head:
        raise ValueError(f"{value!r} is not a PEM file")
    return value


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
    #: The field's type in :class:`Settings` (for readers and type checkers).
    type: str = "Any"
    #: OTel's per-signal variable (``OTEL_EXPORTER_OTLP_TRACES_*``), read before ``env``
    #: as the OTel specification says (blank: unset, then ``env`` is read)
    signal_env: str | None = None


def _tokenizer(raw: Any) -> Any:
    return _str(raw) if isinstance(raw, str) else raw


_SEC = "seconds from {} to 604800"

PARAMS: tuple[Param, ...] = (
    Param("exporter", "RTRACE_EXPORTER", _exporters, (),
          "comma list of none, " + ", ".join(EXPORTERS),
          "Sinks that receive finished trajectories (`collector`: stream spans to an rtrace collector). "
          "Unset or `none`: tracing off, zero cost.", type="tuple[str, ...]"),
    Param("project", "RTRACE_PROJECT", _str, "rtrace", "a non-empty name",
          "trackio project / MLflow experiment the trajectories go to.", type="str"),
    Param("experiment", "RTRACE_EXPERIMENT", _str, None, "a non-empty name",
          "Run name (trackio run, MLflow run name); stamped as `rl.experiment` on every span.", type="str | None"),
    Param("token2text", "RTRACE_TOKEN2TEXT", _bool, None, "true/false (1/0, yes/no, on/off)",
          "Decode captured prompt/response token ids to text in the exporter thread (the collector's, "
          "in collector mode). Unset: decode when a trainer adapter (rtrace.compat) handed rtrace its "
          "tokenizer; false: never.", type="bool | None"),
    Param("tokenizer", "RTRACE_TOKENIZER", _tokenizer, None,
          "a tokenizer object, or a tokenizer name / local path for AutoTokenizer",
          "Tokenizer for token2text (objects only through configure() or set_tokenizer())."),
    Param("token2text_skip_special_tokens", "RTRACE_TOKEN2TEXT_SKIP_SPECIAL_TOKENS", _bool, True,
          "true/false", "Drop special tokens when decoding.", type="bool"),
    Param("token2text_keep_ids", "RTRACE_TOKEN2TEXT_KEEP_IDS", _bool, False, "true/false",
          "Keep the token id lists on spans after decoding them.", type="bool"),
    Param("max_traces_per_step", "RTRACE_MAX_TRACES_PER_STEP", _int(0, optional=True), None,
          "an integer >= 0, or none",
          "Training trajectories kept per RL step: per process, or job-wide through a collector. Unset: keep all.",
          type="int | None"),
    Param("max_val_traces_per_step", "RTRACE_MAX_VAL_TRACES_PER_STEP", _int(0, optional=True), None,
          "an integer >= 0, or none",
          "Validation trajectories kept per step (counted apart from training). Unset: same as max_traces_per_step.",
          type="int | None"),
    Param("sample_groups", "RTRACE_SAMPLE_GROUPS", _bool, False, "true/false",
          "Sample whole GRPO groups (same step, group_id or sample_index) together.", type="bool"),
    Param("sample_prompts", "RTRACE_SAMPLE_PROMPTS", _bool, False, "true/false",
          "Keep the same prompts at every step where they recur (by `prompt_id` in rollout_context's extra, "
          "else group_id, else sample_index), so one prompt can be followed across steps.", type="bool"),
    Param("keep_errors", "RTRACE_KEEP_ERRORS", _int(0), 0, "an integer >= 0",
          "Per step, keep up to this many trajectories that ended in error or were truncated, past the cap.",
          type="int"),
    Param("keep_extremes", "RTRACE_KEEP_EXTREMES", _int(0), 0, "an integer >= 0",
          "Per step, keep the N best and N worst trajectories by `keep_by`, past the cap.", type="int"),
    Param("keep_unhealthy", "RTRACE_KEEP_UNHEALTHY", _int(0), 0, "an integer >= 0",
          "Per step, keep up to this many trajectories with a rollout-health finding (docs/health.md), past the "
          "cap.", type="int"),
    Param("keep_mismatch", "RTRACE_KEEP_MISMATCH", _int(0), 0, "an integer >= 0",
          "Per step, keep up to this many trajectories with the largest train-inference logprob mismatch (k3, "
          "docs/token-values.md), past the cap.", type="int"),
    Param("keep_by", "RTRACE_KEEP_BY", _str, "reward", "`reward` or an annotation key",
          "The value best / worst trajectories are chosen by.", type="str"),
    Param("keep_zero_variance_groups", "RTRACE_KEEP_ZERO_VARIANCE_GROUPS", _int(0), 0, "an integer >= 0",
          "Per step, keep up to this many GRPO groups whose rewards are all equal (zero advantage), past the cap.",
          type="int"),
    Param("health_checks", "RTRACE_HEALTH_CHECKS", _health_checks, tuple(c for c in HEALTH_CHECKS
                                                                         if c != "retokenization"),
          "`all`, `none` or a comma list of " + ", ".join(HEALTH_CHECKS),
          "Rollout-health checks run on every trajectory in rtrace's worker (or the collector); docs/health.md. "
          "Default: all but retokenization (one tokenizer encode per generation).", type="tuple[str, ...]"),
    Param("health_max_staleness", "RTRACE_HEALTH_MAX_STALENESS", _int(0), 1, "an integer >= 0",
          "The `staleness` check reports trajectories whose step - policy_version is above this.", type="int"),
    Param("mismatch_ratio", "RTRACE_MISMATCH_RATIO", _float(1.0, 1e6), 1.05, "a number >= 1",
          "The `logprob_mismatch` check counts a token as off when its sampler/trainer probability ratio leaves "
          "[1/ratio, ratio] (NeMo-RL's 1.05).", type="float"),
    Param("mismatch_max_fraction", "RTRACE_MISMATCH_MAX_FRACTION", _float(0.0, 1.0), 0.05, "a number from 0 to 1",
          "The `logprob_mismatch` check reports a trajectory when more than this share of its loss-masked tokens "
          "is off.", type="float"),
    Param("mismatch_max_k3", "RTRACE_MISMATCH_MAX_K3", _float(0.0, 1e6), 0.01, "a number >= 0",
          "The `logprob_mismatch` check reports a trajectory whose k3 estimate of KL(sampler || trainer) is above "
          "this.", type="float"),
    Param("step_linger_s", "RTRACE_STEP_LINGER_S", _float(0.0), 10.0, _SEC.format(0),
          "Once a later step has begun, a step stays open this long after its last trajectory (workers run "
          "steps out of phase) before its job-wide sample and step metrics are written; flush() writes at "
          "once.", type="float"),
    Param("sample_seed", "RTRACE_SAMPLE_SEED", _int(0), 0, "an integer >= 0",
          "Seed of the collector's job-wide sample (which trajectories of a step are kept).", type="int"),
    Param("pre_sample_rate", "RTRACE_PRE_SAMPLE_RATE", _float(0.0, 1.0), 1.0, "a number from 0 to 1",
          "Collector mode: the fraction of trajectories (by the same hash as the collector's sample) a worker "
          "records in full; the others leave a summary only (RTRACE_SUMMARIES), so the step metrics still count "
          "them. Set it above the cap's share of a step (cap / rollouts per step), with room: the sample is "
          "chosen among the rollouts recorded in full.", type="float"),
    Param("summaries", "RTRACE_SUMMARIES", _bool, True, "true/false",
          "Every rollout leaves a summary (coordinates, reward, verdict, tokens, times; docs/metrics.md): one "
          "sampled out when it starts (max_traces_per_step in one process, RTRACE_PRE_SAMPLE_RATE in a worker) "
          "is recorded as a summary only, and the step metrics and the dataset's trajectories table count every "
          "rollout. Off: a sampled-out rollout costs nothing and is in no metric (they describe the sample).",
          type="bool"),
    Param("promote_per_step", "RTRACE_PROMOTE_PER_STEP", _int(0), 4, "an integer >= 0",
          "Collector mode, in a worker: per step, at most this many rollouts recorded as summaries only "
          "(RTRACE_PRE_SAMPLE_RATE) are sent in full after all when the worker knows the collector's tail may keep "
          "them: the root failed, a generation stopped at `length`, or a rollout-health finding "
          "(docs/multi-process.md). 0: none.", type="int"),
    Param("capture", "RTRACE_CAPTURE", _bool, True, "true/false",
          "Capture arguments and return values of decorated calls (off: names and timings only).", type="bool"),
    Param("max_value_chars", "RTRACE_MAX_VALUE_CHARS", _int(16), 20_000, "an integer >= 16",
          "Captured values longer than this (as JSON text) are truncated; conversion stops there.", type="int"),
    Param("redact_keys", "RTRACE_REDACT_KEYS", _str_list, DEFAULT_REDACT_KEYS,
          "comma list of key fragments, or none",
          "Argument / dict keys containing one of these fragments are replaced by '[REDACTED]' "
          "(`-` and `_` match each other). `none`: no key redaction (value patterns still apply).",
          type="tuple[str, ...]"),
    Param("max_queue_size", "RTRACE_MAX_QUEUE_SIZE", _int(1), 65_536, "an integer >= 1",
          "Ended spans waiting for the worker thread; beyond it spans are dropped and counted.", type="int"),
    Param("max_open_trajectories", "RTRACE_MAX_OPEN_TRAJECTORIES", _int(1), 20_000, "an integer >= 1",
          "Trajectories started whose root has not ended (running); beyond it new ones are not traced (counted). "
          "Finished ones that wait (awaited annotations, the collector's settle time) are held apart: "
          "max_waiting_trajectories.", type="int"),
    Param("max_waiting_trajectories", "RTRACE_MAX_WAITING_TRAJECTORIES", _int(1), 20_000, "an integer >= 1",
          "Finished trajectories held while they wait for awaited annotations (or, in the collector, settle_s), "
          "apart from the running ones. Beyond it the oldest is written now, complete but without what it waited "
          "for (counted: trajectories_written_early); a running trajectory is never evicted for it.", type="int"),
    Param("max_waiting_summaries", "RTRACE_MAX_WAITING_SUMMARIES", _int(1), 100_000, "an integer >= 1",
          "Rollouts recorded as summaries only (docs/metrics.md) held while they wait for awaited annotations, apart "
          "from the trajectories (~1.5 kB each: a step of more summarized rollouts per collector, all waiting for "
          "the trainer's advantages, needs more). Beyond it the oldest is counted now without what it waited for "
          "(counted: trajectories_written_early).", type="int"),
    Param("max_spans_per_trajectory", "RTRACE_MAX_SPANS_PER_TRAJECTORY", _int(1), 2_000, "an integer >= 1",
          "Spans kept per trajectory; the rest are dropped and counted.", type="int"),
    Param("orphan_timeout_s", "RTRACE_ORPHAN_TIMEOUT_S", _float(0.0), 1800.0, _SEC.format(0),
          "A trajectory whose root has not ended after this long is written as partial.", type="float"),
    Param("export_interval_s", "RTRACE_EXPORT_INTERVAL_S", _float(0.001), 0.5, _SEC.format(0.001),
          "How often the worker thread assembles and exports what has ended (collector mode: how soon an "
          "ended span leaves the worker).", type="float"),
    Param("max_export_batch_size", "RTRACE_MAX_EXPORT_BATCH_SIZE", _int(1), 256, "an integer >= 1",
          "Trajectories handed to a sink per call.", type="int"),
    Param("sink_queue_size", "RTRACE_SINK_QUEUE_SIZE", _int(1), 64, "an integer >= 1",
          "Batches waiting per sink; a slow sink beyond it samples fewer trajectories per step (counted).", type="int"),
    Param("sink_timeout_s", "RTRACE_SINK_TIMEOUT_S", _float(0.0), 30.0, _SEC.format(0),
          "How long flush()/shutdown() wait for each sink; also bounds interpreter exit.", type="float"),
    Param("flush_on_sigterm", "RTRACE_FLUSH_ON_SIGTERM", _bool, True, "true/false",
          "On SIGTERM, flush (bounded by sink_timeout_s) and then let the signal do what it did before "
          "(the previous handler, or the default: terminate). Main thread only.", type="bool"),
    Param("await_annotations", "RTRACE_AWAIT_ANNOTATIONS", _str_list, None, "comma list of keys, or none",
          "Annotation keys (`reward`, `advantage`...) a finished training trajectory waits for before it is "
          "exported. Unset: none, until the trainer's `old_logprob` rows come after their trajectories were "
          "written (the logprob_mismatch check then measured nothing): from then on training trajectories wait "
          "for `old_logprob` (said once; docs/token-values.md). `none`: never wait.",
          type="tuple[str, ...] | None"),
    Param("await_eval_annotations", "RTRACE_AWAIT_EVAL_ANNOTATIONS", _str_list, (), "comma list of keys, or none",
          "The same for validation trajectories (none by default: trainers annotate advantages and returns on "
          "training rollouts only, and a validation rollout would wait in vain).", type="tuple[str, ...]"),
    Param("annotation_queue_bytes", "RTRACE_ANNOTATION_QUEUE_BYTES", _int(1024 * 1024), 256 * 1024 * 1024,
          "an integer >= 1048576",
          "Annotations waiting for rtrace's worker thread, by estimated size (~100 bytes a value, per-token "
          "arrays by their bytes): one annotate_batch call of 10^5 rows of two values is ~40 MB. Beyond it the "
          "rows that do not fit are dropped and counted.", type="int"),
    Param("annotation_timeout_s", "RTRACE_ANNOTATION_TIMEOUT_S", _float(0.0), 120.0, _SEC.format(0),
          "How long a trajectory waits for awaited annotations; then it is exported without them (counted).",
          type="float"),
    Param("jsonl_path", "RTRACE_JSONL_PATH", writable_path, "rtrace_traces.jsonl", "a writable file path",
          "Where the jsonl sink appends one trajectory per line. Missing directories are created at the first "
          "write; configure() checks that they can be (the first existing ancestor takes a probe file) and refuses "
          "a dangling symbolic link. A new file is created mode 0600 (less the umask): trajectories hold prompts.",
          type="str"),
    Param("parquet_path", "RTRACE_PARQUET_PATH", dataset_path, "rtrace_dataset",
          "a local folder, or a URL: s3://bucket/prefix (options as query: ?endpoint_override=host:port&region=...), "
          "gs://..., or any fsspec URL",
          "Where the parquet sink writes: the run's dataset is `<path>/<RTRACE_EXPERIMENT or default>/` "
          "(docs/dataset.md). Several processes and collectors may write one run's dataset at once.", type="str"),
    Param("service_name", "OTEL_SERVICE_NAME", _str, "rtrace", "a non-empty name",
          "OTel resource service.name of rtrace's own TracerProvider.", type="str"),
    # collector mode
    Param("collector_endpoint", "RTRACE_COLLECTOR_ENDPOINT", _endpoints, None,
          "host:port, or a comma list host1:4317,host2:4317,...",
          "The rtrace collector workers send spans to (exporter `collector`; set by `collector.env`). A list: "
          "each rollout goes to the collector that owns its key (run, validate, step, sample_index) on a "
          "consistent-hash ring, the OpenTelemetry Collector loadbalancing exporter's (docs/collector.md, "
          "\"Placement\"); give the trainer the same list.", type="str | None"),
    Param("collector_queue_bytes", "RTRACE_COLLECTOR_QUEUE_BYTES", _int(1024 * 1024), 128 * 1024 * 1024,
          "an integer >= 1048576",
          "Collector mode: encoded requests waiting per collector endpoint in a worker or trainer (sent a few MB "
          "at a time, retried on push-back within OTEL_EXPORTER_OTLP_TIMEOUT); beyond it segments are dropped "
          "and counted.", type="int"),
    Param("job_id", "RTRACE_JOB_ID", _str, None, "a non-empty id",
          "The training job's id, set by the collector in `collector.env`; stamped as `rtrace.job_id`.",
          type="str | None"),
    Param("worker_name", "RTRACE_WORKER_NAME", _str, None, "a non-empty name",
          "This process's name on the timeline (docs/timeline.md): its rollouts' `worker` and its weight updates' "
          "(`rtrace.mark_weight_update`). Unset: `<host>:<pid>`. Collector mode: sent as the OTLP resource's "
          "`service.instance.id`.", type="str | None"),
    Param("collector_token", "RTRACE_COLLECTOR_TOKEN", _token, None,
          "at least 16 printable ASCII characters, or none",
          "A shared secret: the collector refuses requests without it (gRPC UNAUTHENTICATED, HTTP 401), workers "
          "send it (`authorization: Bearer ...`). `start_collector` / `rtrace collect` bound beyond loopback "
          "generate one when unset (`none`: no token, with a warning); `collector.env` carries it. Never logged.",
          type="str | None"),
    Param("collector_tls_cert", "RTRACE_COLLECTOR_TLS_CERT", _pem_file, None, "a readable PEM file",
          "Collector: its certificate chain; with `collector_tls_key`, the receiver speaks TLS only (workers then "
          "send to `https://host:port`).", type="str | None"),
    Param("collector_tls_key", "RTRACE_COLLECTOR_TLS_KEY", _pem_file, None, "a readable PEM file",
          "Collector: the private key of `collector_tls_cert`.", type="str | None"),
    Param("collector_tls_client_ca", "RTRACE_COLLECTOR_TLS_CLIENT_CA", _pem_file, None, "a readable PEM file",
          "Collector: require client certificates signed by this CA (mutual TLS; workers present "
          "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE and OTEL_EXPORTER_OTLP_CLIENT_KEY).", type="str | None"),
    Param("collector_tls_ca", "RTRACE_COLLECTOR_TLS_CA", _pem_file, None, "a readable PEM file",
          "Collector: the CA certificate workers verify it with; `collector.env` hands it to them as "
          "OTEL_EXPORTER_OTLP_CERTIFICATE (for a self-signed certificate, the certificate itself).",
          type="str | None"),
    Param("otlp_certificate", "OTEL_EXPORTER_OTLP_CERTIFICATE", _pem_file, None, "a readable PEM file",
          "The CA certificate that verifies an `https://` rtrace collector or OTLP endpoint (unset: the system's "
          "roots).", type="str | None", signal_env="OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE"),
    Param("otlp_client_certificate", "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE", _pem_file, None,
          "a readable PEM file", "The client certificate for a collector or OTLP endpoint that asks for one "
          "(mutual TLS).", type="str | None", signal_env="OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE"),
    Param("otlp_client_key", "OTEL_EXPORTER_OTLP_CLIENT_KEY", _pem_file, None, "a readable PEM file",
          "The private key of the client certificate.", type="str | None",
          signal_env="OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY"),
    Param("collector_max_span_bytes", "RTRACE_COLLECTOR_MAX_SPAN_BYTES", _int(1024), 4 * 1024 * 1024,
          "an integer >= 1024",
          "Collector: a span larger than this on the wire is refused (counted). A 128k-token prompt's ids take "
          "about 0.8 MB.", type="int"),
    Param("collector_max_attributes", "RTRACE_COLLECTOR_MAX_ATTRIBUTES", _int(16), 1024, "an integer >= 16",
          "Collector: a span with more attributes than this is refused (counted).", type="int"),
    Param("collector_max_held_bytes", "RTRACE_COLLECTOR_MAX_HELD_BYTES", _int(1024 * 1024), 1024 ** 3,
          "an integer >= 1048576",
          "Collector: wire bytes the running trajectories (root not arrived) may hold. At it (or at "
          "max_open_trajectories) the receiver pushes back (RESOURCE_EXHAUSTED with RetryInfo / HTTP 429) and the "
          "least recently active running trajectories are written partial until a tenth is free (counted: "
          "trajectories_evicted). Finished trajectories that wait (settle_s, awaited annotations) are not counted "
          "here: collector_max_waiting_bytes.", type="int"),
    Param("collector_max_waiting_bytes", "RTRACE_COLLECTOR_MAX_WAITING_BYTES", _int(1024 * 1024), 1024 ** 3,
          "an integer >= 1048576",
          "Collector: wire bytes the finished trajectories waiting for settle_s or awaited annotations may hold. "
          "Beyond it the oldest is written now, without what it waited for (counted: trajectories_written_early).",
          type="int"),
    # the capture gateway (docs/gateway.md)
    Param("gateway_upstream", "RTRACE_GATEWAY_UPSTREAM", _http_url, None, "an http(s):// URL",
          "The OpenAI-compatible server the capture gateway forwards to (vLLM, SGLang, a hosted API), e.g. "
          "`http://127.0.0.1:8000/v1` (`/v1` is added to a URL without a path). Given to `start_collector` / "
          "`rtrace collect`, the collector serves the gateway too.", type="str | None"),
    Param("gateway_url", "RTRACE_GATEWAY_URL", _http_url, None, "an http(s):// URL",
          "Where trainers reach the gateway, for `rtrace.gateway_access()` (set by `collector.env` and printed by "
          "`rtrace gateway`).", type="str | None"),
    Param("gateway_secret", "RTRACE_GATEWAY_SECRET", _token, None,
          "at least 16 printable ASCII characters",
          "The secret rollout keys are signed with (HMAC-SHA256), shared by the gateway and the trainers that mint "
          "keys; generated by the gateway when unset and carried by `collector.env` / the gateway's env file. "
          "Never logged.", type="str | None"),
    Param("gateway_key_ttl_s", "RTRACE_GATEWAY_KEY_TTL_S", _float(1.0), 3600.0, _SEC.format(1),
          "How long a rollout key or a session lives; a session not ended by then is written partial.",
          type="float"),
    Param("gateway_untraced", "RTRACE_GATEWAY_UNTRACED", _choice("refuse", "record", "forward"), "refuse",
          "refuse, record or forward",
          "A call with no rollout key, session or `traceparent`: `refuse` (401, counted; never forwarded), "
          "`record` (forwarded, recorded as a trajectory of its own) or `forward` (forwarded, not recorded).",
          type="str"),
    Param("gateway_upstream_key", "RTRACE_GATEWAY_UPSTREAM_KEY", _secret, None, "an API key",
          "The upstream's API key: every forwarded call carries `Authorization: Bearer <it>`. Unset: a client's "
          "own key is forwarded, a rollout key or the job's token never. Never logged.", type="str | None"),
    Param("gateway_token_ids", "RTRACE_GATEWAY_TOKEN_IDS", _bool, True, "true/false",
          "Ask the upstream for prompt and completion token ids (vLLM's `return_token_ids`) when the client did "
          "not; off (a server that refuses the field), every call is recorded with a capture gap.", type="bool"),
    Param("gateway_logprobs", "RTRACE_GATEWAY_LOGPROBS", _bool, True, "true/false",
          "Ask the upstream for the sampled tokens' logprobs when the client did not (recorded as "
          "the generation's per-token `logprob` array, docs/token-values.md).", type="bool"),
    Param("gateway_timeout_s", "RTRACE_GATEWAY_TIMEOUT_S", _float(0.001), 600.0, _SEC.format(0.001),
          "The longest wait for the upstream: its answer's head, then each streamed chunk (then 504).",
          type="float"),
    Param("gateway_max_request_bytes", "RTRACE_GATEWAY_MAX_REQUEST_BYTES", _int(1024), 32 * 1024 * 1024,
          "an integer >= 1024", "A request body larger than this is refused (413, counted).", type="int"),
    Param("gateway_max_response_bytes", "RTRACE_GATEWAY_MAX_RESPONSE_BYTES", _int(1024), 32 * 1024 * 1024,
          "an integer >= 1024",
          "An answer larger than this is passed through as it comes, not recorded (a capture gap, counted).",
          type="int"),
    # trackio sink
    Param("trackio_trace_key", "RTRACE_TRACKIO_TRACE_KEY", _str, "rollout/traces", "a non-empty log key",
          "trackio key for training trajectories.", type="str"),
    Param("trackio_eval_trace_key", "RTRACE_TRACKIO_EVAL_TRACE_KEY", _str, "eval/traces", "a non-empty log key",
          "trackio key for validation trajectories.", type="str"),
    Param("space_id", "TRACKIO_SPACE_ID", _str, None, "a Hugging Face Space id",
          "Send the trackio run to a Space, as trackio does.", type="str | None"),
    Param("step_table_rows", "RTRACE_STEP_TABLE_ROWS", _int(0), 1024, "an integer >= 0",
          "Rows of each step's rollouts table (trackio Table, MLflow table): one per exported trajectory of the "
          "step, by group; 0: no table. Beyond it, rows are left out (the table's last row says how many).",
          type="int"),
    Param("summary_metrics", "RTRACE_SUMMARY_METRICS", _bool, True, "true/false",
          "Log per-step summary metrics (reward, turns, latency...) next to the traces (trackio).", type="bool"),
    # MLflow sink
    Param("mlflow_tracking_uri", "MLFLOW_TRACKING_URI", _tracking_uri, None,
          "an MLflow tracking URI: http(s)://, sqlite:///, postgresql://, mysql://, mssql://, databricks, or a "
          "plugin's scheme",
          "Where the mlflow sink writes. Unset: sqlite:///<cwd>/.rtrace/mlflow.db.", type="str | None"),
    Param("mlflow_run_id", "RTRACE_MLFLOW_RUN_ID", _str, None, "an MLflow run id",
          "Run the traces are linked to. Unset: the active run of this process, if any.", type="str | None"),
    Param("mlflow_assessments", "RTRACE_MLFLOW_ASSESSMENTS", _auto_bool, "auto", "auto, true or false",
          "Write each trajectory's reward, verdict and reward components as MLflow assessments (columns of the "
          "traces list, `feedback.reward > 0.5` in search_traces; docs/mlflow.md). `auto`: into a SQL store "
          "(one transaction per batch), not into a server (one request per assessment: several times the cost "
          "of the traces).", type="bool | str"),
    # OTLP sink
    Param("otlp_endpoint", "OTEL_EXPORTER_OTLP_ENDPOINT", _url, None, "a URL",
          "OTLP collector base URL (http: 'http://127.0.0.1:4318'; grpc: '127.0.0.1:4317').", type="str | None"),
    Param("otlp_traces_endpoint", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", _url, None, "a URL",
          "Full traces URL; overrides otlp_endpoint.", type="str | None"),
    Param("otlp_protocol", "OTEL_EXPORTER_OTLP_PROTOCOL", _choice("http/protobuf", "grpc"), "http/protobuf",
          "http/protobuf or grpc", "OTLP transport.", type="str"),
    Param("otlp_headers", "OTEL_EXPORTER_OTLP_HEADERS", _headers, {}, "key=value,key2=value2",
          "Headers sent with every OTLP request.", type="dict[str, str]",
          signal_env="OTEL_EXPORTER_OTLP_TRACES_HEADERS"),
    # The OTel spec gives OTEL_EXPORTER_OTLP_TIMEOUT in milliseconds; configure() takes seconds.
    Param("otlp_timeout_s", "OTEL_EXPORTER_OTLP_TIMEOUT", _float(0.001, 3600.0), 10.0,
          "milliseconds in the environment, seconds in configure()",
          "Per-request OTLP timeout, retries included (the collector's push-back is retried within it).",
          env_scale=0.001, type="float", signal_env="OTEL_EXPORTER_OTLP_TRACES_TIMEOUT"),
    Param("otlp_compression", "OTEL_EXPORTER_OTLP_COMPRESSION", _choice("none", "gzip", "deflate"), "none",
          "none, gzip or deflate", "Compression of OTLP requests (the otlp sink, and the worker's requests to an "
          "rtrace collector).", type="str", signal_env="OTEL_EXPORTER_OTLP_TRACES_COMPRESSION"),
    # The one conversion to OTel spans (otlp and mlflow sinks, the collector's output)
    Param("semconv", "RTRACE_SEMCONV", _choice("both", "genai", "rtrace"), "rtrace", "rtrace, both or genai",
          "Names on exported OTel spans (otlp, mlflow sinks, the collector's output): `rtrace` writes rtrace's "
          "names; `both` adds the OpenTelemetry GenAI conventions (span names `invoke_agent` / `chat` / "
          "`execute_tool`, `gen_ai.*` messages, rewards as `gen_ai.evaluation.result` events), which MLflow and "
          "Phoenix render natively; `genai` leaves out rtrace's copies of what those carry. `rl.*` are always "
          "written. Not `both` by default: it costs the OTLP sink ~1.8x the CPU of `rtrace` (docs/semconv.md).",
          type="str"),
    Param("genai_provider", "RTRACE_GENAI_PROVIDER", _provider, None,
          "a provider name: lower case letters, digits, `.` and `_` (vllm, sglang, openai ...)",
          "`gen_ai.provider.name` on `chat` and `invoke_agent` spans (RTRACE_SEMCONV both / genai) whose "
          "generation did not record one: the engine that serves the policy. The capture gateway records its "
          "upstream's own (vLLM, SGLang, OpenAI: from its `/v1/models`). Unset and unknown: not written "
          "(docs/semconv.md).", type="str | None"),
)

_PARAMS_BY_NAME = {p.name: p for p in PARAMS}
#: ``RTRACE_*`` variables read besides the table's, never warned about as unknown: those of
#: the project's tests and benchmarks (the UI tests' cache and screenshots, the browser,
#: Phoenix), which run with rtrace configured. (rtrace itself reads no other.)
_OTHER_ENV = ("RTRACE_UI_CACHE", "RTRACE_UI_ARTIFACTS", "RTRACE_CHROMIUM", "RTRACE_PHOENIX")


class _SettingsBase:
    """Behaviour of :class:`Settings`; the fields come from :data:`PARAMS`."""

    __slots__ = ()

    @property
    def enabled(self) -> bool:
        """True when at least one sink is configured."""
        return bool(self.exporter) or bool(self.sinks)  # type: ignore[attr-defined]

    @property
    def selects_at_end(self) -> bool:
        """True when one process must record every trajectory and choose at its end (tail
        keeping or prompt sampling under a cap); the collector always does."""
        capped = self.max_traces_per_step is not None or self.max_val_traces_per_step is not None  # type: ignore[attr-defined]
        tail = (self.keep_errors or self.keep_extremes or self.keep_zero_variance_groups  # type: ignore[attr-defined]
                or self.sample_prompts or (self.keep_unhealthy and self.health_checks)  # type: ignore[attr-defined]
                or (self.keep_mismatch and "logprob_mismatch" in self.health_checks))  # type: ignore[attr-defined]
        return bool(capped and tail)

    @property
    def val_cap(self) -> int | None:
        """The per-step cap that applies to validation trajectories."""
        if self.max_val_traces_per_step is not None:  # type: ignore[attr-defined]
            return self.max_val_traces_per_step  # type: ignore[attr-defined]
        return self.max_traces_per_step  # type: ignore[attr-defined]


def _default(value: Any) -> Any:
    return field(default_factory=lambda: dict(value)) if isinstance(value, dict) else value


#: Validated settings, one field per entry of :data:`PARAMS` (same name, same default),
#: plus ``sinks``: custom :class:`rtrace.Sink` instances handed to ``configure()`` (not
#: read from the environment). Build with :func:`load_settings`.
Settings = make_dataclass(
    "Settings",
    [(p.name, p.type, _default(p.default)) for p in PARAMS] + [("sinks", "tuple", ())],
    bases=(_SettingsBase,), frozen=True)
Settings.__module__ = __name__
Settings.__doc__ = ("Validated settings. Build with :func:`load_settings`; every field is in :data:`PARAMS` "
                    "(docs/configuration.md).")


def _parse(param: Param, raw: Any, source: str, var: str | None = None) -> Any:
    try:
        return param.parse(raw)
    except ValueError as exc:
        where = (var or param.env) if source == "env" else f"configure({param.name}=...)"
        env = f" (env {param.env})" if source != "env" and param.env else ""
        raise ConfigError(f"{where}{env}: {exc}; accepted values: {param.accepted}", param.name, str(exc),
                          param.accepted) from None


def unknown_env(environ: Mapping[str, str]) -> list[tuple[str, str | None]]:
    """``RTRACE_*`` variables that are not settings, each with the closest known name."""
    import difflib

    known = [p.env for p in PARAMS if p.env and p.env.startswith("RTRACE_")] + list(_OTHER_ENV)
    out = []
    for key in sorted(environ):
        if key.startswith("RTRACE_") and key not in known:
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            out.append((key, close[0] if close else None))
    return out


def warn_unknown_env(environ: Mapping[str, str]) -> None:
    """Warn once per process for each ``RTRACE_*`` variable that is not a setting, naming
    the closest one: ``RTRACE_EXPORTERS=jsonl`` would otherwise trace nothing, without a word."""
    from . import _stats

    for name, close in unknown_env(environ):
        hint = f"; did you mean {close}?" if close else ""
        _stats.warn_once(f"unknown-env-{name}", "rtrace: unknown environment variable %s is ignored%s", name, hint)


def load_settings(overrides: Mapping[str, Any] | None = None,
                  environ: Mapping[str, str] | None = None) -> Any:
    """Build :class:`Settings` from keyword overrides, then the environment, then defaults.
    Reading the process's environment (every start: ``configure()``, a collector, a
    gateway), it warns once for each ``RTRACE_*`` variable that is not a setting
    (:func:`warn_unknown_env`).

    Args:
        overrides: values given to ``configure()``; ``None`` values are ignored.
        environ: the environment to read (default ``os.environ``).

    Raises:
        ConfigError: an unknown keyword, or a value that does not parse.
    """
    overrides = dict(overrides or {})
    if environ is None:
        environ = os.environ
        warn_unknown_env(environ)
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
            continue
        for var in (param.signal_env, param.env):
            if not var or environ.get(var) is None:
                continue
            raw = environ[var]
            if var.startswith("OTEL_") and not raw.strip():
                continue  # the OTel specification: an empty variable is the same as unset
            if param.env_scale != 1.0:  # e.g. milliseconds in the environment, seconds in configure()
                try:
                    raw = float(raw) * param.env_scale
                except ValueError:
                    pass  # the parser names the variable and the accepted values
            values[param.name] = _parse(param, raw, "env", var)
            break
    if sinks is not None:
        values["sinks"] = tuple(sinks) if isinstance(sinks, (list, tuple)) else (sinks,)
    settings = Settings(**values)
    if "collector" in settings.exporter and settings.collector_endpoint is None:
        raise ConfigError("RTRACE_EXPORTER=collector needs RTRACE_COLLECTOR_ENDPOINT (host:port of "
                          "`rtrace collect` / rtrace.start_collector(); collector.env sets both)")
    for a, b in (("collector_tls_cert", "collector_tls_key"), ("otlp_client_certificate", "otlp_client_key")):
        if (getattr(settings, a) is None) != (getattr(settings, b) is None):
            given, missing = (a, b) if getattr(settings, a) is not None else (b, a)
            raise ConfigError(f"{_PARAMS_BY_NAME[given].env} is set but {_PARAMS_BY_NAME[missing].env} is not: "
                              "a certificate needs its private key; accepted values: both, or neither")
    return settings


def env_setting(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """One setting from the environment alone (its default when unset), parsed as
    ``load_settings`` parses it: for code that reads a setting outside ``configure()``
    (``rtrace.gateway_access()`` in a worker that may trace nothing itself; ``rtrace serve``
    reads ``RTRACE_COLLECTOR_TOKEN`` and must not fail on another setting's value).

    Raises:
        ConfigError: a value that does not parse, naming the variable and the accepted values.
    """
    param = _PARAMS_BY_NAME[name]
    environ = os.environ if environ is None else environ
    raw = environ.get(param.env) if param.env else None
    if raw is None or (param.env.startswith("OTEL_") and not raw.strip()):
        return param.default
    return _parse(param, raw, "env")


def env_exporters(environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The sinks ``RTRACE_EXPORTER`` names in the environment (``()`` when unset or ``none``).

    Raises:
        ConfigError: a name that is not a sink.
    """
    environ = os.environ if environ is None else environ
    return _parse(_PARAMS_BY_NAME["exporter"], environ.get("RTRACE_EXPORTER"), "env")


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
        env = f"`{p.signal_env}`, else `{p.env}`" if p.signal_env else f"`{p.env}`"
        rows.append(f"| `{p.name}` | {env} | {fmt(p.default)} | {p.accepted} | {p.doc} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":  # python -m rtrace.config: print the reference table
    print(reference_markdown(), end="")
