"""Deadlines and size bounds on each HTTP connection of a replica's own server (http_server.py),
mixed into uvicorn's protocol class.

Slow clients. uvicorn times out an idle keep-alive connection, but not one that never finishes
its request: a connection that sends nothing, or a header line every few seconds, or a body
that stops half-way, was held for good (250 such connections stayed open for 70 s and more in
an attack on 2026-12-05), and enough of them take every file descriptor the replica has. So
each connection's protocol (uvicorn's own, `deadlines`) also has, as nginx's
client_header_timeout and client_body_timeout:

    HEADER_TIMEOUT_S  from the connection's start, or a request's first byte, to the end of its
                      headers; then 408 and the connection closed
    BODY_TIMEOUT_S    between two reads of a request body that has not ended; then the
                      connection closed (the handler sees the client gone, as for a disconnect)

Neither runs while a request is served (a long stream is not timed) or while uvicorn itself
has paused reading.

Large heads. Nor did anything bound a request's line and headers: an 8 MiB header was read
and answered, and httptools joins a header value that arrives over many reads by copying it
whole each time, so one 256 MiB header held the replica's event loop (every stream it serves)
for seconds per MiB (a `/health` beside it took 3.5 -> 14.8 s). So

    MAX_HEAD_BYTES    64 KiB of request line and headers (nginx allows 4 x 8 KiB, h11 16 KiB);
                      past it 431 and the connection closed (the parser sees at most one read more)

and a body's bytes on the wire (its chunks' framing and its trailers too: the app counts only
the body, and a 256 MiB trailer took the loop 81 s to parse) at most twice the app's body
bound plus MAX_HEAD_BYTES; past it 413 and the connection closed.

Clients that do not read. A response the client never reads stays in the socket's buffers, and
a connection closed with bytes still unsent is closed only once they are sent: so a client
that stops reading held its connection (and a stream's buffered text) for as long as it liked,
after its request had ended too. As nginx's send_timeout:

    SEND_TIMEOUT_S    while bytes of a response wait to be sent, the longest time in which the
                      client takes none of them (checked every quarter of it); then the
                      connection is reset (a TCP RST: the kernel drops the unsent bytes too;
                      its request is aborted as for a disconnect)

A slow reader that keeps taking bytes is never cut.

Pipelined requests. httptools' protocol keeps only the last request's cycle: a request sent on
the same connection behind a stream (HTTP/1.1 pipelining) replaced it, and when the client then
left, only the queued request was told; the stream it was behind went on writing into a closed
socket (28-650 tokens after a reset, in an attack on 2026-12-06). So every earlier cycle still
under way is told too (`_earlier`).

A client gone. A stream learns that its client left only when the ASGI app's disconnect
listener wakes and its cancellation reaches the stream's generator: several turns of a busy
event loop (p50 ~70 ms under 200 streams, cancellation_stress.py, 2026-12-06), in which the
worker ran on. So a request's handler may list callables under the scope's CLIENT_LOST key,
called when the connection is lost before the response completed (its requests are aborted
on their workers at once; openai_run.Run.abort_soon).
"""

from __future__ import annotations

import contextlib
import socket
import struct

from folio.deploy.http10 import close_delimited

HEADER_TIMEOUT_S = 30.0
BODY_TIMEOUT_S = 60.0
SEND_TIMEOUT_S = 60.0
MAX_HEAD_BYTES = 64 << 10
CLIENT_LOST = "folio.client_lost"  # a scope's list of callables: run when its connection is lost mid-response


def _closing_answer(status: bytes, message: bytes, code: bytes, kind: bytes = b"invalid_request_error") -> bytes:
    body = (b'{"error":{"message":"%s","type":"%s","param":null,"code":"%s"}}' % (message, kind, code))
    return (b"HTTP/1.1 %s\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: %d\r\n\r\n%s" % (status, len(body), body))


TIMED_OUT_408 = _closing_answer(b"408 Request Timeout", b"the request's headers did not arrive within the server's time",
                                b"request_timeout")
BODY_TOO_LARGE_413 = _closing_answer(b"413 Content Too Large", b"the request body is over the server's bound",
                                     b"body_too_large")
