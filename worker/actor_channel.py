"""Part of EngineWorker (actor.py): a frontend's channel. Its commands (submit, abort,
attach, close) arrive in ordered batches, over TCP (data_plane.py, read by the step thread:
step_io.py) or through Ray, and each request's chunks go out in its subscriber's Outbox
(outbox.py), one frame per step."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator

from folio.worker.errors import InvalidRequestError, UnavailableError
from folio.worker.messages import GenerateRequest, mono_from_wall
from folio.worker.outbox import Outbox, Route

CLOSED_KEPT = 1024  # subscribers whose stream closed: their late submits are refused


class FrontendChannels:
    def _apply_frame(self, conn, seq: int, batch) -> None:
        """(The step thread, between two steps.) A batch read from a frontend's TCP connection,
        applied here at once; its results go back on the connection before the step runs.
        A batch that needs the event loop (an attach that waits for an import, a close)
        goes through `commands` there, and the connection's next batch waits for its reply.
        A submit whose grammar is not compiled here yet has its route opened at once and is
        added once the grammar compiled on a thread (`_add_when_compiled`): the connection goes
        on meanwhile (it held every later submit and abort of the frontend for the compile)."""
        box = conn.box if not conn.box.closed else None  # (closed: its submits are refused, as below)
        if not _well_formed(batch):
            conn.push(("e", seq, InvalidRequestError("a malformed command batch: nothing of it was applied")))
            return
        if any(kind in ("attach", "close") for kind, arg in batch):
            conn.held = True

            def done(f) -> None:
                try:
                    reply = ("r", seq, f.result())
                except Exception as e:
                    reply = ("e", seq, e)
                conn.push(reply)
                conn.held = False
                self._io.kick()
            try:
                asyncio.run_coroutine_threadsafe(self.commands(conn.box.subscriber, batch),
                                                 self._loop).add_done_callback(done)
            except RuntimeError as e:  # (no event loop any more)
                conn.held = False
                conn.push(("e", seq, UnavailableError(f"worker {self.worker_id} is stopping: {e}")))
            return
        results: list = [None] * len(batch)
        for i, (kind, arg) in enumerate(batch):
            if kind == "abort":
                try:
                    results[i] = self._abort(arg)
                except Exception:  # (a failed engine)
                    results[i] = False
            elif self._open_route(arg, box):
                if not self._grammar_ready(arg.params.guided):
                    self._add_when_compiled(arg)
                    continue
                try:
                    self._add(self.engine, arg.request_id, arg,
                              mono_from_wall(arg.arrival_time) if arg.arrival_time is not None else None)
                except Exception as err:  # refused: nothing is left behind; the error is its stream's
                    self._put(arg.request_id, err)
        conn.push(("r", seq, results))
        self._flush_out()

    def _grammar_ready(self, spec) -> bool:
        """Whether a submit with `spec` can be added now without compiling (a spec refused
        before is: add_request refuses it)."""
        return spec is None or self.engine is None or self.engine.grammar_compiled(spec)

    def _add_when_compiled(self, req: GenerateRequest) -> None:
        """(The step thread.) Compile `req`'s grammar on a thread, then add it between two steps,
        if its route is still open: an abort meanwhile left a tombstone, which `_add` honours."""
        rid, route = req.request_id, self._streams[req.request_id]

        async def go() -> None:
            await asyncio.to_thread(self._compile_grammars, [req.params.guided])

            def add(e) -> None:
                if self._streams.get(rid) is not route:  # its frontend left (or it was refused)
                    return
                try:
                    self._add(e, rid, req, mono_from_wall(req.arrival_time) if req.arrival_time is not None else None)
                except Exception as err:
                    self._put(rid, err)
            try:
                await self._call(add)
            except UnavailableError as err:  # failed meanwhile
                self._put(rid, err)
        try:
            asyncio.run_coroutine_threadsafe(go(), self._loop)
        except RuntimeError as e:  # (no event loop any more)
            self._put(rid, UnavailableError(f"worker {self.worker_id} is stopping: {e}"))

    def _conn_dropped(self, conn) -> None:
        """(The step thread.) A frontend's connection ended: its requests here are aborted."""
        self._data.attached.discard(conn.box.subscriber)
        self._close_subscriber(conn.box)

    async def commands(self, subscriber: str, batch: list[tuple[str, Any]]) -> list:
        """Apply a frontend's messages in order, all in one pass between two steps:
        ("submit", GenerateRequest), ("abort", request id), ("attach", request id). Each
        request's chunks, or its error, go out on `subscriber`'s stream (subscribe()).
        Returns one result per message (an abort's: whether it found the request)."""
        self._loop = asyncio.get_running_loop()
        if not _well_formed(batch):
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
        guided = {arg.params.guided for _, kind, arg in plan if kind == "submit" and arg.params.guided is not None}
        if guided and self.engine is not None:  # compiled here, on a thread: not in the step thread, between steps
            await asyncio.to_thread(self._compile_grammars, guided)

        def run(e):
            for i, kind, arg in plan:
                if kind == "abort":
                    results[i] = self._abort(arg)
                    continue
                try:
                    self._add(e, arg.request_id, arg, mono_from_wall(arg.arrival_time)
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

    def _compile_grammars(self, specs) -> None:
        """Each spec's grammar into the engine's cache, so adding its request compiles nothing:
        a schema that takes 0.7 s to compile (1,500 properties) held every stream of the worker
        as long, compiled by add_request on the step thread. A spec that does not compile is
        left to add_request, which refuses its request."""
        for spec in specs:
            with contextlib.suppress(Exception):  # (no tokenizer: add_request says so)
                self.engine.compile_grammar(spec)

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
        # (its earlier items went through the event loop: the rest follow them there, in order)
        self._unattached.pop(rid, None)
        route = self._streams[rid] = Route(box, rid, self._streams, self._sent, direct=False)
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
            self._closed.pop(next(iter(self._closed)), None)
        for rid, sink in list(self._streams.items()):  # (the step thread's or the event loop's)
            if isinstance(sink, Route) and sink.box is box:
                self._streams.pop(rid, None)
                self._sent.pop(rid, None)
                self._send(lambda e, rid=rid: self._abort(rid))


def _well_formed(batch) -> bool:
    return isinstance(batch, list) and all(
        isinstance(m, tuple) and len(m) == 2 and (m[0] in ("abort", "attach", "close") or
                                                  m[0] == "submit" and isinstance(m[1], GenerateRequest))
        for m in batch)
