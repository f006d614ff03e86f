"""The connector's timings the way vLLM reports connector metrics: worker processes return a
`KVStoreConnectorStats` from `get_kv_connector_stats()`, vLLM ships it with the step's output
to the scheduler and on to the front end, which logs `reduce()` and feeds `KVStorePromMetrics`
(the `vllm:kvstore_*` histograms on `vllm serve`'s /metrics, labelled like vLLM's own).

Series, one value per observation: load_post_s (prepare_load + layer 0 posted), layer_xfer_s
(post -> a layer's read complete), layer_visible_s (time wait_for_layer_load waited), save_s
(a step's saves: first layer handed over -> committed); from the scheduler, handoff_wait_s,
handoff_timeout_s and handoff_commit_s (`handoff.py`).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from kvstore.connector.layerwise import BUCKETS
from kvstore.connector.vllm.handoff import HANDOFF_SERIES
from kvstore.connector.vllm.worker import STAT_SERIES

SERIES = STAT_SERIES + HANDOFF_SERIES

DOCS = {"load_post_s": "kvstore: prepare_load + posting layer 0's read, per load",
        "layer_xfer_s": "kvstore: post -> completion of one layer's read",
        "layer_visible_s": "kvstore: time the forward waited for one layer",
        "save_s": "kvstore: a step's saves, first layer handed over -> committed",
        "handoff_wait_s": "kvstore: a consumer request's wait for its hand-off (P/D queue time), however it ended",
        "handoff_timeout_s": "kvstore: the same, for waits that reached their deadline (the prompt is computed)",
        "handoff_commit_s": "kvstore: a producer request finished -> its hand-off committed (its last saves)"}


@dataclass
class KVStoreConnectorStats(KVConnectorStats):
    def __post_init__(self) -> None:
        for series in SERIES:
            self.data.setdefault(series, [])

    def reset(self) -> None:
        self.data = {series: [] for series in SERIES}

    def aggregate(self, other: KVConnectorStats) -> KVStoreConnectorStats:
        for series in SERIES:
            self.data[series] = self.data[series] + list(other.data.get(series, []))
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for series in SERIES:
            values = self.data[series]
            if values:
                name = series.removesuffix("_s")
                out[f"{name}_count"] = len(values)
                out[f"{name}_p50_ms"] = round(1e3 * statistics.median(values), 3)
        return out

    def is_empty(self) -> bool:
        return not any(self.data[series] for series in SERIES)


class KVStorePromMetrics(KVConnectorPromMetrics):
    """vllm:kvstore_<series> histograms, one child per engine."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.histograms = {}
        for series in SERIES:
            histogram = self._histogram_cls(name=f"vllm:kvstore_{series.removesuffix('_s')}_seconds",
                                            documentation=DOCS[series], buckets=BUCKETS, labelnames=labelnames)
            self.histograms[series] = {engine: histogram.labels(*values)
                                       for engine, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict, engine_idx: int = 0) -> None:
        for series in SERIES:
            for value in transfer_stats_data.get(series, ()):
                self.histograms[series][engine_idx].observe(value)
