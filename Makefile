# Two commands: `make run` (set up + the main job) and `make test` (set up + the tests).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup run smoke test test-unit test-integration bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

run: setup
	$(PY) -m infera.up $(ARGS)

smoke: setup
	$(PY) -m infera.up --smoke --port 0 $(ARGS)

test: setup
	$(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

test-unit: setup
	$(PY) -m pytest -q tests/unit

test-integration: setup
	$(PY) -m pytest -q tests/integration

bench: setup
	$(PY) bench/router_overhead.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
