"""A frontend replica's own HTTP server stopping gracefully (deploy/http_server.py, used by
deploy/replica_drain.py when Serve stops the replica): it stops listening at once, closes
idle keep-alive connections, lets a stream in flight end whole within the grace, and cuts
what is left at its end. The real server class on a real socket, with raw-socket clients."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

from folio.deploy.http_server import HTTPServer

PACE_S = 0.1  # between a stream's chunks


class Server:
    def __init__(self, protocol: type, ready=None) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

        async def app(scope, receive, send):  # a function: uvicorn takes a bound method for ASGI 2
            await self.app(scope, receive, send)

        async def start():
            self.http = HTTPServer(app, "127.0.0.1", 0, protocol=protocol).start(ready=ready)
            return self.http.sock.getsockname()[1]
        self.port = asyncio.run_coroutine_threadsafe(start(), self.loop).result(10)

    async def app(self, scope, receive, send) -> None:  # /stream/N: N chunks PACE_S apart; else "ok"
        if scope["type"] != "http":
            return
        await receive()
        if scope["path"].startswith("/stream/"):
            await send({"type": "http.response.start", "status": 200, "headers": []})
            for i in range(int(scope["path"][8:])):
                await send({"type": "http.response.body", "body": b"chunk %d\n" % i, "more_body": True})
                await asyncio.sleep(PACE_S)
            return await send({"type": "http.response.body", "body": b"end\n"})
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    def stop(self, grace_s: float) -> threading.Thread:
        """Stops in the background (as Serve's call of the replica's __del__ does); returns the
        thread, which ends when the stop does."""
        t = threading.Thread(target=lambda: asyncio.run_coroutine_threadsafe(self.http.stop(grace_s),
                                                                             self.loop).result(60))
        t.start()
        return t

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(params=["httptools", "h11"])
def protocol(request):
    from uvicorn.protocols.http.h11_impl import H11Protocol
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    return {"httptools": HttpToolsProtocol, "h11": H11Protocol}[request.param]


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def get(s: socket.socket, path: str) -> None:
    s.sendall(f"GET {path} HTTP/1.1\r\nhost: x\r\n\r\n".encode())


def read_until(s: socket.socket, marker: bytes, got: bytes = b"") -> bytes:
    while marker not in got:
        chunk = s.recv(65536)
        if not chunk:
            return got
        got += chunk
    return got


def read_to_close(s: socket.socket, got: bytes = b"") -> bytes:
    while chunk := s.recv(65536):
        got += chunk
    return got


def refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        return False
    except ConnectionRefusedError:
        return True


@pytest.mark.parametrize("n", [5, 20])
def test_a_stream_in_flight_ends_whole_while_the_port_is_left_at_once(protocol, n):
    server = Server(protocol)
    try:
        idle = connect(server.port)  # one answered request, then idle on keep-alive
        get(idle, "/ok")
        assert read_until(idle, b"ok").startswith(b"HTTP/1.1 200")
        streams = [connect(server.port) for _ in range(3)]
        for s in streams:
            get(s, f"/stream/{n}")
        heads = [read_until(s, b"chunk 0") for s in streams]  # every stream in flight
        t0 = time.monotonic()
        stopping = server.stop(grace_s=30)
        deadline = time.monotonic() + 5
        while not refused(server.port):  # nothing listens any more: new connections go elsewhere
            assert time.monotonic() < deadline, "the port still listened 5 s after the stop"
            time.sleep(0.02)
        assert time.monotonic() - t0 < 1.0
        idle.settimeout(5)
        assert read_to_close(idle) == b""  # the idle connection closed, not left open
        for s, head in zip(streams, heads):  # each stream to its last chunk, then the connection closes
            body = read_to_close(s, head)
            assert all(b"chunk %d\n" % i in body for i in range(n)) and b"end\n" in body, body[-200:]
            assert body.endswith(b"\r\n0\r\n\r\n"), body[-200:]  # the chunked body's end
        stopping.join(30)
        assert not stopping.is_alive()
        assert time.monotonic() - t0 < n * PACE_S + 2  # it stopped when the streams ended, not at the grace's end
    finally:
        server.close()


def test_what_outlasts_the_grace_is_cut_at_its_end(protocol):
    server = Server(protocol)
    try:
        s = connect(server.port)
        get(s, "/stream/100")  # 10 s
        head = read_until(s, b"chunk 0")
        t0 = time.monotonic()
        stopping = server.stop(grace_s=0.5)
        body = read_to_close(s, head)  # cut: the connection ends without its last chunk
        cut_after = time.monotonic() - t0
        assert b"end\n" not in body and b"chunk 99" not in body and not body.endswith(b"\r\n0\r\n\r\n")
        stopping.join(10)
        assert not stopping.is_alive() and 0.4 < cut_after < 3.0, cut_after
        assert refused(server.port)
    finally:
        server.close()


def test_a_server_that_never_served_stops_at_once(protocol):
    server = Server(protocol, ready=lambda: False)  # still waiting for its replica to be ready
    try:
        t0 = time.monotonic()
        server.stop(grace_s=30).join(10)
        assert time.monotonic() - t0 < 2 and refused(server.port)
    finally:
        server.close()
