"""The frozen-worker watch, run by the coordinator: a worker whose process stopped answering is
restarted; and the same watch of the coordinator, run by the frontends (CoordinatorWatch).

A worker process that stops (SIGSTOP, a hang that holds the GIL, a host swapping for good) keeps
its TCP connections and its Ray actor: the streams it was serving stalled for as long as it
stayed stopped, with no error, and nothing restarted it (the step watchdog runs inside it, and
Ray restarts only a process that exits). Its heartbeat lapses, so new requests go elsewhere;
this watch then asks Ray, and a worker that has published nothing for `frozen_s` and does not
answer a ping within `ping_timeout_s` is killed, which Ray restarts (max_restarts): its
frontends' connections close, its requests fail or run elsewhere (the router's paths for a
killed worker). A ping that fails at once is a worker dead or restarting, Ray's business (for
`start_s`: below). As Ray Serve replaces a replica that fails its health checks (30 s by default).

A worker restarting (by this watch or by Ray after a crash) fails a ping at once, as Ray
answers for an actor whose new process is still in its __init__. It has `start_s`
(FOLIO_WORKER_START_S, 600 s: a model's load) from its last sign of life or its last kill by
this watch to publish again; past that it is killed again, as Kubernetes' startup probe does.
Before, a new process stuck in its start (a hung device init, a model on storage that stopped
answering) was never looked at again, and the cluster ran a worker short for good (2026-12-07).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time

FROZEN_S = float(os.environ.get("FOLIO_WORKER_FROZEN_S", "20"))
START_S = float(os.environ.get("FOLIO_WORKER_START_S", "600"))  # a restarting process's time to publish
PING_TIMEOUT_S = 5.0
# a frontend's bound on a silent worker's channel (SilentChannelWatch): past the watch's kill and its landing
CHANNEL_SILENT_S = float(os.environ.get("FOLIO_CHANNEL_SILENT_S", str(FROZEN_S + PING_TIMEOUT_S + 5.0)))
COORDINATOR_TTL_S = 3.0  # the coordinator's heartbeat outlives its last beat by this (it beats every second)
log = logging.getLogger("folio.liveness")


class FrozenWatch:
    def __init__(self, client, frozen_s: float = FROZEN_S, ping_timeout_s: float = PING_TIMEOUT_S,
                 what: str = "worker ", start_s: float = START_S) -> None:
        self.client = client  # call(wid, "ping") and restart(wid): RayWorkerClient
        self.what = what  # in its log lines: what `wid` names
        self.frozen_s, self.ping_timeout_s, self.start_s = frozen_s, ping_timeout_s, start_s
        self.seen: dict[str, float] = {}  # wid -> its heartbeat last live, or this watch's last kill (monotonic)
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
        t0 = time.monotonic()
        try:
            await asyncio.wait_for(self.client.call(wid, "ping"), self.ping_timeout_s)
        except asyncio.TimeoutError:  # frozen
            why = f"did not answer a ping in {self.ping_timeout_s:.0f} s"
        except Exception as e:  # dead or restarting: Ray restarts it, its heartbeat comes back
            if now - self.seen.get(wid, now) <= self.start_s:
                log.debug("%s%s did not answer a ping: %s", self.what, wid, e)
                return
            why = f"has been starting for over {self.start_s:.0f} s ({type(e).__name__})"  # stuck in its start
        else:  # alive to Ray: what failed is its way to Redis, not the worker; asked again in frozen_s
            self.seen[wid] = max(self.seen.get(wid, now), now)
            return
        if self.seen.get(wid, now) > now:  # it published again while the ping waited: it is back
            return
        self.seen[wid] = now + (time.monotonic() - t0)  # its new process's start counts from the kill
        log.warning("%s%s has published nothing for over %.0f s and %s: restarting it", self.what, wid,
                    self.frozen_s, why)
        try:
            await self.client.restart(wid)
        except Exception:
            log.exception("restarting %s%s failed", self.what, wid)
            return
        self.restarts += 1

    async def settle(self) -> None:
        """Wait for the pings under way (and the restarts they call for)."""
        await asyncio.gather(*self._checks.values(), return_exceptions=True)

    async def stop(self) -> None:
        for task in list(self._checks.values()):
            task.cancel()
        await self.settle()


class CoordinatorWatch:
    """The same rule for the coordinator, run by every frontend replica: a coordinator whose
    heartbeat (its watch loop's, every second) has lapsed for `frozen_s` and whose actor does not
    answer a ping within `ping_timeout_s` is killed, which Ray restarts (max_restarts). Stopped, it
    planned no move and restarted no frozen worker, and /health still said ok (2026-12-07): nothing
    restarted it, as nothing restarted a stopped worker. One frontend kills it (a claim in Redis);
    a coordinator never seen (none runs: `coordinator=False`) is never pinged."""

    def __init__(self, state, namespace: str, ray_namespace: str | None = None, frozen_s: float = FROZEN_S,
                 ping_timeout_s: float = PING_TIMEOUT_S, check_s: float = 1.0) -> None:
        self.state, self.check_s = state, check_s  # ClusterState: coordinator(), claim_coordinator_restart()
        self.name, self.ray_namespace = f"{namespace}-coordinator", ray_namespace or namespace
        self.watch = FrozenWatch(self, frozen_s, ping_timeout_s, what="the coordinator ")
        self.who = f"{socket.gethostname()}:{os.getpid()}"
        self.last_seen: float | None = None  # monotonic, its last heartbeat seen
        self.live = False
        self._blind = False  # the last read failed (Redis away)
        self.restarts = 0

    def silent_s(self) -> float:
        """How long a coordinator seen before has been silent (0 while its heartbeat is alive)."""
        return 0.0 if self.live or self.last_seen is None else time.monotonic() - self.last_seen

    async def run(self) -> None:
        while True:
            await self.check()
            await asyncio.sleep(self.check_s)

    async def check(self) -> None:
        """One read of its heartbeat."""
        try:
            beat = await asyncio.to_thread(self.state.coordinator)
        except Exception as e:  # Redis away: nobody is known silent until it is back
            log.debug("cluster state unavailable: %s", e)
            self._blind = True
            return
        now = time.monotonic()
        # Redis back: the coordinator's silence counts from now, since it could not beat either
        # (a 20 s Redis stop read "lapsed 21 s ago" until its next beat)
        self.live = beat is not None or (self._blind and self.last_seen is not None)
        self._blind = False
        if self.live:
            self.last_seen = now
        self.watch.observe({self.name: beat} if self.live else {}, now)

    async def _actor(self):
        import ray

        return await asyncio.to_thread(ray.get_actor, self.name, namespace=self.ray_namespace)

    async def call(self, _: str, method: str):  # FrozenWatch's ping
        return await getattr(await self._actor(), {"ping": "stats"}[method]).remote()

    async def restart(self, _: str) -> None:
        import ray

        if not await asyncio.to_thread(self.state.claim_coordinator_restart, self.who, 10.0):
            log.info("another frontend restarts the coordinator")
            return
        ray.kill(await self._actor(), no_restart=False)
        self.restarts += 1


class SilentChannelWatch:
    """A frontend's own bound on a worker that went silent, for when the kill above cannot land: a
    whole node stopped or cut off (its raylet with it), where Ray's kill waits on that raylet and
    Ray calls the node dead only after ~65 s. Its streams hung for as long as the node stayed
    stopped (45-100 s in an attack, 2026-12-08), holding their admission slots, and ended, if
    ever, with "a step ran longer than 60 s". A worker whose heartbeat has lapsed for `bound_s`
    (the watch's kill and its landing by then, where the node answers), while Redis is reachable,
    and whose channel here has carried nothing for as long, has its requests failed here
    (Channel.cut_if_silent). Its heartbeat lapsing alone is no reason: a worker cut off from
    Redis still streams (the coordinator's ping finds it alive), and such a channel is not silent."""

    def __init__(self, state, client, bound_s: float = CHANNEL_SILENT_S, check_s: float = 1.0) -> None:
        self.state, self.client = state, client  # ClusterState, RayWorkerClient (its cut_silent)
        self.bound_s, self.check_s = bound_s, check_s
        self.missing: dict[str, float] = {}  # wid -> when its heartbeat was first seen lapsed (monotonic)
        self.cuts = 0

    async def run(self) -> None:
        while True:
            await self.check()
            await asyncio.sleep(self.check_s)

    async def check(self, now: float | None = None) -> None:
        try:
            live = await self.state.alive_loads()
        except Exception:  # Redis away: no worker could beat, so none is known silent
            self.missing.clear()
            return
        now = time.monotonic() if now is None else now
        for wid in self.client.channel_workers():
            if wid in live:
                self.missing.pop(wid, None)
                continue
            since = self.missing.setdefault(wid, now)
            if now - since >= self.bound_s:
                self.cuts += self.client.cut_silent(wid, self.bound_s)
