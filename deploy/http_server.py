"""The OpenAI-compatible HTTP API served by each frontend replica itself.

Through Serve's HTTP proxy every request, and every chunk of every stream, crossed one
more process (proxy -> replica, a Ray call per chunk). Instead each replica runs its own
uvicorn server on the API's port, bound with SO_REUSEPORT as the gRPC server is, so the
replicas of one node share the port and the kernel spreads connections across them.
Ray Serve still owns the replicas' lifecycle, health checks and scaling; its own proxy,
when one runs, listens elsewhere and serves the same routes (the slower way in).

The app is the Serve ingress's FastAPI app: its class-based routes find their replica
through Serve's replica context, which is process-wide, so they run unchanged here.

Slow clients, large heads and clients that do not read: http_deadlines.py, whose protocol
class (uvicorn's own with its bounds) this server runs.
"""

from __future__ import annotations

import asyncio
import logging
import socket

from folio.deploy.http_deadlines import BODY_TIMEOUT_S, HEADER_TIMEOUT_S, MAX_HEAD_BYTES, SEND_TIMEOUT_S, deadlines

log = logging.getLogger("folio.http")

LISTEN_BACKLOG = 2048


def reuseport_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port) that other replicas on this node can share."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(LISTEN_BACKLOG)
        sock.setblocking(False)
    except OSError as e:
        sock.close()
        raise RuntimeError(f"the HTTP API cannot bind {host}:{port}: {e}") from e
    return sock


class HTTPServer:
    """uvicorn on the running event loop, serving `app` on a shared (SO_REUSEPORT) port."""

    def __init__(self, app, host: str, port: int, keep_alive_s: float = 90.0,
                 header_timeout_s: float = HEADER_TIMEOUT_S, body_timeout_s: float = BODY_TIMEOUT_S,
                 protocol: type | None = None, max_body_bytes: int = 8 << 20,
                 send_timeout_s: float = SEND_TIMEOUT_S) -> None:
        """`protocol`: uvicorn's HTTP protocol class to put the deadlines on (default: httptools'
        where it is installed, else h11's, as uvicorn picks)."""
        import uvicorn
        from uvicorn.protocols.http.auto import AutoHTTPProtocol

        self.host, self.port = host, port
        self.sock = reuseport_socket(host, port)
        logging.getLogger("uvicorn.error").setLevel(logging.CRITICAL)  # errors are answered, not logged
        config = uvicorn.Config(app, lifespan="off", access_log=False, log_level=None, log_config=None,
                                timeout_keep_alive=keep_alive_s,
                                http=deadlines(protocol or AutoHTTPProtocol, header_timeout_s, body_timeout_s,
                                               max_body=max_body_bytes, send_s=send_timeout_s),
                                # h11's own bound above ours plus a read (<= 256 KiB), so ours answers first
                                h11_max_incomplete_event_size=MAX_HEAD_BYTES + (512 << 10))
        self.server = uvicorn.Server(config)
        self.server.install_signal_handlers = lambda: None  # the replica's signals are Ray's
        self.task: asyncio.Task | None = None

    def start(self, ready=None, ready_timeout_s: float = 60.0) -> "HTTPServer":
        """Serve from the running loop; with `ready` (a callable), only once it returns True
        (connections made before wait in the listen backlog)."""
        async def run():
            deadline = asyncio.get_running_loop().time() + ready_timeout_s
            while ready is not None and not ready():
                if asyncio.get_running_loop().time() > deadline:
                    raise RuntimeError("the replica never became ready to serve HTTP")
                await asyncio.sleep(0.01)
            await self.server.serve(sockets=[self.sock])
        self.task = asyncio.get_running_loop().create_task(run())
        return self

    @property
    def failed(self) -> BaseException | None:
        """Why the server stopped, if it did (the replica's health check reports it)."""
        if self.task is None or not self.task.done():
            return None
        if self.task.cancelled():
            return RuntimeError("the HTTP server was cancelled")
        return self.task.exception() or RuntimeError("the HTTP server stopped")

    def open_connections(self) -> int:
        return len(self.server.server_state.connections)

    def cut(self) -> None:
        """Close every connection left: a 503 where no response has started, else cut."""
        for conn in list(self.server.server_state.connections):
            if hasattr(conn, "cut"):
                conn.cut()
            else:
                conn.transport.close()

    async def stop(self, grace_s: float = 10.0) -> None:
        """Stop listening at once; requests in flight finish within `grace_s` (uvicorn's graceful
        shutdown: idle keep-alive connections close now, the others after their response), then
        the rest are cancelled (a drain cuts them first: `cut`)."""
        self.server.should_exit = True
        self.server.config.timeout_graceful_shutdown = grace_s
        if self.task is not None and not self.server.started:  # still waiting to serve: nothing in flight
            self.task.cancel()
        if self.task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self.task), grace_s + 1)
            except (asyncio.TimeoutError, asyncio.CancelledError, Exception):
                self.server.force_exit = True
                self.task.cancel()
        self.sock.close()
