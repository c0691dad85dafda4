"""The worker's data plane: one TCP connection per (frontend, worker) carries that
frontend's commands to the worker and every chunk of its requests back, one frame per
step (a step's outputs for that frontend, as `subscribe()` yields them through Ray), with
no Ray in between. Ray stays for everything else (the address, migrations, the
coordinator, the lifecycle).

    frontend                                  worker
    data_address() (a Ray call) -------->     (host, port, token); the server starts on first use
    connect, send  HELLO token subscriber\\n   (a line, read by the event loop; nothing else is
                                              read before it checks out; then the step thread
                                              owns the socket: step_io.py)
    frame (seq, [(kind, arg), ...]) ---->     applied between two steps, one batch at a time, in order
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
one-token request's time outside the engine. Here a frame costs the worker one send, by the
step thread between two steps (until 2026-12-06 the event loop read and wrote the
connection: two more thread hops per request, ~0.55 ms of a one-token request, and a wake-up
of the loop per step; benchmarks/path_hops.py).

Trust: a connection is accepted only with the token the worker handed out over Ray, so
whoever can send it commands could already call the worker through Ray; until the hello
line checks out the worker reads nothing else (no pickle), so a stranger on the network can
neither read a stream nor push anything into the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import pickle
import secrets
import socket
import struct
import sys
from typing import Callable

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
    """Accepts subscribers over TCP and checks their hello on the event loop, then hands each
    connection to the step thread (`handoff(sock, leftover bytes, box)`: step_io.py), which
    reads its commands and writes its chunks from then on. `open_box(subscriber)` returns the
    subscriber's Outbox (None: that subscriber was closed)."""

    def __init__(self, open_box: Callable[[str], Outbox | None],
                 handoff: Callable[[socket.socket, bytes, Outbox], None]) -> None:
        self.open_box, self.handoff = open_box, handoff
        self.token = secrets.token_hex(16)
        self._listener: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._host = ""
        self._tasks: set[asyncio.Task] = set()
        self.attached: set[str] = set()  # subscribers with a connection (one each; the step thread drops them)
        self.accepted = 0  # connections that said the token and attached to a subscriber

    async def address(self) -> tuple[str, int, str]:
        if self._listener is None:
            self._host = node_host()
            family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
            lsock = socket.socket(family, socket.SOCK_STREAM)
            lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            lsock.bind((self._host, 0))
            lsock.listen(128)
            lsock.setblocking(False)
            self._listener = lsock
            self._loop = asyncio.get_running_loop()
            self._loop.add_reader(lsock, self._accept, lsock)
        return self._host, self._listener.getsockname()[1], self.token

    def _spawn(self, coro) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    def _accept(self, lsock: socket.socket) -> None:  # (the listener is readable)
        for _ in range(64):
            try:
                sock, _ = lsock.accept()
            except BlockingIOError:  # none waiting
                return
            except OSError:  # out of descriptors: the listener stays readable, so wait, not spin
                self._loop.remove_reader(lsock)
                self._loop.call_later(0.1, self._resume, lsock)
                return
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # small frames go at once
            self._spawn(self._hello(sock))

    def _resume(self, lsock: socket.socket) -> None:
        if lsock.fileno() >= 0:
            self._loop.add_reader(lsock, self._accept, lsock)

    async def _hello(self, sock: socket.socket) -> None:
        loop, buf, kept = asyncio.get_running_loop(), bytearray(), False
        try:
            async def line() -> None:
                while b"\n" not in buf and len(buf) <= MAX_HELLO:
                    data = await loop.sock_recv(sock, 4096)
                    if not data:
                        raise ConnectionError("closed before its hello")
                    buf.extend(data)
            try:
                await asyncio.wait_for(line(), HELLO_TIMEOUT_S)
            except (asyncio.TimeoutError, ConnectionError, OSError):
                return
            end = buf.find(b"\n")
            hello, leftover = bytes(buf[:end + 1]), bytes(buf[end + 1:])
            parts = hello.split()
            if (end < 0 or len(hello) > MAX_HELLO or len(parts) != 3 or parts[0] != HELLO
                    or not hmac.compare_digest(parts[1], self.token.encode())):
                return
            subscriber = parts[2].decode("ascii", "replace")
            if subscriber in self.attached:  # one connection per subscriber: a second is refused
                return
            box = self.open_box(subscriber)
            if box is None:  # closed before: its requests were aborted, nothing will come
                return
            self.attached.add(subscriber)
            self.accepted += 1
            self.handoff(sock, leftover, box)
            kept = True
        finally:
            if not kept:
                sock.close()

    def close(self) -> None:
        """Stop listening and end the connections still saying hello (on the event loop's
        thread); the step thread ends the others as it stops."""
        if self._listener is not None:
            with contextlib.suppress(Exception):  # (the loop is closed already)
                self._loop.remove_reader(self._listener)
            self._listener.close()
        for t in list(self._tasks):
            t.cancel()


async def connect(host: str, port: int, token: str, subscriber: str):
    """The frontend's end: a (reader, writer) pair, past the hello (frames from here on)."""
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(b" ".join((HELLO, token.encode(), subscriber.encode())) + b"\n")
    await writer.drain()
    return reader, writer


def frame_bytes(obj) -> bytes:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return FRAME.pack(len(data)) + data


def write_frame(writer: asyncio.StreamWriter, obj) -> None:
    writer.write(frame_bytes(obj))


async def read_frame(reader: asyncio.StreamReader):
    """One frame's object; IncompleteReadError when the other end closed, ValueError when
    the frame is larger than MAX_FRAME."""
    (n,) = FRAME.unpack(await reader.readexactly(FRAME.size))
    if n > MAX_FRAME:
        raise ValueError(f"a {n}-byte frame exceeds {MAX_FRAME}")
    return pickle.loads(await reader.readexactly(n))
