"""vLLM's KV connector for kvstore: `kv_connector_module_path: kvstore.connector.vllm`.

    connector.py   KVStoreConnector (scheduler and worker roles; imports vLLM)
    worker.py      PagedKVWorker: vLLM's paged KV <-> the store, layer by layer (no vLLM import)
    handoff.py     prefill/decode roles: producers commit hand-offs, consumers wait (no vLLM import)
    stats.py       the connector's stats and Prometheus series for vLLM's metrics
    checks.py      what the connector refuses at start-up (KV cache groups, dtypes, parallelism)

`KVStoreConnector` is imported on first use, so the halves that do not need vLLM import
without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvstore.connector.vllm.connector import KVStoreConnector

__all__ = ["KVStoreConnector"]


def __getattr__(name: str):
    if name == "KVStoreConnector":
        from kvstore.connector.vllm.connector import KVStoreConnector

        return KVStoreConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
