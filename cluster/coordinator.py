"""The coordinator: preempts across GPUs and resumes requests wherever there is room.

Every `interval_s` it reads the cluster state (Redis), plans with the pure policy in
placement.py, and carries out each move: export on the source (the request's KV to
CPU tensors, its stream there ends with `migrated_to`), import on the destination
through the Ray object store (into the destination's swap space, after swapping out
any victims there); the destination's next swap-in resumes decoding and the router
re-attaches the client's stream. Moves run concurrently; a failed move is counted
and the request stays where it was.

No call to a worker holds the rounds: a worker stopped mid-move (SIGSTOP, a hang that holds
its GIL) never answers, and a round that waited on its import waited for ever, every later
move and the frozen-worker watch with it (5 streams hung 120 s, the stopped worker never
restarted, 2026-12-07). A victim query gets `query_timeout_s`; a round waits `move_wait_s`
for its moves and leaves the rest running, their two workers out of the planning until they
end; the watch reads the live workers on a loop of its own.

`Coordinator` is plain asyncio (the simulated cluster runs it in-process);
`CoordinatorActor` is the same thing as a Ray actor, which also restarts a worker whose process
stopped answering (liveness.py); with one worker that is all it does.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from folio.cluster.liveness import COORDINATOR_TTL_S, FrozenWatch
from folio.cluster.placement import Move, plan_moves, victim_queries
from folio.cluster.state import ClusterState
from folio.cluster.worker_client import WorkerClient
from folio.worker.errors import FolioError

log = logging.getLogger("folio.coordinator")
QUERY_TIMEOUT_S = 5.0  # a victim query: a worker that takes longer is planned without, this round
MOVE_WAIT_S = 10.0  # a round waits this long for its moves; the rest go on in the background


class Coordinator:
    def __init__(self, state: ClusterState, client: WorkerClient, interval_s: float = 0.1,
                 cooldown_s: float = 1.0, headroom: float = 0.05, max_moves: int = 8,
                 query_timeout_s: float = QUERY_TIMEOUT_S, move_wait_s: float = MOVE_WAIT_S,
                 watch_interval_s: float = 1.0) -> None:
        self.state = state
        self.client = client
        self.interval_s = interval_s
        self.query_timeout_s, self.move_wait_s, self.watch_interval_s = query_timeout_s, move_wait_s, watch_interval_s
        self.moving: dict[asyncio.Task, Move] = {}  # moves under way, past the round that started them
        self.cooldown_s = cooldown_s
        self.headroom = headroom
        self.max_moves = max_moves
        self.last_moved: dict[str, float] = {}
        self.num_moves = 0
        self.num_failed_moves = 0
        self.num_preempted = 0
        self.num_victim_queries = 0
        self.rounds = 0
        self._tasks: list[asyncio.Task] = []
        self.watch: FrozenWatch | None = None  # the Ray actor's: restarts a frozen worker (liveness.py)

    async def round(self) -> list[Move]:
        """One look at the cluster and the moves it called for: those done within `move_wait_s`
        (the rest go on; their workers sit out the planning until they end)."""
        self.rounds += 1
        try:
            loads = await asyncio.to_thread(self.state.live_loads)
        except Exception as e:  # Redis away: nothing to plan with until it is back
            log.debug("cluster state unavailable: %s", e)
            return []
        busy = {w for m in self.moving.values() for w in (m.source, m.destination)}
        loads = {w: load for w, load in loads.items() if w not in busy}
        if len(loads) < 2:  # a move takes two workers
            return []
        await self._ask_for_victims(loads)
        now = time.monotonic()
        moves = plan_moves(loads, now, self.last_moved, self.cooldown_s, self.headroom, self.max_moves)
        tasks = [self._start_move(m) for m in moves]
        if tasks:
            await asyncio.wait(tasks, timeout=self.move_wait_s)
        cutoff = now - 10 * self.cooldown_s
        self.last_moved = {r: t for r, t in self.last_moved.items() if t > cutoff}
        return [m for m, t in zip(moves, tasks) if t.done() and t.result()]

    def _start_move(self, m: Move) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(self._move(m))
        self.moving[task] = m
        task.add_done_callback(lambda t: self.moving.pop(t, None))
        return task

    async def _ask_for_victims(self, loads: dict) -> None:
        """Heartbeats list only the requests waiting for room; a starving request that fits
        nowhere may preempt less urgent running ones, so ask the workers that run any for
        them (one call per such worker, only in a round that needs it)."""
        asks = victim_queries(loads, self.headroom)
        if not asks:
            return
        got = await asyncio.gather(*(asyncio.wait_for(self.client.running_requests(d, p), self.query_timeout_s)
                                     for d, p in asks.items()), return_exceptions=True)
        for d, running in zip(asks, got):
            if isinstance(running, BaseException):  # gone, stopped or busy: plan without it this round
                log.debug("running requests of %s unavailable: %s", d, running)
                continue
            loads[d].requests = [r for r in loads[d].requests if r.state != "running"] + list(running)
        self.num_victim_queries += len(asks)

    async def _move(self, m: Move) -> bool:
        self.last_moved[m.request_id] = time.monotonic()
        try:
            await self.client.move(m.source, m.destination, m.request_id, m.preempt)
        except FolioError as e:  # finished meanwhile, or the destination refused / died
            self.num_failed_moves += 1
            log.info("move of %s from %s to %s failed: %s", m.request_id, m.source, m.destination, e)
            return False
        except Exception:  # a fault of one move is logged; the round's other moves stand
            self.num_failed_moves += 1
            log.exception("move of %s from %s to %s failed", m.request_id, m.source, m.destination)
            return False
        self.num_moves += 1
        self.num_preempted += len(m.preempt)
        return True

    async def run(self) -> None:
        while True:
            t0 = time.monotonic()
            try:
                await self.round()
            except Exception:
                log.exception("coordinator round failed")
            await asyncio.sleep(max(self.interval_s - (time.monotonic() - t0), 0.0))

    async def run_watch(self) -> None:
        """The frozen-worker watch's own loop: it reads the live workers whatever the rounds wait
        on, and publishes the coordinator's own heartbeat (the frontends watch it: liveness.py)."""
        while True:
            try:
                live = await asyncio.to_thread(self._beat)
            except Exception as e:  # Redis away: nobody is known silent until it is back
                log.debug("cluster state unavailable: %s", e)
            else:
                self.watch.observe(live)
            await asyncio.sleep(self.watch_interval_s)

    def _beat(self) -> dict:
        live = self.state.live_loads()
        try:  # a heartbeat that cannot be written does not stop the watch
            self.state.publish_coordinator({"rounds": self.rounds, "time": time.time()},
                                           COORDINATOR_TTL_S + self.watch_interval_s)
        except Exception as e:
            log.debug("the coordinator's heartbeat was not written: %s", e)
        return live

    def start(self) -> None:
        if not self._tasks:
            loop = asyncio.get_running_loop()
            self._tasks = [loop.create_task(self.run())]
            if self.watch is not None:
                self._tasks.append(loop.create_task(self.run_watch()))

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks + list(self.moving), []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.watch is not None:
            await self.watch.stop()

    def stats(self) -> dict:
        return {"moves": self.num_moves, "failed_moves": self.num_failed_moves,
                "preempted_for_moves": self.num_preempted, "rounds": self.rounds,
                "victim_queries": self.num_victim_queries,
                "frozen_restarts": self.watch.restarts if self.watch is not None else 0}


