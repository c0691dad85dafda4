"""The worker's side of a frontend's channel (actor.py: `commands` in, `subscribe` out).

    frontend (one per replica and worker)         worker
    commands(sub, [("submit", req), ("abort", rid), ("attach", rid), ...])   in order, awaited
    subscribe(sub)  <-- one message per wake-up: [(rid, StreamChunk | exception), ...]

An Outbox holds what waits for one subscriber: per request, its chunks merged while the
reader is behind (a migration marker, the last chunk and an error are never merged into),
so a slow frontend costs one merged chunk per request, never a growing queue. A Route is
a request's entry in the worker's stream table that delivers into an Outbox and removes
itself once the request's last item went in. Tombstones: aborts that arrived before their
request (bounded in count and age); the request then finishes at once with "abort", if it
was sent before the abort came (its `arrival_time`, stamped by the router, not later than
the abort's: the wall clocks of one machine, or of NTP-synced nodes). A request sent after
an abort that found nothing is a new one: before, a client that aborted an id not running
(or its own finished request, on the workers where it had not run) had every request with
the id refused for 60 s (an attack, 2026-12-06: 20 of 20 fresh ids).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict

from folio.worker.messages import StreamChunk, merge_chunks

TOMBSTONES_KEPT = 4096
TOMBSTONE_S = 60.0
SEEN_KEPT = 16384  # request ids admitted lately: an abort of one of them leaves no tombstone


def terminal(item) -> bool:
    return isinstance(item, BaseException) or item.finished or item.migrated_to is not None


def _mergeable(a, b) -> bool:
    return (isinstance(a, StreamChunk) and isinstance(b, StreamChunk) and not terminal(a)
            and b.migrated_to is None)


class Outbox:
    """A subscriber's items. Read through Ray (`subscribe`: the event loop waits on `ready`)
    or over TCP by the step thread (`conn`, step_io.py): then anyone may put, and a put by
    any thread but the step thread sends at once."""

    def __init__(self, subscriber: str) -> None:
        self.subscriber = subscriber
        self.pending: dict[str, list] = {}
        self.ready = asyncio.Event()
        self.closed = False
        self.lock = threading.RLock()  # (step_io's Conn takes it around take + send)
        self.conn = None  # step_io.Conn once a TCP connection owns this box

    def put(self, rid: str, item) -> None:
        with self.lock:
            items = self.pending.setdefault(rid, [])
            if items and _mergeable(items[-1], item):
                items[-1] = merge_chunks(items[-1], item)
            else:
                items.append(item)
        conn = self.conn
        if conn is None:
            self.ready.set()
        elif threading.get_ident() != conn.owner:  # (the step thread flushes after its step)
            conn.flush()

    def take(self) -> list[tuple[str, object]]:
        self.ready.clear()
        with self.lock:
            out = [(rid, item) for rid, items in self.pending.items() for item in items]
            self.pending = {}
        return out


class Route:
    """The stream-table entry of a request whose chunks go to a subscriber."""

    def __init__(self, box: Outbox, rid: str, streams: dict, sent: dict, direct: bool = True) -> None:
        """`direct`: the step thread puts its items here itself (when the box has a TCP
        connection); False for a route whose earlier items went through the event loop (an
        import's queue), so that they keep their order."""
        self.box, self.rid, self._streams, self._sent, self.direct = box, rid, streams, sent, direct

    def put_nowait(self, item) -> None:
        self.box.put(self.rid, item)
        if terminal(item) and self._streams.get(self.rid) is self:
            self._streams.pop(self.rid, None)
            self._sent.pop(self.rid, None)


class Tombstones:
    """Aborts of requests not seen yet (step thread only)."""

    def __init__(self) -> None:
        self._dead: OrderedDict[str, tuple[float, float]] = OrderedDict()  # rid -> (expiry, the abort's wall time)
        self._seen: OrderedDict[str, None] = OrderedDict()

    def seen(self, rid: str) -> None:
        self._seen[rid] = None
        self._seen.move_to_end(rid)
        if len(self._seen) > SEEN_KEPT:
            self._seen.popitem(last=False)

    def abort_unknown(self, rid: str) -> None:
        """An abort found nothing: leave a tombstone unless the request already ran here."""
        if rid in self._seen:
            return
        self._dead[rid] = (time.monotonic() + TOMBSTONE_S, time.time())
        self._dead.move_to_end(rid)
        while len(self._dead) > TOMBSTONES_KEPT:
            self._dead.popitem(last=False)

    def take(self, rid: str, sent_at: float | None = None) -> bool:
        """True if an abort for `rid` is waiting and the request (sent at wall time `sent_at`;
        None: unknown, taken as before it) is not newer than it. The tombstone is spent."""
        entry = self._dead.pop(rid, None)
        if entry is None:
            return False
        expiry, aborted_at = entry
        return expiry > time.monotonic() and (sent_at is None or sent_at <= aborted_at)

    def __len__(self) -> int:
        return len(self._dead)
