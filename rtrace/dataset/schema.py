"""The dataset's schema, version ``rtrace.dataset/1.2``: three tables, declared once here.

``trajectories``: one row per trajectory; ``spans``: one row per span, in OTel's shape
(trace id, span id, parent, name, kind, times, status, attributes, events) with the RL
coordinates as real columns; ``events`` (1.2): the run's events, the trainer's weight
updates (docs/timeline.md). docs/dataset.md and docs/dataset-schema.json are generated
from :data:`TABLES` (``python -m rtrace.dataset.schema``) and a test keeps them equal to
this module and to what the sink writes.

Open-ended keys (``extra`` coordinates, ``record_reward`` outcome keywords, annotations,
span attributes) are typed maps, as Jaeger's ClickHouse schema keeps attributes: one map
per value type (``<name>_bool`` BOOLEAN, ``<name>_int`` BIGINT, ``<name>_double`` DOUBLE,
``<name>_str`` VARCHAR, ``<name>_json`` VARCHAR holding JSON for lists, dicts and nulls). So
``outcome_bool['correct']`` and ``annotations_double['advantage'] > 0`` need no cast, and every file of every run has the
same columns: a key that appears in the middle of a run (an annotation that validation
steps never get) changes no schema, so every engine reads a whole run without merging
schemas. The values readers ask for most have columns of their own (``reward``,
``advantage``, ``verdict``, ``finish_reason``, tokens, times).

Versioning: ``MAJOR.MINOR``. A minor version only adds columns at the end of a table (the
per-token arrays of a later round will be one), so a reader of 1.0 reads 1.x files; a new
major version is an incompatible change, which this reader refuses with a message saying
so. The version is in every file's Parquet schema metadata (``rtrace.schema``) and in its
name (``.v1.0.parquet``), so a reader knows every file's version from the listing alone.
"""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa

__all__ = ["VERSION", "MAJOR", "MINOR", "SCHEMA_KEY", "SELECTION_KEY", "TABLES", "MAP_KINDS", "arrow_schema", "schema_json",
           "reference_markdown", "TRAJECTORIES", "SPANS", "EVENTS"]

#: The schema version written in every file's metadata (key :data:`SCHEMA_KEY`).
VERSION = "1.2"
MAJOR, MINOR = (int(v) for v in VERSION.split("."))
#: The Parquet key-value metadata key holding ``rtrace.dataset/<VERSION>``.
SCHEMA_KEY = "rtrace.schema"
#: The key holding how the writer's process chose what it kept (JSON: the per-step caps, whole
#: groups, the seed, the tail settings): a reader cuts several writers' samples with it.
SELECTION_KEY = "rtrace.selection"
TRAJECTORIES = "trajectories"
SPANS = "spans"
#: the run's events (weight updates): small files of their own under ``<run>/events/`` (1.2)
EVENTS = "events"

#: The suffixes of a typed map, and their value types (Jaeger's split: ints apart from doubles).
MAP_KINDS = (("bool", pa.bool_()), ("int", pa.int64()), ("double", pa.float64()), ("str", pa.string()),
             ("json", pa.string()))
_KIND_TEXT = {"bool": "boolean", "int": "integer", "double": "floating-point", "str": "string",
              "json": "other (lists, dicts, nulls: JSON text)"}

_TS = pa.timestamp("ns", tz="UTC")
_HEALTH = pa.list_(pa.struct([("check", pa.string()), ("detail", pa.string())]))
_TOOL_CALLS = pa.list_(pa.struct([("id", pa.string()), ("type", pa.string()), (
    "function", pa.struct([("name", pa.string()), ("arguments", pa.string())]))]))
_MESSAGES = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string()), ("name", pa.string()),
                                ("tool_call_id", pa.string()), ("tool_calls", _TOOL_CALLS)]))
_TOKEN_VALUES = pa.list_(pa.struct([("name", pa.string()), ("values", pa.list_(pa.float32()))]))
_EVENTS = pa.list_(pa.struct([("name", pa.string()), ("time", _TS), ("attributes", pa.string())]))


def _maps(name: str, what: str) -> list[tuple[str, pa.DataType, str]]:
    return [(f"{name}_{kind}", pa.map_(pa.string(), vtype), f"{what}: the {_KIND_TEXT[kind]} values, by key")
            for kind, vtype in MAP_KINDS]


_COORDS: list[tuple[str, pa.DataType, str]] = [
    ("step", pa.int64(), "RL step (`rl.step`); also the partition folder `step=N`"),
    ("validate", pa.bool_(), "a validation rollout (folder `validate/`, else `train/`)"),
    ("sample_index", pa.int64(), "index of the prompt in the step's batch"),
    ("rollout_n", pa.int64(), "index of the rollout within its GRPO group"),
    ("group_id", pa.string(), "the GRPO group as given (its text form)"),
    ("policy_version", pa.int64(), "policy version that generated it"),
]

