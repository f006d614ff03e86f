"""vLLM's calls on the connector's worker half (`PagedKVWorker`), as its forward makes them: a save
handed over layer by layer, then committed; a load waited for layer by layer, then verified."""

from __future__ import annotations

from kvstore.connector.vllm.worker import BlockPlan, PagedKVWorker


def save_pages(worker: PagedKVWorker, namespace_id: str, req_id: str, hashes: list[str], block_ids: list[int]) -> None:
    """Save the blocks (vLLM block ids) under `hashes` and wait until the save is committed."""
    plans = [BlockPlan(req_id, hashes, block_ids)]
    for name in worker.layer_names:
        worker.save_layer(namespace_id, plans, name)
    worker.finish_step(namespace_id, plans)
    worker.flush({req_id})


def load_pages(worker: PagedKVWorker, namespace_id: str, req_id: str, hashes: list[str],
               block_ids: list[int]) -> set[int]:
    """Load `hashes` into the blocks; the block ids vLLM must recompute."""
    worker.start_loads(namespace_id, [BlockPlan(req_id, hashes, block_ids)])
    for name in worker.layer_names:
        worker.wait_layer(name)
    worker.finish_step(namespace_id, [])
    return worker.take_load_errors()
