"""Slow HTTP clients cannot hold a replica's connections, nor a large head its event loop, nor
a client that stops reading its response (deploy/http_deadlines.py).

The replica's own uvicorn server, on a real socket, with a small ASGI app and timeouts of
0.5 s; clients are raw sockets that stall where a hostile one would."""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time

import pytest

from folio.deploy.http_deadlines import CLIENT_LOST, MAX_HEAD_BYTES
from folio.deploy.http_server import HTTPServer

T = 0.5  # both timeouts, in these tests
MAX_BODY = 1 << 20  # the app's body bound, as `folio serve --max-body-bytes` passes it


class Server:
    def __init__(self, protocol: type) -> None:
        self.disconnects = 0
        self.lost: list[bool] = []  # one per CLIENT_LOST hook called: had the handler seen the disconnect?
        self.sent_for = 0.0  # how long the last /big response took the app to send
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()

        async def app(scope, receive, send):  # a function: uvicorn takes a bound method for ASGI 2
            await self.app(scope, receive, send)

        async def start():
            self.http = HTTPServer(app, "127.0.0.1", 0, header_timeout_s=T, body_timeout_s=T, send_timeout_s=T,
                                   protocol=protocol, max_body_bytes=MAX_BODY).start()
            self.port = self.http.sock.getsockname()[1]
            ready.set()

        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(start(), self.loop)
        assert ready.wait(10)

    async def app(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            m = await receive()
            if m["type"] == "http.disconnect":
                self.disconnects += 1
                return
            body += m.get("body", b"")
            if not m.get("more_body"):
                break
        if scope["path"].startswith("/hooked"):
            return await self.hooked(scope, receive, send)
        if scope["path"].startswith("/big/"):  # /big/N: N x 64 KiB streamed, until the client goes
            return await self.big(int(scope["path"][5:]), receive, send)
        if scope["path"].startswith("/blob/"):  # /blob/N: N x 64 KiB in one body, then done
            body = b"y" * (int(scope["path"][6:]) << 16)
        if scope["path"] == "/slow":
            await asyncio.sleep(3 * T)  # longer than both timeouts: serving is not timed
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def hooked(self, scope, receive, send) -> None:
        """/hooked: a stream that lists a CLIENT_LOST hook and ends when its client goes;
        /hooked-done: a whole response (its hook must never be called). Each call of a hook
        records whether the handler had seen the disconnect by then."""
        seen: list = []
        scope.setdefault(CLIENT_LOST, []).append(lambda: self.lost.append(bool(seen)))
        if scope["path"] == "/hooked-done":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
            return await send({"type": "http.response.body", "body": b"ok"})
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"data: x\n\n", "more_body": True})
        assert (await receive())["type"] == "http.disconnect"
        seen.append(True)
        self.disconnects += 1

    async def big(self, n: int, receive, send) -> None:
        gone = asyncio.ensure_future(receive())  # http.disconnect once the connection is lost
        t0 = time.monotonic()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for _ in range(n):
            await send({"type": "http.response.body", "body": b"x" * 65536, "more_body": True})
            await asyncio.sleep(0)
            if gone.done():
                self.disconnects += 1
                return
        await send({"type": "http.response.body", "body": b""})
        self.sent_for = time.monotonic() - t0
        gone.cancel()

    def connect(self, rcvbuf: int | None = None) -> socket.socket:
        s = socket.socket()
        if rcvbuf:  # a small window: the server's bytes wait in its buffers sooner
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        s.settimeout(10)
        s.connect(("127.0.0.1", self.port))
        return s

    def connections(self) -> int:
        return len(self.http.server.server_state.connections)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.http.stop(), self.loop).result(20)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module", params=["httptools", "h11"])
def server(request):
    from uvicorn.protocols.http.h11_impl import H11Protocol
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    s = Server({"httptools": HttpToolsProtocol, "h11": H11Protocol}[request.param])
    yield s
    s.stop()


def read_all(s: socket.socket) -> bytes:
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def request(path: str = "/echo", body: bytes = b"hello") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-length: {len(body)}\r\n\r\n").encode() + body


def assert_answered(s: socket.socket, body: bytes = b"hello") -> None:
    got = b""
    while b"\r\n\r\n" not in got or not got.endswith(body):
        chunk = s.recv(65536)
        assert chunk, f"closed before the answer: {got!r}"
        got += chunk
    assert got.startswith(b"HTTP/1.1 200"), got


def test_a_connection_that_sends_nothing_gets_408_and_is_closed(server):
    with server.connect() as s:
        t0 = time.monotonic()
        got = read_all(s)
        assert got.startswith(b"HTTP/1.1 408") and b'"code":"request_timeout"' in got, got
        assert T * 0.8 < time.monotonic() - t0 < T + 2