SHUTTING_DOWN_503 = _closing_answer(b"503 Service Unavailable", b"this server is shutting down: retry the request",
                                    b"server_shutting_down", b"service_unavailable")
HEAD_TOO_LARGE_431 = _closing_answer(b"431 Request Header Fields Too Large",
                                     b"the request line and headers are over %d bytes" % MAX_HEAD_BYTES,
                                     b"request_header_fields_too_large")


class _Counted:
    """The transport as uvicorn's protocol sees it: every write (and close) also tells the
    protocol, which watches the bytes that wait (`_Deadlines._watch_send`)."""

    def __init__(self, transport, protocol) -> None:
        self._transport, self._protocol, self.written = transport, protocol, 0

    def write(self, data) -> None:
        self._transport.write(data)
        self.written += len(data)
        self._protocol._watch_send()

    def close(self) -> None:
        self._transport.close()
        self._protocol._watch_send()

    def __getattr__(self, name):
        return getattr(self._transport, name)


class _Deadlines:
    """The timeouts and size bounds above, mixed into uvicorn's HTTP protocol class (httptools'
    or h11's; `deadlines` makes the class). Both keep `cycle` (the request whose headers were
    read last) with `more_body`, `response_started` and `response_complete`; a new cycle object
    is a request whose headers have all arrived."""

    header_s, body_s, send_s = HEADER_TIMEOUT_S, BODY_TIMEOUT_S, SEND_TIMEOUT_S
    max_head, max_wire_body = MAX_HEAD_BYTES, 0
    _head_timer = _body_timer = _send_timer = None
    _head_cycle = None
    _head_bytes = _body_bytes = _sent_mark = 0
    _sent_at = 0.0
    _lost = False
    _earlier: tuple = ()  # cycles the protocol no longer keeps whose response is under way

    @property
    def cycle(self):
        return self.__dict__.get("_cycle")

    @cycle.setter
    def cycle(self, new) -> None:
        """uvicorn's protocol sets it for each request whose headers are in, a pipelined one
        while the one before it is still answered: that one is kept in `_earlier`."""
        old = self.__dict__.get("_cycle")
        if old is not None and old is not new and not old.response_complete:
            self._earlier = (*(c for c in self._earlier if not c.response_complete), old)
        if new is not None and new.scope.get("http_version") == "1.0" and hasattr(new, "chunked_encoding"):
            close_delimited(new)  # httptools' (h11 answers 1.0 right): no chunks to an HTTP/1.0 client (http10.py)
        self.__dict__["_cycle"] = new

    def connection_made(self, transport) -> None:
        super().connection_made(_Counted(transport, self))
        self._arm_head()

    def _watch_send(self) -> None:
        """Bytes wait to be sent: checked every send_s / 4 while they do; once none has left for
        send_s, the connection is reset."""
        if self._send_timer is None and not self._lost:
            waiting = self.transport._transport.get_write_buffer_size()
            if waiting:
                self._sent_mark, self._sent_at = self.transport.written - waiting, self.loop.time()
                self._send_timer = self.loop.call_later(self.send_s / 4, self._send_check)

    def _send_check(self) -> None:
        self._send_timer = None
        raw = self.transport._transport
        waiting = raw.get_write_buffer_size()
        if not waiting:
            return  # all sent: the next write that leaves bytes waiting starts a new watch
        sent, now = self.transport.written - waiting, self.loop.time()
        if sent != self._sent_mark:
            self._sent_mark, self._sent_at = sent, now
        elif now - self._sent_at >= self.send_s:
            return self._reset(raw)
        self._send_timer = self.loop.call_later(self.send_s / 4, self._send_check)

    @staticmethod
    def _reset(raw) -> None:
        """A TCP reset (SO_LINGER 0, as nginx's reset_timedout_connection): a plain close would
        leave the kernel holding the unsent bytes, retrying to a client that takes none."""
        sock = raw.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        raw.abort()

    def data_received(self, data: bytes) -> None:
        before = self.cycle
        in_body = before is not None and before.more_body and not before.disconnected
        super().data_received(data)
        if self.transport.is_closing():
            return self._cancel()
        cycle = self.cycle
        if cycle is not before:  # a request's headers are in
            self._cancel_head()
            self._head_bytes = self._body_bytes = 0
        else:
            if not in_body:  # every byte of `data` went to a request line or headers still open
                self._head_bytes += len(data)
                if self._head_bytes > self.max_head:
                    return self._refuse(HEAD_TOO_LARGE_431)
            else:  # body, chunk framing, trailers
                self._body_bytes += len(data)
                if self._body_bytes > self.max_wire_body:
                    return self._refuse(BODY_TOO_LARGE_413, its_body=True)
            if self._head_timer is None and (cycle is None or (cycle.response_complete and not cycle.more_body)):
                self._arm_head()  # the first bytes of the next request
        if cycle is not None and cycle.more_body and not cycle.disconnected:
            if self._body_timer is not None:
                self._body_timer.cancel()
            self._body_timer = self.loop.call_later(self.body_s, self._body_expired, cycle)
        elif self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _refuse(self, answer: bytes, its_body: bool = False) -> None:
        # answered unless a response is under way, or (for a body) already sent
        c = self.cycle
        if c is None or not c.response_started or (c.response_complete and not its_body):
            self.transport.write(answer)
        self.transport.close()
        self._cancel()

    def shutdown(self) -> None:
        """uvicorn's graceful shutdown (a drain's start): an idle connection closes and a request
        being served finishes, as in uvicorn; a request whose head is still arriving gets a 503
        to retry elsewhere (uvicorn closed it without a word)."""
        c = self.cycle
        if self._head_bytes and (c is None or c.response_complete):
            return self._refuse(SHUTTING_DOWN_503)
        super().shutdown()

    def cut(self) -> None:
        """The end of a drain (replica_drain.py): a request whose response has not started (its
        head or body still arriving, or its handler not yet answering) gets a 503 to retry
        elsewhere, rather than uvicorn's plain-text 500 of a cancelled task; a response under
        way is cut. Either way the connection closes and its handler sees the disconnect."""
        self._refuse(SHUTTING_DOWN_503)

    def _arm_head(self) -> None:
        self._head_cycle = self.cycle
        self._head_timer = self.loop.call_later(self.header_s, self._head_expired)

    def _cancel_head(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _cancel(self) -> None:
        """The head and body timers; not the send watch, which must outlive a close while bytes wait."""
        self._cancel_head()
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def connection_lost(self, exc) -> None:
        self._lost = True
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None
        self._cancel()
        for c in (*self._earlier, self.cycle):
            if c is not None and not c.response_complete:
                for hook in c.scope.get(CLIENT_LOST, ()):
                    with contextlib.suppress(Exception):  # (a hook's failure must not keep the rest)
                        hook()
        for c in self._earlier:  # as uvicorn does for the cycle it keeps
            if not c.response_complete:
                c.disconnected = True
            c.message_event.set()
        self._earlier = ()
        super().connection_lost(exc)

    def _head_expired(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.cycle is not self._head_cycle:
            return
        if (self.cycle is not None and not self.cycle.response_complete) or self.flow.read_paused:
            return self._arm_head()  # a request is being served: not this timer's business
        self.transport.write(TIMED_OUT_408)
        self.transport.close()

    def _body_expired(self, cycle) -> None:
        self._body_timer = None
        if self.transport.is_closing() or self.cycle is not cycle or not cycle.more_body:
            return
        if self.flow.read_paused:  # uvicorn stopped reading, not the client stopping
            self._body_timer = self.loop.call_later(self.body_s, self._body_expired, cycle)
            return
        self.transport.close()


def deadlines(base: type, header_s: float, body_s: float, max_head: int = MAX_HEAD_BYTES,
              max_body: int = 8 << 20, send_s: float = SEND_TIMEOUT_S) -> type:
    """uvicorn's HTTP protocol class `base` with `_Deadlines` (`max_body`: the app's own body
    bound; a body's bytes on the wire may be twice it plus `max_head`)."""
    return type(f"Deadline{base.__name__}", (_Deadlines, base),
                {"header_s": header_s, "body_s": body_s, "send_s": send_s, "max_head": max_head,
                 "max_wire_body": 2 * max_body + max_head})
