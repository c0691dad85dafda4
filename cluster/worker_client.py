"""How the router and coordinator reach workers: through Ray, or in-process (simulation).

    WorkerClient.generate(wid, req)   async iterator of StreamChunk
    WorkerClient.attach(wid, rid)     async iterator of StreamChunk (after a migration)
    WorkerClient.abort(wid, rid)      -> bool
    WorkerClient.move(src, dst, rid, preempt)   export on src, import on dst, then announce

A move is settled in this order, so that a refusal never stalls the client's stream:
export on src (the request leaves its engine; its stream stays open), import on dst,
and only then src ends the stream with `migrated_to=dst` (finish_migration). If dst
refuses or dies, src takes the request back on the same stream (cancel_migration).

Errors come out as Folio's own: InvalidRequestError from the worker as is, a dead
worker as WorkerDiedError (an UnavailableError).
"""

from __future__ import annotations

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

    def generate(self, wid: str, req: GenerateRequest) -> AsyncIterator[StreamChunk]:
        return self._stream(wid, "generate", req)

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
        """Export on `src`, import on `dst`, then announce (module docstring); the state goes
        through the object store (the ObjectRef is passed on, never fetched here)."""
        state_ref = self.handle(src).export_request.remote(request_id, dst)
        await _settle(self._call, src, dst, request_id, state_ref, preempt)


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
