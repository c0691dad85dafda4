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
folio.cluster.app), and the simulated cluster runs it in-process. It never imports the
cluster: the publisher comes in as a factory.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import itertools
import logging
import os
import queue
import threading
import time
import traceback
from typing import Any, AsyncIterator, Callable

from folio.worker.errors import InvalidRequestError, RequestFailedError, UnavailableError, WorkerFailedError
from folio.worker.messages import (CompletionDelta, GenerateRequest, RequestSummary, StreamChunk, WorkerLoad,
                                   merge_chunks)
from folio.worker.data_plane import DataServer
from folio.worker.heartbeat import Heartbeat, LoadPublisher
from folio.worker.outbox import Outbox, Route, Tombstones

ATTACH_TIMEOUT_S = 10.0  # how long attach() waits for a migrated request to be imported
CLOSED_KEPT = 1024  # subscribers whose stream closed: their late submits are refused
QUEUED_IN_LOAD = 64  # the most waiting / swapped requests a heartbeat lists (the most urgent)
RUNNING_LISTED = 256  # the most running requests running_requests() returns
MOVE_TIMEOUT_S = 60.0  # an export neither confirmed nor refused by then resumes here (its mover died)
log = logging.getLogger("folio.worker")


def _wall_from_mono(t: float) -> float:
    return time.time() - (time.monotonic() - t)


def _mono_from_wall(t: float) -> float:
    return time.monotonic() - (time.time() - t)


