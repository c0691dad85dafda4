"""The frontend replicas' own metrics (folio_requests_total and the latency histograms:
metrics.py), summed over every replica of a deployment, whichever replica a scrape reaches.

Several frontend replicas (the chart's `serve.frontendReplicas`) share the HTTP, gRPC and
metrics ports (SO_REUSEPORT), so a scrape reaches one of them at random. Each answered with its
own counts alone: the totals jumped from scrape to scrape, and Prometheus reads a drop as a
counter reset. Before that, the second replica could not bind the metrics port at all, and the
application never ran (2026-12-07). vLLM's API servers add theirs up through prometheus_client's
multiprocess files, on one host; here it is the cluster's Redis, so replicas on several nodes
add up too:

    {ns}:frontend_metrics          HASH  replica id -> JSON {"t": wall time, "s": [[sample name,
                                         {labels}, value], ...]}: its counters and histograms,
                                         written every PUBLISH_S; the field "retired" holds the
                                         sum of the replicas gone
    {ns}:frontend_metrics:retired  SET   the ids folded into "retired"

A scrape publishes its own replica's figures, then sums what the hash holds: every replica's
last published figures and the retired sum. So every replica answers the same sum, and a total
never goes down from one scrape to the next, whichever replicas they reach, nor when a replica
goes:
- a replica silent for RETIRE_S is folded into "retired", in one WATCH transaction;
- a replica once folded can publish no more under its id (a Lua check), so it is never counted
  twice; one folded that comes back (a partition of over RETIRE_S, say) goes on under a new id
  with what it counted since its last publish before the fold (its figures less those, which
  "retired" holds): it stayed out of the totals for good, and every scrape it answered too;
- a replica that Serve stops publishes a last time once its requests are drained
  (replica_drain.py); one killed loses what it counted since its last publish (<= PUBLISH_S).

While Redis is away, each replica answers its own figures and the others' as it last read them
(folio_cluster_state_up is 0 meanwhile): such totals can differ from replica to replica, lower
than an earlier scrape's by what the others did since, until Redis is back.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid

import redis
from prometheus_client.core import Metric

PUBLISH_S = 1.0
RETIRE_S = 600.0  # a replica that has published nothing for this long is gone: its figures are folded
RETIRED = "retired"
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum")}
log = logging.getLogger("folio.metrics")

# KEYS[1]: the hash, KEYS[2]: the retired ids; ARGV: this replica's id and its figures
_PUBLISH = """
if redis.call('SISMEMBER', KEYS[2], ARGV[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return 1
"""

Figures = dict  # (sample name, ((label, value), ...)) -> value


def figures(registry) -> Figures:
    return {(s.name, tuple(sorted(s.labels.items()))): float(s.value)
            for fam in registry.collect() for s in fam.samples}


def add(total: Figures, part: Figures) -> Figures:
    for key, value in part.items():
        total[key] = total.get(key, 0.0) + value
    return total


def _encode(figs: Figures, t: float) -> str:
    return json.dumps({"t": t, "s": [[name, dict(labels), v] for (name, labels), v in figs.items()]})


def _decode(raw: bytes) -> tuple[float, Figures]:
    d = json.loads(raw)
    return float(d["t"]), {(str(n), tuple(sorted((str(k), str(v)) for k, v in labels.items()))): float(v)
                           for n, labels, v in d["s"]}


def _order(key) -> tuple:
    (name, labels) = key
    le = dict(labels).get("le")
    return (tuple(kv for kv in labels if kv[0] != "le"), name.rsplit("_", 1)[-1] != "bucket", name,
            float(le) if le is not None else 0.0)


class ReplicaMetrics:
    """A collector, for the registry that is served: `own` (this replica's counters and
    histograms) summed with every other replica's. `publish` writes this replica's figures."""

    def __init__(self, state, own, retire_s: float = RETIRE_S, clock=time.time, replica_id: str | None = None) -> None:
        self.r, self.own, self.retire_s, self.clock = state.r, own, retire_s, clock
        self.key = f"{state.keys.ns}:frontend_metrics"
        self.retired_key = f"{self.key}:retired"
        self.id = replica_id or f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.others: dict[str, Figures] = {}  # the last figures read of every other replica, "retired" included
        self.published: Figures = {}  # this replica's figures at its last publish
        self.baseline: Figures = {}  # what "retired" holds of this replica (folded as gone, then back)
        self._publish = self.r.register_script(_PUBLISH)
        self._lock = threading.Lock()  # the publishing thread and the scrapes

    def publish(self, figs: Figures | None = None) -> bool:
        """Write this replica's figures (less its baseline). Folded as gone meanwhile: it goes on
        under a new id with what it counted since its last publish (False if that fails too)."""
        figs = figures(self.own) if figs is None else figs
        with self._lock:
            for _ in range(2):
                sent = _encode(self._own_part(figs), self.clock())
                if self._publish(keys=[self.key, self.retired_key], args=[self.id, sent]):
                    self.published = figs
                    return True
                log.warning("this frontend replica's metrics were folded as gone (silent for %.0f s): it goes on "
                            "under a new id", self.retire_s)
                self.id, self.baseline = f"{os.getpid()}-{uuid.uuid4().hex[:12]}", self.published
            return False

    def _own_part(self, figs: Figures) -> Figures:
        """What this replica's field holds of `figs`: the rest is in "retired" (its baseline)."""
        return {k: v - self.baseline.get(k, 0.0) for k, v in figs.items()}

    def run(self, stop: threading.Event, every_s: float = PUBLISH_S) -> None:
        """Publish now, then every `every_s` until `stop` is set (a daemon thread of the replica)."""
        while True:
            try:
                self.publish()
            except (redis.RedisError, OSError) as e:
                log.debug("the replica's metrics were not published: %s", e)
            if stop.wait(every_s):
                return

    def total(self) -> Figures:
        """Every replica's figures as Redis holds them, this one's published first: the same
        sum from whichever replica, never lower than an earlier scrape's. Redis away: this
        replica's own figures and the others' as it last read them, so replicas differ (each
        saw the others last at its own last scrape) until Redis is back."""
        own = figures(self.own)
        try:
            self.publish(own)
            every = self._read()
        except (redis.RedisError, OSError) as e:
            log.debug("other replicas' metrics unavailable: %s", e)
            every = {**self.others, self.id: self._own_part(own)}
        else:
            self.others = {field: figs for field, figs in every.items() if field != self.id}
        total: Figures = {}
        for figs in every.values():
            add(total, figs)
        return total

    def collect(self):
        total = self.total()
        for fam in self.own.collect():
            names = {fam.name + s for s in SUFFIXES.get(fam.type, ("",))}
            out = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            for key in sorted((k for k in total if k[0] in names), key=_order):
                out.add_sample(key[0], dict(key[1]), total[key])
            yield out

    def _read(self) -> dict[str, Figures]:
        now, others, stale = self.clock(), {}, []
        for field, raw in self.r.hgetall(self.key).items():
            field = field.decode()
            try:
                t, figs = _decode(raw)
            except (ValueError, KeyError, TypeError, AttributeError):  # not a replica's figures: none
                continue
            others[field] = figs
            if field not in (RETIRED, self.id) and now - t > self.retire_s:
                stale.append(field)
        if stale:
            self._fold(stale, now)
        return others

    def _fold(self, stale: list[str], now: float) -> None:
        """Add the replicas gone into "retired", atomically (another replica's fold, or a gone
        one back and publishing meanwhile, makes this one wait for the next scrape)."""
        with self.r.pipeline() as p:
            try:
                p.watch(self.key)
                raws = p.hmget(self.key, [RETIRED, *stale])
                retired = _decode(raws[0])[1] if raws[0] is not None else {}
                for raw in raws[1:]:
                    if raw is not None:
                        add(retired, _decode(raw)[1])
                p.multi()
                p.hset(self.key, RETIRED, _encode(retired, now))
                p.hdel(self.key, *stale)
                p.sadd(self.retired_key, *stale)
                p.execute()
            except (redis.WatchError, ValueError, KeyError, TypeError):
                pass