@pytest.mark.parametrize("split", [1, 7, 20, 33])
def test_headers_dripped_slower_than_the_deadline_are_cut_off(server, split):
    head = request()
    with server.connect() as s:
        t0 = time.monotonic()
        s.sendall(head[:split])
        try:
            for b in head[split:split + 12]:  # a byte every T/4: the deadline is for the whole head
                time.sleep(T / 4)
                s.sendall(bytes([b]))
        except (BrokenPipeError, ConnectionResetError):
            pass
        got = read_all(s)
        assert got.startswith(b"HTTP/1.1 408"), got
        assert time.monotonic() - t0 < T + 2


def test_a_body_that_stops_closes_the_connection_and_the_handler_sees_a_disconnect(server):
    before = server.disconnects
    with server.connect() as s:
        s.sendall(request(body=b"0123456789")[:-7])
        t0 = time.monotonic()
        assert read_all(s) == b""  # closed, no answer
        assert T * 0.8 < time.monotonic() - t0 < T + 2
    deadline = time.monotonic() + 5
    while server.disconnects == before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.disconnects == before + 1


def test_a_body_that_keeps_coming_is_read_whole(server):
    body = b"abcdefgh"
    with server.connect() as s:
        s.sendall(request(body=body)[:-len(body)])
        for b in body:  # 8 reads over 2 x T: each gap under the body timeout
            time.sleep(T / 4)
            s.sendall(bytes([b]))
        assert_answered(s, body)


def test_serving_is_not_timed_and_keep_alive_requests_get_their_own_deadline(server):
    with server.connect() as s:
        s.sendall(request("/slow"))
        assert_answered(s)  # took 3 x T
        s.sendall(request())
        assert_answered(s)
        time.sleep(T / 2)
        s.sendall(b"POST /echo HTTP/1.1\r\n")  # the next request's first line, then nothing
        got = read_all(s)
        assert got.startswith(b"HTTP/1.1 408"), got


def test_many_stalled_connections_go_and_the_server_still_answers(server):
    stalled = [server.connect() for _ in range(200)]
    for i, s in enumerate(stalled):
        s.sendall(request()[: i % 40])
    with server.connect() as s:  # answered meanwhile
        s.sendall(request())
        assert_answered(s)
    t0 = time.monotonic()
    for s in stalled:
        s.settimeout(T + 5)
        read_all(s)  # closed by the server (a timeout here raises)
        s.close()
    assert time.monotonic() - t0 < T + 5


def get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nhost: x\r\n\r\n".encode()


def wait_for(cond, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)
    return cond()


def test_a_stream_the_client_stops_reading_is_reset_and_its_handler_sees_a_disconnect(server):
    before = server.disconnects
    with server.connect(rcvbuf=4096) as s:
        s.sendall(get("/big/512"))  # 32 MiB: far past every buffer on the way
        t0 = time.monotonic()
        assert wait_for(lambda: server.disconnects > before), "the handler never saw the client go"
        assert time.monotonic() - t0 < 1.5 * T + 1  # no byte taken for T: checked every T/4
        assert wait_for(lambda: server.connections() == 0)
        with pytest.raises(ConnectionResetError):  # a TCP reset, not a close the kernel would hold
            while s.recv(1 << 20):
                pass
    with server.connect() as s:  # and the server answers the next client
        s.sendall(request())
        assert_answered(s)


@pytest.mark.parametrize("how", ["close", "reset"])
def test_a_connection_lost_mid_response_calls_its_hooks_before_the_handler_sees_it(server, how):
    """A handler's CLIENT_LOST hooks (how a stream's requests are aborted on their workers)
    run in the protocol's connection_lost, once, ahead of the handler's own http.disconnect;
    a response that was whole never calls them."""
    lost, before = len(server.lost), server.disconnects
    with server.connect() as s:
        s.sendall(get("/hooked-done"))
        assert_answered(s, b"ok")
        s.sendall(get("/hooked"))
        got = b""
        while b"data: x" not in got:
            got += s.recv(1 << 16)
        if how == "reset":
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    assert wait_for(lambda: server.disconnects > before), "the handler never saw the client go"
    assert server.lost[lost:] == [False]


@pytest.mark.parametrize("chunks", [160, 512])
def test_a_response_done_but_left_unread_does_not_hold_its_connection(server, chunks):
    """The app has finished (10 or 32 MiB in one body, more than the kernel's socket buffers
    take); the bytes the client never takes wait in the server's, and the connection is reset
    T after the last byte left. (A response the kernel takes whole leaves an idle keep-alive
    connection, closed by uvicorn's keep-alive timeout.)"""
    with server.connect(rcvbuf=4096) as s:
        s.sendall(request(f"/blob/{chunks}"))
        time.sleep(0.2)
        assert server.connections() == 1
        assert wait_for(lambda: server.connections() == 0, 1.5 * T + 1)
        with pytest.raises(ConnectionResetError):
            while s.recv(1 << 20):
                pass


