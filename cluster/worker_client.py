"""How the router and coordinator reach workers: through Ray, or in-process (simulation).

    WorkerClient.generate(wid, req)   async iterator of StreamChunk
    WorkerClient.attach(wid, rid)     async iterator of StreamChunk (after a migration)
    WorkerClient.abort(wid, rid)      -> bool
    WorkerClient.move(src, dst, rid, preempt)   export on src, import on dst, then announce

A move is settled in this order, so that a refusal never stalls the client's stream:
export on src (the request leaves its engine; its stream stays open), import on dst,
and only then src ends the stream with `migrated_to=dst` (finish_migration). If dst
refuses or dies, src takes the request back on the same stream (cancel_migration).

Through Ray, a frontend's requests on one worker share one channel (`_Channel`), one TCP
connection to the worker (worker/data_plane.py; its address and token come over Ray): its
submits, aborts and attaches go down it in order as batches (one in flight, awaited), and
every chunk of all of them comes back on it, one frame per worker step: no Ray hop per
request or step. A reader that leaves queues its abort on that channel at once (no await,
nothing to lose), behind its own submit: the worker cannot miss it. Closing the connection
aborts everything the frontend still had running on that worker.

Errors come out as Folio's own: InvalidRequestError from the worker as is, a dead
worker as WorkerDiedError (an UnavailableError).
"""

from __future__ import annotations

import asyncio
import uuid
import weakref
from collections import deque
from typing import AsyncIterator, Protocol

from folio.worker import data_plane
from folio.worker.errors import FolioError, InvalidRequestError, UnavailableError
from folio.worker.messages import GenerateRequest, StreamChunk, merge_chunks
from folio.worker.outbox import terminal

CLOSE_FLUSH_S = 5.0  # how long a frontend that cannot connect waits to close its subscriber over Ray


class WorkerDiedError(UnavailableError):
    def __init__(self, worker_id: str, detail: str = "") -> None:
        super().__init__(f"worker {worker_id} died{': ' + detail if detail else ''}")
        self.worker_id = worker_id


class WorkerClient(Protocol):
    def generate(self, wid: str, req: GenerateRequest) -> AsyncIterator[StreamChunk]: ...
    def attach(self, wid: str, request_id: str) -> AsyncIterator[StreamChunk]: ...
    async def abort(self, wid: str, request_id: str) -> bool: ...
    async def move(self, src: str, dst: str, request_id: str, preempt: tuple[str, ...] = ()) -> None: ...
    async def running_requests(self, wid: str, min_priority: int | None = None) -> list: ...


def actor_name(namespace: str, wid: str) -> str:
    return f"{namespace}-worker-{wid}"


class RayWorkerClient:
    """Workers are named Ray actors, reached through one `_Channel` per (event loop, worker):
    a request's stream is its share of the channel's subscription, demultiplexed here."""

    def __init__(self, namespace: str = "folio", ray_namespace: str | None = None) -> None:
        self.namespace = namespace
        self.ray_namespace = ray_namespace
        self._handles: dict = {}
        self._channels: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # loop -> {wid: _Channel}

    def handle(self, wid: str):
        import ray

        h = self._handles.get(wid)
        if h is None:
            try:
                h = ray.get_actor(actor_name(self.namespace, wid), namespace=self.ray_namespace)
            except ValueError as e:
                raise WorkerDiedError(wid, "no such actor") from e
            self._handles[wid] = h
        return h

    async def generate(self, wid: str, req: GenerateRequest) -> AsyncIterator[StreamChunk]:
        async for chunk in self._channel(wid).stream(req.request_id, ("submit", req)):
            yield chunk

    async def attach(self, wid: str, request_id: str) -> AsyncIterator[StreamChunk]:
        async for chunk in self._channel(wid).stream(request_id, ("attach", request_id)):
            yield chunk

    def _channel(self, wid: str) -> "_Channel":
        per_loop = self._channels.setdefault(asyncio.get_running_loop(), {})
        ch = per_loop.get(wid)
        if ch is None or ch.dead is not None:
            ch = per_loop[wid] = _Channel(self, wid)
        return ch

    def _live_channel(self, wid: str) -> "_Channel | None":
        ch = self._channels.get(asyncio.get_running_loop(), {}).get(wid)
        return ch if ch is not None and ch.dead is None else None

    async def _call(self, wid: str, method: str, *args):
        import ray

        try:
            return await getattr(self.handle(wid), method).remote(*args)
        except ray.exceptions.RayTaskError as e:
            raise _unwrap(e) from None
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
            self._handles.pop(wid, None)
            raise WorkerDiedError(wid, type(e).__name__) from None

    async def abort(self, wid: str, request_id: str) -> bool:
        ch = self._live_channel(wid)
        if ch is not None:  # behind whatever this frontend sent there before (its submit)
            return bool(await ch.call(("abort", request_id)))
        return await self._call(wid, "abort", request_id)

    async def move(self, src: str, dst: str, request_id: str, preempt: tuple[str, ...] = ()) -> None:
        """Export on `src`, import on `dst`, then announce (module docstring); the state goes
        through the object store (the ObjectRef is passed on, never fetched here)."""
        state_ref = self.handle(src).export_request.remote(request_id, dst)
        await _settle(self._call, src, dst, request_id, state_ref, preempt)

    async def running_requests(self, wid: str, min_priority: int | None = None) -> list:
        return await self._call(wid, "running_requests", min_priority)


