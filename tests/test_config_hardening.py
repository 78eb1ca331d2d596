"""Configuration never breaks the traced program and fails early, by name (issue #13, items 18-23)."""

from __future__ import annotations

import logging
import os
import pathlib

import pytest

import rtrace
import rtrace._setup
from rtrace import exporters
from rtrace.config import ConfigError
from rtrace.testing import MemorySink

ROOT = pathlib.Path(__file__).resolve().parents[1]


@rtrace.traced_tool
def tool(x):
    return x


class TestTimeouts:
    @pytest.mark.parametrize("name, env", [
        ("sink_timeout_s", "RTRACE_SINK_TIMEOUT_S"),
        ("orphan_timeout_s", "RTRACE_ORPHAN_TIMEOUT_S"),
        ("export_interval_s", "RTRACE_EXPORT_INTERVAL_S"),
        ("annotation_timeout_s", "RTRACE_ANNOTATION_TIMEOUT_S"),
    ])
    @pytest.mark.parametrize("value", ["1e10", "inf", "nan"])
    def test_huge_timeouts_are_rejected_at_configure(self, monkeypatch, name, env, value):
        """Seconds beyond a week (1e10 overflows thread waits: OverflowError at the first wait in
        0.1.0), inf and nan fail at configure, naming the keyword or the variable."""
        with pytest.raises(ConfigError, match=rf"configure\({name}=\.\.\.\) \(env {env}\)"):
            rtrace.configure(sinks=[MemorySink()], **{name: float(value)})
        monkeypatch.setenv(env, value)
        with pytest.raises(ConfigError, match=rf"^{env}: .*accepted values: seconds"):
            rtrace.configure(sinks=[MemorySink()])

    @pytest.mark.parametrize("timeout", [1e10, float("inf"), float("nan"), -5, "soon", None])
    def test_flush_accepts_any_timeout(self, timeout):
        """flush(timeout_s=...) never raises, whatever it is given (0.1.0: OverflowError for 1e10)."""
        sink = MemorySink()
        rtrace.configure(sinks=[sink], export_interval_s=0.02)
        with rtrace.rollout_context(step=1):
            tool(1)
        result = rtrace.flush(timeout)
        assert result in (True, False)
        if timeout not in (-5,):
            assert result is True and len(sink.trajectories) == 1


class TestEmptyValues:
    @pytest.mark.parametrize("env", ["RTRACE_PROJECT", "RTRACE_TRACKIO_TRACE_KEY", "RTRACE_JSONL_PATH",
                                     "RTRACE_REDACT_KEYS", "RTRACE_CAPTURE", "RTRACE_EXPERIMENT"])
    @pytest.mark.parametrize("value", ["", "   "])
    def test_empty_rtrace_variable_is_an_error(self, monkeypatch, env, value):
        """An empty RTRACE_* value is a ConfigError naming the variable, never a silent default
        (0.1.0: RTRACE_REDACT_KEYS="" turned redaction off, RTRACE_PROJECT="" logged to project '')."""
        monkeypatch.setenv(env, value)
        with pytest.raises(ConfigError, match=rf"^{env}: "):
            rtrace.configure(sinks=[MemorySink()])

    def test_empty_otel_variable_is_unset(self, monkeypatch):
        """OTEL_* variables follow the OTel specification: empty means unset (the application's own
        OTel setup reads them the same way)."""
        monkeypatch.setenv("OTEL_SERVICE_NAME", "")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "")
        settings = rtrace.configure(sinks=[MemorySink()])
        assert settings.service_name == "rtrace" and settings.otlp_headers == {}


