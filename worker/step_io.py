"""The step thread's own socket I/O: once a frontend's data connection has said its hello
(data_plane.py, on the event loop), the step thread owns it. Between two steps it reads the
frontend's command batches and applies them at once, and after each step it writes that
frontend's chunks itself, one frame per step. Idle, it sleeps in the selector over those
connections and a wake-up socket, so a new request wakes it directly.

Why: the event loop between the sockets and the step thread cost each request two thread
hops (loop to step thread for the submit, step thread to loop and its send task for the
chunks), ~0.55 ms of a one-token request on the 2-core machine (benchmarks/path_hops.py),
and a wake-up of the loop thread per step while the next forward ran. vLLM's engine core
polls its sockets between steps the same way.

Anyone may put into a connection's Outbox; only the owner (the step thread) reads, and a
put from another thread (an import's error, the watchdog's) sends at once under the
connection's lock, so one request's items leave in the order they were put. A reader that
is behind leaves its bytes in `wbuf` and its chunks merge in the Outbox until the socket
drains (bounded, as before). Its commands are still read and applied meanwhile: an abort
never waits behind the chunks of the requests it stops (only past MAX_UNSENT unsent bytes,
a frontend that sends and never reads, does the step thread stop reading it).
"""

from __future__ import annotations

import pickle
import selectors
import socket
import threading
from typing import Callable

from folio.worker.data_plane import FRAME, frame_bytes
from folio.worker.outbox import Outbox

__all__ = ["Conn", "StepIO", "FRAME_HEAD", "frame_bytes"]
FRAME_HEAD = FRAME.size
READ_BYTES = 1 << 18
READS_PER_POLL = 16  # recv calls a connection gets per poll before the next step
MAX_UNSENT = 1 << 22  # bytes owed to a connection past which its commands wait (replies pile up)


class Conn:
    def __init__(self, sock: socket.socket, leftover: bytes, box: Outbox, owner: int) -> None:
        self.sock, self.box, self.owner = sock, box, owner
        self.rbuf = bytearray(leftover)
        self.wbuf = bytearray()
        self.lock = box.lock  # one lock for the box and the socket: take + send stay in order
        self.held = False  # a batch being applied on the event loop: its reply comes before the next
        self.broken = False
        self.mask = 0
        box.conn = self

    def push(self, obj) -> None:
        """Send a frame (any thread)."""
        data = frame_bytes(obj)
        with self.lock:
            self._send(data)

    def flush(self) -> None:
        """What waits in the box goes out as one frame, unless the socket is behind (any thread)."""
        with self.lock:
            if not self.wbuf and not self.broken and self.box.pending:
                self._send(frame_bytes(("c", self.box.take())))

    def _send(self, data: bytes) -> None:  # (under the lock)
        if self.broken:
            return
        if not self.wbuf:
            try:
                n = self.sock.send(data)
            except BlockingIOError:
                n = 0
            except OSError:
                self.broken = True
                return
            if n == len(data):
                return
            data = data[n:]
        self.wbuf += data

    def _drain(self) -> None:
        with self.lock:
            try:
                n = self.sock.send(self.wbuf)
            except BlockingIOError:
                return
            except OSError:
                self.broken = True
                return
            del self.wbuf[:n]
            self.flush()  # (the lock is reentrant) what merged in the box while the socket was behind


