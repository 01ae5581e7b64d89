"""The connector's counters in vLLM's own metrics: `/metrics` beside vLLM's, and its periodic log line.

Each side of the connector keeps cumulative counters (SchedulerSide.counters, WorkerSide.counters and
the tiers' hits, bytes and errors). vLLM asks each side for stats after every step
(`get_kv_connector_stats`): `Increments` turns the totals into what changed since the last ask, vLLM
adds the sides up (`CachetuneStats.aggregate`), and `CachetunePromMetrics` adds them to Prometheus
counters named `vllm:cachetune_<name>_total` (per tier: `vllm:cachetune_tier_<what>_total{tier=...}`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

COUNTERS = {
    # scheduler side
    "claimed_requests": "Requests whose prompt rows the connector filled.",
    "claimed_tokens": "Prompt tokens the connector filled (vLLM counts them as cached).",
    "registered": "Documents registered through vLLM.",
    "unsalted_with_documents": "Requests with known documents left to vLLM: no blend cache_salt.",
    "bad_params": "Requests whose cachetune parameters were refused.",
    # worker side
    "blended_requests": "Blends written into vLLM's paged cache.",
    "blended_tokens": "Prompt rows written by blends.",
    "computed_tokens": "Tokens blends ran through the layers (selected, text, question).",
    "recomputed_document_tokens": "Of those, document tokens recomputed.",
    "reused_tokens": "Document rows blends loaded from the tiers instead of computing.",
    "recomputed_by_vllm": "Blends that failed and were computed by vLLM instead.",
    "missing_documents": "Blends whose document was evicted, corrupt or never stored.",
    "saved_documents": "Documents stored into the tiers.",
    "save_failures": "Documents that could not be stored.",
    "blend_seconds": "Seconds spent blending (running decodes wait for them).",
}
TIER_COUNTERS = {
    "hits": "Documents a tier answered.",
    "bytes_read": "K/V bytes read from a tier.",
    "errors": "Reads or writes a tier failed.",
}


def tier_key(what: str, tier: str) -> str:
    return f"tier_{what}:{tier}"


@dataclass
class CachetuneStats(KVConnectorStats):
    """Counter increments since the last report, {name: amount}; per tier under tier_key(what, tier)."""

    def __post_init__(self):
        self.data = {key: amount for key, amount in (self.data or {}).items() if amount}

    def reset(self):
        self.data = {}

    def is_empty(self) -> bool:
        return not self.data

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, amount in other.data.items():
            self.data[key] = self.data.get(key, 0) + amount
        return self

    def reduce(self) -> dict[str, int | float]:
        return {key: round(amount, 3) if isinstance(amount, float) else amount for key, amount in self.data.items()}


class Increments:
    """What cumulative counters gained since the last call."""

    def __init__(self):
        self._last: dict[str, float] = {}

    def __call__(self, totals: dict[str, Any]) -> CachetuneStats | None:
        changed = {key: value - self._last.get(key, 0) for key, value in totals.items()
                   if isinstance(value, (int, float)) and value != self._last.get(key, 0)}
        self._last.update({key: totals[key] for key in changed})
        return CachetuneStats(changed) if changed else None


class CachetunePromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames: list[str], per_engine_labelvalues: dict[int, list]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {name: self._counter_cls(name=f"vllm:cachetune_{name}", documentation=doc,
                                                  labelnames=labelnames)
                          for name, doc in COUNTERS.items()}
        self._tiers = {what: self._counter_cls(name=f"vllm:cachetune_tier_{what}", documentation=doc,
                                               labelnames=[*labelnames, "tier"])
                       for what, doc in TIER_COUNTERS.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        labels = self.per_engine_labelvalues[engine_idx]
        for key, amount in transfer_stats_data.items():
            if amount <= 0:
                continue
            name, _, tier = key.partition(":")
            if tier and name.startswith("tier_") and name[5:] in self._tiers:
                self._tiers[name[5:]].labels(*labels, tier).inc(amount)
            elif name in self._counters:
                self._counters[name].labels(*labels).inc(amount)
