"""docs/metrics.md and docs/configuration.md say what the code exports and reads."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _generator():
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "scripts/gen_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_generated_docs_match_the_code():
    gen = _generator()
    for name, render in gen.FILES.items():
        assert (ROOT / "docs" / name).read_text() == render(), f"docs/{name} is stale: python scripts/gen_docs.py"


def test_every_metric_and_setting_is_in_them():
    from kvstore.directory.settings import DirectorySettings
    from kvstore.worker.metrics import WorkerMetrics
    from kvstore.worker.settings import WorkerSettings

    gen = _generator()
    metrics, configuration = gen.metrics_md(), gen.configuration_md()
    from kvstore.directory.metrics import DirectoryMetrics

    directory = DirectoryMetrics()
    for registry in (WorkerMetrics().registry, directory.registry, directory.cluster):
        for family in registry.collect():
            assert f"`{family.name}" in metrics, family.name
    assert "`kvstore_pins`" in metrics and "`kvstore_request_seconds_bucket" in metrics
    for cls, prefix in ((DirectorySettings, "KVSTORE_"), (WorkerSettings, "KVSTORE_WORKER_")):
        for name in cls.model_fields:
            assert f"`{prefix}{name.upper()}`" in configuration, name


def test_the_design_says_what_relaxed_commits_promise_and_the_default_stays_durable():
    """The control plane's first rule names the one mode that relaxes it, with the window the
    setting states: visible at return, durable within 3 x wal_writer_delay; off by default."""
    from kvstore.directory.settings import DirectorySettings

    assert DirectorySettings.model_fields["relaxed_commits"].default is False
    assert "0.6 s" in DirectorySettings.model_fields["relaxed_commits"].description
    design = (ROOT / "docs/architecture.md").read_text()
    rule = design[design.index("1. **A block is visible"):design.index("2. **A pinned replica")]
    assert "committed in SQL** (durably, by default)" in rule
    assert "relaxed commits" in rule and "durable within three" in rule and "0.6 s" in rule
    relaxed = design[design.index("## Relaxed commits"):]
    assert "**visible at return, durable within 0.6 s**" in relaxed
