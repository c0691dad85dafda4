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
keep their last values (their age grows) instead of vanishing, and so do a worker's whose
heartbeat lapsed (dead, stopped), for LAPSED_KEPT_S: it vanished at once, the requests it
held out of sight and no series left to alert on. folio_coordinator_heartbeat_age_seconds: the
age of the coordinator's last heartbeat (growing while it is silent; none before one is seen).
Frontend: folio_requests_total{finish_reason} and the histograms
folio_time_to_first_token_seconds, folio_inter_token_latency_seconds,
folio_e2e_request_latency_seconds, folio_queue_time_seconds: summed over every frontend
replica of the deployment, whichever one is scraped (replica_metrics.py).

Every series of a request, a token or a worker carries `model_name` (the first served
name), as vLLM's do (its dashboards select on it); folio_cluster_state_up does not (it is
about Redis). No `_created` series (prometheus_client's, disabled as vLLM does). `render`
answers in OpenMetrics when the scraper's Accept header asks for it, else in Prometheus'
text format 0.0.4.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import choose_encoder

disable_created_metrics()  # process-wide: no metric of this process has a _created series

LAPSED_KEPT_S = 600.0  # a worker's last figures stay this long after its last heartbeat
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)


class WorkerCollector:
    """Reads the workers' last heartbeats (cluster/state.py) when scraped."""

    def __init__(self, state, model_name: str = "") -> None:
        self.state, self.model_name = state, model_name
        self._last: dict = {}  # each worker's last load read from the cluster state
        self._coordinator_at: float | None = None  # its last heartbeat's time.time()

    def collect(self):
        # Redis away: the last values stay (not a silent drop to nothing), marked by
        # folio_cluster_state_up 0 and a growing folio_worker_heartbeat_age_seconds
        try:
            self._last.update(self.state.live_loads())
            beat = self.state.coordinator()
            self._coordinator_at = beat["time"] if beat else self._coordinator_at
            up = 1.0
        except Exception:
            up = 0.0
        cutoff = time.time() - LAPSED_KEPT_S
        loads = self._last = {w: l for w, l in self._last.items() if l.timestamp > cutoff}
        g = GaugeMetricFamily("folio_cluster_state_up", "1 if the cluster state (Redis) answered this scrape, else 0")
        g.add_metric([], up)
        yield g
        m = self.model_name
        age = GaugeMetricFamily("folio_worker_heartbeat_age_seconds", "Age of the worker's figures below",
                                labels=["model_name", "worker"])
        now = time.time()
        for w, l in loads.items():
            age.add_metric([m, w], max(now - l.timestamp, 0.0))
        yield age
        if self._coordinator_at is not None:
            g = GaugeMetricFamily("folio_coordinator_heartbeat_age_seconds",
                                  "Age of the coordinator's last heartbeat (it beats every second)")
            g.add_metric([], max(now - self._coordinator_at, 0.0))
            yield g
        gauges = {
            "folio_requests_running": ("Requests running on the worker", lambda l: l.num_running),
            "folio_requests_waiting": ("Requests waiting on the worker", lambda l: l.num_waiting),
            "folio_requests_swapped": ("Requests swapped out to the worker's CPU memory", lambda l: l.num_swapped),
            "folio_kv_cache_usage_ratio": ("Device KV blocks in use / all", lambda l: l.kv_usage),
            "folio_cpu_swap_usage_ratio": ("CPU swap blocks in use / all", lambda l: l.cpu_usage),
        }
        for name, (doc, get) in gauges.items():
            g = GaugeMetricFamily(name, doc, labels=["model_name", "worker"])
            for w, l in loads.items():
                g.add_metric([m, w], float(get(l)))
            yield g
        pre = CounterMetricFamily("folio_preemptions", "Preemptions by mode", labels=["model_name", "worker", "mode"])
        for w, l in loads.items():
            for mode in ("swap", "recompute"):
                pre.add_metric([m, w, mode], float(getattr(l.counters, f"preemptions_{mode}")))
        yield pre
        counters = {
            "folio_swapped_out_blocks": ("KV blocks swapped out to CPU", lambda l: l.swapped_out_blocks),
            "folio_swapped_in_blocks": ("KV blocks swapped back in", lambda l: l.swapped_in_blocks),
            "folio_migrations": ("Requests migrated into the worker", lambda l: l.num_migrations_in),
            "folio_prompt_tokens": ("Prompt tokens admitted", lambda l: l.counters.prompt_tokens),
            "folio_generation_tokens": ("Tokens generated", lambda l: l.counters.generation_tokens),
            "folio_prefix_cache_queries": ("Prefix-cache blocks looked up",
                                           lambda l: l.counters.prefix_cache_queries),
            "folio_prefix_cache_hits": ("Prefix-cache blocks found", lambda l: l.counters.prefix_cache_hits),
            "folio_engine_steps": ("Engine steps run", lambda l: l.counters.timings.steps),
        }
        for name, (doc, get) in counters.items():
            c = CounterMetricFamily(name, doc, labels=["model_name", "worker"])
            for w, l in loads.items():
                c.add_metric([m, w], float(get(l)))
            yield c
        phases = CounterMetricFamily("folio_engine_step_seconds", "Seconds of engine steps, by phase",
                                     labels=["model_name", "worker", "phase"])
        for w, l in loads.items():
            for phase, seconds in vars(l.counters.timings).items():
                if phase != "steps":
                    phases.add_metric([m, w, phase], float(seconds))
        yield phases


class _Labelled:
    """A metric with its `model_name` label bound: `.labels(finish_reason=...)` adds the rest."""

    def __init__(self, metric, model_name: str) -> None:
        self.metric, self.model_name = metric, model_name

    def labels(self, **labels):
        return self.metric.labels(model_name=self.model_name, **labels)


class Metrics:
    def __init__(self, state, model_name: str = "") -> None:
        from folio.deploy.replica_metrics import ReplicaMetrics

        self.own = CollectorRegistry()  # this replica's, served summed with every other replica's
        r, m = self.own, ["model_name"]

        def hist(name: str, doc: str):
            return Histogram(name, doc, m, buckets=LATENCY_BUCKETS, registry=r).labels(model_name=model_name)
        self.requests = _Labelled(Counter("folio_requests", "Finished requests", m + ["finish_reason"], registry=r),
                                  model_name)
        self.ttft = hist("folio_time_to_first_token_seconds", "Time to first token")
        self.itl = hist("folio_inter_token_latency_seconds", "Time between streamed tokens")
        self.e2e = hist("folio_e2e_request_latency_seconds", "Arrival to last token")
        self.queue = hist("folio_queue_time_seconds", "Arrival to first scheduled")
        self.replicas = ReplicaMetrics(state, self.own)  # its `run` publishes this replica's (a thread)
        self.registry = CollectorRegistry()
        self.registry.register(WorkerCollector(state, model_name))
        self.registry.register(self.replicas)

    def render(self, accept: str | None = None) -> tuple[bytes, str]:
        """(body, content type): OpenMetrics if `accept` (an Accept header) asks for it."""
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.registry), content_type
