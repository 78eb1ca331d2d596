"""rtrace without torch, transformers or tokenizers: a subprocess in which they cannot be imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCKED = ("torch", "transformers", "tokenizers")

SITECUSTOMIZE = f'''
import sys

class _Blocker:
    """Makes {BLOCKED} unimportable, as if they were not installed."""

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {BLOCKED!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked by test_no_torch)", name=name)
        return None

sys.meta_path.insert(0, _Blocker())
'''

SCRIPT = r'''
import json, sys
for mod in ("torch", "transformers", "tokenizers"):
    try:
        __import__(mod)
    except ImportError:
        pass
    else:
        raise SystemExit(f"{mod} is importable: the blocker does not work")
import rtrace
from rtrace.exporters.jsonl import read_jsonl

class CharDecoder:
    """A tokenizer stand-in without transformers: id i is chr(i)."""
    def batch_decode(self, seqs, skip_special_tokens=True):
        return ["".join(chr(i) for i in s) for s in seqs]

path = sys.argv[1]
rtrace.configure(exporter="jsonl", jsonl_path=path, token2text=True, export_interval_s=60)
rtrace.set_tokenizer(CharDecoder())

@rtrace.traced_generation
def generate(prompt_ids):
    return [ord(c) for c in "call add"]

@rtrace.traced_tool
def add(a, b, tool_call_id="c1"):
    return a + b

@rtrace.traced_rollout
def agent(prompt):
    generate([ord(c) for c in prompt])
    return add(2, 3)

with rtrace.rollout_context(step=1, sample_index=0, rollout_n=0):
    agent("2+3?")
    rtrace.record_reward(1.0)
ids = [[ord(c) for c in "Q: hi" + "A: yo" + "T: ok" + "A: end"]]
loss = [[0] * 5 + [1] * 5 + [0] * 5 + [1] * 6]
rtrace.log_rollout_batch(ids, loss_mask=loss, rewards=[0.5], step=2)
assert rtrace.flush(10)
print(json.dumps({"modules": sorted(m for m in ("torch", "transformers", "tokenizers", "numpy") if m in sys.modules),
                  "trajectories": [t.to_dict() for t in read_jsonl(path)],
                  "stats": rtrace.stats()}))
'''


@pytest.fixture
def no_torch_env(tmp_path):
    """Environment variables for a subprocess in which torch/transformers/tokenizers cannot be imported."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["HF_HUB_OFFLINE"] = "1"
    return env


def test_traced_rollout_and_batch_without_torch(tmp_path, no_torch_env):
    """Without torch: rtrace imports, a decorated rollout and a list batch are traced, decoded and written to JSONL."""
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "t.jsonl")], env=no_torch_env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert [m for m in result["modules"] if m != "numpy"] == []
    traced, batch = sorted(result["trajectories"], key=lambda t: t["step"])
    assert (traced["step"], traced["sample_index"], traced["reward"]) == (1, 0, 1.0)
    assert [s["kind"] for s in traced["spans"]] == ["rollout", "agent", "generation", "tool"]
    gen = traced["spans"][2]
    assert (gen["attributes"]["rtrace.prompt_text"], gen["attributes"]["rtrace.response_text"]) == ("2+3?", "call add")
    assert traced["spans"][3]["output"] == 5
    assert traced["messages"][0] == {"role": "user", "content": "2+3?"}
    assert batch["reward"] == 0.5
    assert batch["messages"] == [{"role": "user", "content": "Q: hi"}, {"role": "assistant", "content": "A: yo"},
                                 {"role": "tool", "content": "T: ok"}, {"role": "assistant", "content": "A: end"}]
    assert result["stats"]["trajectories_completed"] == 2


FOUNDATION = ["tests/test_config.py", "tests/test_context.py", "tests/test_decorators.py", "tests/test_package.py",
              "tests/test_pipeline.py"]


@pytest.mark.integration  # a pytest run in a subprocess (~9 s): make test-integration
def test_foundation_tests_pass_without_torch(tmp_path, no_torch_env):
    """The foundation test files run without torch: no import error, and no failure that involves torch."""
    report = tmp_path / "junit.xml"
    files = [f for f in FOUNDATION if (ROOT / f).exists()]
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", *files],
                         env=no_torch_env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert report.exists(), out.stdout[-3000:] + out.stderr[-3000:]
    suite = ET.parse(report).getroot().find("testsuite")
    assert int(suite.get("errors")) == 0, out.stdout[-3000:]  # collection / import errors
    assert int(suite.get("tests")) >= 50
    # A failure owned by another module's own timing is not this test's subject; one
    # caused by the missing packages is.
    for case in suite.iter("testcase"):
        for failure in case.findall("failure"):
            text = (failure.get("message") or "") + (failure.text or "")
            assert not any(f"'{m}'" in text or f"No module named {m}" in text for m in BLOCKED), (
                case.get("name"), text[-2000:])