#: table -> [(column, Arrow type, meaning)], in file order.
TABLES: dict[str, list[tuple[str, pa.DataType, str]]] = {
    TRAJECTORIES: [
        ("run", pa.string(), "the run: the dataset folder's name (`RTRACE_EXPERIMENT`, else `default`)"),
        ("trace_id", pa.string(), "OTel trace id, 32 hex digits (the spans table's key)"),
        ("name", pa.string(), "the root span's name"),
        *_COORDS,
        ("experiment", pa.string(), "`rl.experiment`"),
        ("group_key", pa.string(), "the group the step metrics count: `group_id`, else `sample_index`"),
        ("reward", pa.float64(), "from `record_reward` / an annotation; NULL when missing or not finite "
                                 "(the `reward` health check flags a NaN)"),
        ("advantage", pa.float64(), "the `advantage` annotation when it is a finite number"),
        ("verdict", pa.string(), "`error`, `partial`, `truncated`, `correct`, `wrong` or `ok` (Trajectory.verdict)"),
        ("status", pa.string(), "`ok` or `error` (the root span's status)"),
        ("error", pa.string(), "`<ExceptionType>: <message>` when the root failed"),
        ("partial", pa.bool_(), "the root never ended (orphan timeout or shutdown)"),
        ("finish_reason", pa.string(), "why the last generation that says so stopped"),
        ("truncated", pa.bool_(), "a generation stopped at `length`"),
        ("kept", pa.list_(pa.string()), "why it was kept: `sampled`, `error`, `unhealthy`, `best`, `worst`, "
                                       "`zero_variance`; empty when every trajectory is kept"),
        ("in_sample", pa.bool_(), "counted by the step metrics: every row when the run counts every rollout "
                                  "(`RTRACE_SUMMARIES`, the default: one row per rollout); else kept by the sample "
                                  "(or no cap), not only for the tail"),
        ("health", _HEALTH, "rollout-health findings; empty when healthy, NULL when no check ran"),
        ("num_turns", pa.int32(), "generation spans"),
        ("num_tool_calls", pa.int32(), "tool spans"),
        ("num_spans", pa.int32(), "spans written to the spans table"),
        ("dropped_spans", pa.int32(), "spans dropped by `max_spans_per_trajectory`"),
        ("input_tokens", pa.int64(), "sum of `gen_ai.usage.input_tokens` over generations"),
        ("output_tokens", pa.int64(), "sum of `gen_ai.usage.output_tokens` over generations"),
        ("start_time", _TS, "the root's start"),
        ("end_time", _TS, "the last span's end"),
        ("duration_ms", pa.float64(), "end - start"),
        ("generation_ms", pa.float64(), "time in generation spans"),
        ("tool_ms", pa.float64(), "time in tool spans"),
        ("task", pa.string(), "the first user message's content"),
        ("answer", pa.string(), "the last assistant message's content"),
        ("messages", _MESSAGES, "the conversation in OpenAI's chat format (docs/jsonl-schema.md, Messages): a content that is not text, "
                                  "and tool call arguments, as JSON text"),
        *_maps("extra", "extra coordinates (`rollout_context(dataset=...)`)"),
        *_maps("outcome", "`record_reward` keywords"),
        *_maps("annotations", "`rtrace.annotate` / `annotate_batch` values"),
        ("job_id", pa.string(), "`rtrace.job_id` of the collector's job, when set"),
        # 1.1
        ("health_checks", pa.list_(pa.string()), "the health checks that ran on it (docs/health.md); NULL when "
                                                 "unknown"),
        # 1.2
        ("recorded", pa.bool_(), "recorded in full: its spans and conversation are written; false: a rollout "
                                 "counted by its summary only (sampled out); NULL in files before 1.2 (recorded)"),
        ("priority", pa.float64(), "its rank in the step's sample (the lowest are kept): readers cut the samples of "
                                   "several collectors to the one-collector sample by it"),
        ("finish_reasons", pa.map_(pa.string(), pa.int64()), "every generation's finish reasons, counted "
                                                             "(the step metrics' `finish_reason/<reason>_frac`)"),
        ("worker", pa.string(), "the process it ran in: `RTRACE_WORKER_NAME`, else `host:pid` (collector mode: its "
                                "root's sender); the timeline's worker track (docs/timeline.md)"),
        ("policy_version_end", pa.int64(), "the policy version it ended on: its last generation's own version when "
                                           "the server said (`rtrace.weight_version`), else the latest "
                                           "`rtrace.mark_weight_update` at or before its end; NULL when unknown"),
        ("crossed_update", pa.bool_(), "a weight update was marked while it ran, or its last generation's own "
                                       "version is not `policy_version`; NULL when unknown"),
        ("wait_ms", pa.float64(), "time in neither a generation nor a tool call (their union): waiting for a slot, "
                                  "a parser, an environment"),
        ("server_ms", pa.map_(pa.string(), pa.float64()), "generation time by inference server "
                                                          "(`server.address[:server.port]`)"),
    ],
    SPANS: [
        ("run", pa.string(), "as in trajectories"),
        ("trace_id", pa.string(), "OTel trace id"),
        ("span_id", pa.string(), "OTel span id, 16 hex digits"),
        ("parent_span_id", pa.string(), "NULL for the root"),
        ("name", pa.string(), "span name"),
        ("kind", pa.string(), "`rollout`, `agent`, `generation`, `tool`, `chain`, `segment`, `span`"),
        ("start_time", _TS, "start"),
        ("end_time", _TS, "end"),
        ("duration_ms", pa.float64(), "end - start"),
        ("status_code", pa.string(), "`ok`, `error` or `unset`"),
        ("status_message", pa.string(), "the error text"),
        *_COORDS,
        ("model", pa.string(), "`gen_ai.request.model`"),
        ("tool_name", pa.string(), "`gen_ai.tool.name`"),
        ("tool_call_id", pa.string(), "`gen_ai.tool.call.id`"),
        ("input_tokens", pa.int64(), "`gen_ai.usage.input_tokens`"),
        ("output_tokens", pa.int64(), "`gen_ai.usage.output_tokens`"),
        ("finish_reasons", pa.list_(pa.string()), "`gen_ai.response.finish_reasons`"),
        *_maps("attributes", "the span's other attributes (the `rl.*` coordinates are columns)"),
        ("input", pa.string(), "captured arguments, JSON text"),
        ("output", pa.string(), "captured return value, JSON text"),
        ("events", _EVENTS, "span events; `attributes` is JSON text"),
        ("prompt_ids", pa.list_(pa.int64()), "token ids, when kept (docs/token2text.md)"),
        ("response_ids", pa.list_(pa.int64()), "token ids, when kept"),
        # 1.1
        ("token_values", _TOKEN_VALUES, "a generation's per-token values (docs/token-values.md): `logprob`, "
                                        "`old_logprob`, `advantage`, `loss_mask` ..., each aligned with its "
                                        "response tokens; NULL when none"),
    ],
    # 1.2
    EVENTS: [
        ("run", pa.string(), "as in trajectories"),
        ("event_id", pa.string(), "16 hex digits; an event several collectors wrote is one row of the view"),
        ("kind", pa.string(), "`weight_update` (`rtrace.mark_weight_update`)"),
        ("time", _TS, "when it was marked"),
        ("version", pa.int64(), "the policy version published"),
        ("step", pa.int64(), "the trainer's step, when given"),
        ("worker", pa.string(), "the process that marked it (as a trajectory's `worker`)"),
        *_maps("attributes", "the call's keyword arguments"),
    ],
}


