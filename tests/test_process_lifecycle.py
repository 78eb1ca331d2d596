"""Process lifecycle: imports, ids, fork, SIGTERM and interpreter exit (issue #13, items 3, 4, 5, 15, 16).

Each test runs its program in a fresh interpreter (a subprocess): fresh imports, real
signals, real exits. A generous subprocess timeout is the failure condition for "never
hangs"; nothing here asserts on a duration.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
TIMEOUT = 120  # seconds: only a hang gets near it


def run_py(code, cwd, *, timeout=TIMEOUT, env=None, **kwargs):
    """Run ``code`` in a fresh interpreter with rtrace importable; returns CompletedProcess."""
    full_env = {**os.environ, **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(cwd), full_env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=timeout, **kwargs)


def lines(path):
    return [json.loads(line) for line in pathlib.Path(path).read_text().splitlines() if line.strip()]


# ----------------------------------------------------------------------------- item 3
# A package whose import graph has the shape that deadlocked `import mlflow` against
# rtrace's sink thread: two subpackages that import each other's modules, with time
# spent in between (mlflow spends ~1.5 s). A sink that imports it lazily in its thread,
# as the MLflow sink imports mlflow, races the application's own `import racepkg`.
RACE_PACKAGE = {
    "racepkg/__init__.py": "import racepkg.x.m\n",
    "racepkg/x/__init__.py": "import time\ntime.sleep(0.02)\nimport racepkg.y.m\n",
    "racepkg/y/__init__.py": "import time\ntime.sleep(0.02)\nimport racepkg.x.m\n",
    "racepkg/x/m.py": "",
    "racepkg/y/m.py": "",
    "lazysink.py": textwrap.dedent("""\
        import importlib, random, time
        from rtrace.exporters.base import Sink

        class LazySink(Sink):
            name = "lazy"

            def export(self, trajectories):
                time.sleep(random.uniform(0.002, 0.015))
                importlib.import_module("racepkg.y.m")  # like `from mlflow.tracing.client import ...`
        """),
}

RACE_LOOP = """
    import importlib, random, sys, time
    import rtrace
    from rtrace import exporters

    # the mlflow slot of the sink table, holding the stand-in sink and its package
    exporters.SINKS["mlflow"] = ("lazysink", "LazySink", "mlflow")
    exporters.APP_THREAD_IMPORTS["mlflow"] = ("racepkg",) if sys.argv[1] == "fixed" else ()
    app_failures = []
    for i in range(int(sys.argv[2])):
        for name in [m for m in sys.modules if m.split(".")[0] == "racepkg"]:
            del sys.modules[name]  # a fresh import every round
        rtrace.configure(exporter="mlflow", export_interval_s=0.001)
        with rtrace.rollout_context(step=i):
            pass
        time.sleep(random.uniform(0, 0.015))
        try:
            importlib.import_module("racepkg")  # the application's own import
        except Exception as exc:
            app_failures.append(type(exc).__name__)
        rtrace.flush(30)
    stats = rtrace.stats()
    print(json.dumps({"app_failures": app_failures, "exported": stats.get("sink.lazy.exported", 0),
                      "failed": stats.get("sink.lazy.failed_batches", 0)}))
