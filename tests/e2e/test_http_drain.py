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
        while (await receive()).get("more_body"):  # the whole body first, as the API's handlers read it
            pass
        if scope["path"].startswith("/stream/"):  # ends when its client goes, as Starlette's StreamingResponse
            gone = asyncio.ensure_future(receive())
            await send({"type": "http.response.start", "status": 200, "headers": []})
            for i in range(int(scope["path"][8:])):
                await send({"type": "http.response.body", "body": b"chunk %d\n" % i, "more_body": True})
                await asyncio.wait([gone], timeout=PACE_S)
                if gone.done():
                    return
            gone.cancel()
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


@pytest.mark.parametrize("n", [0, 3])
def test_an_http_1_0_stream_is_sent_as_it_comes_and_ended_by_the_close(protocol, n):
    """A response of no stated length to an HTTP/1.0 request (every server-sent event stream)
    is its body as it comes, ended by the connection's close (RFC 9112 section 6.3): httptools'
    protocol sent it chunked, which HTTP/1.0 may not use, and a 1.0 client (or nginx's default
    proxy_http_version 1.0) read the chunk sizes as text (deploy/http10.py). HTTP/1.1 keeps its
    chunks; a response with a length keeps it."""
    server = Server(protocol)
    try:
        s = connect(server.port)
        s.sendall(f"GET /stream/{n} HTTP/1.0\r\nhost: x\r\n\r\n".encode())
        head, _, body = read_to_close(s).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding" not in head.lower(), head
        assert body == b"".join(b"chunk %d\n" % i for i in range(n)) + b"end\n", body
        s = connect(server.port)
        s.sendall(b"GET /ok HTTP/1.0\r\nhost: x\r\n\r\n")
        head, _, body = read_to_close(s).partition(b"\r\n\r\n")
        assert b"content-length: 2" in head.lower() and body == b"ok", (head, body)
        s = connect(server.port)
        get(s, f"/stream/{n}")
        head = read_until(s, b"\r\n\r\n")
        assert b"transfer-encoding: chunked" in head.lower(), head
        assert read_until(s, b"0\r\n\r\n", head).endswith(b"end\n\r\n0\r\n\r\n")
        s.close()
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


def post_head(path: str, length: int) -> bytes:
    return f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {length}\r\n\r\n".encode()


def test_the_cut_answers_503_to_a_request_still_arriving_and_ends_a_stream(protocol):
    """What outlasts a drain: a body still arriving gets a 503 in OpenAI's shape, which a client
    may retry (uvicorn's own cut answered a plain-text 500, found by an attack); a stream ends
    without its last chunk."""
    server = Server(protocol)
    try:
        trickle = connect(server.port)
        trickle.sendall(post_head("/ok", 100) + b'{"prompt": ')  # and no more of it
        stream = connect(server.port)
        get(stream, "/stream/100")
        head = read_until(stream, b"chunk 0")
        stopping = server.stop(grace_s=30)
        time.sleep(0.3)
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0), server.loop).result(5)  # (the loop is free)
        server.loop.call_soon_threadsafe(server.http.cut)
        answer = read_to_close(trickle)
        assert answer.startswith(b"HTTP/1.1 503") and b'"code":"server_shutting_down"' in answer, answer
        assert b"application/json" in answer and b"connection: close" in answer.lower()
        body = read_to_close(stream, head)
        assert b"end\n" not in body and not body.endswith(b"\r\n0\r\n\r\n")
        stopping.join(10)
        assert not stopping.is_alive()
    finally:
        server.close()


def test_a_request_head_still_arriving_when_the_drain_starts_gets_a_503(protocol):
    server = Server(protocol)
    try:
        first = connect(server.port)  # a head in part, on a new connection
        first.sendall(b"GET /ok HTTP/1.1\r\nhost: x\r\n")
        second = connect(server.port)  # and on a kept-alive one, after its first answer
        get(second, "/ok")
        assert read_until(second, b"ok").startswith(b"HTTP/1.1 200")
        second.sendall(b"GET /ok HTTP/1.1\r\n")
        time.sleep(0.2)  # (both parts read by the server)
        stopping = server.stop(grace_s=30)
        for s in (first, second):
            answer = read_to_close(s)
            assert answer.startswith(b"HTTP/1.1 503") and b'"code":"server_shutting_down"' in answer, answer
        stopping.join(10)
        assert not stopping.is_alive()
    finally:
        server.close()


