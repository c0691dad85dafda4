"""Part of EngineWorker (actor.py): a request leaving or arriving by a migration. The
mover (cluster/worker_client.py) calls export_request on the source, import_request on the
destination, then finish_migration (or cancel_migration) on the source; worker/migration.py
does the engine's side."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from folio.worker.errors import InvalidRequestError
from folio.worker.messages import StreamChunk, mono_from_wall, wall_from_mono

log = logging.getLogger("folio.worker")
MOVE_TIMEOUT_S = 60.0  # an export neither confirmed nor refused by then resumes here (its mover died)
# an import no reader attached to by then is dropped: its frontend left before reading the move
# and could not say so (it died, or its drop_import was lost). Past the frontends' own bound on
# a reader that takes nothing (SEND_TIMEOUT_S, 60 s), whose router reads the move at its next chunk.
UNATTACHED_S = 120.0


class Migrations:
    async def export_request(self, request_id: str, destination: str):
        """Take a request off this worker (its KV to CPU tensors) for `destination`; returns
        the RequestState. The move is then settled by its mover: `finish_migration` once
        `destination` imported it (the stream here ends with `migrated_to`), or
        `cancel_migration` if it refused (the request resumes here; its stream never
        stalled on the refusal). Unsettled after MOVE_TIMEOUT_S, it resumes here."""
        self._loop = asyncio.get_running_loop()
        if request_id in self._unattached:  # moved here, its move not read yet: moved on, no reader could follow
            raise InvalidRequestError(f"request {request_id!r} has no reader on {self.worker_id} yet: it stays")
        state = await self._call(lambda e: self._export(request_id, destination))
        moving = self._moving.get(request_id)
        if moving is None or moving[1] is not state:  # its abort came between (its reader left): it is gone
            raise InvalidRequestError(f"request {request_id!r} was aborted while it was exported")
        token = moving[2]
        self._loop.call_later(MOVE_TIMEOUT_S, lambda: self._loop.create_task(self._expire_move(request_id, token)))
        return state

    async def finish_migration(self, request_id: str, destination: str) -> bool:
        """`destination` has imported the request: end its stream here with `migrated_to`.
        False if its reader left meanwhile (the mover then aborts it on `destination`)."""
        moving = self._moving.pop(request_id, None)
        if moving is None or request_id not in self._streams:
            return False
        self._put(request_id, StreamChunk(request_id=request_id, worker_id=self.worker_id, deltas=[],
                                          migrated_to=destination))
        return True

    async def cancel_migration(self, request_id: str) -> bool:
        """The destination refused the request: it resumes here, on the same stream."""
        moving = self._moving.pop(request_id, None)
        if moving is None:
            return False
        if request_id not in self._streams:  # its reader left meanwhile: nothing to resume
            return False
        state = dataclasses.replace(moving[1], arrival_time=mono_from_wall(moving[1].arrival_time))
        await self._call(lambda e: e.import_request(state))
        return True

    async def drop_import(self, request_id: str) -> bool:
        """Undo an import nobody will attach to, so its stream goes too: its move was never
        announced (its reader left, or it expired on the source), or its reader left before it
        read the move (the frontend's drop_moved), or none attached within UNATTACHED_S."""
        found = await self._call(lambda e: e.abort(request_id))
        self._streams.pop(request_id, None)
        self._sent.pop(request_id, None)
        self._unattached.pop(request_id, None)
        return found

    def _drop_unattached(self, request_id: str, stream: asyncio.Queue) -> None:
        if self._unattached.get(request_id) is stream:
            log.warning("%s was imported %g s ago and no reader attached: dropped", request_id, UNATTACHED_S)
            self._loop.create_task(self.drop_import(request_id))

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
        stream = self._streams[rid] = self._unattached[rid] = asyncio.Queue()  # (an attach takes it off)
        self._sent[rid] = {s.index: s.sent_tokens for s in state.seqs}
        state = dataclasses.replace(state, arrival_time=mono_from_wall(state.arrival_time))

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
            self._unattached.pop(rid, None)
            raise
        self._loop.call_later(UNATTACHED_S, self._drop_unattached, rid, stream)
        for ev in self._arrivals.pop(rid, []):
            ev.set()
        return rid_

    async def preempt(self, request_id: str) -> bool:
        self._loop = asyncio.get_running_loop()
        return await self._call(lambda e: e.preempt_request(request_id))

    def _export(self, rid: str, destination: str):
        state = self.engine.export_request(rid)
        state.arrival_time = wall_from_mono(state.arrival_time)
        self.num_migrations_out += 1
        self._moving[rid] = (destination, state, next(self._move_ids))  # announced once imported there
        return state
