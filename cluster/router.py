"""The global router: picks a worker for every request and carries its stream to the end.

- Load figures come from the cluster state (Redis), cached for `refresh_s`; requests
  routed since a worker's last heartbeat count toward its load (policies.py).
- A request is never sent to a dead worker (no live heartbeat key, or a call that
  failed with the actor gone); with none alive the caller gets UnavailableError.
- The stream follows migrations: a chunk with `migrated_to` ends the stream on one
  worker and the router attaches to the next, checking that token counts continue
  exactly (no token lost or repeated).
- A worker that dies before the request streamed any token: the request is re-run on
  another worker. After tokens were streamed it fails with WorkerFailedError (re-running
  would repeat them).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import defaultdict, deque
from typing import AsyncIterator

from folio.cluster.policies import (POLICIES, Candidate, SentSince, least_loaded, power_of_two, prefix_aware,
                                    round_robin)
from folio.cluster.state import ClusterState
from folio.cluster.worker_client import WorkerClient, WorkerDiedError
from folio.worker.errors import ConfigError, InvalidRequestError, UnavailableError, WorkerFailedError
from folio.worker.hashing import DEFAULT_HASH_SEED, hash_full_blocks
from folio.worker.messages import GenerateRequest, StreamChunk, WorkerLoad

DECISIONS_KEPT = 10_000
DEAD_HOLD_S = 5.0  # a worker seen dying is skipped this long, whatever Redis still says
ID_WAIT_S = 5.0  # how long a request waits for its id's request here to end before it is refused
log = logging.getLogger("folio.router")


class Router:
    def __init__(self, state: ClusterState, client: WorkerClient, policy: str = "least-loaded",
                 refresh_s: float = 0.05, imbalance: float = 0.25, seed: int = 0,
                 hash_seed: bytes = DEFAULT_HASH_SEED) -> None:
        if policy not in POLICIES:
            raise ConfigError(f"router policy must be one of {POLICIES}, got {policy!r}")
        self.state, self.client, self.policy = state, client, policy
        self.refresh_s, self.imbalance, self.hash_seed = refresh_s, imbalance, hash_seed
        self.id_wait_s = ID_WAIT_S
        self._rng = random.Random(seed)
        self._counter = 0
        self._loads: dict[str, WorkerLoad] = {}
        self._loads_at = 0.0
        self._refreshing: asyncio.Task | None = None
        self._sent: dict[str, SentSince] = defaultdict(SentSince)  # wid -> sent since its last heartbeat
        self._live: dict[str, WorkerLoad] = {}  # the snapshot less draining workers
        self._cands: dict[str, Candidate] = {}  # wid -> its Candidate for this snapshot and sent list
        self._dead: dict[str, tuple[float, float]] = {}  # wid -> (monotonic, wall) time it was seen dying
        self._where: dict[str, str] = {}  # request id -> worker streaming it
        self._ids: dict[str, asyncio.Event] = {}  # request id -> set when its request here ends
        self.state_error: str | None = None  # why the cluster state is unreachable, while it is
        self.decisions = 0
        # time spent per routing decision, the latest ones (benchmarks): bounded, as everything kept per request
        self.decision_seconds: deque[float] = deque(maxlen=DECISIONS_KEPT)

    # ---- choosing a worker --------------------------------------------------------------
    async def live_loads(self, refresh: bool = False) -> dict[str, WorkerLoad]:
        """Live workers' loads. A stale snapshot is refreshed in the background while
        decisions go on with it (no request waits on Redis), unless `refresh` asks to wait."""
        return dict(await self._live_now(refresh))

    async def _live_now(self, refresh: bool = False) -> dict[str, WorkerLoad]:
        """live_loads() without the copy: the router's own dict, not to be changed."""
        now = time.monotonic()
        if refresh or not self._loads_at:
            # one read of Redis for every request that waits on one: 100 requests arriving
            # before the first figures made 100 reads at once, and on a loaded host those timed
            # out (0.5 s) and failed their requests with "Redis unreachable"
            if not self._refresh_in_flight():
                self._refreshing = asyncio.get_running_loop().create_task(self._refresh())
            await asyncio.shield(self._refreshing)
        elif now - self._loads_at > self.refresh_s and not self._refresh_in_flight():
            self._refreshing = asyncio.get_running_loop().create_task(self._refresh())
        if not self._dead:
            return self._live
        return {w: l for w, l in self._live.items() if not self._held_dead(w, l, now)}

    def _held_dead(self, wid: str, load: WorkerLoad, now: float) -> bool:
        """Seen dying, and no heartbeat since: Redis may still list it for a TTL. A heartbeat
        newer than the death (its restart registering again) brings it back at once."""
        dead = self._dead.get(wid)
        if dead is None:
            return False
        if now - dead[0] > DEAD_HOLD_S or load.timestamp > dead[1]:
            del self._dead[wid]
            return False
        return True

    def _refresh_in_flight(self) -> bool:
        # a task of another (finished) event loop never completes: it does not count
        t = self._refreshing
        return t is not None and not t.done() and t.get_loop() is asyncio.get_running_loop()

    async def _refresh(self) -> None:
        try:
            loads = await self.state.alive_loads()
        except Exception as e:  # Redis away: keep routing on the last figures until it is back
            self._state_failed(e)
            if not self._loads_at:
                raise UnavailableError("the cluster state (Redis) is unreachable") from None
            return
        self._state_ok()
        self._loads, self._loads_at = loads, time.monotonic()
        self._live = {w: l for w, l in loads.items() if not l.draining}
        self._cands.clear()  # new heartbeats: what was sent since them changes

    # ---- degraded mode: the cluster state (Redis) unreachable ---------------------------
    # Routing goes on with the last known loads (plus what was sent since), load-only: a
    # prefix lookup that fails counts as no match. `degraded` says so (/health, metrics).
    @property
    def degraded(self) -> bool:
        return self.state_error is not None

    def _state_failed(self, e: Exception) -> None:
        if self.state_error is None:
            log.warning("cluster state unreachable, routing on the last known loads: %s", e)
        self.state_error = f"cluster state unreachable: {type(e).__name__}: {e}"

    def _state_ok(self) -> None:
        if self.state_error is not None:
            log.warning("cluster state reachable again")
        self.state_error = None

    async def _prefix_matches(self, worker_ids: list[str], hashes: list[bytes]) -> dict[str, int]:
        if not hashes:
            return {}
        try:
            matches = await self.state.aprefix_matches(worker_ids, hashes)
        except Exception as e:
            self._state_failed(e)
            return {}
        self._state_ok()
        return matches

    def mark_dead(self, wid: str) -> None:
        self._dead[wid] = (time.monotonic(), time.time())

    def _candidate(self, w: str, l: WorkerLoad) -> Candidate:
        """`w`'s figures: its heartbeat plus what was sent to it since (kept until the
        snapshot changes or the router sends it more)."""
        c = self._cands.get(w)
        if c is None:
            sent = self._sent[w]
            sent.trim(l.timestamp)  # what that heartbeat already shows
            c = self._cands[w] = Candidate(w, l.num_kv_blocks, l.num_free_blocks, l.queued_tokens + sent.tokens,
                                           l.num_waiting + len(sent.times), l.num_swapped, l.block_size,
                                           l.num_cpu_blocks - l.num_free_cpu_blocks)
        return c

    async def pick(self, req: GenerateRequest, exclude: set[str] = frozenset()) -> str:
        t0 = time.perf_counter()
        loads = await self._live_now()
        if exclude:
            loads = {w: l for w, l in loads.items() if w not in exclude}
        if not loads:
            loads = {w: l for w, l in (await self._live_now(refresh=True)).items() if w not in exclude}
        if not loads:
            raise UnavailableError("no worker is alive to take the request")
        cands = [self._candidate(w, l) for w, l in loads.items()]
        matches: dict[str, int] = {}
        if len(cands) == 1:  # nothing to choose: no policy, and no prefix lookup (a Redis round trip)
            wid = cands[0].worker_id
        elif self.policy == "round-robin":
            wid = round_robin(cands, self._counter)
            self._counter += 1
        elif self.policy == "least-loaded":
            wid = least_loaded(cands)
        elif self.policy == "power-of-two":
            wid = power_of_two(cands, self._rng)
        else:
            block_size = cands[0].block_size
            hashes = hash_full_blocks(req.prompt_token_ids, block_size, self.hash_seed, req.params.cache_salt)
            matches = await self._prefix_matches(list(loads), hashes)
            # figures again after the await: picks made meanwhile (a burst) count, or every
            # prompt of a burst would see the same loads and go to the same worker
            cands = [self._candidate(w, l) for w, l in loads.items()]
            wid = prefix_aware(cands, matches, self.imbalance)
        # work sent there until its next heartbeat shows it: the prompt, less any cached prefix
        cached = matches.get(wid, 0) * cands[0].block_size
        self._sent[wid].add(time.time(), len(req.prompt_token_ids) - cached)
        self._cands.pop(wid, None)
        self.decisions += 1
        self.decision_seconds.append(time.perf_counter() - t0)
        return wid

    # ---- serving a request --------------------------------------------------------------
    async def generate(self, req: GenerateRequest, worker_id: str | None = None) -> AsyncIterator[StreamChunk]:
        """Stream a request's chunks from whichever workers run it. `worker_id` pins the
        first worker (operators, tests); otherwise the policy picks."""
        if req.arrival_time is None:
            req.arrival_time = time.time()
        ended = await self._claim(req.request_id)
        tried: set[str] = set()
        counts: dict[int, int] = {}
        streamed = False
        stream = previous = None
        try:
            wid = worker_id or await self.pick(req)
            stream = self.client.generate(wid, req)
            while True:
                self._where[req.request_id] = wid
                try:
                    async for chunk in stream:
                        for d in chunk.deltas:
                            before = counts.get(d.index, 0)
                            if d.num_tokens != before + len(d.token_ids):
                                raise WorkerFailedError(f"request {req.request_id}: stream from {wid} skipped or "
                                                        f"repeated tokens ({before} + {len(d.token_ids)} != "
                                                        f"{d.num_tokens})")
                            counts[d.index] = d.num_tokens
                            streamed = streamed or bool(d.token_ids)
                        if chunk.migrated_to is not None:
                            await stream.aclose()
                            previous, wid = wid, chunk.migrated_to
                            stream = self.client.attach(wid, req.request_id)
                            break
                        yield chunk
                        if chunk.finished:
                            return
                    else:
                        raise WorkerFailedError(f"the stream of {req.request_id} from {wid} ended unfinished")
                except WorkerDiedError as e:
                    self.mark_dead(e.worker_id)
                    tried.add(e.worker_id)
                    if streamed:
                        raise WorkerFailedError(f"request {req.request_id} failed: {e} after it had made tokens "
                                                f"(not run again: they would repeat)") from None
                    wid = await self.pick(req, exclude=tried)  # nothing streamed yet: run it elsewhere
                    stream = self.client.generate(wid, req)
                except UnavailableError as e:
                    if previous is None and not streamed and worker_id is None:
                        # refused, or its engine failed (the step watchdog), before this request's
                        # first token: nothing to repeat, so it runs elsewhere
                        tried.add(wid)
                        wid = await self.pick(req, exclude=tried)
                        stream = self.client.generate(wid, req)
                        continue
                    if isinstance(e, WorkerFailedError) or previous is None or wid == previous:
                        raise
                    # the destination of a migration never got it: the move went back to the source
                    wid, previous = previous, None
                    stream = self.client.attach(wid, req.request_id)
        finally:
            self._where.pop(req.request_id, None)
            try:
                if stream is not None:
                    await stream.aclose()  # a caller that went away: the worker aborts the request
            finally:  # the id is free once its stream is closed on the worker too
                if self._ids.get(req.request_id) is ended:
                    del self._ids[req.request_id]
                ended.set()

    async def _claim(self, rid: str) -> asyncio.Event:
        """Hold a request id while its request runs through this router. Another request with
        the id waits for it to end (a client that cancelled a stream and sent its id again at
        once), up to ID_WAIT_S, then is refused: two at once ran on two workers, and an abort
        of the id stopped either."""
        held = self._ids.get(rid)
        if held is not None:
            try:
                await asyncio.wait_for(held.wait(), self.id_wait_s)
            except asyncio.TimeoutError:
                pass
            except RuntimeError:  # held on an event loop that is gone (a router used from several): stale
                if self._ids.get(rid) is held:
                    del self._ids[rid]
            if rid in self._ids:  # still running, or another waiter took the id first
                raise InvalidRequestError(f"request id {rid!r} is already in use")
        ended = self._ids[rid] = asyncio.Event()
        return ended

    def abort_soon(self, request_id: str) -> None:
        """Abort a request streamed through this router now, not when its stream is closed."""
        if (wid := self._where.get(request_id)) is not None:
            self.client.abort_soon(wid, request_id)

    async def abort(self, request_id: str) -> bool:
        """Abort wherever the request runs: where this router streams it, then every other live
        worker (another replica's request; one moved before its reader read the move, 2026-12-06)."""
        wid = self._where.get(request_id)
        async def candidates():
            if wid is not None:
                yield wid
            for w in await self.live_loads(refresh=True):  # (asked only when it was not where expected)
                if w != wid:
                    yield w
        async for w in candidates():
            try:
                if await self.client.abort(w, request_id):
                    return True
            except (WorkerDiedError, InvalidRequestError):
                continue
        return False
