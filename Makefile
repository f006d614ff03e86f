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
# SGLang's HiCache contract tests run in their own environment too: SGLang 0.5 without its CUDA
# stack (--no-deps), and the modules its HiCache storage interface imports on a CPU host
SGLANG_VENV := .venv-sglang
SGLANG_PY := $(SGLANG_VENV)/bin/python
SGLANG_STAMP := $(SGLANG_VENV)/.setup-done
SGLANG_IMPORTS := numpy orjson psutil pybase64 requests triton packaging pillow starlette msgspec pydantic pyzmq \
	tqdm ipython aiohttp
# peers the comparison benchmarks run against, each in its own environment
MOONCAKE_VENV := .venv-mooncake
LMCACHE_VENV := .venv-lmcache
ARGS ?=

.PHONY: setup setup-vllm setup-sglang setup-mooncake setup-lmcache run test test-unit test-vllm bench bench-peers clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# the CPU build of torch first; a bare torch requirement would pull a multi-GB CUDA build
	$(PY) -m pip install --quiet torch==2.13.0
	# the versions the tests ran with (and the images install): constraints.txt
	$(PY) -m pip install --quiet -c constraints.txt -e '.[test]'
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
	$(VLLM_PY) -m pip install --quiet -e '.[directory,worker,connector]' pytest pytest-timeout httpx
	VLLM_TARGET_DEVICE=cpu $(VLLM_PY) -c "from vllm.config import VllmConfig; \
		from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory; \
		from vllm.v1.core.sched.scheduler import Scheduler"
	touch $(VLLM_STAMP)

setup-sglang: $(SGLANG_STAMP)

$(SGLANG_STAMP): pyproject.toml constraints.txt Makefile
	test -x $(SGLANG_PY) || $(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_PY) -m pip install --quiet --upgrade pip
	$(SGLANG_PY) -m pip install --quiet torch==2.13.0
	$(SGLANG_PY) -m pip install --quiet --no-deps sglang==0.5.23
	$(SGLANG_PY) -m pip install --quiet $(SGLANG_IMPORTS)
	$(SGLANG_PY) -m pip install --quiet -c constraints.txt -e '.[directory,worker,connector]' pytest pytest-timeout httpx
	$(SGLANG_PY) -c "from sglang.srt.mem_cache.hicache_storage import HiCacheStorage; \
		from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory"
	touch $(SGLANG_STAMP)

setup-mooncake: $(MOONCAKE_VENV)/.setup-done

$(MOONCAKE_VENV)/.setup-done: Makefile
	# the transfer engine links the RDMA and NUMA libraries even when it only speaks TCP
	dpkg -s libibverbs1 librdmacm1 libnuma1 >/dev/null 2>&1 || apt-get install -y -q libibverbs1 librdmacm1 libnuma1
	test -x $(MOONCAKE_VENV)/bin/python || $(PYTHON) -m venv $(MOONCAKE_VENV)
	$(MOONCAKE_VENV)/bin/pip install --quiet mooncake-transfer-engine-non-cuda==0.3.13.post1 numpy
	touch $@

setup-lmcache: $(LMCACHE_VENV)/.setup-done

$(LMCACHE_VENV)/.setup-done: Makefile
	test -x $(LMCACHE_VENV)/bin/python || $(PYTHON) -m venv $(LMCACHE_VENV)
	$(LMCACHE_VENV)/bin/pip install --quiet torch==2.13.0
	$(LMCACHE_VENV)/bin/pip install --quiet lmcache==0.5.6
	touch $@

run: setup
	$(VENV)/bin/kvstore up $(ARGS)

test: setup setup-vllm setup-sglang
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q -ra $(ARGS)
	VLLM_TARGET_DEVICE=cpu $(VLLM_PY) -m pytest -q -ra -p no:cacheprovider tests_vllm
	$(SGLANG_PY) -m pytest -q -ra -p no:cacheprovider tests_sglang

test-vllm: setup setup-vllm
	VLLM_TARGET_DEVICE=cpu $(VLLM_PY) -m pytest -q -ra -p no:cacheprovider tests_vllm $(ARGS)

test-unit: setup
	$(PY) -m pytest -q tests/unit $(ARGS)

bench: setup
	$(PY) bench/datapath.py $(ARGS)

bench-peers: setup setup-mooncake setup-lmcache
	$(PY) bench/vs_mooncake.py
	$(PY) bench/vs_lmcache.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(SGLANG_VENV) $(MOONCAKE_VENV) $(LMCACHE_VENV) var .pytest_cache .hypothesis
