"""One process per worker name: a worker that Ray has replaced stops itself.

Ray restarts a worker whose node it calls dead (its raylet stopped or cut off for ~65 s) on another
node, while the old process, still running, cannot be told: the kill goes through the raylet that
stopped. In a two-node attack (2026-12-08) both processes served as `w1` for 12-26 s: both beat into
the same key (w1's metrics and loads flapped between them on every scrape, its counters running
backwards), the frontends kept their connections to the old one, the new one sat idle, and when the
old raylet came back the old process exited with 5 streams that had started after it was replaced.

Each process of a worker takes a token of its own, and its first heartbeat claims the worker's name
in Redis (`{ns}:incarnation:{wid}`, set, not set-if-absent: Ray made the newest one). Every
`check_every` beats after (~1 s) it reads the claim back; a process that finds another's token there
has been replaced, and ends at once (SIGKILL to itself: nothing of it may go on, and a clean shutdown
would withdraw the heartbeat that is now the new process's). Its connections close, so its frontends
fail or re-run its requests and open new channels, to the new process. A claim lost with Redis's
data is taken again by whoever beats first (set-if-absent then)."""

from __future__ import annotations

import logging
import os
import signal
import uuid

from folio.cluster.state import WorkerPublisher

log = logging.getLogger("folio.fencing")


class FencedPublisher:
    """A WorkerPublisher (the heartbeat's LoadPublisher) that claims the worker's name and ends
    this process when another process has claimed it since."""

    def __init__(self, url: str, namespace: str = "folio", check_every: int = 10, on_replaced=None) -> None:
        self.pub = WorkerPublisher(url, namespace)
        self.token = uuid.uuid4().hex
        self.check_every = check_every
        self.on_replaced = on_replaced or _end_this_process
        self._beats = 0
        self.replaced = False

    def key(self, wid: str) -> str:
        return f"{self.pub.keys.ns}:incarnation:{wid}"

    def publish(self, load, cached_block_hashes=None, changes=None) -> bool:
        wid, r = load.worker_id, self.pub.r
        if self.replaced:  # (on_replaced ended the process; a test's goes on, and beats no more)
            return False
        if self._beats == 0:
            r.set(self.key(wid), self.token)
        elif self._beats % self.check_every == 0:
            owner = r.get(self.key(wid))
            if owner is None:  # Redis lost its data: the first to beat claims it again
                r.set(self.key(wid), self.token, nx=True)
            elif owner.decode() != self.token:
                self.replaced = True
                log.error("worker %s runs in another process now (Ray replaced this one): this one ends", wid)
                self.on_replaced(wid)
                return False
        self._beats += 1
        return self.pub.publish(load, cached_block_hashes, changes)

    def withdraw(self, worker_id: str) -> None:
        self.pub.withdraw(worker_id)

    def close(self) -> None:
        self.pub.close()


def _end_this_process(wid: str) -> None:
    os.kill(os.getpid(), signal.SIGKILL)
