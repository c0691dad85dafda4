"""Prometheus metrics: per-worker figures read from the cluster state at scrape time,
and per-request latencies recorded by the frontend.

Per worker (label `worker`): folio_requests_running / _waiting / _swapped,
folio_kv_cache_usage_ratio, folio_cpu_swap_usage_ratio (gauges);
folio_preemptions_total{mode}, folio_swapped_out_blocks_total,
folio_swapped_in_blocks_total, folio_migrations_total, folio_prompt_tokens_total,
folio_generation_tokens_total, folio_prefix_cache_queries_total,
folio_prefix_cache_hits_total (the workers' cumulative counts, from their heartbeats).
Cluster state: folio_cluster_state_up (1/0: Redis answered the scrape) and
folio_worker_heartbeat_age_seconds{worker}; while Redis is away the per-worker figures
keep their last values (their age grows) instead of vanishing.
Frontend: folio_requests_total{finish_reason} and the histograms
folio_time_to_first_token_seconds, folio_inter_token_latency_seconds,
folio_e2e_request_latency_seconds, folio_queue_time_seconds.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)


class WorkerCollector:
    """Reads the live workers' last heartbeats (cluster/state.py) when scraped."""

    def __init__(self, state) -> None:
        self.state = state
        self._last: dict = {}  # the loads of the last scrape that reached the cluster state

    def collect(self):
        # Redis away: the last values stay (not a silent drop to nothing), marked by
        # folio_cluster_state_up 0 and a growing folio_worker_heartbeat_age_seconds
        try:
            loads = self._last = self.state.live_loads()
            up = 1.0
        except Exception:
            loads, up = self._last, 0.0
        g = GaugeMetricFamily("folio_cluster_state_up", "1 if the cluster state (Redis) answered this scrape, else 0")
        g.add_metric([], up)
        yield g
        age = GaugeMetricFamily("folio_worker_heartbeat_age_seconds", "Age of the worker's figures below",
                                labels=["worker"])
        now = time.time()
        for w, l in loads.items():
            age.add_metric([w], max(now - l.timestamp, 0.0))
        yield age
        gauges = {
            "folio_requests_running": ("Requests running on the worker", lambda l: l.num_running),
            "folio_requests_waiting": ("Requests waiting on the worker", lambda l: l.num_waiting),
            "folio_requests_swapped": ("Requests swapped out to the worker's CPU memory", lambda l: l.num_swapped),
            "folio_kv_cache_usage_ratio": ("Device KV blocks in use / all", lambda l: l.kv_usage),
            "folio_cpu_swap_usage_ratio": ("CPU swap blocks in use / all", lambda l: l.counters.get("cpu_usage", 0.0)),
        }
        for name, (doc, get) in gauges.items():
            g = GaugeMetricFamily(name, doc, labels=["worker"])
            for w, l in loads.items():
                g.add_metric([w], float(get(l)))
            yield g
        pre = CounterMetricFamily("folio_preemptions", "Preemptions by mode", labels=["worker", "mode"])
        for w, l in loads.items():
            for mode in ("swap", "recompute"):
                pre.add_metric([w, mode], float(l.counters.get(f"preemptions_{mode}", 0)))
        yield pre
        counters = {
            "folio_swapped_out_blocks": ("KV blocks swapped out to CPU", lambda l: l.swapped_out_blocks),
            "folio_swapped_in_blocks": ("KV blocks swapped back in", lambda l: l.swapped_in_blocks),
            "folio_migrations": ("Requests migrated into the worker", lambda l: l.num_migrations_in),
            "folio_prompt_tokens": ("Prompt tokens admitted", lambda l: l.counters.get("prompt_tokens", 0)),
            "folio_generation_tokens": ("Tokens generated", lambda l: l.counters.get("generation_tokens", 0)),
            "folio_prefix_cache_queries": ("Prefix-cache blocks looked up",
                                           lambda l: l.counters.get("prefix_cache_queries", 0)),
            "folio_prefix_cache_hits": ("Prefix-cache blocks found", lambda l: l.counters.get("prefix_cache_hits", 0)),
        }
        for name, (doc, get) in counters.items():
            c = CounterMetricFamily(name, doc, labels=["worker"])
            for w, l in loads.items():
                c.add_metric([w], float(get(l)))
            yield c


class Metrics:
    def __init__(self, state) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(WorkerCollector(state))
        r = self.registry
        self.requests = Counter("folio_requests", "Finished requests", ["finish_reason"], registry=r)
        self.ttft = Histogram("folio_time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS,
                              registry=r)
        self.itl = Histogram("folio_inter_token_latency_seconds", "Time between streamed tokens",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("folio_e2e_request_latency_seconds", "Arrival to last token", buckets=LATENCY_BUCKETS,
                             registry=r)
        self.queue = Histogram("folio_queue_time_seconds", "Arrival to first scheduled", buckets=LATENCY_BUCKETS,
                               registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
