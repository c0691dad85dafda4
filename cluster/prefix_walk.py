"""The router's prefix walk (state.py's _WALK_PREFIX) over a lean asyncio Redis connection.

Prefix-aware routing runs one EVALSHA per decision. Through redis-py's asyncio client that
costs ~200 us of the event loop's CPU per call (command packing, its parser, a timeout
context and an observability hook per read); this connection writes the call as one
pre-framed buffer and reads the one bulk-string reply: ~30 us. Only this one read goes
this way; everything else in the cluster state stays on redis-py.

- Pipelined: calls from concurrent decisions share the connection, replies come back in
  order (RESP), each resolves its caller's future.
- Errors are redis-py's exception types, so callers treat them alike: a reply that does not
  arrive within `timeout_s` fails every call in flight with redis.TimeoutError and drops the
  connection; a lost connection fails them with redis.ConnectionError; the next call
  connects again (AUTH and SELECT first). NOSCRIPT (a Redis that restarted) sends the
  script itself once (EVAL, which caches it again).
- One connection per event loop (a transport belongs to its loop).
- redis:// over TCP only: `supported(url)` is False for TLS or a Unix socket, and the
  caller keeps redis-py for those.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import deque

import redis
from redis.connection import parse_url


def _frame(*args: bytes) -> bytes:
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)


def _error(line: bytes) -> redis.RedisError:
    msg = line.decode("utf-8", "replace")
    if msg.startswith("NOSCRIPT"):
        return redis.exceptions.NoScriptError(msg)
    if msg.startswith(("NOAUTH", "WRONGPASS", "NOPERM")):
        return redis.AuthenticationError(msg)
    return redis.ResponseError(msg)


class _Connection(asyncio.Protocol):
    def __init__(self, timeout_s: float, where: str) -> None:
        self.timeout_s = timeout_s
        self.where = where
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._buf = bytearray()
        self._pending: deque[tuple[asyncio.Future, float]] = deque()  # (reply, deadline), in send order
        self._timer: asyncio.TimerHandle | None = None
        self._loop = asyncio.get_running_loop()

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self._fail(redis.ConnectionError(f"Connection to {self.where} lost" + (f": {exc}" if exc else "")))

    def call(self, frame: bytes) -> asyncio.Future:
        if self.closed:
            raise redis.ConnectionError(f"Connection to {self.where} closed")
        fut = self._loop.create_future()
        self._pending.append((fut, self._loop.time() + self.timeout_s))
        self.transport.write(frame)
        if self._timer is None:
            self._timer = self._loop.call_at(self._pending[0][1], self._check)
        return fut

    def _check(self) -> None:
        self._timer = None
        if not self._pending:
            return
        if self._pending[0][1] <= self._loop.time():
            self._fail(redis.TimeoutError(f"Timeout reading from {self.where}"))
        else:
            self._timer = self._loop.call_at(self._pending[0][1], self._check)

    def _fail(self, exc: Exception) -> None:
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while self._pending:
            fut = self._pending.popleft()[0]
            if not fut.done():
                fut.set_exception(exc)
        if self.transport is not None:
            self.transport.abort()

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        while True:
            end = buf.find(b"\r\n")
            if end < 0:
                return
            kind = buf[:1]
            if kind == b"$":
                size = int(buf[1:end])
                if size < 0:
                    reply, used = None, end + 2
                elif len(buf) < end + 4 + size:
                    return
                else:
                    reply, used = bytes(buf[end + 2 : end + 2 + size]), end + 4 + size
            elif kind in (b"+", b":"):
                reply, used = bytes(buf[1:end]), end + 2
            elif kind == b"-":
                reply, used = _error(bytes(buf[1:end])), end + 2
            else:  # not a reply this connection asks for
                self._fail(redis.ConnectionError(f"unexpected reply from {self.where}: {bytes(buf[:end])[:40]!r}"))
                return
            del buf[:used]
            if not self._pending:
                self._fail(redis.ConnectionError(f"reply without a request from {self.where}"))
                return
            fut = self._pending.popleft()[0]
            if not fut.done():  # its caller may have been cancelled
                if isinstance(reply, Exception):
                    fut.set_exception(reply)
                else:
                    fut.set_result(reply)
            if not self._pending and self._timer is not None:
                self._timer.cancel()
                self._timer = None


class PrefixWalker:
    """Runs one Lua script (the prefix walk) over a lean connection; see the module doc."""

    def __init__(self, url: str, script: str, password: str | None = None, timeout_s: float = 0.5) -> None:
        opts = parse_url(url)
        self.host, self.port = opts.get("host", "localhost"), int(opts.get("port", 6379))
        self.db = int(opts.get("db", 0))
        self.username, self.password = opts.get("username"), password or opts.get("password")
        self.timeout_s = timeout_s
        self.script = script.encode()
        self.sha = hashlib.sha1(self.script).hexdigest().encode()
        self._conn: _Connection | None = None
        self._connecting: asyncio.Future | None = None
        self._keys: tuple[list[bytes] | None, bytes] = (None, b"")  # the last key list, framed

    @staticmethod
    def supported(url: str) -> bool:
        return "connection_class" not in parse_url(url)

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        where = f"{self.host}:{self.port}"
        _, conn = await asyncio.wait_for(
            loop.create_connection(lambda: _Connection(self.timeout_s, where), self.host, self.port),
            self.timeout_s)
        try:
            if self.password:
                auth = (self.username.encode(),) if self.username else ()
                await conn.call(_frame(b"AUTH", *auth, self.password.encode()))
            if self.db:
                await conn.call(_frame(b"SELECT", b"%d" % self.db))
        except BaseException:
            conn._fail(redis.ConnectionError(f"Connection to {where} closed"))
            raise
        return conn

    def _connected(self, attempt: asyncio.Future) -> None:
        if not attempt.cancelled() and attempt.exception() is None:
            self._conn = attempt.result()

    async def _connection(self) -> _Connection:
        conn = self._conn
        if conn is not None and not conn.closed:
            return conn
        attempt = self._connecting
        if attempt is None or attempt.done():  # concurrent callers share one attempt
            attempt = self._connecting = asyncio.ensure_future(self._connect())
            attempt.add_done_callback(self._connected)
        return await asyncio.shield(attempt)

    async def run(self, keys: list[bytes], args: list[bytes]) -> bytes | None:
        """The script's reply to `keys` and `args` (EVALSHA, EVAL after a NOSCRIPT)."""
        conn = await self._connection()
        if self._keys[0] is not keys:  # callers pass the same list decision after decision
            self._keys = (keys, b"$%d\r\n%d\r\n" % (len(str(len(keys))), len(keys))
                          + b"".join(b"$%d\r\n%s\r\n" % (len(k), k) for k in keys))
        tail = self._keys[1] + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)
        n = b"*%d\r\n" % (3 + len(keys) + len(args))
        try:
            return await conn.call(n + b"$7\r\nEVALSHA\r\n$%d\r\n%s\r\n" % (len(self.sha), self.sha) + tail)
        except redis.exceptions.NoScriptError:
            return await conn.call(n + b"$4\r\nEVAL\r\n$%d\r\n%s\r\n" % (len(self.script), self.script) + tail)

    def close(self) -> None:
        if self._conn is not None and not self._conn.closed:
            self._conn._fail(redis.ConnectionError("closed"))
