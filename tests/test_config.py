"""Configuration: one table, early and precise errors, docs generated from the code."""

from __future__ import annotations

import dataclasses
import pathlib

import pytest

import rtrace
from rtrace.config import PARAMS, ConfigError, Settings, load_settings, reference_markdown

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("env, value, message", [
    # unknown exporter name: names the variable and lists the accepted names
    ("RTRACE_EXPORTER", "trakio", "RTRACE_EXPORTER: unknown exporter 'trakio'; accepted values: comma list of none, console, jsonl, trackio, mlflow, otlp, collector, parquet"),
    # non-integer cap
    ("RTRACE_MAX_TRACES_PER_STEP", "ten", "RTRACE_MAX_TRACES_PER_STEP: not an integer: 'ten'; accepted values: an integer >= 0, or none"),
    # negative cap
    ("RTRACE_MAX_TRACES_PER_STEP", "-1", "RTRACE_MAX_TRACES_PER_STEP: -1 is below the minimum 0; accepted values: an integer >= 0, or none"),
    # bad boolean
    ("RTRACE_TOKEN2TEXT", "maybe", "RTRACE_TOKEN2TEXT: not a boolean: 'maybe'; accepted values: true/false (1/0, yes/no, on/off)"),
    # bad float
    ("RTRACE_ORPHAN_TIMEOUT_S", "soon", "RTRACE_ORPHAN_TIMEOUT_S: not a number: 'soon'; accepted values: seconds from 0 to 604800"),
    # bad OTLP protocol
    ("OTEL_EXPORTER_OTLP_PROTOCOL", "udp", "OTEL_EXPORTER_OTLP_PROTOCOL: got 'udp'; accepted values: http/protobuf or grpc"),
])
def test_bad_env_values_fail_at_configure(monkeypatch, env, value, message):
    """A bad environment value raises ConfigError at configure(), naming the variable and accepted values."""
    monkeypatch.setenv(env, value)
    with pytest.raises(ConfigError) as info:
        rtrace.configure()
    assert str(info.value) == message


def test_bad_env_value_fails_at_first_traced_call(monkeypatch):
    """Without configure(), a typo in RTRACE_EXPORTER fails loudly at the first traced call, not silently off."""
    monkeypatch.setenv("RTRACE_EXPORTER", "jsnol")

    @rtrace.traced
    def f():
        return 1

    with pytest.raises(ConfigError, match="RTRACE_EXPORTER"):
        f()


def test_bad_keyword_names_the_keyword_and_env_var():
    """A bad keyword value names configure(<kw>=...) and its environment variable."""
    with pytest.raises(ConfigError) as info:
        rtrace.configure(max_spans_per_trajectory=0)
    assert str(info.value) == ("configure(max_spans_per_trajectory=...) (env RTRACE_MAX_SPANS_PER_TRAJECTORY): "
                               "0 is below the minimum 1; accepted values: an integer >= 1")


def test_unknown_keyword():
    """An unknown configure() keyword is an error listing the accepted ones."""
    with pytest.raises(ConfigError, match="unknown setting\\(s\\) exporters"):
        rtrace.configure(exporters="jsonl")


def test_keyword_overrides_env(monkeypatch):
    """Keyword arguments win over environment variables, which win over defaults."""
    monkeypatch.setenv("RTRACE_PROJECT", "from-env")
    monkeypatch.setenv("RTRACE_MAX_TRACES_PER_STEP", "8")
    s = load_settings({"project": "from-kw"})
    assert (s.project, s.max_traces_per_step, s.experiment) == ("from-kw", 8, None)


@pytest.mark.parametrize("raw, parsed", [
    ("jsonl,console", ("jsonl", "console")),
    (" JSONL , none ", ("jsonl",)),  # case and blanks ignored; none is no sink
    ("none", ()),
    ("", ()),
    ("jsonl,jsonl", ("jsonl",)),  # duplicates collapse
])
def test_exporter_lists(monkeypatch, raw, parsed):
    """RTRACE_EXPORTER is a comma list."""
    monkeypatch.setenv("RTRACE_EXPORTER", raw)
    assert load_settings().exporter == parsed


def test_otlp_timeout_env_is_milliseconds(monkeypatch):
    """OTEL_EXPORTER_OTLP_TIMEOUT is in ms (OTel spec); configure() takes seconds."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "2500")
    assert load_settings().otlp_timeout_s == 2.5
    assert load_settings({"otlp_timeout_s": 3}).otlp_timeout_s == 3.0


def test_otlp_per_signal_variables_come_first(tmp_path):
    """OTEL_EXPORTER_OTLP_TRACES_* is read before OTEL_EXPORTER_OTLP_* (the OTel spec); a blank
    one is unset (the generic one is read); a bad one fails naming itself."""
    ca, other = tmp_path / "ca.pem", tmp_path / "other.pem"
    for path in (ca, other):
        path.write_text("-----BEGIN CERTIFICATE-----\n-----END CERTIFICATE-----\n")
    env = {"OTEL_EXPORTER_OTLP_CERTIFICATE": str(other), "OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE": str(ca),
           "OTEL_EXPORTER_OTLP_TIMEOUT": "1000", "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "2500",
           "OTEL_EXPORTER_OTLP_COMPRESSION": "deflate", "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION": " ",
           "OTEL_EXPORTER_OTLP_HEADERS": "a=1", "OTEL_EXPORTER_OTLP_TRACES_HEADERS": "b=2"}
    s = load_settings({}, env)
    assert (s.otlp_certificate, s.otlp_timeout_s, s.otlp_compression, s.otlp_headers) == (
        str(ca), 2.5, "deflate", {"b": "2"})
    with pytest.raises(ConfigError, match="OTEL_EXPORTER_OTLP_TRACES_COMPRESSION: got 'zstd'; accepted values: "
                                          "none, gzip or deflate"):
        load_settings({}, {"OTEL_EXPORTER_OTLP_TRACES_COMPRESSION": "zstd"})


def test_otlp_headers_parse(monkeypatch):
    """OTEL_EXPORTER_OTLP_HEADERS parses k=v pairs, URL-decoded."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-mlflow-experiment-id=1,Authorization=Bearer%20abc")
    assert load_settings().otlp_headers == {"x-mlflow-experiment-id": "1", "authorization": "Bearer abc"}


def test_settings_defaults_match_the_table():
    """The Settings dataclass and PARAMS agree on every default."""
    defaults = {f.name: (f.default if f.default is not dataclasses.MISSING else f.default_factory())
                for f in dataclasses.fields(Settings)}
    for p in PARAMS:
        assert defaults[p.name] == p.default, p.name
    assert set(defaults) - {p.name for p in PARAMS} == {"sinks"}


def test_docs_reference_is_generated_from_the_table():
    """docs/configuration.md embeds exactly the table generated from rtrace/config.py."""
    text = (ROOT / "docs" / "configuration.md").read_text()
    start = text.index("<!-- BEGIN GENERATED: python -m rtrace.config -->\n") + len(
        "<!-- BEGIN GENERATED: python -m rtrace.config -->\n")
    end = text.index("<!-- END GENERATED -->")
    assert text[start:end] == reference_markdown()


def test_configure_returns_settings_and_can_turn_off(tmp_path):
    """configure() returns the validated settings; configure(exporter='none') turns tracing off."""
    s = rtrace.configure(exporter="jsonl", jsonl_path=str(tmp_path / "x.jsonl"))
    assert s.exporter == ("jsonl",) and rtrace.is_enabled()
    rtrace.configure(exporter="none")
    assert not rtrace.is_enabled()
