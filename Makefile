# kvstore — `make run` starts the embedded stack, `make test` runs every test.
# Both set everything up first (idempotent `make setup`).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-done
# vLLM contract tests run in their own environment: vLLM 0.33 pins transformers < 5.21
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.setup-done
# what vllm.config, the v1 connector base/factory and kv_cache_utils import on a CPU host
VLLM_IMPORTS := packaging pydantic regex psutil cbor2 pyzmq urllib3 'transformers>=5.16.1,<5.21' aiohttp \
	requests openai-harmony openai pillow pybase64 cachetools msgspec cloudpickle uvloop py-cpuinfo \
	prometheus-client xgrammar fastapi partial-json-parser llguidance einops
ARGS ?=

.PHONY: setup setup-vllm run test test-unit test-vllm bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# the CPU build of torch first; a bare torch requirement would pull a multi-GB CUDA build
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	./scripts/ensure-postgres.sh
	touch $(STAMP)

setup-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml Makefile
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --upgrade pip
	$(VLLM_PY) -m pip install --quiet torch==2.13.0
	# --no-deps: its full requirements are the CUDA stack; these are the modules the contract needs
	# (config, connector, kv_cache_utils, and the v1 Scheduler with a model config's architecture check)
	$(VLLM_PY) -m pip install --quiet --no-deps vllm==0.33.0
	$(VLLM_PY) -m pip install --quiet $(VLLM_IMPORTS)
	$(VLLM_PY) -m pip install --quiet -e . pytest pytest-timeout
	VLLM_TARGET_DEVICE=cpu $(VLLM_PY) -c "from vllm.config import VllmConfig; \
		from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory; \
		from vllm.v1.core.sched.scheduler import Scheduler"
	touch $(VLLM_STAMP)

run: setup
	$(VENV)/bin/kvstore up $(ARGS)

test: setup setup-vllm
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q -ra $(ARGS)
	VLLM_TARGET_DEVICE=cpu $(VLLM_PY) -m pytest -q -ra -p no:cacheprovider tests_vllm

test-vllm: setup setup-vllm
	VLLM_TARGET_DEVICE=cpu $(VLLM_PY) -m pytest -q -ra -p no:cacheprovider tests_vllm $(ARGS)

test-unit: setup
	$(PY) -m pytest -q tests/unit $(ARGS)

bench: setup
	$(PY) bench/datapath.py $(ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) var .pytest_cache .hypothesis
