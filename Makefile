# kvstore — `make run` starts the embedded stack, `make test` runs every test.
# Both set everything up first (idempotent `make setup`).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-done
ARGS ?=

.PHONY: setup run test test-unit bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# the CPU build of torch first; a bare torch requirement would pull a multi-GB CUDA build
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	./scripts/ensure-postgres.sh
	touch $(STAMP)

run: setup
	$(VENV)/bin/kvstore up $(ARGS)

test: setup
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q -ra $(ARGS)

test-unit: setup
	$(PY) -m pytest -q tests/unit $(ARGS)

bench: setup
	$(PY) bench/datapath.py $(ARGS)

clean:
	rm -rf $(VENV) var .pytest_cache .hypothesis
