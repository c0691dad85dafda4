"""A frontend's end of the data plane (worker/data_plane.py): one channel per (event loop, worker). Submits, aborts and
attaches go down its TCP connection in order as batches (one in flight, awaited); every chunk of the frontend's
requests there comes back on it, one frame per worker step, and is put in its request's Inbox (merged while the
reader is behind). A reader that leaves queues its abort on the channel at once, behind its own submit; one that
leaves before reading its request's move has the move's import dropped on its destination instead
(RayWorkerClient.drop_moved: an abort here found nothing, and the request ran on there, unread, to its end, its id
held for good: an attack of stalled gRPC streams, 2026-12-06). RayWorkerClient (worker_client.py) opens them; the
address and token of the worker's data port come over Ray.

Request ids are demultiplexed by name, so an id whose reader left is held ("draining") until the worker's last item
for it comes back (its abort's final chunk, its finish, a migration, an error): a new request under the same id
meanwhile waits for it (up to DRAIN_WAIT_S, then "already in use"). Without the hold, a client that cancelled a
stream and sent its id again got the old request's final chunk on the new stream, which the router read as a worker
that skipped tokens: UNAVAILABLE "no worker is alive to take the request"."""

from __future__ import annotations

import asyncio
import copy
import time
import uuid
from collections import deque
from typing import AsyncIterator

from folio.worker import data_plane
from folio.worker.errors import FolioError, InvalidRequestError, UnavailableError
from folio.worker.messages import StreamChunk, merge_chunks
from folio.worker.outbox import terminal

CLOSE_FLUSH_S = 5.0  # how long a frontend that cannot connect waits to close its subscriber over Ray
DRAIN_WAIT_S = 5.0  # how long a request waits for its id's previous request to end on the worker
MAX_DRAINING = 4096  # ids held at once; past it the oldest half are let go


class WorkerDiedError(UnavailableError):
    def __init__(self, worker_id: str, detail: str = "") -> None:
        super().__init__(f"worker {worker_id} died{': ' + detail if detail else ''}")
        self.worker_id = worker_id


class Inbox:
    """One request's chunks at the frontend, merged while its reader is behind."""

    def __init__(self) -> None:
        self.items: deque = deque()
        self.ready = asyncio.Event()
        self.aborted = False  # its abort went out ahead of its stream's close (Channel.abort_soon)

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