class CoordinatorActor:
    """The Ray actor around Coordinator (see folio.cluster.launcher for its options: restarted
    when its process dies). Its rounds run on a thread of their own, started with the actor, so
    that a restarted actor goes on by itself: nobody calls `start` on a restart, and a killed
    coordinator's cluster never moved a request again (an attack, 2026-12-06)."""

    def __init__(self, redis_url: str, namespace: str, ray_namespace: str | None = None,
                 frozen_s: float | None = None, start_s: float | None = None, **kw) -> None:
        from folio.cluster.worker_client import RayWorkerClient

        client = RayWorkerClient(namespace, ray_namespace)
        self.coordinator = Coordinator(ClusterState(redis_url, namespace), client, **kw)
        bounds = {k: v for k, v in (("frozen_s", frozen_s), ("start_s", start_s)) if v is not None}
        self.coordinator.watch = FrozenWatch(client, **bounds)
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="folio-coordinator", daemon=True).start()
        self._loop.call_soon_threadsafe(self.coordinator.start)

    def _on_loop(self, fn) -> asyncio.Future:
        async def run():
            return await fn() if asyncio.iscoroutinefunction(fn) else fn()
        return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(run(), self._loop))

    async def start(self) -> None:
        await self._on_loop(self.coordinator.start)

    async def stop(self) -> None:
        await self._on_loop(self.coordinator.stop)

    async def stats(self) -> dict:
        return await self._on_loop(self.coordinator.stats)

    def pid(self) -> int:
        import os

        return os.getpid()
