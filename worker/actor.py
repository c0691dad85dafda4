"""A worker: one engine, its step loop, and the async methods the cluster calls.

    cluster (router, coordinator)           EngineWorker (a Ray actor, num_gpus=1)
    ------------------------------          ----------------------------------------------
    generate(req)  -- async generator -->   event loop: asyncio queues, one per request
    attach(id)     -- after a migration     ^ call_soon_threadsafe(a step's chunks, at once)
    commands(sub, [submit|abort|attach|close])  a frontend's channel (outbox.py): in order, applied
    data_address() -> TCP (data_plane.py) <-- one frame per wake-up for all of that frontend's
    subscribe(sub)    (the same through Ray)      requests here
    abort / export / import / preempt --->  commands ---> step thread: engine.step() loop
    running_requests(prio)  ------------->  the coordinator asks when it plans a preemption
    (Redis)  <-- heartbeat every ~100 ms --- publisher thread (heartbeat.py: O(changes))

The engine is single-threaded (LLMEngine's contract): only the step thread touches it.
Everything else sends it a command that runs between two steps, so an order from the
coordinator never lands in the middle of a step. A slow or dead Redis never stalls the
engine: the publisher thread takes the newest load and drops the rest (prefix changes
accumulate until sent).

The class is plain Python; the cluster wraps it with `ray.remote` (see
folio.cluster.launcher), and the simulated cluster runs it in-process. It never imports the
cluster: the publisher comes in as a factory. Its parts, one file each, share its state:
actor_channel.py (a frontend's channel), actor_migration.py (requests leaving and arriving),
actor_steps.py (the step thread), actor_load.py (the load it reports); this file holds the
state, the request streams and the calls the cluster makes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import os
import queue
import threading
import time
from typing import AsyncIterator, Callable

from folio.worker.errors import InvalidRequestError, UnavailableError
from folio.worker.messages import (GenerateRequest, RequestSummary, StreamChunk, WorkerLoad, merge_chunks,
                                   mono_from_wall, wall_from_mono)
from folio.worker.actor_channel import FrontendChannels
from folio.worker.actor_load import LoadReports
from folio.worker.actor_migration import Migrations
from folio.worker.actor_steps import StepLoop
from folio.worker.data_plane import MAX_FRAME, DataServer
from folio.worker.engine_core import EngineCore
from folio.worker.heartbeat import Heartbeat, LoadPublisher
from folio.worker.outbox import Outbox, Tombstones
from folio.worker.step_io import StepIO

ATTACH_TIMEOUT_S = 10.0  # how long attach() waits for a migrated request to be imported
LEAVE_WAIT_S = 5.0  # how long a request waits for the abort of its id's last request, whose reader left
RUNNING_LISTED = 256  # the most running requests running_requests() returns
log = logging.getLogger("folio.worker")


class EngineWorker(FrontendChannels, Migrations, StepLoop, LoadReports):
    def __init__(self, worker_id: str, engine_factory: Callable[[], EngineCore],
                 publisher_factory: Callable[[], LoadPublisher] | None = None, heartbeat_s: float = 0.1,
                 exit_on_failure_s: float | None = None) -> None:
        """`exit_on_failure_s`: once the engine fails (a fault no request explains), exit the
        process after this long (its requests' errors go out first) so that the cluster
        restarts the worker (Ray's max_restarts); None (in-process use): stay, refusing work."""
        self.worker_id = worker_id
        self.exit_on_failure_s = exit_on_failure_s
        self._moving: dict[str, tuple] = {}  # exported, not yet settled: rid -> (destination, state, move id)
        self._move_ids = itertools.count()
        self._arrivals: dict[str, list[asyncio.Event]] = {}  # attach() waiting for an import: rid -> events
        self._unattached: dict[str, asyncio.Queue] = {}  # imported, no reader attached yet: rid -> its stream
        self._leaving: dict[str, asyncio.Future] = {}  # rid -> the abort of a request whose reader left
        self.engine: EngineCore | None = None  # built by the step thread (_step_loop), before __init__ returns
        self.heartbeat_s = heartbeat_s
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = False
        self._draining = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, asyncio.Queue] = {}  # request id -> its chunks (event-loop side)
        self._sent: dict[str, dict[int, int]] = {}  # request id -> {completion: tokens streamed}
        self._outboxes: dict[str, Outbox] = {}  # subscriber -> what waits for its stream
        self._closed: dict[str, None] = {}  # subscribers whose stream closed (bounded, oldest first)
        # frontends over TCP: the event loop says hello, then the step thread owns the socket
        self._io = StepIO(self._apply_frame, self._conn_dropped, MAX_FRAME)
        self._data = DataServer(self._outbox, self._io.adopt)
        self._tombstones = Tombstones()  # step thread only
        self._out: list = []  # (request id, item) put by the step thread, delivered once per step
        self._step_thread: threading.Thread | None = None
        self.num_migrations_in = 0
        self.num_migrations_out = 0
        self.num_prompt_tokens = 0
        self.failed: str | None = None  # the engine's fatal error, once it has one
        self._rate = (time.monotonic(), 0, 0.0)  # (time, generated tokens then, tokens/s)
        self._step_started: float | None = None  # monotonic start of the step running now
        self._heartbeat = (Heartbeat(publisher_factory(), f"folio-pub-{worker_id}", alive=self._alive)
                           if publisher_factory is not None else None)
        built: concurrent.futures.Future = concurrent.futures.Future()
        self._threads = [threading.Thread(target=self._step_loop, args=(engine_factory, built),
                                          name=f"folio-step-{worker_id}", daemon=True),
                         threading.Thread(target=self._watch, name=f"folio-watch-{worker_id}", daemon=True)]
        for t in self._threads:
            t.start()
        try:
            built.result()  # the factory's exception, if it raised (the thread has ended then)
        except BaseException:
            if self._heartbeat is not None:
                self._heartbeat.close()
            raise

    # ---- the async API ------------------------------------------------------------------
    async def generate(self, req: GenerateRequest) -> AsyncIterator[StreamChunk]:
        """Run a request and yield its chunks until it finishes or migrates. Raises
        InvalidRequestError (nothing is left behind) or UnavailableError (draining / failed).
        Closing or cancelling the generator aborts the request."""
        self._loop = asyncio.get_running_loop()
        if self._draining or self.failed:
            raise UnavailableError(f"worker {self.worker_id} is {'draining' if self._draining else 'failed'}")
        rid = req.request_id
        if rid in self._leaving:  # its reader left the id's last request: that one's abort goes first, or
            # the chunks of the steps it ran meanwhile would come to this stream (the id's)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(self._leaving[rid]), LEAVE_WAIT_S)
        if rid in self._streams:
            raise InvalidRequestError(f"request id {rid!r} is already in use")
        self._streams[rid] = asyncio.Queue()
        self._sent[rid] = {}
        arrival = mono_from_wall(req.arrival_time) if req.arrival_time is not None else None
        try:
            await self._call(lambda e: self._add(e, rid, req, arrival))
        except BaseException:
            self._streams.pop(rid, None)
            self._sent.pop(rid, None)
            # cancelled while the step thread was adding it: it may be in the engine already
            self._send(lambda e: e.abort(rid))
            raise
        # closed here, not by the garbage collector: its `finally` forgets the request and
        # aborts it when the reader went away
        async with contextlib.aclosing(self._drain_stream(rid)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def attach(self, request_id: str) -> AsyncIterator[StreamChunk]:
        """The stream of a request imported here by a migration (waits for the import)."""
        self._loop = asyncio.get_running_loop()
        await self._await_arrival(request_id)
        if request_id not in self._streams or self.failed:
            raise UnavailableError(f"request {request_id!r} never arrived on worker {self.worker_id}")
        self._unattached.pop(request_id, None)
        async with contextlib.aclosing(self._drain_stream(request_id)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def _await_arrival(self, request_id: str) -> None:
        if request_id in self._streams or self.failed:
            return
        # a move announces itself only after the import here (see export_request), so this
        # waits only for a reader that raced ahead; woken by the import or a failure
        ev = asyncio.Event()
        self._arrivals.setdefault(request_id, []).append(ev)
        try:
            await asyncio.wait_for(ev.wait(), ATTACH_TIMEOUT_S)
        except asyncio.TimeoutError:
            pass
        finally:
            waiting = self._arrivals.get(request_id, [])
            if ev in waiting:
                waiting.remove(ev)
            if not waiting:
                self._arrivals.pop(request_id, None)

    async def _drain_stream(self, rid: str) -> AsyncIterator[StreamChunk]:
        q = self._streams[rid]
        done = False
        pending = None
        try:
            while True:
                chunk, pending = (pending if pending is not None else await q.get()), None
                if isinstance(chunk, BaseException):
                    done = True
                    raise chunk
                # steps that ran while the reader was busy go out as one chunk: under load the
                # per-chunk cost of every hop (Ray, frontend, SSE) is paid once, not per step
                while not (chunk.finished or chunk.migrated_to is not None) and not q.empty():
                    nxt = q.get_nowait()
                    if isinstance(nxt, BaseException) or nxt.migrated_to is not None:
                        pending = nxt  # a migration marker stays a chunk of its own (no tokens)
                        break
                    chunk = merge_chunks(chunk, nxt)
                done = chunk.finished or chunk.migrated_to is not None
                yield chunk
                if done:
                    return
        finally:
            if self._streams.get(rid) is q:
                del self._streams[rid]
                self._sent.pop(rid, None)
            if not done:  # the caller went away (cancelled, closed, disconnected): free its blocks
                self._leave(rid)

    def _leave(self, rid: str) -> None:
        """Abort a request whose reader left; until the step thread has applied it (and every
        chunk made before it reached the loop), a new request with the id waits (generate)."""
        left = asyncio.wrap_future(self._send(lambda e: e.abort(rid)), loop=self._loop)
        self._leaving[rid] = left

        def forget(f: asyncio.Future) -> None:
            if not f.cancelled():
                f.exception()  # retrieved: a failed worker's refusal is no one's error
            if self._leaving.get(rid) is f:
                del self._leaving[rid]
        left.add_done_callback(forget)

    async def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks; its stream ends with finish_reason "abort"."""
        self._loop = asyncio.get_running_loop()
        return await self._call(lambda e: self._abort(request_id))

    async def load(self) -> WorkerLoad:
        return await self._call(lambda e: self._load())

    async def running_requests(self, min_priority: int | None = None) -> list[RequestSummary]:
        """The running requests of priority > `min_priority` (less urgent), least urgent first
        (at most RUNNING_LISTED): what the coordinator asks for when it plans to preempt here,
        instead of every heartbeat listing every request."""
        def run(e):
            rids = e.running_request_ids(min_priority)
            out = [RequestSummary(request_id=rid, state=state, priority=prio, arrival_time=wall_from_mono(arr),
                                  num_blocks=blocks)
                   for rid, state, prio, arr, blocks in e.request_summaries(rids) if state == "running"]
            out.sort(key=lambda r: (-r.priority, -r.arrival_time, r.request_id))
            return out[:RUNNING_LISTED]
        return await self._call(run)

    async def stats(self) -> dict:
        """The engine's figures plus the worker's own (migrations)."""
        def run(e):
            d = dict(vars(e.stats()))
            d.update(worker_id=self.worker_id, num_migrations_in=self.num_migrations_in,
                     num_migrations_out=self.num_migrations_out, num_streams=len(self._streams),
                     num_subscribers=len(self._outboxes))
            return d
        return await self._call(run)

    async def check_invariants(self) -> None:
        """Raise AssertionError if any block is leaked or a ref count is wrong (tests)."""
        await self._call(lambda e: e.check_invariants())

    async def drain(self, grace_s: float) -> int:
        """Stop admitting; wait up to `grace_s` for in-flight requests, then abort the rest.
        Returns how many were aborted."""
        self._loop = asyncio.get_running_loop()
        self._draining = True
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and await self._call(lambda e: e.has_unfinished_requests()):
            await asyncio.sleep(0.02)
        return await self._call(lambda e: sum(self._abort(rid) for rid in e.request_ids()))

    async def ping(self) -> str:
        return self.worker_id

    async def pid(self) -> int:
        """The process running this worker (fault tests kill it)."""
        return os.getpid()

    async def process_ids(self) -> list[int]:
        """This process, then each follower rank's (a tensor-parallel group's; fault tests)."""
        return await self._call(lambda e: e.process_ids())

    def shutdown(self) -> None:
        """Stop the step and publisher threads and wait for them: a thread still running
        at interpreter exit would die inside the engine's tensors."""
        self._stop = True
        self._io.kick()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=10)
        if self._heartbeat is not None:
            self._heartbeat.close()
        if self._loop is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                self._loop.call_soon_threadsafe(self._data.close)