class _Inbox:
    """One request's chunks at the frontend, merged while its reader is behind."""

    def __init__(self) -> None:
        self.items: deque = deque()
        self.ready = asyncio.Event()

    def put(self, item) -> None:
        last = self.items[-1] if self.items else None
        if (isinstance(last, StreamChunk) and isinstance(item, StreamChunk) and not terminal(last)
                and item.migrated_to is None):
            self.items[-1] = merge_chunks(last, item)
        else:
            self.items.append(item)
        self.ready.set()

    async def get(self):
        while not self.items:
            self.ready.clear()
            await self.ready.wait()
        return self.items.popleft()


class _Channel:
    """This frontend's (event loop's) channel to one worker: one TCP connection carrying an
    ordered sender of command batches and the reader of the worker's frames, demultiplexed
    per request. If either side sees the worker die, every request on it gets
    WorkerDiedError and the next request opens a new channel."""

    def __init__(self, client: RayWorkerClient, wid: str) -> None:
        self.client, self.wid = client, wid
        self.subscriber = f"fe-{uuid.uuid4().hex[:16]}"
        self.inboxes: dict[str, _Inbox] = {}
        self.outgoing: list = []  # (message, future or None), not yet sent
        self.inflight: list = []  # the batch sent, its results not back yet
        self.wake = asyncio.Event()
        self.dead: BaseException | None = None
        loop = asyncio.get_running_loop()
        self.connected: asyncio.Future = loop.create_future()  # the writer, once the hello went out
        self.results: asyncio.Future | None = None  # the in-flight batch's results
        self.seq = 0
        self.reader = loop.create_task(self._read())
        self.sender = loop.create_task(self._send_loop())

    def send(self, msg) -> None:
        """Queue a message (no await: safe in a `finally`); the sender keeps the order."""
        self.outgoing.append((msg, None))
        self.wake.set()

    async def call(self, msg):
        fut = asyncio.get_running_loop().create_future()
        self.outgoing.append((msg, fut))
        self.wake.set()
        return await fut

    async def stream(self, rid: str, msg) -> AsyncIterator[StreamChunk]:
        if self.dead is not None:
            raise self.dead
        if rid in self.inboxes:
            raise InvalidRequestError(f"request id {rid!r} is already in use")
        box = self.inboxes[rid] = _Inbox()
        self.send(msg)
        finished = False
        try:
            while True:
                item = await box.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished or item.migrated_to is not None
                yield item
                if finished:
                    return
        finally:
            if self.inboxes.get(rid) is box:
                del self.inboxes[rid]
            if not finished and self.dead is None:  # the reader left: free its blocks
                self.send(("abort", rid))

    async def _send_loop(self) -> None:
        try:
            writer = await asyncio.shield(self.connected)
        except FolioError:  # never connected: _break failed what was queued
            return
        while True:
            while not self.outgoing:
                self.wake.clear()
                await self.wake.wait()
            batch, self.outgoing = self.outgoing, []
            self.inflight, self.seq = batch, self.seq + 1
            self.results = asyncio.get_running_loop().create_future()
            data_plane.write_frame(writer, (self.seq, [m for m, _ in batch]))
            try:
                results = await self.results
            except Exception as e:  # the worker refused the batch: not one message was applied
                self._fail_batch(batch, e)
                continue
            finally:
                self.inflight = []
            for (_, fut), res in zip(batch, results):
                if fut is not None and not fut.done():
                    fut.set_result(res)

    def _fail_batch(self, batch: list, err: BaseException) -> None:
        for (kind, arg), fut in batch:
            if fut is not None and not fut.done():
                fut.set_exception(err)
            elif kind in ("submit", "attach"):
                box = self.inboxes.get(arg.request_id if kind == "submit" else arg)
                if box is not None:
                    box.put(err)

    async def _read(self) -> None:
        writer = None
        try:
            host, port, token = await self.client._call(self.wid, "data_address")
            try:
                reader, writer = await data_plane.connect(host, port, token, self.subscriber)
            except OSError as e:  # the worker answers Ray but its data port is out of reach
                asyncio.get_running_loop().create_task(self._close_over_ray())
                raise WorkerDiedError(self.wid, f"its data connection failed: {e}") from None
            self.connected.set_result(writer)
            while True:
                frame = await data_plane.read_frame(reader)
                if frame[0] == "c":
                    for rid, item in frame[1]:
                        box = self.inboxes.get(rid)
                        if box is not None:
                            box.put(item)
                elif self.results is not None and not self.results.done() and frame[1] == self.seq:
                    if frame[0] == "r":
                        self.results.set_result(frame[2])
                    else:
                        self.results.set_exception(frame[2])
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):  # closed by the worker, or it died
            self.client._handles.pop(self.wid, None)
            err: BaseException = WorkerDiedError(self.wid, "its data connection closed")
        except FolioError as e:  # WorkerDiedError, or the worker's own refusal
            err = e
        except asyncio.CancelledError:
            self._break(WorkerDiedError(self.wid, "the frontend's channel closed"))
            raise
        finally:
            if writer is not None:
                writer.close()  # the worker sees EOF and aborts this subscriber's requests
        self._break(err)

    async def _close_over_ray(self) -> None:
        """A frontend that cannot reach the worker's data port: the outbox that its submits
        would have opened there must not wait for a connection forever."""
        try:
            await asyncio.wait_for(self.client._call(self.wid, "commands", self.subscriber, [("close", "")]),
                                   CLOSE_FLUSH_S)
        except BaseException:
            pass

    def _break(self, err: BaseException) -> None:
        if self.dead is not None:
            return
        self.dead = err
        if not self.connected.done():
            self.connected.set_exception(err)
            self.connected.exception()  # (retrieved: the sender may be gone before it looks)
        self._fail_batch(self.inflight, err)
        self._fail_batch(self.outgoing, err)
        self.outgoing, self.inflight = [], []
        for box in self.inboxes.values():
            box.put(err)
        for t in (self.reader, self.sender):
            if t is not asyncio.current_task() and not t.done():
                t.cancel()