def arrow_schema(table: str) -> pa.Schema:
    """The Arrow schema of ``table``, with the version in its metadata."""
    return pa.schema([pa.field(name, dtype) for name, dtype, _ in TABLES[table]],
                     metadata={SCHEMA_KEY: f"rtrace.dataset/{VERSION}", "rtrace.table": table})


_SCHEMAS: dict[str, pa.Schema] = {}


def cached_schema(table: str) -> pa.Schema:
    schema = _SCHEMAS.get(table)
    if schema is None:
        schema = _SCHEMAS[table] = arrow_schema(table)
    return schema


def type_text(dtype: pa.DataType) -> str:
    """An Arrow type as the docs spell it (DuckDB's names): ``MAP(VARCHAR, DOUBLE)``..."""
    if pa.types.is_map(dtype):
        return f"MAP(VARCHAR, {type_text(dtype.item_type)})"
    if pa.types.is_list(dtype):
        return f"{type_text(dtype.value_type)}[]"
    if pa.types.is_struct(dtype):
        return "STRUCT(" + ", ".join(f"{f.name} {type_text(f.type)}" for f in dtype) + ")"
    if pa.types.is_timestamp(dtype):
        return "TIMESTAMPTZ_NS"  # nanoseconds, UTC (DuckDB's name)
    return {"string": "VARCHAR", "large_string": "VARCHAR", "int64": "BIGINT", "int32": "INTEGER",
            "double": "DOUBLE", "float": "FLOAT", "bool": "BOOLEAN"}[str(dtype)]


def schema_json() -> dict[str, Any]:
    """The machine-readable schema (docs/dataset-schema.json): version, and per table its
    columns with their Arrow type (``str(type)``) and meaning."""
    return {"version": VERSION, "metadata_key": SCHEMA_KEY,
            "tables": {t: [{"name": n, "arrow_type": str(d), "type": type_text(d), "doc": doc}
                           for n, d, doc in cols] for t, cols in TABLES.items()}}


def reference_markdown() -> str:
    """The column tables of docs/dataset.md (a test keeps them equal)."""
    out = []
    for table, cols in TABLES.items():
        out += [f"### `{table}`", "", "| column | type | meaning |", "| --- | --- | --- |"]
        out += [f"| `{n}` | {type_text(d)} | {doc} |" for n, d, doc in cols]
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":  # python -m rtrace.dataset.schema: print the JSON copy
    print(json.dumps(schema_json(), indent=1))
