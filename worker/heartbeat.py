"""A worker's heartbeat: its load and prefix index, published every ~100 ms, at the cost
of what changed rather than of what exists.

    step thread, between two steps            publisher thread
    beat(load, engine)  ->  pending: latest load  ->  publisher.publish(load, whole | changes)
                        + prefix changes          (Redis: cluster/state.py)
                          merged until sent

On the step thread a beat is O(changes): the KV manager's log of prefix blocks stored
and removed since the last beat (vLLM's BlockStored / BlockRemoved events), and a load
(built by the caller) with no per-request list beyond the requests that wait for room.
Only a resync copies the whole cache map: the first beat, and the beat after a failed
publish or a Redis that lost the index. Serializing and sending happen on the publisher
thread; the latest load replaces an unsent one, changes accumulate until sent.

Liveness is not step progress: a step longer than the load's TTL in Redis (a prefill of
a few thousand tokens of a real model on a CPU: several seconds) made the worker vanish
from the cluster state, and the router answered 503 "no worker is alive" while it ran.
While no new beat comes, the publisher thread sends the last load again every
`keepalive_s` (its figures as they were, its timestamp unchanged: only its TTL is renewed),
as long as `alive()` says the step thread is alive and not stuck in one step for longer
than the actor's bound.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Protocol

from folio.worker.messages import WorkerLoad

log = logging.getLogger("folio.worker")


class PrefixIndex(Protocol):  # EngineCore's prefix queries
    def cached_block_hashes(self) -> set[bytes]: ...
    def prefix_cache_changes(self) -> tuple[dict[bytes, bool], bool]: ...


class LoadPublisher(Protocol):
    def publish(self, load: WorkerLoad, cached_block_hashes: set[bytes] | None = None,
                changes: dict[bytes, bool] | None = None) -> bool:
        """Called from the publisher thread; may block or raise (the next heartbeat tries
        again). Returns False when the next publish must carry the whole prefix set."""

    def close(self) -> None: ...


class Heartbeat:
    def __init__(self, publisher: LoadPublisher, name: str, keepalive_s: float = 0.5,
                 alive: Callable[[], bool] | None = None) -> None:
        self.publisher = publisher
        self.keepalive_s, self.alive = keepalive_s, alive
        self.num_keepalives = 0
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._stop = False
        self._load: WorkerLoad | None = None
        self._whole: set[bytes] | None = None  # a resync's full set (changes since it applied)
        self._changes: dict[bytes, bool] = {}
        self._need_whole = True
        self.num_resyncs = 0
        self.num_published = 0
        self.beat_cpu_seconds = 0.0  # step-thread CPU time spent in beat()
        self.num_changes_sent = 0  # prefix changes handed to the publisher (whole sets not counted)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def beat(self, make_load: Callable[[], WorkerLoad], index: PrefixIndex) -> None:
        """Step thread: hand over a new load and the prefix changes since the last beat
        (`index`: the engine, EngineCore's prefix queries)."""
        t0 = time.thread_time()
        load = make_load()
        changes, lost = index.prefix_cache_changes()
        with self._lock:
            if self._need_whole or lost:
                self._whole, self._changes, self._need_whole = index.cached_block_hashes(), {}, False
                self.num_resyncs += 1
            elif self._whole is not None:  # an unsent resync: bring it up to date
                for h, cached in changes.items():
                    if cached:
                        self._whole.add(h)
                    else:
                        self._whole.discard(h)
            else:
                self._changes.update(changes)  # a later change of a hash wins
            self._load = load
        self._ready.set()
        self.beat_cpu_seconds += time.thread_time() - t0

    def _take(self) -> tuple[WorkerLoad | None, set[bytes] | None, dict[bytes, bool]]:
        with self._lock:
            out = self._load, self._whole, self._changes
            self._load, self._whole, self._changes = None, None, {}
            return out

    def _run(self) -> None:
        last: WorkerLoad | None = None
        while not self._stop:
            if self._ready.wait(self.keepalive_s):
                self._ready.clear()
                load, whole, changes = self._take()
                if load is None:
                    continue
            elif last is not None and not self._stop and (self.alive is None or self.alive()):
                load, whole, changes = last, None, {}  # no beat for a while (a long step): renew the TTL
                self.num_keepalives += 1
            else:
                continue
            last = load
            self.num_changes_sent += len(changes)
            try:
                synced = self.publisher.publish(load, whole, changes)
            except Exception as e:  # Redis away: the next heartbeat tries again, with the whole set
                log.debug("heartbeat of %s failed: %s", load.worker_id, e)
                synced = False
                time.sleep(0.05)
            if synced is False:
                with self._lock:
                    self._need_whole = True
            else:
                self.num_published += 1

    def close(self) -> None:
        self._stop = True
        self._ready.set()
        self._thread.join(timeout=2.0)
        try:
            self.publisher.close()
        except Exception:
            pass
