"""How the router and coordinator reach workers: through Ray, or in-process (simulation).

    WorkerClient.generate(wid, req)   async iterator of StreamChunk (through Ray: `submit`,
                                      chunks back on one `subscribe` stream per worker)
    WorkerClient.attach(wid, rid)     async iterator of StreamChunk (after a migration)
    WorkerClient.abort(wid, rid)      -> bool
    WorkerClient.move(src, dst, rid, preempt)   export on src, import on dst

Errors come out as Folio's own: InvalidRequestError from the worker as is, a dead
worker as WorkerDiedError (an UnavailableError).
"""

from __future__ import annotations

import asyncio
import uuid
import weakref
from typing import AsyncIterator, Protocol

from folio.worker.errors import FolioError, UnavailableError
from folio.worker.messages import GenerateRequest, StreamChunk

STREAM_BACKPRESSURE = 2  # chunks a worker may have in flight to one reader before its stream pauses


class WorkerDiedError(UnavailableError):
    def __init__(self, worker_id: str, detail: str = "") -> None:
        super().__init__(f"worker {worker_id} died{': ' + detail if detail else ''}")
        self.worker_id = worker_id


class WorkerClient(Protocol):
    def generate(self, wid: str, req: GenerateRequest) -> AsyncIterator[StreamChunk]: ...
    def attach(self, wid: str, request_id: str) -> AsyncIterator[StreamChunk]: ...
    async def abort(self, wid: str, request_id: str) -> bool: ...
    async def move(self, src: str, dst: str, request_id: str, preempt: tuple[str, ...] = ()) -> None: ...


def actor_name(namespace: str, wid: str) -> str:
    return f"{namespace}-worker-{wid}"


class RayWorkerClient:
    """Workers are named Ray actors; a stream is an actor async generator read without
    blocking (`async for ref in gen: await ref`)."""

    def __init__(self, namespace: str = "folio", ray_namespace: str | None = None) -> None:
        self.namespace = namespace
        self.ray_namespace = ray_namespace
        self._handles: dict = {}
        self._muxes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # loop -> {wid: _Subscription}

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

    async def _stream(self, wid: str, method: str, arg) -> AsyncIterator[StreamChunk]:
        import ray

        # backpressure: the worker's stream pauses while 2 chunks wait unread here, so steps that
        # finish meanwhile queue on the worker and travel merged as one chunk (actor.py)
        gen = getattr(self.handle(wid), method).options(
            num_returns="streaming", _generator_backpressure_num_objects=STREAM_BACKPRESSURE).remote(arg)
        finished = False
        try:
            async for ref in gen:
                try:
                    chunk = await ref
                except ray.exceptions.RayTaskError as e:
                    finished = True
                    raise _unwrap(e) from None
                except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
                    finished = True
                    self._handles.pop(wid, None)
                    raise WorkerDiedError(wid, type(e).__name__) from None
                finished = chunk.finished or chunk.migrated_to is not None
                yield chunk
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
            finished = True
            self._handles.pop(wid, None)
            raise WorkerDiedError(wid, type(e).__name__) from None
        finally:
            if not finished:  # the caller went away: cancel the actor task (it aborts the request)
                try:
                    ray.cancel(gen)
                except Exception:
                    pass

    async def generate(self, wid: str, req: GenerateRequest) -> AsyncIterator[StreamChunk]:
        """The request runs on `wid` and its chunks come back on this client's one
        subscription to that worker (per event loop): one Ray message per worker step for
        all of this frontend's requests there, not one per request."""
        mux = self._mux(wid)
        rid = req.request_id
        q: asyncio.Queue = asyncio.Queue()
        mux.queues[rid] = q
        try:
            mux.start()
            await self._call(wid, "submit", req, mux.subscriber)
        except FolioError:  # refused, nothing admitted: nothing to abort (the id may be another request's)
            mux.queues.pop(rid, None)
            raise
        except BaseException:  # cancelled while submitting: it may have been admitted
            mux.queues.pop(rid, None)
            self._abort_soon(wid, rid)
            raise
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished or item.migrated_to is not None
                yield item
                if finished:
                    return
        finally:
            mux.queues.pop(rid, None)
            if not finished:  # the caller went away: free the request's blocks
                self._abort_soon(wid, rid)

    def _abort_soon(self, wid: str, rid: str) -> None:
        """Fire-and-forget abort (from a finally: nothing to await there)."""
        try:
            self.handle(wid).abort.remote(rid)
        except Exception:
            pass

    def _mux(self, wid: str) -> "_Subscription":
        loop = asyncio.get_running_loop()
        per_loop = self._muxes.setdefault(loop, {})
        mux = per_loop.get(wid)
        if mux is None:
            mux = per_loop[wid] = _Subscription(self, wid)
        return mux

    def attach(self, wid: str, request_id: str) -> AsyncIterator[StreamChunk]:
        return self._stream(wid, "attach", request_id)

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
        return await self._call(wid, "abort", request_id)

    async def move(self, src: str, dst: str, request_id: str, preempt: tuple[str, ...] = ()) -> None:
        """Export on `src` and import on `dst`; the state goes through the object store
        (the ObjectRef is passed on, never fetched here). If `dst` refuses it, it goes
        back to `src` so the request is not lost."""
        state_ref = self.handle(src).export_request.remote(request_id, dst)
        try:
            await self._call_ref(dst, "import_request", state_ref, list(preempt))
        except FolioError:
            await self._call_ref(src, "import_request", state_ref, [])
            raise

    async def _call_ref(self, wid: str, method: str, *args):
        return await self._call(wid, method, *args)


class _Subscription:
    """One long-lived `subscribe` stream from a worker, read by a task that hands each
    (request id, chunk) of every batch to that request's queue. If the stream breaks
    (the worker died), every request waiting on it gets WorkerDiedError; the next
    generate() opens a new one."""

    def __init__(self, client: RayWorkerClient, wid: str) -> None:
        self.client, self.wid = client, wid
        self.subscriber = f"sub-{uuid.uuid4().hex[:12]}"
        self.queues: dict[str, asyncio.Queue] = {}
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        import ray

        err: Exception
        try:
            gen = self.client.handle(self.wid).subscribe.options(num_returns="streaming").remote(self.subscriber)
            async for ref in gen:
                for rid, item in await ref:
                    q = self.queues.get(rid)
                    if q is not None:
                        q.put_nowait(item)
            err = WorkerDiedError(self.wid, "its stream ended")
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
            self.client._handles.pop(self.wid, None)
            err = WorkerDiedError(self.wid, type(e).__name__)
        except ray.exceptions.RayTaskError as e:
            err = _unwrap(e)
        except WorkerDiedError as e:
            err = e
        except Exception as e:  # anything else: the requests waiting here fail rather than hang
            err = UnavailableError(f"the stream from worker {self.wid} broke: {type(e).__name__}: {e}")
        for q in list(self.queues.values()):
            q.put_nowait(err)


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
        try:
            await self._w(dst).import_request(state, list(preempt))
        except FolioError:
            await self._w(src).import_request(state, [])
            raise


def _unwrap(e) -> BaseException:
    cause = getattr(e, "cause", None)
    return cause if isinstance(cause, BaseException) else e