def test_a_drain_ends_what_is_left_with_an_error_and_counts_it_first(protocol):
    """replica_drain.drain on a real HTTP server. At the drain's end the frontend's requests
    left are ended with ShuttingDownError (Frontend.cut: each aborted on its worker, its stream
    ending with the error as its last event and a whole body, as openai_sse does); what that
    does not end (a handler that never sees it, a request whose body is still arriving) is cut
    next: a 503 where no response has started, else the connection closed. The requests and
    connections left are counted before either (counted after the cut, they read 0 after every
    drain), and the replica's metrics are published once, after."""
    import types

    from folio.deploy.replica_drain import drain
    from folio.worker.errors import ShuttingDownError

    server = Server(protocol)
    frontend = types.SimpleNamespace(in_flight=0, published=0, cut_with=[])
    frontend.metrics = types.SimpleNamespace(replicas=types.SimpleNamespace(
        publish=lambda: setattr(frontend, "published", frontend.published + 1)))
    ended = asyncio.Event()  # set by the frontend's cut, on the server's loop
    frontend.cut = lambda err: (frontend.cut_with.append(err), ended.set())

    async def counted(scope, receive, send):  # in flight as the frontend's admission counts
        path = scope.get("path", "")
        n = int(path.startswith(("/stream/", "/ended")))
        frontend.in_flight += n
        try:
            if path == "/ended":  # a stream that ends with the error once the frontend's requests are ended
                while (await receive()).get("more_body"):
                    pass
                await send({"type": "http.response.start", "status": 200, "headers": []})
                await send({"type": "http.response.body", "body": b"chunk 0\n", "more_body": True})
                await ended.wait()
                await send({"type": "http.response.body", "body": b"data: {\"error\": 503}\n\ndata: [DONE]\n\n"})
            else:  # /stream/N: one that the frontend's cut does not reach
                await Server.app(server, scope, receive, send)
        finally:
            frontend.in_flight -= n
    server.app = counted
    try:
        short, long_, deaf = connect(server.port), connect(server.port), connect(server.port)
        get(short, "/stream/3")
        get(long_, "/ended")
        get(deaf, "/stream/100")
        heads = [read_until(s, b"chunk 0") for s in (short, long_, deaf)]
        trickle = connect(server.port)
        trickle.sendall(post_head("/ok", 100) + b"{")
        deadline = time.monotonic() + 5
        while server.http.open_connections() < 4:
            assert time.monotonic() < deadline
            time.sleep(0.01)

        async def run():
            replica = types.SimpleNamespace(frontend=frontend, http=server.http, grpc=None,
                                            watch_task=asyncio.ensure_future(asyncio.sleep(3600)),
                                            metrics_stop=threading.Event())
            return await drain(replica, 1.0), replica.metrics_stop.is_set()
        done, stopped = asyncio.run_coroutine_threadsafe(run(), server.loop).result(20)
        assert done["requests"] == 3 and done["connections"] == 4, done
        assert done["left"] == 2 and done["left_connections"] == 3, done  # the two long streams, and the trickle
        assert 1.0 <= done["seconds"] < 2.5 and stopped and frontend.published == 1, done
        assert [type(e) for e in frontend.cut_with] == [ShuttingDownError]
        assert read_to_close(short, heads[0]).endswith(b"\r\n0\r\n\r\n")  # ended whole within the drain
        body = read_to_close(long_, heads[1])  # ended by the error, whole
        assert b"data: [DONE]" in body and body.endswith(b"\r\n0\r\n\r\n"), body[-200:]
        assert not read_to_close(deaf, heads[2]).endswith(b"\r\n0\r\n\r\n")  # cut
        assert read_to_close(trickle).startswith(b"HTTP/1.1 503")
        assert refused(server.port) and frontend.in_flight == 0  # the cut stream's handler ended
    finally:
        server.close()