class TestFailedReconfigure:
    def sink_that_cannot_import(self, monkeypatch):
        """'console' as if its optional dependency were missing."""
        monkeypatch.setitem(exporters.SINKS, "console", ("rtrace_no_such_module", "X", "console-extra"))

    @pytest.mark.parametrize("bad", [
        # a missing optional dependency
        {"exporter": "console"},
        # a bad value
        {"max_value_chars": 3},
        # a tokenizer that is not one
        {"tokenizer": object()},
    ], ids=["missing_extra", "bad_value", "bad_tokenizer"])
    def test_previous_pipeline_keeps_running(self, monkeypatch, bad):
        """A configure() that fails leaves the running configuration in force: its sinks still get
        trajectories, current_settings() is still its settings, the tokenizer unchanged."""
        self.sink_that_cannot_import(monkeypatch)
        sink = MemorySink()

        class Tok:
            def batch_decode(self, ids, **kw):
                return ["t"] * len(ids)

        tok = Tok()
        good = rtrace.configure(sinks=[sink], export_interval_s=0.02, tokenizer=tok)
        with pytest.raises(ConfigError):
            rtrace.configure(sinks=[MemorySink()], **bad)
        assert rtrace.current_settings() is good and rtrace.is_enabled()
        assert rtrace._setup.get_tokenizer() is tok
        with rtrace.rollout_context(step=1):
            tool(1)
        assert rtrace.flush(10) and len(sink.trajectories) == 1


class TestEnvironmentOnly:
    def test_config_error_raises_once_then_tracing_is_off(self, monkeypatch):
        """With a bad environment and no configure(), the first traced call raises the ConfigError;
        later calls run untraced without raising, and is_enabled() is False."""
        monkeypatch.setenv("RTRACE_EXPORTER", "jsonl")
        monkeypatch.setenv("RTRACE_MAX_VALUE_CHARS", "3")
        with pytest.raises(ConfigError, match="RTRACE_MAX_VALUE_CHARS"):
            tool(1)
        assert [tool(i) for i in range(3)] == [0, 1, 2]
        with rtrace.rollout_context(step=1) as ctx:
            tool(5)
        assert not ctx.traced and rtrace.is_enabled() is False

    def test_misspelt_variable_warns_once_with_the_right_name(self, monkeypatch, caplog):
        """RTRACE_MAX_TRACE_PER_STEP (missing S) logs one warning naming RTRACE_MAX_TRACES_PER_STEP."""
        monkeypatch.setenv("RTRACE_MAX_TRACE_PER_STEP", "4")
        with caplog.at_level(logging.WARNING, logger="rtrace"):
            rtrace.configure(sinks=[MemorySink()])
            rtrace.configure(sinks=[MemorySink()])
        warnings = [r.getMessage() for r in caplog.records if "RTRACE_MAX_TRACE_PER_STEP" in r.getMessage()]
        assert len(warnings) == 1
        assert "did you mean RTRACE_MAX_TRACES_PER_STEP?" in warnings[0]
        assert rtrace.current_settings().max_traces_per_step is None