def test_a_slow_reader_that_keeps_reading_is_never_cut(server):
    """512 KiB every T/5: the server waits on this client longer than T in all, but bytes leave
    within every T."""
    with server.connect(rcvbuf=4096) as s:
        s.sendall(get("/big/192"))  # 12 MiB: more than the kernel's buffers take
        got = bytearray()
        while not got.endswith(b"0\r\n\r\n"):
            mark = len(got)
            while len(got) - mark < 512 << 10 and not got.endswith(b"0\r\n\r\n"):
                chunk = s.recv(1 << 16)
                assert chunk, f"cut after {len(got)} bytes"
                got += chunk
            time.sleep(T / 5)
        assert got.startswith(b"HTTP/1.1 200")
    assert server.sent_for > 2 * T  # it did wait on the client, two send timeouts' worth


def head_with(header_bytes: int, n: int = 1) -> bytes:
    """A request whose head carries `n` headers of about `header_bytes` bytes in all."""
    each = header_bytes // n
    return (b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\n"
            + b"".join(b"x-h%d: %s\r\n" % (i, b"a" * each) for i in range(n)) + b"\r\n")


def flood(server, data: bytes, reset_as: bytes) -> tuple[bytes, float]:
    """Send `data` a MiB at a time on one connection while another's request is answered; then
    (what the first got, seconds taken). A reset after the server's answer reads as `reset_as`:
    the rest of our bytes arrived after the close."""
    with server.connect() as s, server.connect() as other:
        t0 = time.monotonic()
        try:
            for i in range(0, len(data), 1 << 20):
                s.sendall(data[i:i + (1 << 20)])
        except (BrokenPipeError, ConnectionResetError):
            pass  # closed once past the bound, as it should
        other.sendall(request())
        assert_answered(other)
        try:
            got = read_all(s)
        except ConnectionResetError:
            got = reset_as
        return got, time.monotonic() - t0


@pytest.mark.parametrize("n", [1, 4000])
def test_a_head_over_the_bound_is_431_at_once_and_the_loop_keeps_serving(server, n):
    got, took = flood(server, head_with(8 << 20, n), b"HTTP/1.1 431 (reset after it)")
    assert got.startswith(b"HTTP/1.1 431"), got[:200]
    assert took < 5


@pytest.mark.parametrize("size", [MAX_HEAD_BYTES // 2, MAX_HEAD_BYTES - 200])
def test_a_head_under_the_bound_is_served_with_its_body_in_the_same_write(server, size):
    with server.connect() as s:
        s.sendall(head_with(size, 8) + b"hello")
        assert_answered(s)


def test_a_large_body_is_not_counted_as_head(server):
    body = b"b" * (4 * MAX_HEAD_BYTES)
    with server.connect() as s:
        s.sendall(request(body=body))  # one write: its head and a body 4x the head bound
        assert_answered(s, body)
        s.sendall(request(body=body[:1000]))  # and on the same connection, kept alive
        assert_answered(s, body[:1000])


def test_a_trailer_cannot_grow_without_bound(server):
    head = b"POST /echo HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\nx-t: "
    # 16 MiB of one trailer line, where the body itself is 5 bytes
    got, took = flood(server, head + b"a" * (16 << 20), b"HTTP/1.1 413 (reset after it)")
    # ours, or h11's own bound on an incomplete event (a trailer line is one), which comes first
    assert got[:12] in (b"HTTP/1.1 413", b"HTTP/1.1 400"), got[:200]
    assert took < 5


def test_a_chunked_body_under_the_bound_is_read_whole_in_small_chunks(server):
    body = bytes(range(256)) * (MAX_BODY // 256)  # the app's whole bound, in 1 KiB chunks
    framed = b"".join(b"%x\r\n%s\r\n" % (1024, body[i:i + 1024]) for i in range(0, len(body), 1024))
    with server.connect() as s:
        s.sendall(b"POST /echo HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n" + framed
                  + b"0\r\nx-trailer: ok\r\n\r\n")
        assert_answered(s, body)


@pytest.mark.parametrize("reset", [True, False])
def test_a_stream_with_a_pipelined_request_behind_it_sees_its_client_go(server, reset):
    """HTTP/1.1 pipelining: a second request sent behind a stream, then the client leaves (a
    reset or a close). httptools' protocol kept only the queued request and told only it: the
    stream went on writing into the closed socket to its end (attack of 2026-12-06, 28-650
    tokens after the reset)."""
    before = server.disconnects
    with server.connect() as s:
        s.sendall(get("/big/4096") + request())  # 256 MiB: never finishes in this test's time
        assert s.recv(1 << 16).startswith(b"HTTP/1.1 200")
        if reset:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    assert wait_for(lambda: server.disconnects > before, 3.0), "the stream never saw its client go"
    assert wait_for(lambda: server.connections() == 0)
    with server.connect() as s:  # and the server answers the next client
        s.sendall(request())
        assert_answered(s)
