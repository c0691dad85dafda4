"""The worker's data plane: one TCP connection per (frontend, worker) carries every chunk
of that frontend's requests on the worker, one frame per wake-up of the worker's event loop
(a step's outputs, as `subscribe()` yields them), with no Ray in between.

    frontend                                  worker (EngineWorker's event loop)
    data_address() (a Ray call) -------->     (host, port, token); the server starts on first use
    connect, send  HELLO token subscriber\\n   the subscriber's Outbox (outbox.py) is drained
    <-- frames: 4-byte big-endian length, then pickle([(request id, StreamChunk | exception)])
    close (or die) --------------------->     EOF: the subscriber's requests still here are aborted

Why not Ray's streaming generator (what `subscribe()` is, and what this replaced): each
yielded item hops through several threads on both sides (the event loop, an executor that
reports it, the core worker's io thread, gRPC pollers): ~70 context switches per step on
this 2-core machine, each one taking a core from the forward's OpenMP threads, whose
barriers then wait for it. The forward of a one-request decode step took 7.2-7.8 ms behind
a Ray stream against 4.7-5.4 ms with its reader in the same process (benchmarks/results/
data_plane.json). Here a frame costs the worker one wake-up of its event loop and one send.

Trust: the frontend unpickles what the worker sends, as it trusts Ray's messages from it.
The worker reads only the hello line (no pickle) and accepts a connection only with the
token it handed out over Ray, so a stranger on the network can neither read a stream nor
push anything into the worker.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import pickle
import secrets
import struct
import sys
from typing import Callable

from folio.worker.outbox import Outbox

HELLO = b"FOLIO-DATA/1"
FRAME = struct.Struct("!I")
HELLO_TIMEOUT_S = 10.0  # a connection that has not said who it is by then is closed
MAX_HELLO = 512
log = logging.getLogger("folio.worker")


def node_host() -> str:
    """Where other nodes reach this process: Ray's node address when Ray runs here (the
    worker is then a Ray actor), else loopback (an in-process worker). Ray is not imported."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return ray.util.get_node_ip_address()
    return "127.0.0.1"


class DataServer:
    """Serves subscribers' outboxes over TCP. `open_box(subscriber)` returns its Outbox (None:
    that subscriber was closed); `close_box(box)` runs once its connection ends."""

    def __init__(self, open_box: Callable[[str], Outbox | None], close_box: Callable[[Outbox], None]) -> None:
        self.open_box, self.close_box = open_box, close_box
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
            await self._pump(box, reader, writer)
        finally:
            self._connections.discard(asyncio.current_task())
            if box is not None:
                self._attached.discard(box.subscriber)
                self.close_box(box)
            writer.close()

    async def _pump(self, box: Outbox, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        gone = asyncio.get_running_loop().create_future()

        async def watch() -> None:  # the frontend sends nothing after its hello: any byte or EOF ends it
            try:
                await reader.read(1)
            except ConnectionError:
                pass
            if not gone.done():
                gone.set_result(None)
            box.ready.set()

        watcher = asyncio.get_running_loop().create_task(watch())
        try:
            while not gone.done():
                await box.ready.wait()
                batch = box.take()
                if batch and not gone.done():
                    data = pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)
                    writer.write(FRAME.pack(len(data)) + data)
                    await writer.drain()  # a slow reader: the outbox merges meanwhile (bounded)
        except ConnectionError:
            pass
        finally:
            watcher.cancel()

    def close(self) -> None:
        """Stop listening and end every connection (on the event loop's thread)."""
        if self._server is not None:
            self._server.close()
        for t in list(self._connections):
            t.cancel()


async def connect(host: str, port: int, token: str, subscriber: str):
    """The frontend's end: a (reader, writer) pair whose reader yields frames via `read_frame`."""
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(b" ".join((HELLO, token.encode(), subscriber.encode())) + b"\n")
    await writer.drain()
    return reader, writer


async def read_frame(reader: asyncio.StreamReader) -> list:
    """One frame's [(request id, item)]; raises IncompleteReadError when the worker closed."""
    (n,) = FRAME.unpack(await reader.readexactly(FRAME.size))
    return pickle.loads(await reader.readexactly(n))