class LocalWorkerClient:
    """In-process EngineWorker objects (the simulated cluster and its benchmark)."""

    def __init__(self, workers: dict) -> None:
        self.workers = workers

    def _w(self, wid: str):
        w = self.workers.get(wid)
        if w is None:
            raise WorkerDiedError(wid, "unknown")
        return w

    def generate(self, wid: str, req: GenerateRequest) -> AsyncIterator[StreamChunk]:
        return self._w(wid).generate(req)

    def attach(self, wid: str, request_id: str) -> AsyncIterator[StreamChunk]:
        return self._w(wid).attach(request_id)

    async def abort(self, wid: str, request_id: str) -> bool:
        return await self._w(wid).abort(request_id)

    async def move(self, src: str, dst: str, request_id: str, preempt: tuple[str, ...] = ()) -> None:
        state = await self._w(src).export_request(request_id, dst)
        await _settle(self._call, src, dst, request_id, state, preempt)

    async def running_requests(self, wid: str, min_priority: int | None = None) -> list:
        return await self._w(wid).running_requests(min_priority)

    async def _call(self, wid: str, method: str, *args):
        return await getattr(self._w(wid), method)(*args)


async def _settle(call, src: str, dst: str, request_id: str, state, preempt) -> None:
    """Import on `dst`, then have `src` announce the move; on a refusal `src` resumes it."""
    try:
        await call(dst, "import_request", state, list(preempt))
    except FolioError:
        await call(src, "cancel_migration", request_id)
        raise
    if not await call(src, "finish_migration", request_id, dst):
        await call(dst, "drop_import", request_id)  # its reader left meanwhile (or the move expired)


def _unwrap(e) -> BaseException:
    cause = getattr(e, "cause", None)
    return cause if isinstance(cause, BaseException) else e
