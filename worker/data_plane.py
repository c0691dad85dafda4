"""The worker's data plane: one TCP connection per (frontend, worker) carries that
frontend's commands to the worker and every chunk of its requests back, one frame per
wake-up of the worker's event loop (a step's outputs, as `subscribe()` yields them), with
no Ray in between. Ray stays for everything else (the address, migrations, the
coordinator, the lifecycle).

    frontend                                  worker (EngineWorker's event loop)
    data_address() (a Ray call) -------->     (host, port, token); the server starts on first use
    connect, send  HELLO token subscriber\\n   (a line; nothing else is read before it checks out)
    frame (seq, [(kind, arg), ...]) ---->     EngineWorker.commands, one batch at a time, in order
    <-- frame ("r", seq, results) | ("e", seq, exception)
    <-- frame ("c", [(request id, StreamChunk | exception), ...])   the subscriber's Outbox
    close (or die) --------------------->     EOF: the subscriber's requests still here are aborted

A frame is a 4-byte big-endian length, then a pickle. Commands and chunks share the one
ordered connection, so an abort can never overtake its submit, and closing it is the abort
of everything the frontend still had running there.

Why not Ray's streaming generator (what `subscribe()` is, and what this replaced): each
yielded item hops through several threads on both sides (the event loop, an executor that
reports it, the core worker's io thread, gRPC pollers): ~70 context switches per step on
this 2-core machine, each one taking a core from the forward's OpenMP threads, whose
barriers then wait for it (benchmarks/data_plane.py, A B B A: the forward of a one-request
decode step 9.6 ms behind a Ray stream, 7.7 over this connection, 6.4 with its reader in the
same process; 71 / 21 / 4 context switches per step). And a Ray actor call took ~2 ms to deliver a submit on this machine, a third of a
one-token request's time outside the engine. Here a frame costs the worker one wake-up of
its event loop and one send.

Trust: a connection is accepted only with the token the worker handed out over Ray, so
whoever can send it commands could already call the worker through Ray; until the hello
line checks out the worker reads nothing else (no pickle), so a stranger on the network can
neither read a stream nor push anything into the worker.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import pickle
import secrets
import struct
import sys
from typing import Awaitable, Callable

from folio.worker.outbox import Outbox

HELLO = b"FOLIO-DATA/1"
FRAME = struct.Struct("!I")
HELLO_TIMEOUT_S = 10.0  # a connection that has not said who it is by then is closed
MAX_HELLO = 512
MAX_FRAME = 1 << 28  # a frame's largest size (bytes); a longer one ends the connection
log = logging.getLogger("folio.worker")


def node_host() -> str:
    """Where other nodes reach this process: Ray's node address when Ray runs here (the
    worker is then a Ray actor), else loopback (an in-process worker). Ray is not imported."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return ray.util.get_node_ip_address()
    return "127.0.0.1"


class DataServer:
    """Serves subscribers over TCP. `open_box(subscriber)` returns its Outbox (None: that
    subscriber was closed); `apply(subscriber, batch)` runs a batch of its commands and returns
    their results; `close_box(box)` runs once its connection ends."""

    def __init__(self, open_box: Callable[[str], Outbox | None], close_box: Callable[[Outbox], None],
                 apply: Callable[[str, list], Awaitable[list]]) -> None:
        self.open_box, self.close_box, self.apply = open_box, close_box, apply
        self.token = secrets.token_hex(16)
        self._server: asyncio.base_events.Server | None = None
        self._host = ""
        self._connections: set[asyncio.Task] = set()
        self._attached: set[str] = set()  # subscribers with a connection (one each)
        self.accepted = 0  # connections that said the token and attached to a subscriber

    async def address(self) -> tuple[str, int, str]:
        if self._server is None:
            self._host = node_host()
            self._server = await asyncio.start_server(self._handle, self._host, 0)
        return self._host, self._server.sockets[0].getsockname()[1], self.token

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._connections.add(asyncio.current_task())
        box = None
        try:
            try:
                line = await asyncio.wait_for(reader.readuntil(b"\n"), HELLO_TIMEOUT_S)
            except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
                return
            parts = line.split()
            if (len(line) > MAX_HELLO or len(parts) != 3 or parts[0] != HELLO
                    or not hmac.compare_digest(parts[1], self.token.encode())):
                return
            subscriber = parts[2].decode("ascii", "replace")
            if subscriber in self._attached:  # one connection per subscriber: a second is refused
                return
            box = self.open_box(subscriber)
            if box is None:  # closed before: its requests were aborted, nothing will come
                return
            self._attached.add(subscriber)
            self.accepted += 1
            await self._pump(box, subscriber, reader, writer)
        finally:
            self._connections.discard(asyncio.current_task())
            if box is not None:
                self._attached.discard(box.subscriber)
                self.close_box(box)
            writer.close()

    async def _pump(self, box: Outbox, subscriber: str, reader: asyncio.StreamReader,
                    writer: asyncio.StreamWriter) -> None:
        gone = asyncio.get_running_loop().create_future()

        async def commands() -> None:  # the frontend's batches, applied in order; EOF ends it all
            try:
                while True:
                    seq, batch = await read_frame(reader)
                    try:
                        reply = ("r", seq, await self.apply(subscriber, batch))
                    except Exception as e:  # not one message of it was applied
                        reply = ("e", seq, e)
                    write_frame(writer, reply)
            except (asyncio.IncompleteReadError, ConnectionError, ValueError, TypeError, pickle.UnpicklingError):
                pass
            finally:
                if not gone.done():
                    gone.set_result(None)
                box.ready.set()

        reader_task = asyncio.get_running_loop().create_task(commands())
        try:
            while not gone.done():
                await box.ready.wait()
                batch = box.take()
                if batch and not gone.done():
                    write_frame(writer, ("c", batch))
                    await writer.drain()  # a slow reader: the outbox merges meanwhile (bounded)
        except ConnectionError:
            pass
        finally:
            reader_task.cancel()

    def close(self) -> None:
        """Stop listening and end every connection (on the event loop's thread)."""
        if self._server is not None:
            self._server.close()
        for t in list(self._connections):
            t.cancel()


async def connect(host: str, port: int, token: str, subscriber: str):
    """The frontend's end: a (reader, writer) pair, past the hello (frames from here on)."""
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(b" ".join((HELLO, token.encode(), subscriber.encode())) + b"\n")
    await writer.drain()
    return reader, writer


def write_frame(writer: asyncio.StreamWriter, obj) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    writer.write(FRAME.pack(len(data)) + data)


async def read_frame(reader: asyncio.StreamReader):
    """One frame's object; IncompleteReadError when the other end closed, ValueError when
    the frame is larger than MAX_FRAME."""
    (n,) = FRAME.unpack(await reader.readexactly(FRAME.size))
    if n > MAX_FRAME:
        raise ValueError(f"a {n}-byte frame exceeds {MAX_FRAME}")
    return pickle.loads(await reader.readexactly(n))
