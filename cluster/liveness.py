"""The frozen-worker watch, run by the coordinator: a worker whose process stopped answering is
restarted.

A worker process that stops (SIGSTOP, a hang that holds the GIL, a host swapping for good) keeps
its TCP connections and its Ray actor: the streams it was serving stalled for as long as it
stayed stopped, with no error, and nothing restarted it (the step watchdog runs inside it, and
Ray restarts only a process that exits). Its heartbeat lapses, so new requests go elsewhere;
this watch then asks Ray, and a worker that has published nothing for `frozen_s` and does not
answer a ping within `ping_timeout_s` is killed, which Ray restarts (max_restarts): its
frontends' connections close, its requests fail or run elsewhere (the router's paths for a
killed worker). A ping that fails at once is a worker dead or restarting, Ray's business: never
killed here. Once killed, a worker is watched again only after its new process publishes.
As Ray Serve replaces a replica that fails its health checks (30 s by default).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

FROZEN_S = float(os.environ.get("FOLIO_WORKER_FROZEN_S", "20"))
PING_TIMEOUT_S = 5.0
log = logging.getLogger("folio.liveness")


class FrozenWatch:
    def __init__(self, client, frozen_s: float = FROZEN_S, ping_timeout_s: float = PING_TIMEOUT_S) -> None:
        self.client = client  # call(wid, "ping") and restart(wid): RayWorkerClient
        self.frozen_s, self.ping_timeout_s = frozen_s, ping_timeout_s
        self.seen: dict[str, float] = {}  # wid -> when its heartbeat was last live (monotonic)
        self._checks: dict[str, asyncio.Task] = {}  # wid -> its ping under way
        self.restarts = 0

    def observe(self, live: dict, now: float | None = None) -> None:
        """One look at the live workers (their heartbeat keys in Redis): pings each one lapsed
        past `frozen_s`, in the background (a frozen one takes `ping_timeout_s` to tell)."""
        now = time.monotonic() if now is None else now
        for wid in live:
            self.seen[wid] = now
        for wid, t in list(self.seen.items()):
            if wid not in live and now - t > self.frozen_s and wid not in self._checks:
                task = asyncio.get_running_loop().create_task(self._check(wid, now))
                self._checks[wid] = task
                task.add_done_callback(lambda _, w=wid: self._checks.pop(w, None))

    async def _check(self, wid: str, now: float) -> None:
        try:
            await asyncio.wait_for(self.client.call(wid, "ping"), self.ping_timeout_s)
        except asyncio.TimeoutError:
            pass  # frozen
        except Exception as e:  # dead or restarting: Ray restarts it, its heartbeat comes back
            log.debug("worker %s did not answer a ping: %s", wid, e)
            return
        else:  # alive to Ray: what failed is its way to Redis, not the worker; asked again in frozen_s
            self.seen[wid] = max(self.seen.get(wid, now), now)
            return
        if self.seen.get(wid, now) > now:  # it published again while the ping waited: it is back
            return
        self.seen.pop(wid, None)
        log.warning("worker %s has published nothing for over %.0f s and did not answer a ping in %.0f s: "
                    "restarting it", wid, self.frozen_s, self.ping_timeout_s)
        try:
            await self.client.restart(wid)
        except Exception:
            log.exception("restarting worker %s failed", wid)
            return
        self.restarts += 1

    async def settle(self) -> None:
        """Wait for the pings under way (and the restarts they call for)."""
        await asyncio.gather(*self._checks.values(), return_exceptions=True)

    async def stop(self) -> None:
        for task in list(self._checks.values()):
            task.cancel()
        await self.settle()