class StepIO:
    """The selector of the step thread. `apply(conn, seq, batch)` runs a frontend's batch
    (on the step thread); `dropped(conn)` runs once a connection ended (EOF, an error, a
    malformed frame)."""

    def __init__(self, apply: Callable[[Conn, int, list], None], dropped: Callable[[Conn], None],
                 max_frame: int) -> None:
        self.apply, self.dropped, self.max_frame = apply, dropped, max_frame
        self.sel = selectors.DefaultSelector()
        self._r, self._w = socket.socketpair()
        for s in (self._r, self._w):
            s.setblocking(False)
        self.sel.register(self._r, selectors.EVENT_READ, None)
        self.conns: list[Conn] = []
        self._adopted: list[tuple[socket.socket, bytes, Outbox]] = []
        self.sleeping = False
        self.owner = 0

    def kick(self) -> None:
        """Wake the step thread if it sleeps in poll() (any thread)."""
        if self.sleeping:
            try:
                self._w.send(b"\0")
            except OSError:  # full (it is awake already) or closed (it has ended)
                pass

    def adopt(self, sock: socket.socket, leftover: bytes, box: Outbox) -> None:
        """A connection past its hello (any thread): the step thread takes it at its next poll."""
        self._adopted.append((sock, leftover, box))
        self.kick()

    def poll(self, timeout: float, busy: Callable[[], bool]) -> None:
        """Read and apply what the frontends sent, write what they are owed; wait up to
        `timeout` for something to do unless `busy()` (a command is queued)."""
        self.owner = threading.get_ident()
        while self._adopted:
            sock, leftover, box = self._adopted.pop(0)
            self.conns.append(Conn(sock, leftover, box, self.owner))
            self.conns[-1].flush()  # what was put before it came
        for c in self.conns:
            self._parse(c)  # what was read while a batch was held
            self._interest(c)
        if timeout > 0:
            self.sleeping = True
            if busy() or self._adopted:
                timeout = 0
        try:
            events = self.sel.select(timeout)
        finally:
            self.sleeping = False
        for key, mask in events:
            c = key.data
            if c is None:
                try:
                    while self._r.recv(4096):
                        pass
                except OSError:
                    pass
                continue
            if mask & selectors.EVENT_WRITE:
                c._drain()
            if mask & selectors.EVENT_READ:
                self._read(c)
        for c in [c for c in self.conns if c.broken]:
            self._drop(c)

    def flush(self) -> None:
        """Send each connection's waiting chunks (the step thread, after a step or a command)."""
        for c in self.conns:
            if c.box.pending:
                c.flush()

    def _interest(self, c: Conn) -> None:
        full = c.held or len(c.wbuf) > MAX_UNSENT
        mask = (selectors.EVENT_WRITE if c.wbuf else 0) | (0 if full else selectors.EVENT_READ)
        if mask != c.mask:
            if c.mask and mask:
                self.sel.modify(c.sock, mask, c)
            elif mask:
                self.sel.register(c.sock, mask, c)
            else:
                self.sel.unregister(c.sock)
            c.mask = mask

    def _read(self, c: Conn) -> None:
        for _ in range(READS_PER_POLL):
            try:
                data = c.sock.recv(READ_BYTES)
            except BlockingIOError:
                break
            except OSError:
                c.broken = True
                return
            if not data:  # EOF: the frontend closed (or died)
                c.broken = True
                return
            c.rbuf += data
            if len(data) < READ_BYTES:
                break
        self._parse(c)

    def _parse(self, c: Conn) -> None:
        while not (c.held or c.broken or len(c.wbuf) > MAX_UNSENT) and len(c.rbuf) >= FRAME_HEAD:
            n = int.from_bytes(c.rbuf[:FRAME_HEAD], "big")
            if n > self.max_frame:
                c.broken = True
                return
            if len(c.rbuf) < FRAME_HEAD + n:
                return
            try:
                seq, batch = pickle.loads(c.rbuf[FRAME_HEAD:FRAME_HEAD + n])
            except Exception:  # not a frontend's frame: the connection ends (its requests aborted)
                c.broken = True
                return
            del c.rbuf[:FRAME_HEAD + n]
            self.apply(c, seq, batch)

    def _drop(self, c: Conn) -> None:
        self.conns.remove(c)
        if c.mask:
            self.sel.unregister(c.sock)
        with c.lock:
            c.broken = True
            c.sock.close()
        self.dropped(c)

    def close(self) -> None:
        """End every connection and the selector (the step thread, as it ends)."""
        while self._adopted:
            sock, leftover, box = self._adopted.pop(0)
            self.conns.append(Conn(sock, leftover, box, self.owner))
        for c in list(self.conns):
            self._drop(c)
        self.sel.close()
        self._r.close()
        self._w.close()