class TestUnknownVariables:
    """A misspelt RTRACE_* variable is said at every start that reads the environment, once per
    process and name, with the closest setting; rtrace's own other variables are not."""

    OURS = ("RTRACE_UI_CACHE", "RTRACE_UI_ARTIFACTS", "RTRACE_CHROMIUM", "RTRACE_PHOENIX")

    def _said(self, caplog):
        return sorted(r.getMessage().split(" (logged once")[0] for r in caplog.records
                      if "unknown environment variable" in r.getMessage())

    def test_a_collector_says_it_too(self, monkeypatch, caplog, tmp_path):
        """rtrace.start_collector (and so `rtrace collect`) reads the environment without configure():
        RTRACE_EXPORTERS=jsonl is said there too (before: nothing, the run traced nothing)."""
        pytest.importorskip("grpc")
        monkeypatch.setenv("RTRACE_EXPORTERS", "jsonl")
        monkeypatch.setenv("RTRACE_MAX_TRACE_PER_STEP", "1")
        monkeypatch.setenv("RTRACE_COLLECTOR_PORT", "4317")  # read by nothing: `rtrace collect --port`
        for name in self.OURS:
            monkeypatch.setenv(name, str(tmp_path))
        with caplog.at_level(logging.WARNING, logger="rtrace"):
            for _ in range(2):
                rtrace.start_collector(exporter="jsonl", jsonl_path=str(tmp_path / "c.jsonl")).stop()
        assert self._said(caplog) == [
            "rtrace: unknown environment variable RTRACE_COLLECTOR_PORT is ignored; did you mean "
            "RTRACE_COLLECTOR_ENDPOINT?",
            "rtrace: unknown environment variable RTRACE_EXPORTERS is ignored; did you mean RTRACE_EXPORTER?",
            "rtrace: unknown environment variable RTRACE_MAX_TRACE_PER_STEP is ignored; did you mean "
            "RTRACE_MAX_TRACES_PER_STEP?"]

    def test_the_environment_alone_says_it_at_the_first_traced_call(self, monkeypatch, caplog, tmp_path):
        """No configure(): the first traced call configures from the environment and says it; the
        variables of rtrace's own tests and tools are not settings and are not said (before: each
        was "unknown")."""
        for name in self.OURS:
            monkeypatch.setenv(name, str(tmp_path))
        monkeypatch.setenv("RTRACE_EXPORTER", "jsonl")
        monkeypatch.setenv("RTRACE_JSONL_PATH", str(tmp_path / "t.jsonl"))
        monkeypatch.setenv("RTRACE_TOKEN2TXT", "1")
        with caplog.at_level(logging.WARNING, logger="rtrace"):
            with rtrace.rollout_context(step=1):
                tool(1)
        assert self._said(caplog) == [
            "rtrace: unknown environment variable RTRACE_TOKEN2TXT is ignored; did you mean RTRACE_TOKEN2TEXT?"]

    def test_a_given_environment_is_not_the_process_s(self, caplog):
        """load_settings(environ=...) (a check of another process's environment) warns about nothing."""
        with caplog.at_level(logging.WARNING, logger="rtrace"):
            rtrace.config.load_settings({}, environ={"RTRACE_EXPORTERS": "jsonl"})
        assert self._said(caplog) == []


class TestEarlyChecks:
    @pytest.mark.parametrize("env, value, match", [
        # a directory where the file should be
        ("RTRACE_JSONL_PATH", "{tmp}", "is a directory"),
        # a directory that cannot be created: a file is in the way
        ("RTRACE_JSONL_PATH", "{tmp}/a-file/traces/x.jsonl", "a-file' is not a directory"),
        # a directory that cannot be created by anyone, root included (a real probe, not access())
        ("RTRACE_JSONL_PATH", "/proc/rtrace-no-such-dir/x.jsonl", "cannot be created: '/proc' is not writable"),
        # a dangling symbolic link: the sink would start, then fail every batch
        ("RTRACE_JSONL_PATH", "{tmp}/dangling.jsonl", "symbolic link to .*gone/x.jsonl', which does not exist"),
        # a misspelt scheme
        ("MLFLOW_TRACKING_URI", "htp://localhost:5000", "unknown scheme 'htp'"),
        # not a URL: a path, MLflow 3's refused file store
        ("MLFLOW_TRACKING_URI", "not a url", "'not a url' is a path .*MLFLOW_ALLOW_FILE_STORE"),
        ("MLFLOW_TRACKING_URI", "file:///tmp/mlruns", "is a path"),
        # gRPC endpoint without a port
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "localhost", "has no port"),
        # not a URL at all
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://", "is not"),
        # a port that is not a number
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://host:port", "bad port"),
    ])
    def test_bad_destination_fails_at_configure(self, monkeypatch, tmp_path, env, value, match):
        """Destinations are checked at configure(), not at the first export in the sink thread."""
        (tmp_path / "a-file").write_text("")
        (tmp_path / "dangling.jsonl").symlink_to(tmp_path / "gone" / "x.jsonl")
        monkeypatch.setenv(env, value.format(tmp=tmp_path))
        with pytest.raises(ConfigError, match=rf"^{env}: .*{match}"):
            rtrace.configure(sinks=[MemorySink()])

    def test_new_jsonl_file_is_private(self, tmp_path, monkeypatch):
        """A JSONL file rtrace creates is readable by its owner only (0600 less the umask):
        trajectories hold prompts and answers. An existing file keeps its mode."""
        import os

        old = os.umask(0o022)
        try:
            rtrace.configure(exporter="jsonl", jsonl_path=str(tmp_path / "new.jsonl"))
            existing = tmp_path / "existing.jsonl"
            existing.write_text("")
            existing.chmod(0o644)
            with rtrace.rollout_context(step=0, sample_index=0):
                pass
            assert rtrace.flush()
            rtrace.configure(exporter="jsonl", jsonl_path=str(existing))
            with rtrace.rollout_context(step=0, sample_index=1):
                pass
            assert rtrace.flush()
        finally:
            os.umask(old)
        assert (tmp_path / "new.jsonl").stat().st_mode & 0o777 == 0o600
        assert existing.stat().st_mode & 0o777 == 0o644
        assert len(existing.read_text().splitlines()) == 1

    def test_default_jsonl_path_is_checked_too(self, tmp_path, monkeypatch):
        """The default path (relative to the working directory) is checked when the sink is built."""
        (tmp_path / "rtrace_traces.jsonl").mkdir()
        monkeypatch.chdir(tmp_path)
        with pytest.raises(ConfigError, match="^RTRACE_JSONL_PATH: .*is a directory"):
            rtrace.configure(exporter="jsonl")

    def test_plugin_tracking_uri_schemes_are_accepted(self, monkeypatch):
        """A tracking-store scheme registered by an installed MLflow plugin (azureml, ...) is valid."""
        from rtrace import config

        monkeypatch.setattr(config, "_plugin_schemes", lambda: {"azureml"})
        monkeypatch.setenv("MLFLOW_TRACKING_URI", "azureml://region.api.azureml.ms/mlflow/v1.0/x")
        assert rtrace.configure(sinks=[MemorySink()]).mlflow_tracking_uri.startswith("azureml://")


