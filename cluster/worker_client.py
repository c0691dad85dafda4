"""How the router and coordinator reach workers: through Ray, or in-process (simulation).

    WorkerClient.generate(wid, req)   async iterator of StreamChunk
    WorkerClient.attach(wid, rid)     async iterator of StreamChunk (after a migration)
    WorkerClient.abort(wid, rid)      -> bool
    WorkerClient.move(src, dst, rid, preempt)   export on src, import on dst, then announce

A move is settled in this order, so that a refusal never stalls the client's stream:
export on src (the request leaves its engine; its stream stays open), import on dst,
and only then src ends the stream with `migrated_to=dst` (finish_migration). If dst
refuses or dies, src takes the request back on the same stream (cancel_migration).

Through Ray, a frontend's requests on one worker share one channel (channel.py: one TCP
connection, commands down it in order, every chunk back on it; no Ray hop per request or
step); Ray carries the rest (the data port's address, migrations, the coordinator's calls).

Errors come out as Folio's own: InvalidRequestError from the worker as is, a dead
worker as WorkerDiedError (an UnavailableError), a call that needed another actor which
died (an import whose source was killed mid-export) as UnavailableError.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from typing import AsyncIterator, Protocol

from folio.cluster.channel import Channel, WorkerDiedError
from folio.worker.errors import FolioError, UnavailableError
from folio.worker.messages import GenerateRequest, StreamChunk


class WorkerClient(Protocol):
    def generate(self, wid: str, req: GenerateRequest) -> AsyncIterator[StreamChunk]: ...
    def attach(self, wid: str, request_id: str) -> AsyncIterator[StreamChunk]: ...
    async def abort(self, wid: str, request_id: str) -> bool: ...
    def abort_soon(self, wid: str, request_id: str) -> None: ...
    def cut(self, err: BaseException) -> None: ...
    async def move(self, src: str, dst: str, request_id: str, preempt: tuple[str, ...] = ()) -> None: ...
    async def running_requests(self, wid: str, min_priority: int | None = None) -> list: ...


def actor_name(namespace: str, wid: str) -> str:
    return f"{namespace}-worker-{wid}"


class RayWorkerClient:
    """Workers are named Ray actors, reached through one `Channel` per (event loop, worker):
    a request's stream is its share of the channel's subscription, demultiplexed here."""

    def __init__(self, namespace: str = "folio", ray_namespace: str | None = None) -> None:
        self.namespace = namespace
        self.ray_namespace = ray_namespace
        self._handles: dict = {}
        self._channels: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # loop -> {wid: Channel}
        self._dropping: set[asyncio.Task] = set()  # drop_moved's calls under way
        self.cut_with: BaseException | None = None  # set by `cut`: every stream after it fails with it

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
        # closed with this generator, not later by the garbage collector: its abort must go out
        # (and its id be held) before the caller's next request, which may reuse the id
        async with contextlib.aclosing(self._channel(wid).stream(req.request_id, ("submit", req))) as chunks:
            async for chunk in chunks:
                yield chunk

    async def attach(self, wid: str, request_id: str) -> AsyncIterator[StreamChunk]:
        async with contextlib.aclosing(self._channel(wid).stream(request_id, ("attach", request_id))) as chunks:
            async for chunk in chunks:
                yield chunk

    def _channel(self, wid: str) -> "Channel":
        per_loop = self._channels.setdefault(asyncio.get_running_loop(), {})
        ch = per_loop.get(wid)
        if ch is None or ch.dead is not None:
            ch = per_loop[wid] = Channel(self, wid)
        return ch

    def _live_channel(self, wid: str) -> "Channel | None":
        ch = self._channels.get(asyncio.get_running_loop(), {}).get(wid)
        return ch if ch is not None and ch.dead is None else None

    async def call(self, wid: str, method: str, *args):
        """A Ray call to worker `wid`'s actor, its errors as Folio's own (WorkerDiedError when it died)."""
        import ray

        try:
            return await getattr(self.handle(wid), method).remote(*args)
        except ray.exceptions.RayTaskError as e:
            err = _unwrap(e)
            if isinstance(err, ray.exceptions.RayActorError):  # another actor died (an input's maker)
                raise UnavailableError(f"{method} on {wid}: an actor it needed died ({type(err).__name__})") from None
            raise err from None
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
            self.forget(wid)
            raise WorkerDiedError(wid, type(e).__name__) from None

    async def restart(self, wid: str) -> None:
        """Kill worker `wid`'s process, frozen or not; Ray restarts it (max_restarts)."""
        import ray

        h = self.handle(wid)
        self.forget(wid)
        ray.kill(h, no_restart=False)

    def forget(self, wid: str) -> None:
        """Drop the cached actor handle of a worker seen dead (the next call looks it up again)."""
        self._handles.pop(wid, None)

    async def abort(self, wid: str, request_id: str) -> bool:
        ch = self._live_channel(wid)
        if ch is not None:  # behind whatever this frontend sent there before (its submit)
            return bool(await ch.call(("abort", request_id)))
        return await self.call(wid, "abort", request_id)

    def abort_soon(self, wid: str, request_id: str) -> None:
        """Abort a request streamed here, without waiting (Channel.abort_soon)."""
        ch = self._live_channel(wid)
        if ch is not None:
            ch.abort_soon(request_id)

    def cut(self, err: BaseException) -> None:
        """End every request streamed through this client with `err`, each aborted on its worker
        (Channel.cut), on whichever event loop its channel is; a stream opened after (an HTTP
        request whose body came in after the cut, a move's attach) fails with it at once."""
        self.cut_with = err
        here = asyncio.get_running_loop()
        for loop, channels in list(self._channels.items()):
            for ch in list(channels.values()):
                if loop is here:
                    ch.cut(err)
                elif not loop.is_closed():
                    loop.call_soon_threadsafe(ch.cut, err)

    def channel_workers(self) -> set[str]:
        """The workers this client has a channel to, on any event loop."""
        return {w for channels in list(self._channels.values()) for w in list(channels)}

    def cut_silent(self, wid: str, bound_s: float) -> int:
        """Fail the requests on `wid`'s channels that have carried nothing for `bound_s` (its
        heartbeat lapsed as long: liveness.SilentChannelWatch); how many channels it looked at."""
        here, n = asyncio.get_running_loop(), 0
        self.forget(wid)  # (its cached actor handle: looked up again, as after a death)
        for loop, channels in list(self._channels.items()):
            ch = channels.get(wid)
            if ch is None or ch.dead is not None:
                continue
            n += 1
            if loop is here:
                ch.cut_if_silent(bound_s)
            elif not loop.is_closed():
                loop.call_soon_threadsafe(ch.cut_if_silent, bound_s)
        return n

    def drop_moved(self, wid: str, request_id: str) -> None:
        """A request moved to `wid` whose reader left before reading the move: nobody will
        attach to it there, so its import is dropped (aborted, its stream gone), without waiting."""
        task = asyncio.get_running_loop().create_task(self._drop(wid, request_id))
        self._dropping.add(task)
        task.add_done_callback(self._dropping.discard)

    async def _drop(self, wid: str, request_id: str) -> None:
        with contextlib.suppress(Exception):  # (a worker gone took the request with it)
            await self.call(wid, "drop_import", request_id)

    async def move(self, src: str, dst: str, request_id: str, preempt: tuple[str, ...] = ()) -> None:
        """Export on `src`, import on `dst`, then announce (module docstring); the state goes
        through the object store (the ObjectRef is passed on, never fetched here)."""
        state_ref = self.handle(src).export_request.remote(request_id, dst)
        await _settle(self.call, src, dst, request_id, state_ref, preempt)

    async def running_requests(self, wid: str, min_priority: int | None = None) -> list:
        return await self.call(wid, "running_requests", min_priority)


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

    def abort_soon(self, wid: str, request_id: str) -> None:
        """Nothing: in-process streams have no channel to jump (their close aborts them)."""

    def cut(self, err: BaseException) -> None:
        """Nothing: in-process workers serve no frontend replica that Serve drains."""

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
