"""The vLLM connector package: its vLLM-free halves import without vLLM, and vLLM's loader finds
the connector class by the module path operators configure."""

import importlib
import sys


def test_the_worker_and_handoff_halves_import_without_vllm():
    had_vllm = "vllm" in sys.modules
    package = importlib.import_module("kvstore.connector.vllm")
    worker = importlib.import_module("kvstore.connector.vllm.worker")
    handoff = importlib.import_module("kvstore.connector.vllm.handoff")
    assert worker.PagedKVWorker and worker.BlockPlan and handoff.HandoffRoles
    assert package.__all__ == ["KVStoreConnector"]
    assert ("vllm" in sys.modules) == had_vllm  # none of these imported vLLM


def test_an_unknown_name_is_an_attribute_error():
    package = importlib.import_module("kvstore.connector.vllm")
    try:
        package.NoSuchConnector
    except AttributeError as exc:
        assert "NoSuchConnector" in str(exc)
    else:
        raise AssertionError("an unknown attribute was answered")