class EngineWorker:
    def __init__(self, worker_id: str, engine_factory: Callable[[], Any],
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
        self.engine: Any = None  # built by the step thread (_step_loop), before __init__ returns
        self.heartbeat_s = heartbeat_s
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = False
        self._draining = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, asyncio.Queue] = {}  # request id -> its chunks (event-loop side)
        self._sent: dict[str, dict[int, int]] = {}  # request id -> {completion: tokens streamed}
        self._outboxes: dict[str, Outbox] = {}  # subscriber -> what waits for its stream
        self._closed: dict[str, None] = {}  # subscribers whose stream closed (bounded, oldest first)
        self._data = DataServer(self._outbox, self._close_subscriber, self.commands)  # frontends over TCP
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
                                          name=f"folio-step-{worker_id}", daemon=True)]
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
        if rid in self._streams:
            raise InvalidRequestError(f"request id {rid!r} is already in use")
        self._streams[rid] = asyncio.Queue()
        self._sent[rid] = {}
        arrival = _mono_from_wall(req.arrival_time) if req.arrival_time is not None else None
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

    # ---- a frontend's channel (outbox.py) -----------------------------------------------
    async def commands(self, subscriber: str, batch: list[tuple[str, Any]]) -> list:
        """Apply a frontend's messages in order, all in one pass between two steps:
        ("submit", GenerateRequest), ("abort", request id), ("attach", request id). Each
        request's chunks, or its error, go out on `subscriber`'s stream (subscribe()).
        Returns one result per message (an abort's: whether it found the request)."""
        self._loop = asyncio.get_running_loop()
        if not isinstance(batch, list) or not all(
                isinstance(m, tuple) and len(m) == 2 and (m[0] in ("abort", "attach", "close") or
                                                          m[0] == "submit" and isinstance(m[1], GenerateRequest))
                for m in batch):
            raise InvalidRequestError("a malformed command batch: nothing of it was applied")
        box = self._outbox(subscriber)
        results: list = [None] * len(batch)
        plan: list[tuple[int, str, Any]] = []
        for i, (kind, arg) in enumerate(batch):
            if kind == "submit":
                if self._open_route(arg, box):
                    plan.append((i, kind, arg))
            elif kind == "abort":
                plan.append((i, kind, arg))
            elif kind == "attach":
                self._loop.create_task(self._attach_route(arg, box))
            elif kind == "close" and box is not None:  # a frontend that could not connect
                self._close_subscriber(box)
        if not plan:
            return results

        def run(e):
            for i, kind, arg in plan:
                if kind == "abort":
                    results[i] = self._abort(arg)
                    continue
                try:
                    self._add(e, arg.request_id, arg, _mono_from_wall(arg.arrival_time)
                              if arg.arrival_time is not None else None)
                except Exception as err:  # refused: nothing is left behind; the error is its stream's
                    self._put(arg.request_id, err)
        try:
            await self._call(run)
        except UnavailableError as err:  # failed meanwhile
            for i, kind, arg in plan:
                if kind == "submit":
                    self._put(arg.request_id, err)
        return results

    def _outbox(self, subscriber: str) -> Outbox | None:
        if subscriber in self._closed:
            return None
        box = self._outboxes.get(subscriber)
        if box is None:
            box = self._outboxes[subscriber] = Outbox(subscriber)
        return box

    def _open_route(self, req: GenerateRequest, box: Outbox | None) -> bool:
        """The request's entry in the stream table, or its error on `box` (False)."""
        rid = req.request_id
        if box is None:  # its frontend's stream closed: nobody would read it
            return False
        err = None
        if self._draining or self.failed:
            err = UnavailableError(f"worker {self.worker_id} is {'draining' if self._draining else 'failed'}")
        elif rid in self._streams:
            err = InvalidRequestError(f"request id {rid!r} is already in use")
        if err is not None:
            box.put(rid, err)
            return False
        self._streams[rid] = Route(box, rid, self._streams, self._sent)
        self._sent[rid] = {}
        return True

    async def _attach_route(self, rid: str, box: Outbox | None) -> None:
        """A request imported here by a migration: its chunks go to `box` from now on."""
        if box is None:
            return
        await self._await_arrival(rid)
        q = self._streams.get(rid)
        if box.closed or not isinstance(q, asyncio.Queue) or self.failed:
            if not box.closed:
                box.put(rid, UnavailableError(f"request {rid!r} never arrived on worker {self.worker_id}"))
            return
        route = self._streams[rid] = Route(box, rid, self._streams, self._sent)
        while not q.empty():
            route.put_nowait(q.get_nowait())

    async def data_address(self) -> tuple[str, int, str]:
        """(host, port, token) of this worker's data plane (data_plane.py): `commands` in and
        what `subscribe` yields out, over one TCP connection per subscriber instead of Ray."""
        self._loop = asyncio.get_running_loop()
        return await self._data.address()

    async def subscribe(self, subscriber: str) -> AsyncIterator[list[tuple[str, Any]]]:
        """Every (request id, chunk or error) for `subscriber`, one list per wake-up: a
        step's outputs for one frontend as one message. Closing it aborts the subscriber's
        requests still running here."""
        self._loop = asyncio.get_running_loop()
        box = self._outbox(subscriber)
        if box is None:
            return
        try:
            while True:
                await box.ready.wait()
                batch = box.take()
                if batch:
                    yield batch
        finally:
            self._close_subscriber(box)

    def _close_subscriber(self, box: Outbox) -> None:
        """The subscriber's stream ended: its late submits are refused, its requests here aborted."""
        if box.closed:
            return
        box.closed = True
        self._outboxes.pop(box.subscriber, None)
        self._closed[box.subscriber] = None
        while len(self._closed) > CLOSED_KEPT:
            del self._closed[next(iter(self._closed))]
        for rid, sink in list(self._streams.items()):
            if isinstance(sink, Route) and sink.box is box:
                del self._streams[rid]
                self._sent.pop(rid, None)
                self._send(lambda e, rid=rid: self._abort(rid))

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
                self._send(lambda e: e.abort(rid))

    async def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks; its stream ends with finish_reason "abort"."""
        self._loop = asyncio.get_running_loop()
        return await self._call(lambda e: self._abort(request_id))

    async def export_request(self, request_id: str, destination: str):
        """Take a request off this worker (its KV to CPU tensors) for `destination`; returns
        the RequestState. The move is then settled by its mover: `finish_migration` once
        `destination` imported it (the stream here ends with `migrated_to`), or
        `cancel_migration` if it refused (the request resumes here; its stream never
        stalled on the refusal). Unsettled after MOVE_TIMEOUT_S, it resumes here."""
        self._loop = asyncio.get_running_loop()
        state = await self._call(lambda e: self._export(request_id, destination))
        token = self._moving[request_id][2]
        self._loop.call_later(MOVE_TIMEOUT_S, lambda: self._loop.create_task(self._expire_move(request_id, token)))
        return state

    async def finish_migration(self, request_id: str, destination: str) -> bool:
        """`destination` has imported the request: end its stream here with `migrated_to`.
        False if its reader left meanwhile (the mover then aborts it on `destination`)."""
        moving = self._moving.pop(request_id, None)
        if moving is None or request_id not in self._streams:
            return False
        self._put(request_id, StreamChunk(request_id, self.worker_id, [], migrated_to=destination))
        return True

    async def cancel_migration(self, request_id: str) -> bool:
        """The destination refused the request: it resumes here, on the same stream."""
        moving = self._moving.pop(request_id, None)
        if moving is None:
            return False
        if request_id not in self._streams:  # its reader left meanwhile: nothing to resume
            return False
        state = dataclasses.replace(moving[1], arrival_time=_mono_from_wall(moving[1].arrival_time))
        await self._call(lambda e: e.import_request(state))
        return True

    async def drop_import(self, request_id: str) -> bool:
        """Undo an import whose move was never announced (its reader left, or it expired
        on the source): nobody will attach to it, so its stream goes too."""
        found = await self._call(lambda e: e.abort(request_id))
        self._streams.pop(request_id, None)
        self._sent.pop(request_id, None)
        return found

    async def _expire_move(self, request_id: str, token: int) -> None:
        if self._moving.get(request_id, (None, None, None))[2] == token:
            log.warning("move of %s was never settled: it resumes on %s", request_id, self.worker_id)
            try:
                await self.cancel_migration(request_id)
            except Exception:
                log.exception("resuming %s after an unsettled move failed", request_id)

    async def import_request(self, state, preempt: list[str] = ()) -> str:
        """Admit a migrated request (into SWAPPED: the next swap-in resumes it), after
        preempting `preempt` here to make room. Its stream is then read with attach()."""
        self._loop = asyncio.get_running_loop()
        rid = state.request_id
        if rid in self._streams:
            raise InvalidRequestError(f"request id {rid!r} is already in use on {self.worker_id}")
        self._streams[rid] = asyncio.Queue()
        self._sent[rid] = {s.index: s.sent_tokens for s in state.seqs}
        state = dataclasses.replace(state, arrival_time=_mono_from_wall(state.arrival_time))

        def run(e):
            for victim in preempt:
                e.preempt_request(victim)
            rid_ = e.import_request(state)
            self._tombstones.seen(rid_)
            self.num_migrations_in += 1
            return rid_
        try:
            rid_ = await self._call(run)
        except BaseException:
            self._streams.pop(rid, None)
            self._sent.pop(rid, None)
            raise
        for ev in self._arrivals.pop(rid, []):
            ev.set()
        return rid_

    async def preempt(self, request_id: str) -> bool:
        self._loop = asyncio.get_running_loop()
        return await self._call(lambda e: e.preempt_request(request_id))

    async def load(self) -> WorkerLoad:
        return await self._call(lambda e: self._load())

    async def running_requests(self, min_priority: int | None = None) -> list[RequestSummary]:
        """The running requests of priority > `min_priority` (less urgent), least urgent first
        (at most RUNNING_LISTED): what the coordinator asks for when it plans to preempt here,
        instead of every heartbeat listing every request."""
        def run(e):
            rids = e.running_request_ids(min_priority)
            out = [RequestSummary(rid, state, prio, _wall_from_mono(arr), blocks)
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
        return await self._call(lambda e: sum(self._abort(rid) for rid in list(e.groups)))

    async def ping(self) -> str:
        return self.worker_id

    async def pid(self) -> int:
        """The process running this worker (fault tests kill it)."""
        return os.getpid()

    def shutdown(self) -> None:
        """Stop the step and publisher threads and wait for them: a thread still running
        at interpreter exit would die inside the engine's tensors."""
        self._stop = True
        self._wake.set()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=10)
        if self._heartbeat is not None:
            self._heartbeat.close()
        if self._loop is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                self._loop.call_soon_threadsafe(self._data.close)

    # ---- commands: run on the step thread, between steps --------------------------------
    def _send(self, fn: Callable) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((fn, fut))
        self._wake.set()
        return fut

    async def _call(self, fn: Callable):
        if self.failed:
            raise UnavailableError(f"worker {self.worker_id} failed: {self.failed}")
        return await asyncio.wrap_future(self._send(fn))

    def _run_commands(self) -> None:
        while True:
            try:
                fn, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            if fut.set_running_or_notify_cancel():
                try:
                    result = fn(self.engine)
                except BaseException as e:  # the caller gets it; the engine is unchanged (its contract)
                    self._flush_out()
                    fut.set_exception(e)
                else:
                    self._flush_out()  # what the command put goes out before its caller resumes
                    fut.set_result(result)

    def _add(self, e, rid: str, req: GenerateRequest, arrival: float | None) -> None:
        if self._tombstones.take(rid):  # its abort came first: it ends before it starts
            self._put(rid, StreamChunk(rid, self.worker_id, [CompletionDelta(0, [], "", 0, "abort")], finished=True))
            return
        e.add_request(rid, req.prompt_token_ids, req.params, priority=req.priority, arrival_time=arrival,
                      output_kind="delta")
        self.num_prompt_tokens += len(req.prompt_token_ids)
        self._tombstones.seen(rid)

    def _abort(self, rid: str) -> bool:
        if not self.engine.abort(rid) and self._moving.pop(rid, None) is None:
            self._tombstones.abort_unknown(rid)  # an abort that overtook its request still wins
            return False
        sent = self._sent.get(rid, {0: 0})
        self._put(rid, StreamChunk(rid, self.worker_id, [CompletionDelta(i, [], "", n, "abort")
                                                         for i, n in sorted(sent.items()) or [(0, 0)]], finished=True))
        return True

    def _export(self, rid: str, destination: str):
        state = self.engine.export_request(rid)
        state.arrival_time = _wall_from_mono(state.arrival_time)
        self.num_migrations_out += 1
        self._moving[rid] = (destination, state, next(self._move_ids))  # announced once imported there
        return state

    def _put(self, rid: str, item) -> None:
        """Queue `item` for the request's stream. The step thread's items go to the event loop
        together, once per step (and after each command); anyone else's at once. Either way
        they reach the loop in the order they were put."""
        if threading.current_thread() is self._step_thread:
            self._out.append((rid, item))
        else:
            self._post([(rid, item)])

    def _flush_out(self) -> None:
        if self._out:
            items, self._out = self._out, []
            self._post(items)

    def _post(self, items: list) -> None:
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._deliver, items)
            except RuntimeError:  # the event loop is gone (an in-process worker outliving it)
                pass

    def _deliver(self, items: list) -> None:
        for rid, item in items:
            q = self._streams.get(rid)
            if q is not None:
                q.put_nowait(item)

    # ---- the step loop ------------------------------------------------------------------
    def _step_loop(self, engine_factory: Callable[[], Any], built: concurrent.futures.Future) -> None:
        # OpenMP's thread count is per OS thread, and a new thread starts from OMP_NUM_THREADS,
        # which Ray sets to the actor's num_cpus (1 for a fractional CPU): without this the
        # forward ran on one core, at half speed, while torch.get_num_threads() said 2.
        import torch

        torch.set_num_threads(torch.get_num_threads())
        self._step_thread = threading.current_thread()
        # The engine is built here, on the thread that runs it: an engine loaded (and its
        # linear layers warmed up) on another thread left that thread's OpenMP pool beside
        # this one's, and every step ran 10-15 % slower (benchmarks/step_thread.py).
        try:
            self.engine = engine = engine_factory()
        except BaseException as e:
            built.set_exception(e)
            return
        built.set_result(None)
        next_beat = 0.0
        while not self._stop:
            self._run_commands()
            if self.failed is None and engine.has_unfinished_requests():
                self._step_started = time.monotonic()
                try:
                    outs = engine.step()
                except Exception:
                    self._fail(traceback.format_exc())
                    continue
                finally:
                    self._step_started = None
                for out in outs:
                    if out.error is not None:  # the engine failed this request alone (fault_isolation.py)
                        self._put(out.request_id, RequestFailedError(out.error))
                    else:
                        self._dispatch(out)
                self._flush_out()  # one hop to the event loop for the whole step
            else:
                self._wake.wait(0.05)
                self._wake.clear()
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + self.heartbeat_s
                self._offer_load()

    def _dispatch(self, out) -> None:
        sent = self._sent.get(out.request_id)
        if sent is None:  # its reader left (the abort it sent is on its way): nothing to stream
            return
        deltas = []
        for c in out.outputs:
            n = sent.get(c.index, 0) + len(c.token_ids)
            sent[c.index] = n
            deltas.append(CompletionDelta(c.index, list(c.token_ids), c.text, n, c.finish_reason, c.logprobs))
        m = out.metrics
        npre = m.num_preemptions if m is not None else 0
        queue_s = None
        if m is not None and m.first_scheduled_time is not None and not any(sent.get(c.index, 0) > len(c.token_ids)
                                                                            for c in out.outputs):
            queue_s = m.first_scheduled_time - m.arrival_time  # the request's first chunk
        self._put(out.request_id, StreamChunk(out.request_id, self.worker_id, deltas, out.finished, None, npre,
                                              queue_s, out.prompt_logprobs))

    def _fail(self, tb: str) -> None:
        """The engine raised inside a step: its state cannot be trusted. Every request fails
        with a clear error, the worker refuses new ones, and its heartbeat stops."""
        self.failed = tb.strip().splitlines()[-1]
        log.error("worker %s failed:\n%s", self.worker_id, tb)
        err = WorkerFailedError(f"worker {self.worker_id} failed: {self.failed}")
        for rid in list(self._streams):
            self._put(rid, err)
        self._flush_out()
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._wake_arrivals)
            except RuntimeError:
                pass
        if self.exit_on_failure_s is not None:  # the cluster restarts this process with a new engine
            t = threading.Timer(self.exit_on_failure_s, os._exit, args=(1,))
            t.daemon = True
            t.start()

    def _wake_arrivals(self) -> None:
        for evs in self._arrivals.values():
            for ev in evs:
                ev.set()

    # ---- load publishing ----------------------------------------------------------------
    def _load(self) -> WorkerLoad:
        e = self.engine
        st = e.stats()
        now = time.monotonic()
        t0, n0, rate = self._rate
        if now - t0 >= 1.0:
            rate = (e.num_generated_tokens - n0) / (now - t0)
            self._rate = (now, e.num_generated_tokens, rate)
        # the requests that wait for room, most urgent first; running ones only on request
        reqs = [RequestSummary(rid, state, prio, _wall_from_mono(arr), blocks)
                for rid, state, prio, arr, blocks in e.request_summaries(e.queued_request_ids()) if state != "running"]
        reqs.sort(key=lambda r: (r.priority, r.arrival_time, r.request_id))
        queued, least_urgent = e.queue_figures()
        return WorkerLoad(self.worker_id, time.time(), st.num_kv_blocks, st.num_free_blocks, st.num_cpu_blocks,
                          st.num_free_cpu_blocks, e.config.block_size, st.num_running,
                          st.num_waiting, st.num_swapped, queued, rate, st.num_preemptions, st.swapped_out_blocks,
                          st.swapped_in_blocks, self.num_migrations_in, self.num_migrations_out, self._draining,
                          reqs[:QUEUED_IN_LOAD],
                          {"prompt_tokens": self.num_prompt_tokens, "generation_tokens": st.num_generated_tokens,
                           "preemptions_swap": st.preemptions_by_mode.get("swap", 0),
                           "preemptions_recompute": st.preemptions_by_mode.get("recompute", 0),
                           "prefix_cache_queries": st.prefix_cache_queries, "prefix_cache_hits": st.prefix_cache_hits,
                           "cpu_usage": st.cpu_usage, "steps": e.timings.steps,
                           **{f"step_s_{k}": v for k, v in vars(e.timings).items() if k != "steps"}},
                          least_urgent)

    STEP_STALL_S = 60.0  # a step running longer than this is stuck: the worker's heartbeat lapses

    def _alive(self) -> bool:
        """For the heartbeat's keep-alive (publisher thread): the step thread runs, has not
        failed, and is not stuck in one step."""
        t = getattr(self, "_step_thread", None)
        started = self._step_started
        return (not self.failed and not self._stop and t is not None and t.is_alive()
                and (started is None or time.monotonic() - started < self.STEP_STALL_S))

    def _offer_load(self) -> None:
        if self._heartbeat is not None and not self.failed:
            self._heartbeat.beat(self._load, self.engine.kv)