class TestImportProblems:
    def test_version_conflict_is_named_not_a_missing_extra(self, tmp_path):
        """trackio installed beside a huggingface_hub 0.x that another package pins (transformers<5
        does): configure() names the conflict and both requirements, and does not suggest
        reinstalling rtrace[trackio], which cannot fix it."""
        import subprocess
        import sys
        import textwrap

        shadow = tmp_path / "shadow"
        (shadow / "huggingface_hub").mkdir(parents=True)
        (shadow / "huggingface_hub" / "__init__.py").write_text('__version__ = "0.36.0"\n')
        for dist, meta in (("huggingface_hub-0.36.0", "Name: huggingface_hub\nVersion: 0.36.0\n"),
                           ("pinning_lib-4.57.0", "Name: pinning-lib\nVersion: 4.57.0\n"
                                                  "Requires-Dist: huggingface-hub<1.0,>=0.34.0\n")):
            info = shadow / f"{dist}.dist-info"
            info.mkdir()
            (info / "METADATA").write_text(f"Metadata-Version: 2.1\n{meta}")
            (info / "top_level.txt").write_text(dist.split("-")[0] + "\n")
        code = textwrap.dedent("""
            import rtrace
            try:
                rtrace.configure(exporter="trackio")
            except rtrace.ConfigError as exc:
                print(exc)
            """)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(shadow), str(ROOT)]), "HF_HUB_OFFLINE": "1"}
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
        message = out.stdout.strip()
        assert message.startswith("RTRACE_EXPORTER=trackio: huggingface_hub is installed but cannot be imported"), \
            out.stdout + out.stderr[-2000:]
        assert "huggingface_hub 0.36.0 is installed" in message
        assert "pinning-lib requires huggingface-hub<1.0,>=0.34.0" in message
        assert "trackio requires huggingface-hub" in message
        assert "pip install 'rtrace[trackio]'" not in message

    def test_missing_module_says_which_extra(self, monkeypatch):
        """A sink whose backend is not installed says which extra installs it."""
        import sys

        monkeypatch.setitem(sys.modules, "trackio", None)  # `import trackio` raises ImportError
        monkeypatch.delitem(sys.modules, "rtrace.exporters.trackio", raising=False)
        with pytest.raises(ConfigError, match=r"needs trackio, which is not installed; install it with: pip install "
                                              r"'rtrace\[trackio\]'"):
            rtrace.configure(exporter="trackio")
