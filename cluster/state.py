"""The cluster state in Redis: who is alive, how loaded, which prefixes, what is swapped.

Keys (all under a namespace, default "folio"):

    {ns}:workers                SET     registered worker ids
    {ns}:worker:{id}            STRING  its last WorkerLoad (JSON), TTL = ttl_s:
                                        a worker whose key expired is dead
    {ns}:prefix:{id}            SET     prefix block hashes cached on that worker
                                        (worker/hashing.py, the engine's own chain)
    {ns}:prefix_epoch:{id}      STRING  present while {ns}:prefix:{id} is complete; a
                                        Redis restart drops it and the worker resends all
    {ns}:swapped:{id}           HASH    request id -> JSON {blocks, priority, arrival}:
                                        the requests in that worker's CPU swap space

Everything is soft state written by heartbeats (~100 ms): after a Redis restart
the next heartbeats rebuild it. Readers never trust a worker without a live key.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import time

import redis
import redis.asyncio

from folio.cluster.prefix_walk import PrefixWalker
from folio.worker.messages import EngineCounters, QueueState, RequestSummary, WorkerLoad
from folio.worker.stats import StepTimings

DEFAULT_TTL_S = 1.5

# KEYS: one prefix set per worker; ARGV[1]: a prompt's chained block hashes, concatenated;
# ARGV[2]: the width of one hash. Returns, per worker, the length of the leading run of
# hashes it holds, as one comma-separated string (one bulk reply: cheap to parse). A
# worker's walk stops at its first miss: one SISMEMBER for a worker without block 0.
_WALK_PREFIX = """
local blob, w = ARGV[1], tonumber(ARGV[2])
local nblocks = math.floor(#blob / w)
local out = {}
for i, key in ipairs(KEYS) do
  local n = 0
  for j = 1, nblocks do
    if redis.call('SISMEMBER', key, string.sub(blob, (j - 1) * w + 1, j * w)) == 1 then n = j else break end
  end
  out[i] = n
end
return table.concat(out, ',')
"""


def _password() -> dict:
    """FOLIO_REDIS_PASSWORD (the chart sets it from a Secret for an external Redis)."""
    pw = os.environ.get("FOLIO_REDIS_PASSWORD")
    return {"password": pw} if pw else {}


def redact_url(url: str) -> str:
    """A Redis URL fit for logs: any password replaced by ****."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"{user}:****@{host}"))


def connect(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5, retry_on_timeout=False,
                                **_password())


def load_to_json(load: WorkerLoad) -> str:
    return json.dumps(dataclasses.asdict(load))


def load_from_json(raw: bytes | str) -> WorkerLoad:
    d = json.loads(raw)
    d["requests"] = [RequestSummary(**{**r, "state": QueueState(r["state"])}) for r in d.get("requests", [])]
    c = d.get("counters") or {}
    d["counters"] = EngineCounters(**{**c, "timings": StepTimings(**c.get("timings", {}))})
    return WorkerLoad(**d)


class Keys:
    def __init__(self, namespace: str = "folio") -> None:
        self.ns = namespace
        self.workers = f"{namespace}:workers"
        self.registry = f"{namespace}:registry"  # set by every heartbeat: gone only with Redis's data

    def worker(self, wid: str) -> str:
        return f"{self.ns}:worker:{wid}"

    def prefix(self, wid: str) -> str:
        return f"{self.ns}:prefix:{wid}"

    def prefix_epoch(self, wid: str) -> str:
        return f"{self.ns}:prefix_epoch:{wid}"

    def swapped(self, wid: str) -> str:
        return f"{self.ns}:swapped:{wid}"

    @property
    def coordinator(self) -> str:  # its heartbeat (liveness.py watches it)
        return f"{self.ns}:coordinator"

    @property
    def coordinator_restart(self) -> str:  # the one frontend that restarts a frozen coordinator
        return f"{self.ns}:coordinator:restart"


class WorkerPublisher:
    """A worker's side (worker/heartbeat.py's LoadPublisher): one heartbeat per publish(),
    one Redis round trip.

    The prefix index goes either whole (after a start, an error or a Redis restart) or as
    the changes since the last publish, so a heartbeat costs what changed, not what is
    cached. The epoch key says the index in Redis is complete: a Redis that restarted has
    none, and the publish that finds it missing asks for the whole set next time.
    """

    SADD_CHUNK = 8192  # hashes per SADD when the whole set goes

    def __init__(self, url: str, namespace: str = "folio", ttl_s: float = DEFAULT_TTL_S) -> None:
        self.r = connect(url)
        self.keys = Keys(namespace)
        self.ttl_ms = int(ttl_s * 1000)
        self._synced = False  # Redis's prefix index is known to be complete

    def publish(self, load: WorkerLoad, cached_block_hashes: set[bytes] | None = None,
                changes: dict[bytes, bool] | None = None) -> bool:
        """The load, and the prefix index: whole (`cached_block_hashes`), or `changes`
        ({hash: cached now?}) since the last publish. Returns whether Redis's index is
        complete after it: False means the caller must send the whole set next time."""
        k, wid = self.keys, load.worker_id
        whole = cached_block_hashes is not None
        try:
            p = self.r.pipeline(transaction=True)
            p.exists(k.prefix_epoch(wid))
            p.set(k.worker(wid), load_to_json(load), px=self.ttl_ms)
            p.sadd(k.workers, wid)
            p.set(k.registry, 1)
            if whole:
                p.delete(k.prefix(wid))
                hashes = list(cached_block_hashes)
                for i in range(0, len(hashes), self.SADD_CHUNK):
                    p.sadd(k.prefix(wid), *hashes[i : i + self.SADD_CHUNK])
                p.set(k.prefix_epoch(wid), 1)
            elif changes:
                added = [h for h, c in changes.items() if c]
                removed = [h for h, c in changes.items() if not c]
                if added:
                    p.sadd(k.prefix(wid), *added)
                if removed:
                    p.srem(k.prefix(wid), *removed)
            p.delete(k.swapped(wid))
            swapped = {r.request_id: json.dumps({"blocks": r.num_blocks, "priority": r.priority,
                                                 "arrival": r.arrival_time})
                       for r in load.requests if r.state == "swapped"}
            if swapped:
                p.hset(k.swapped(wid), mapping=swapped)
                p.pexpire(k.swapped(wid), self.ttl_ms)
            had_epoch = p.execute()[0]
        except redis.RedisError:
            self._synced = False
            raise
        self._synced = whole or (self._synced and bool(had_epoch))
        return self._synced

    def withdraw(self, worker_id: str) -> None:
        """Leave the cluster at once (clean shutdown) instead of waiting for the TTL."""
        k = self.keys
        self.r.delete(k.worker(worker_id), k.prefix(worker_id), k.prefix_epoch(worker_id), k.swapped(worker_id))
        self.r.srem(k.workers, worker_id)

    def close(self) -> None:
        self.r.close()


class ClusterState:
    """The readers' side: the router and the coordinator."""

    def __init__(self, url: str, namespace: str = "folio") -> None:
        self.url = url
        self.r = connect(url)
        self.keys = Keys(namespace)
        self._walk_prefix = self.r.register_script(_WALK_PREFIX)
        self._aloop = self._ar = self._awalk = None
        self._walk_keys: tuple[tuple[str, ...], list[bytes]] = ((), [])
        self._seen: dict[str, WorkerLoad] = {}  # the last registry that listed a worker
        self._lost_at: float | None = None  # when the registry was first seen lost (monotonic)

    def _kept(self, loads: dict[str, WorkerLoad], registry: bool) -> dict[str, WorkerLoad]:
        """`loads`; with none listed and the registry key gone too (read with the list: a Redis restarted
        empty), the last listed for one TTL: they beat again in 0.12-0.24 s (refused meanwhile: attacks,
        2026-12-07; their beats may be old, Redis away long). Workers that left or lapsed leave the key."""
        if loads or not self._seen or registry:
            self._seen, self._lost_at = loads, None
            return loads
        self._lost_at = self._lost_at or time.monotonic()
        if time.monotonic() - self._lost_at >= DEFAULT_TTL_S:
            self._seen = {}
        return dict(self._seen)

    def live_loads(self) -> dict[str, WorkerLoad]:
        """Every worker whose heartbeat key is alive, with its last load."""
        members, registry = self.r.pipeline().smembers(self.keys.workers).exists(self.keys.registry).execute()
        ids = sorted(w.decode() for w in members)  # (and the key at the same instant: a beat between two
        raws = self.r.mget([self.keys.worker(w) for w in ids]) if ids else []  # reads made it look left)
        return self._kept({w: load_from_json(raw) for w, raw in zip(ids, raws) if raw is not None}, registry)

    def prefix_matches(self, worker_ids: list[str], block_hashes: list[bytes]) -> dict[str, int]:
        """How many leading blocks of a prompt's hash chain each worker has cached: one
        round trip, a server-side walk per worker that stops at its first miss."""
        if not block_hashes or not worker_ids:
            return {w: 0 for w in worker_ids}
        return self._walk_counts(worker_ids, self._walk_prefix(*self._walk_args(worker_ids, block_hashes)))

    def _walk_args(self, worker_ids: list[str], block_hashes: list[bytes]) -> tuple[list[bytes], list]:
        ids = tuple(worker_ids)
        if self._walk_keys[0] != ids:  # the router asks for the same workers pick after pick
            self._walk_keys = (ids, [self.keys.prefix(w).encode() for w in ids])
        width = len(block_hashes[0])
        blob = b"".join(block_hashes)
        if not width or len(blob) != width * len(block_hashes):
            raise ValueError("prefix block hashes must all have the same width")
        return self._walk_keys[1], [blob, b"%d" % width]

    @staticmethod
    def _walk_counts(worker_ids: list[str], raw: bytes) -> dict[str, int]:
        return dict(zip(worker_ids, map(int, raw.split(b","))))

    # ---- the same reads without leaving the event loop (the router) ----------------------
    def _async(self):
        """An asyncio client per event loop (a connection belongs to the loop that made it),
        and the prefix walk's own lean connection (prefix_walk.py) where the URL allows."""
        loop = asyncio.get_running_loop()
        if self._aloop is not loop:
            self._ar = redis.asyncio.Redis.from_url(self.url, socket_timeout=0.5, socket_connect_timeout=0.5,
                                                    **_password())
            if PrefixWalker.supported(self.url):
                self._awalk = PrefixWalker(self.url, _WALK_PREFIX, _password().get("password"), 0.5).run
            else:
                script = self._ar.register_script(_WALK_PREFIX)
                self._awalk = lambda keys, args: script(keys=keys, args=args)
            self._aloop = loop
        return self._ar

    async def alive_loads(self) -> dict[str, WorkerLoad]:
        r = self._async()
        members, registry = await r.pipeline().smembers(self.keys.workers).exists(self.keys.registry).execute()
        ids = sorted(w.decode() for w in members)
        raws = await r.mget([self.keys.worker(w) for w in ids]) if ids else []
        return self._kept({w: load_from_json(raw) for w, raw in zip(ids, raws) if raw is not None}, registry)

    async def aprefix_matches(self, worker_ids: list[str], block_hashes: list[bytes]) -> dict[str, int]:
        if not block_hashes or not worker_ids:
            return {w: 0 for w in worker_ids}
        self._async()
        keys, args = self._walk_args(worker_ids, block_hashes)
        return self._walk_counts(worker_ids, await self._awalk(keys, args))

    def swapped_directory(self) -> list[tuple[str, str, dict]]:
        """(worker id, request id, {blocks, priority, arrival}) of every swapped-out request."""
        out = []
        for w in self.live_loads():
            for rid, raw in self.r.hgetall(self.keys.swapped(w)).items():
                out.append((w, rid.decode(), json.loads(raw)))
        return out

    def forget(self, worker_id: str) -> None:
        """Drop a dead worker from the registry (its keys expire by themselves)."""
        self.r.srem(self.keys.workers, worker_id)

    def publish_coordinator(self, info: dict, ttl_s: float) -> None:
        """The coordinator's heartbeat: `info`, alive for `ttl_s`."""
        self.r.set(self.keys.coordinator, json.dumps(info), px=int(ttl_s * 1000))

    def coordinator(self) -> dict | None:
        """Its last heartbeat, or None (lapsed, or not one: whatever else the key holds)."""
        raw = self.r.get(self.keys.coordinator)
        try:
            beat = None if raw is None else json.loads(raw)
        except ValueError:
            return None
        return beat if isinstance(beat, dict) and isinstance(beat.get("time"), (int, float)) else None

    def claim_coordinator_restart(self, who: str, ttl_s: float) -> bool:
        """Whether `who` is the one to restart the coordinator (for `ttl_s`, whoever else asks)."""
        return bool(self.r.set(self.keys.coordinator_restart, who, nx=True, px=int(ttl_s * 1000)))

    def close(self) -> None:
        self.r.close()
