# The two commands of the README: `make demo` runs the main job, `make test` runs the test suite.
# Both create .venv and install the package with its extras on first use; nothing else is needed.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.rtrace-installed

.PHONY: install demo test bench clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check --upgrade pip
	$(BIN)/python -m pip install -q --disable-pip-version-check -c constraints-dev.txt -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/rtrace demo

test: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_hot_path.py

clean:
	rm -rf $(VENV) .pytest_cache
