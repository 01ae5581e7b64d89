"""Prometheus metrics of one server, named in the `cachetune:` style of vLLM's `vllm:` metrics.

Counters and histograms are updated as requests end; engine state (queue, KV use, per-tier hits,
bytes read and errors, chunks encoded) is read from the worker's last snapshot at scrape time.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from cachetune.server.worker import EngineWorker

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
disable_created_metrics()  # no *_created series beside every counter (as vLLM)


class _EngineCollector:
    def __init__(self, worker: EngineWorker):
        self.worker = worker

    def collect(self):
        snap = self.worker.snapshot
        waiting = GaugeMetricFamily("cachetune:num_requests_waiting", "requests not yet started (queued)")
        waiting.add_metric([], max(self.worker.waiting, snap.kv.waiting))
        running = GaugeMetricFamily("cachetune:num_requests_running", "requests prefilled and decoding")
        running.add_metric([], snap.kv.running)
        kv = GaugeMetricFamily("cachetune:kv_cache_usage_perc", "share of the KV budget reserved (0-1)")
        kv.add_metric([], snap.kv.used_rows / max(1, snap.kv.total_rows))
        encoded = CounterMetricFamily("cachetune:chunks_encoded", "chunks run through the model (store misses)")
        encoded.add_metric([], snap.chunks_encoded)
        hits = CounterMetricFamily("cachetune:tier_hits", "chunk lookups answered by each tier", labels=["tier"])
        read = CounterMetricFamily("cachetune:tier_bytes_read", "K/V bytes read from each tier", labels=["tier"])
        errors = CounterMetricFamily("cachetune:tier_errors", "failed calls to each tier", labels=["tier"])
        for stats in snap.tiers:
            hits.add_metric([stats.tier], stats.hits)
            read.add_metric([stats.tier], stats.bytes_read)
            errors.add_metric([stats.tier], stats.errors)
        yield from (waiting, running, kv, encoded, hits, read, errors)


class ServerMetrics:
    def __init__(self, worker: EngineWorker):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("cachetune:requests", "requests answered, by how they ended",
                                ["endpoint", "finish_reason"], registry=r)
        self.errors = Counter("cachetune:request_errors", "requests refused or failed, by kind",
                              ["kind"], registry=r)
        self.ttft = Histogram("cachetune:time_to_first_token_seconds", "request received to first token",
                              ["method"], buckets=TTFT_BUCKETS, registry=r)
        self.latency = Histogram("cachetune:e2e_request_latency_seconds", "request received to its end",
                                 ["method"], buckets=TTFT_BUCKETS, registry=r)
        self.prompt_tokens = Counter("cachetune:prompt_tokens", "prompt tokens of answered requests", registry=r)
        self.reused_tokens = Counter("cachetune:reused_tokens", "prompt tokens served from cached KV", registry=r)
        self.recomputed_tokens = Counter("cachetune:recomputed_tokens", "cached chunk tokens recomputed in context",
                                         registry=r)
        self.generation_tokens = Counter("cachetune:generation_tokens", "tokens generated", registry=r)
        self.documents = Counter("cachetune:documents_registered", "documents registered (texts sent)", registry=r)
        r.register(_EngineCollector(worker))

    def render(self) -> bytes:
        return generate_latest(self.registry)