class Channel:
    """This frontend's (event loop's) channel to one worker: one TCP connection carrying an
    ordered sender of command batches and the reader of the worker's frames, demultiplexed
    per request. If either side sees the worker die, every request on it gets
    WorkerDiedError and the next request opens a new channel."""

    def __init__(self, client, wid: str) -> None:
        """`client`: a RayWorkerClient (its `call` and `forget`)."""
        self.client, self.wid = client, wid
        self.subscriber = f"fe-{uuid.uuid4().hex[:16]}"
        self.inboxes: dict[str, Inbox] = {}
        self.draining: dict[str, asyncio.Event] = {}  # ids whose reader left before their last item came
        self.outgoing: list = []  # (message, future or None), not yet sent
        self.inflight: list = []  # the batch sent, its results not back yet
        self.wake = asyncio.Event()
        self.dead: BaseException | None = None
        loop = asyncio.get_running_loop()
        self.connected: asyncio.Future = loop.create_future()  # the writer, once the hello went out
        self.results: asyncio.Future | None = None  # the in-flight batch's results
        self.seq, self.heard = 0, time.monotonic()  # heard: the worker's last frame here (or the channel's start)
        self.reader = loop.create_task(self._read())
        self.sender = loop.create_task(self._send_loop())

    def send(self, msg) -> None:
        """Queue a message (no await: safe in a `finally`); the sender keeps the order. An abort
        whose request's submit (or attach) is already out goes out at once, alone, in a batch
        no one waits on (seq 0: its reply is dropped), ahead of what is queued for other
        requests and while another batch awaits its reply: a client gone must not wait a
        round trip (and every frame the worker sent before that reply) to stop its request."""
        if msg[0] == "abort" and self.dead is None and self.connected.done() and not self.connected.exception() \
                and not self.connected.result().is_closing() \
                and not any(m[0] in ("submit", "attach") and _rid(m) == msg[1] for m, _ in self.outgoing):
            # (closing: the worker reset it, and the reader has yet to see it: uvloop raises on a write)
            data_plane.write_frame(self.connected.result(), (0, [msg]))
            return
        self.outgoing.append((msg, None))
        self.wake.set()

    def abort_soon(self, rid: str) -> None:
        """Abort `rid` now, ahead of its stream's close (which then sends nothing more): its
        client is known gone (an HTTP connection lost) while the stream's reader has yet to see it."""
        box = self.inboxes.get(rid)
        if box is None or box.aborted:
            return
        moved = _moved_to(box)
        if moved is not None:
            box.aborted = True
            self.client.drop_moved(moved, rid)
        elif self.dead is None and not any(terminal(i) for i in box.items):
            box.aborted = True
            self.send(("abort", rid))

    def cut(self, err: BaseException) -> None:
        """End every request's stream here with `err` (a frontend replica's drain at its end:
        its clients get an error they can act on, not a connection cut mid-answer), each aborted
        on the worker first: a stream that raises is finished, and its close sends nothing."""
        for rid, box in list(self.inboxes.items()):
            self.abort_soon(rid)  # (a move not read yet: its import is dropped there, and its marker here)
            box.items = deque(i for i in box.items if not (isinstance(i, StreamChunk) and i.migrated_to is not None))
            box.put(copy.copy(err))  # one each (a ShuttingDownError: its message its only argument)

    def cut_if_silent(self, bound_s: float) -> None:
        """Fail every request here if the worker sent nothing for `bound_s` (liveness.SilentChannelWatch)."""
        silent = time.monotonic() - self.heard
        if self.dead is None and (self.inboxes or self.inflight) and silent >= bound_s:
            self._break(WorkerDiedError(self.wid, f"it sent nothing for {silent:.0f} s and its heartbeat lapsed: its "
                                                  "process or its node stopped, or the network to it failed"))

    async def call(self, msg):
        fut = asyncio.get_running_loop().create_future()
        self.outgoing.append((msg, fut))
        self.wake.set()
        return await fut

    async def stream(self, rid: str, msg) -> AsyncIterator[StreamChunk]:
        if rid in self.draining and self.dead is None:  # the id's previous request is still ending
            try:
                await asyncio.wait_for(self.draining[rid].wait(), DRAIN_WAIT_S)
            except asyncio.TimeoutError:
                pass
        if self.dead is not None:
            raise self.dead
        if getattr(self.client, "cut_with", None) is not None:  # its frontend ended every request: no new one
            raise copy.copy(self.client.cut_with)
        if rid in self.inboxes or rid in self.draining:
            raise InvalidRequestError(f"request id {rid!r} is already in use")
        box = self.inboxes[rid] = Inbox()
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
            moved = None if finished else _moved_to(box)
            if moved is not None:  # the reader left before it read the move: it runs there, unread
                if not box.aborted:
                    self.client.drop_moved(moved, rid)
            elif not finished and self.dead is None:  # the reader left: free its blocks
                if not any(terminal(item) for item in box.items):  # its last item is still to come
                    self._hold(rid)
                if not box.aborted:
                    self.send(("abort", rid))

    def _hold(self, rid: str) -> None:
        if len(self.draining) >= MAX_DRAINING:
            for old in list(self.draining)[: MAX_DRAINING // 2]:
                self._release(old)
        self.draining[rid] = asyncio.Event()

    def _release(self, rid: str) -> None:
        event = self.draining.pop(rid, None)
        if event is not None:
            event.set()

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
                rid = _rid((kind, arg))
                box = self.inboxes.get(rid)
                if box is not None:
                    box.put(err)
                else:  # never applied: nothing more will come for it
                    self._release(rid)

    async def _read(self) -> None:
        writer = None
        try:
            host, port, token = await self.client.call(self.wid, "data_address")
            try:
                reader, writer = await data_plane.connect(host, port, token, self.subscriber)
            except OSError as e:  # the worker answers Ray but its data port is out of reach
                asyncio.get_running_loop().create_task(self._close_over_ray())
                raise WorkerDiedError(self.wid, f"its data connection failed: {e}") from None
            self.connected.set_result(writer)
            while True:
                frame = await data_plane.read_frame(reader)
                self.heard = time.monotonic()
                if frame[0] == "c":
                    for rid, item in frame[1]:
                        box = self.inboxes.get(rid)
                        if box is not None:
                            box.put(item)
                            continue
                        if isinstance(item, StreamChunk) and item.migrated_to is not None:
                            self.client.drop_moved(item.migrated_to, rid)  # its reader left as it moved
                        if rid in self.draining and terminal(item):
                            self._release(rid)
                elif self.results is not None and not self.results.done() and frame[1] == self.seq:
                    if frame[0] == "r":
                        self.results.set_result(frame[2])
                    else:
                        self.results.set_exception(frame[2])
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):  # closed by the worker, or it died
            self.client.forget(self.wid)
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
            await asyncio.wait_for(self.client.call(self.wid, "commands", self.subscriber, [("close", "")]),
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
        for rid in list(self.draining):
            self._release(rid)
        for t in (self.reader, self.sender):
            if t is not asyncio.current_task() and not t.done():
                t.cancel()


def _moved_to(box: Inbox) -> str | None:
    """The worker a request moved to, where its reader has not read the move yet: it runs there,
    and no one else will attach to it (an abort here, where it no longer is, found nothing)."""
    return next((i.migrated_to for i in box.items if isinstance(i, StreamChunk) and i.migrated_to is not None), None)


def _rid(msg) -> str:
    return msg[1].request_id if msg[0] == "submit" else msg[1]
