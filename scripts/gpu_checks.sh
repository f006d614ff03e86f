#!/usr/bin/env bash
# The GPU checks on a CUDA host: the tests marked `gpu`, then bench/gpu_paged.py.
#   scripts/gpu_checks.sh [OUT_DIR]        # logs and JSON go to OUT_DIR (default bench/out)
# WHEELS=DIR installs the wheels in DIR into a private folder first (a host without a package
# index: kvstore's dependencies that its Python lacks, and nixl-cu13 where CUDA is 13).
set -uo pipefail
out=${1:-bench/out}
mkdir -p "$out"
py=${PYTHON:-python3}
if [ -n "${WHEELS:-}" ]; then
    $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/kvstore-site \
        "$WHEELS"/*.whl || exit 1
    export PYTHONPATH=/tmp/kvstore-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
nvidia-smi -L
$py - <<'PY' || exit 1
import torch
import kvstore.directory.process.app, kvstore.worker.control, tests.stacks  # noqa: F401  (the services import here)
from kvstore.transfer import Agent
agent = Agent("gpu-check", backends={"UCX": {}})
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())
print("nixl plugins:", agent.plugins(), "| GDS_MT loads:", agent.add_backend("GDS_MT", {}))
agent.close()
PY
$py -m pytest -m gpu -v -p no:cacheprovider --timeout 240 tests/integration/test_hbm.py 2>&1 | tee "$out/gpu_tests.log"
tests=${PIPESTATUS[0]}
$py bench/gpu_paged.py --repeats "${REPEATS:-5}" --json "$out/gpu_paged.json" 2>&1 | tee "$out/gpu_paged.log"
bench=${PIPESTATUS[0]}
echo "tests exit $tests, bench exit $bench"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ]