"""


@pytest.mark.integration  # processes racing an import (~16 s): make test-integration
class TestImportRace:
    ROUNDS = 60

    def race(self, tmp_path, mode):
        for name, text in RACE_PACKAGE.items():
            (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / name).write_text(text)
        code = "import json\n" + textwrap.dedent(RACE_LOOP)
        out = subprocess.run([sys.executable, "-c", code, mode, str(self.ROUNDS)], cwd=tmp_path,
                             env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"},
                             capture_output=True, text=True, timeout=TIMEOUT)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    def test_application_import_never_fails(self, tmp_path):
        """60 rounds of the race, each with a fresh import: with the backend imported on the thread
        that configures rtrace, the application's import never fails and every batch is exported.
        (Without APP_THREAD_IMPORTS, in the same rounds, the sink thread or the application hits
        `_DeadlockError`; for mlflow that was the application's `import mlflow` in 26 of 50 runs.)"""
        got = self.race(tmp_path, "fixed")
        assert got == {"app_failures": [], "exported": self.ROUNDS, "failed": 0}

    def test_the_race_is_real_without_the_fix(self, tmp_path):
        """The same rounds with the lazy import left to the sink thread deadlock in some rounds: the
        stand-in reproduces the race the fix removes (guards the test above against passing
        vacuously)."""
        got = self.race(tmp_path, "lazy")
        assert got["app_failures"] or got["failed"], got

    def test_mlflow_is_imported_on_the_configuring_thread(self, tmp_path):
        """configure(exporter='mlflow') imports mlflow and the sink's own MLflow modules on the
        calling thread, so the application's `import mlflow` right after a rollout (the issue's
        program) cannot race the sink thread."""
        pytest.importorskip("mlflow")
        out = run_py(f"""
            import importlib.abc, json, sys, threading
            first = {{}}

            class Record(importlib.abc.MetaPathFinder):
                def find_spec(self, name, path, target=None):
                    first.setdefault(name, threading.current_thread().name)

            sys.meta_path.insert(0, Record())
            import rtrace
            from rtrace.exporters import APP_THREAD_IMPORTS
            rtrace.configure(exporter="mlflow", mlflow_tracking_uri="sqlite:///{tmp_path}/m.db",
                             export_interval_s=0.001)
            with rtrace.rollout_context(step=1):
                pass
            import mlflow  # the issue's program: right after a rollout, while the sink exports
            ok = rtrace.flush(120)
            print(json.dumps({{"ok": ok, "exported": rtrace.stats().get("sink.mlflow.exported"),
                               "threads": {{m: first.get(m) for m in APP_THREAD_IMPORTS["mlflow"]}},
                               "elsewhere": sorted(m for m, t in first.items() if t != "MainThread")}}))
            """, tmp_path, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        got = json.loads(out.stdout.strip().splitlines()[-1])
        assert got["ok"] and got["exported"] == 1
        assert set(got["threads"].values()) == {"MainThread"}, got["threads"]
        # nor any module of the store the first export creates (SQLAlchemy, alembic, ...: ~390
        # modules before), except the database's migration scripts, which alembic loads by path
        assert all(m.startswith("mlflow.store.db.trace_analytics_") for m in got["elsewhere"]), got["elsewhere"]


# ----------------------------------------------------------------------------- item 4
TRACE_IDS = """
    import json, os, random, sys
    import rtrace
    rtrace.configure(exporter="none")
    rtrace.configure(sinks=[__import__("rtrace.testing").testing.MemorySink()])
    random.seed(1234)
    state = random.getstate()
    ids = []
    for i in range(3):
        with rtrace.rollout_context(step=i) as ctx:
            pass
        ids.append(ctx.trace_id)
    print(json.dumps({"ids": ids, "random_untouched": random.getstate() == state, "next": random.random()}))
"""


class TestIds:
    def test_same_seed_in_two_processes_gives_different_ids(self, tmp_path):
        """Two workers seeded alike (RL trainers do) get different trace ids, and the program's random
        stream is the same with and without tracing (0.1.0: identical ids across runs and workers)."""
        outs = [run_py(TRACE_IDS, tmp_path) for _ in range(2)]
        got = [json.loads(o.stdout.strip().splitlines()[-1]) for o in outs]
        assert all(g["random_untouched"] for g in got)
        assert got[0]["next"] == got[1]["next"]  # the program's own stream: same seed, same numbers
        assert not set(got[0]["ids"]) & set(got[1]["ids"])

    def test_forked_children_get_their_own_ids(self, tmp_path):
        """Children forked after seeding draw different ids from each other and from the parent."""
        out = run_py("""
            import json, os, random
            import rtrace, rtrace.testing
            rtrace.configure(sinks=[rtrace.testing.MemorySink()])
            random.seed(0)
            r, w = os.pipe()
            for _ in range(3):
                if os.fork() == 0:
                    with rtrace.rollout_context(step=1) as ctx:
                        pass
                    os.write(w, (ctx.trace_id + "\\n").encode())
                    os._exit(0)
            for _ in range(3):
                os.wait()
            os.close(w)
            with rtrace.rollout_context(step=1) as ctx:
                pass
            child_ids = os.read(r, 4096).decode().split()
            print(json.dumps(child_ids + [ctx.trace_id]))
            """, tmp_path)
        assert out.returncode == 0, out.stderr[-3000:]
        ids = json.loads(out.stdout.strip().splitlines()[-1])
        assert len(ids) == 4 and len(set(ids)) == 4


# ----------------------------------------------------------------------------- item 5
class TestFork:
    def test_multiprocessing_fork_child_traces_on_its_own(self, tmp_path):
        """A multiprocessing (fork) child gets a fresh pipeline: configured with its own JSONL file it
        writes there, without calling flush (it exits with os._exit), and the parent's pipeline, file
        and counters are untouched; a trajectory the parent had not exported at fork time is written
        once (by the parent), not twice."""
        parent_path, child_path = tmp_path / "parent.jsonl", tmp_path / "child.jsonl"
        out = run_py(f"""
            import json, multiprocessing as mp
            import rtrace

            @rtrace.traced_tool
            def tool(x):
                return x

            def child(path):
                rtrace.configure(exporter="jsonl", jsonl_path=path, export_interval_s=60)
                for i in range(3):
                    with rtrace.rollout_context(step=100, sample_index=i):
                        tool(i)
                # no flush: a multiprocessing child leaves through os._exit

            rtrace.configure(exporter="jsonl", jsonl_path="{parent_path}", export_interval_s=60)
            with rtrace.rollout_context(step=1, sample_index=0):  # finished, not yet exported
                tool(0)
            p = mp.get_context("fork").Process(target=child, args=("{child_path}",))
            p.start()
            p.join(60)
            with rtrace.rollout_context(step=2, sample_index=0):
                tool(1)
            assert rtrace.flush(30)
            print(json.dumps({{"exitcode": p.exitcode, "stats": rtrace.stats()}}))
            """, tmp_path)
        assert out.returncode == 0, out.stderr[-3000:]
        got = json.loads(out.stdout.strip().splitlines()[-1])
        assert got["exitcode"] == 0
        assert sorted(t["step"] for t in lines(parent_path)) == [1, 2]
        assert sorted((t["step"], t["sample_index"]) for t in lines(child_path)) == [(100, 0), (100, 1), (100, 2)]
        assert got["stats"]["sink.jsonl.exported"] == 2 and got["stats"]["trajectories_started"] == 2

    def test_child_reconfigures_from_the_parents_arguments(self, tmp_path):
        """A child that does not call configure() traces with the parent's settings, through its own
        pipeline: its trajectories reach the file, whole lines, beside the parent's."""
        path = tmp_path / "shared.jsonl"
        out = run_py(f"""
            import multiprocessing as mp
            import rtrace

            @rtrace.traced_tool
            def tool(x):
                return x

            def child(i):
                with rtrace.rollout_context(step=10 + i):
                    tool(i)

            rtrace.configure(exporter="jsonl", jsonl_path="{path}", export_interval_s=60)
            procs = [mp.get_context("fork").Process(target=child, args=(i,)) for i in range(3)]
            for p in procs:
                p.start()
            for p in procs:
                p.join(60)
            with rtrace.rollout_context(step=1):
                tool(9)
            assert rtrace.flush(30)
            print([p.exitcode for p in procs])
            """, tmp_path)
        assert out.returncode == 0, out.stderr[-3000:]
        assert sorted(t["step"] for t in lines(path)) == [1, 10, 11, 12]


# ----------------------------------------------------------------------------- item 15
SIGTERM_PROGRAM = """
    import os, signal, sys, time
    import rtrace
    {install_handler}
    rtrace.configure(exporter="jsonl", jsonl_path="{path}", export_interval_s=60, sink_timeout_s=10)

    @rtrace.traced_tool
    def tool(x):
        return x

    for i in range(3):
        with rtrace.rollout_context(step=1, sample_index=i):
            tool(i)
    ctx = rtrace.rollout_context(step=1, sample_index=99)
    ctx.__enter__()  # still open when the signal comes
    tool(99)
    print("ready", flush=True)
    time.sleep(60)
    print("not killed", flush=True)
"""


class TestSigterm:
    def start(self, tmp_path, install_handler=""):
        path = tmp_path / "t.jsonl"
        code = textwrap.dedent(SIGTERM_PROGRAM).format(path=path, install_handler=install_handler)
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=TIMEOUT)
        return proc.returncode, out, err, path

    def test_default_handler_writes_then_dies_of_sigterm(self, tmp_path):
        """With SIGTERM's default disposition, the finished trajectories are written and the open one
        as partial, then the process still dies of SIGTERM (exit status -15), as without rtrace."""
        code, out, err, path = self.start(tmp_path)
        assert code == -signal.SIGTERM, err[-3000:]
        assert "not killed" not in out
        got = {t["sample_index"]: t for t in lines(path)}
        assert sorted(got) == [0, 1, 2, 99]
        assert got[99]["partial"] is True and not got[0]["partial"]

    def test_existing_python_handler_is_still_called(self, tmp_path):
        """An application handler installed before configure() still runs, after rtrace flushed."""
        handler = textwrap.dedent("""
            def on_term(signum, frame):
                print("app handler", flush=True)
                sys.exit(3)
            signal.signal(signal.SIGTERM, on_term)
            """)
        code, out, err, path = self.start(tmp_path, handler)
        assert code == 3, err[-3000:]
        assert "app handler" in out
        got = {t["sample_index"]: t for t in lines(path)}
        assert {0, 1, 2} <= set(got)  # flushed before the application's handler ran


# ----------------------------------------------------------------------------- item 16
class TestExitNeverHangs:
    @pytest.mark.parametrize("where", ["shutdown", "export", "flush"])
    def test_hung_sink_does_not_hold_the_interpreter(self, tmp_path, where):
        """A sink that blocks forever in shutdown(), export() or flush(): the program returns from its
        last line and the interpreter exits (bounded by sink_timeout_s); what the hung sink still
        held is counted as abandoned, and the other sink got everything."""
        path = tmp_path / "t.jsonl"
        out = run_py(f"""
            import atexit, json, threading
            import rtrace

            def report():  # registered before rtrace's own atexit hook, so it runs after it
                print(json.dumps(rtrace.stats()), flush=True)

            atexit.register(report)

            class Hung(rtrace.Sink):
                name = "hung"

                def export(self, trajectories):
                    if "{where}" == "export":
                        threading.Event().wait()

                def flush(self, timeout_s):
                    if "{where}" == "flush":
                        threading.Event().wait()

                def shutdown(self):
                    threading.Event().wait()

            rtrace.configure(exporter="jsonl", jsonl_path="{path}", sinks=[Hung(None)],
                             export_interval_s=0.05, sink_timeout_s=1)

            @rtrace.traced_tool
            def tool(x):
                return x

            for i in range(5):
                with rtrace.rollout_context(step=1, sample_index=i):
                    tool(i)
            print("main done", flush=True)
            """, tmp_path)
        assert out.returncode == 0, out.stderr[-3000:]
        assert "main done" in out.stdout
        stats = json.loads(out.stdout.strip().splitlines()[-1])
        assert len(lines(path)) == 5 and stats["sink.jsonl.exported"] == 5
        assert stats["sink.hung.shutdown_timeouts"] == 1
        if where == "export":
            assert stats["sink.hung.abandoned_trajectories"] + stats.get("sink.hung.dropped_trajectories", 0) == 5


class TestNormalExit:
    def test_queued_trajectories_reach_every_sink_at_exit_without_flush(self, tmp_path, trackio_mod):
        """Trajectories still queued when the program ends normally (no flush, no shutdown) are
        written by rtrace's exit hook to JSONL and trackio, on every Python version: the exit path
        starts no thread (Python 3.12+ refuses to at interpreter shutdown; 0 of 4 reached trackio)."""
        path = tmp_path / "t.jsonl"
        trackio_dir = tmp_path / "trackio"
        out = run_py(f"""
            import rtrace
            rtrace.configure(exporter="jsonl,trackio", jsonl_path="{path}", project="exit-test",
                             experiment="exit", export_interval_s=60)
            for i in range(4):
                with rtrace.rollout_context(step=1, sample_index=i, rollout_n=0):
                    rtrace.record_reward(1.0)
            print("main done", flush=True)
            """, tmp_path, env={"TRACKIO_DIR": str(trackio_dir), "HF_HUB_OFFLINE": "1"})
        assert out.returncode == 0, out.stderr[-3000:]
        assert "Traceback" not in out.stderr, out.stderr[-3000:]  # (trackio itself may warn: its
        # run opens at the first export, here at exit, and then writes inline, "degraded")
        assert sorted(t["sample_index"] for t in lines(path)) == [0, 1, 2, 3]
        stored = run_py("""
            from trackio.sqlite_storage import SQLiteStorage
            print(SQLiteStorage.get_trace_steps("exit-test", "exit")["total"])
            """, tmp_path, env={"TRACKIO_DIR": str(trackio_dir), "HF_HUB_OFFLINE": "1"})
        assert stored.stdout.strip().splitlines()[-1] == "4", stored.stderr[-3000:]
