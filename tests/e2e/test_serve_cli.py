"""`folio serve` as a user runs it: a subprocess, real Ray, a real Redis, SIGTERM to stop."""

import contextlib
import os
import random
import signal
import subprocess
import sys
import time

import psutil
import pytest

from folio.cluster.redis_server import EmbeddedRedis
from folio.cluster.state import ClusterState


def folio(*args):
    return [sys.executable, "-m", "folio.deploy.cli", *args]


def test_serve_starts_workers_and_drains_on_sigterm(model_dirs, tmp_path):
    with EmbeddedRedis() as redis:
        env = dict(os.environ, RAY_AUTH_MODE="disabled")
        proc = subprocess.Popen(folio("serve", "--model", model_dirs["llama"], "--num-workers", "2",
                                      "--redis-url", redis.url, "--namespace", "clitest", "--block-size", "8",
                                      "--num-kv-blocks", "32", "--grace-period-s", "2", "--http-port", "0", "--grpc-port", "0"),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        try:
            lines = []
            deadline = time.monotonic() + 180
            while not any("ready" in line for line in lines):
                assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
                lines.append(proc.stdout.readline())
            state = ClusterState(redis.url, "clitest")
            loads = state.live_loads()
            assert sorted(loads) == ["w0", "w1"] and all(l.num_kv_blocks == 32 for l in loads.values())
            proc.send_signal(signal.SIGTERM)
            out, _ = proc.communicate(timeout=60)
            assert proc.returncode == 0, out
            assert "stopped" in out
            assert redis.password not in "".join(lines) + out  # the URL is printed redacted
            assert state.live_loads() == {}  # the workers left the registry at once
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.parametrize("args, message", [
    (["--num-workers", "0"], "num_workers must be >= 1"),
    (["--block-size", "0"], "block_size must be >= 1"),
    (["--dtype", "int3"], "dtype must be one of"),
    (["--torch-threads", "0"], "torch_threads must be >= 1"),
])
def test_serve_rejects_bad_arguments_clearly(model_dirs, args, message):
    r = subprocess.run(folio("serve", "--model", model_dirs["llama"], *args), capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and message in r.stderr


def test_serve_names_a_port_in_use_before_starting_anything(model_dirs):
    """A port another process holds: exit 2 at once, naming the flag and the cause, with no Ray
    started (it took ~23 s, Ray and the workers up and down, to print Serve's "Failed to update
    the deployments ['FolioFrontend']", 2026-12-07)."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        t0 = time.monotonic()
        r = subprocess.run(folio("serve", "--model", model_dirs["llama"], "--host", "127.0.0.1", "--http-port",
                                 str(free_port()), "--grpc-port", str(port)), capture_output=True, text=True,
                           timeout=120, env=dict(os.environ, RAY_AUTH_MODE="disabled"))
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"--grpc-port {port}: cannot bind 127.0.0.1:{port}: [Errno 98] Address already in use" in r.stderr
    assert "Ray" not in r.stdout + r.stderr and time.monotonic() - t0 < 60


def test_serve_rejects_a_missing_model():
    r = subprocess.run(folio("serve", "--model", "/nonexistent/model"), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "does not exist" in r.stderr


def group_left(pgid: int) -> list[str]:
    """Processes still in the process group `pgid` (what `folio serve` started)."""
    out = subprocess.run(["ps", "-eo", "pgid=,stat=,args="], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if line.split()[0] == str(pgid) and not line.split()[1].startswith("Z")]


def http_up(port: int) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
            return True
    except Exception:
        return False


@contextlib.contextmanager
def serve_in_its_own_group(model_dir: str, namespace: str, args: tuple = (), **env_extra: str):
    """`folio serve` (one worker, the HTTP API on a free port, and `args`) in a process group of
    its own: yields (proc, port); afterwards the group is killed whatever happened (never procps'
    `kill -9 -PGID`: procps-ng 4.0.2 sends that to pid -1, every process)."""
    port = free_port()  # the frontends (and Serve) run only with one
    env = dict(os.environ, RAY_AUTH_MODE="disabled", **env_extra)
    proc = subprocess.Popen(folio("serve", "--model", model_dir, "--num-workers", "1", "--block-size", "8",
                                  "--num-kv-blocks", "32", "--grace-period-s", "1", "--http-port", str(port),
                                  "--grpc-port", "0", "--host", "127.0.0.1", "--namespace", namespace, *args),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        yield proc, port
    finally:
        if proc.poll() is None:
            proc.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_until_ready(proc) -> list[str]:
    """`folio serve`'s output lines up to its "ready in" line."""
    lines = []
    deadline = time.monotonic() + 180
    while not any("ready in" in line for line in lines):
        assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
        lines.append(proc.stdout.readline())
    return lines


def assert_stopped_leaving_nothing(proc, out: str) -> None:
    assert proc.returncode == 0 and "stopped" in out, out
    deadline = time.monotonic() + 20
    while group_left(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not group_left(proc.pid), (group_left(proc.pid), out)


@pytest.mark.parametrize("when", ["ray-connecting", "3s", "8s", "http-up"])
def test_a_stop_while_starting_leaves_no_process_behind(model_dirs, when):
    """SIGTERM to `folio serve` alone (as `kill PID` sends it) while Ray, the embedded Redis, the
    workers or the frontends are starting: it stops, and nothing it started keeps running (Ray's
    own SIGTERM handler used to end the process at once and leave the embedded Redis up).
    "ray-connecting": 0.1-0.3 s after Ray's node is up, while ray.init connects this process to it
    (the signal meets the core worker's own handler): it ended in SIGABRT, then in SIGSEGV."""
    with serve_in_its_own_group(model_dirs["llama"], f"stop{when}") as (proc, port):
        t0, seen = time.monotonic(), ""
        if when == "ray-connecting":
            for line in proc.stdout:
                seen += line
                if "Started a local Ray instance" in line:
                    time.sleep(random.uniform(0.1, 0.3))
                    break
        while when != "ray-connecting" and proc.poll() is None and time.monotonic() - t0 < 120:
            if when == "http-up" and http_up(port) or when.endswith("s") and time.monotonic() - t0 > float(when[:-1]):
                break
            time.sleep(0.05)
        assert proc.poll() is None, seen + proc.communicate()[0]
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        assert_stopped_leaving_nothing(proc, seen + out)


def test_a_frozen_coordinator_and_a_frozen_frontend_replica_are_replaced(model_dirs):
    """SIGSTOP the coordinator (its silence past FOLIO_WORKER_FROZEN_S, 3 s here): /health says
    "degraded", and the frontend replica's watch (cluster/liveness.py) has Ray restart it; before,
    nothing did and /health said ok. Then SIGSTOP the frontend replica (a hang that holds the GIL
    looks the same): it keeps its listening sockets, so every client waited. Serve's default health
    checks (every 10 s, failed after 30 s, 3 in a row, then 20 s of graceful shutdown) left it so
    for over 60 s; with the deployment's own (serve_deployment.HEALTH) a new replica answered 22 s
    after the stop."""
    with serve_in_its_own_group(model_dirs["llama"], "frozenfe", FOLIO_WORKER_FROZEN_S="3") as (proc, port):
        lines = read_until_ready(proc)

        def child(name):
            return [c for c in psutil.Process(proc.pid).children(recursive=True) if name in " ".join(c.cmdline())]
        coordinator = child("CoordinatorActor")[0]
        coordinator.send_signal(signal.SIGSTOP)
        t0, said = time.monotonic(), set()
        try:
            while not (said and health(port).get("status") == "ok" and child("CoordinatorActor")
                       and child("CoordinatorActor")[0].pid != coordinator.pid):
                h = health(port)
                if h.get("status") == "degraded":
                    said.add(h["detail"])
                assert time.monotonic() - t0 < FROZEN_COORDINATOR_BOUND_S, f"not restarted; /health said {said}"
                time.sleep(0.5)
        finally:
            with contextlib.suppress(psutil.Error):
                coordinator.send_signal(signal.SIGCONT)
        assert all("the coordinator's heartbeat lapsed" in d for d in said), said
        print(f"stopped coordinator -> a new one and /health ok in {time.monotonic() - t0:.1f} s")
        replica = child("ServeReplica")[0]
        replica.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            while replica.is_running() and replica.status() != psutil.STATUS_ZOMBIE or not http_up(port):
                assert time.monotonic() - t0 < FROZEN_REPLICA_BOUND_S, "the stopped replica is still the one serving"
                time.sleep(0.5)
        finally:
            with contextlib.suppress(psutil.Error):
                replica.send_signal(signal.SIGCONT)
        print(f"stopped replica -> a new one answers in {time.monotonic() - t0:.1f} s")
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        assert_stopped_leaving_nothing(proc, "".join(lines) + out)


def gauge(port: int, name: str) -> float:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


SILENT_BOUND_S = 15.0  # FOLIO_CHANNEL_SILENT_S (3 s) after the heartbeat's TTL (1.5 s), checked every second


def test_a_stopped_worker_that_no_kill_reaches_has_its_streams_failed_by_the_frontend(model_dirs):
    """A whole node stopped (its raylet too) cannot be killed: Ray's kill waits on that raylet, and the
    streams on its worker hung for as long as it stayed stopped (45-100 s in a two-node attack). Here the
    coordinator's kill is kept away (FOLIO_WORKER_FROZEN_S 600 s) and the worker SIGSTOPped mid-stream:
    the frontend fails the stream itself once the worker's heartbeat has lapsed and its channel has been
    silent for FOLIO_CHANNEL_SILENT_S (3 s here). SIGCONT: the worker sees its channel closed and drops
    the request (KV back to 0), and the next request is served."""
    import openai

    with serve_in_its_own_group(model_dirs["llama"], "silentch", FOLIO_WORKER_FROZEN_S="600",
                                FOLIO_CHANNEL_SILENT_S="3") as (proc, port):
        lines = read_until_ready(proc)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=60)
        worker = [c for c in psutil.Process(proc.pid).children(recursive=True)
                  if "EngineWorker" in " ".join(c.cmdline())][0]
        stream = client.completions.create(model=os.path.basename(model_dirs["llama"]), prompt="def f(x):",
                                           max_tokens=200, temperature=0, stream=True, extra_body={"ignore_eos": True})
        next(iter(stream))
        worker.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            with pytest.raises(openai.APIError, match="heartbeat lapsed"):
                for _ in stream:
                    pass
            took = time.monotonic() - t0
            assert took < SILENT_BOUND_S, took
        finally:
            worker.send_signal(signal.SIGCONT)
        print(f"stream failed {took:.1f} s after the stop")
        assert_eventually(lambda: gauge(port, "folio_requests_running") == 0
                          and gauge(port, "folio_kv_cache_usage_ratio") == 0, "the worker to drop the request", 20)
        out = client.completions.create(model=os.path.basename(model_dirs["llama"]), prompt="def f(x):",
                                        max_tokens=4, temperature=0)
        assert out.choices[0].finish_reason == "length"
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=60)
        assert_stopped_leaving_nothing(proc, "".join(lines) + rest)


def test_two_frontend_replicas_share_the_ports_and_their_metrics(model_dirs):
    """`--frontend-replicas 2` (vLLM's --api-server-count): both replicas serve the HTTP port,
    every scrape of the shared metrics port counts both replicas' requests, and one replica
    killed leaves the other serving every new connection while Serve replaces it, with no total
    going down (its last published figures stay: deploy/replica_metrics.py)."""
    import json
    import urllib.request

    metrics = free_port()
    with serve_in_its_own_group(model_dirs["llama"], "tworeplicas",
                                ("--frontend-replicas", "2", "--metrics-port", str(metrics))) as (proc, port):
        lines = read_until_ready(proc)
        replicas = [c for c in psutil.Process(proc.pid).children(recursive=True)
                    if "ServeReplica" in " ".join(c.cmdline())]
        assert len(replicas) == 2 and listeners(port) == 2

        def complete(i: int) -> int:  # a new connection each: the kernel spreads them over both replicas
            body = json.dumps({"prompt": f"request {i}", "max_tokens": 2}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                         {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status

        def totals() -> list[float]:
            return [scrape_requests(metrics) for _ in range(8)]
        assert [complete(i) for i in range(24)] == [200] * 24
        assert_eventually(lambda: totals() == [24.0] * 8, "every scrape counting 24 requests")
        replicas[0].kill()
        t0, seen = time.monotonic(), []
        # Its socket closes when its last thread exits, not when the process reads as a zombie (the
        # leader waits as one while the others unmap the process's memory): a connection queued on it
        # until then is reset (CI, 2026-12-07: it read as a zombie ~20 ms before,
        # in 2 runs of 6). So wait for the port to have one listener left.
        assert_eventually(lambda: listeners(port) == 1, "the killed replica's socket closed")
        assert [complete(i) for i in range(24, 40)] == [200] * 16  # the other replica takes them all
        while sum(1 for c in psutil.Process(proc.pid).children(recursive=True)
                  if "ServeReplica" in " ".join(c.cmdline())) < 2:
            seen += totals()
            assert time.monotonic() - t0 < 60, "the killed replica was not replaced"
            time.sleep(0.5)
        assert_eventually(lambda: totals() == [40.0] * 8, "every scrape counting 40 requests")
        assert all(b >= a for a, b in zip(seen, seen[1:])) and min(seen, default=24) >= 24, seen
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        assert_stopped_leaving_nothing(proc, "".join(lines) + out)


def listeners(port: int) -> int:
    """The listening TCP sockets on `port` (SO_REUSEPORT: one per replica serving it)."""
    return sum(1 for c in psutil.net_connections("tcp") if c.laddr and c.laddr.port == port and c.status == "LISTEN")


def scrape_requests(port: int) -> float:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "folio_requests_total")


def assert_eventually(pred, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def health(port: int) -> dict:
    import json
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return json.loads(r.read())
    except Exception as e:
        return {"status": f"no answer: {e}"}


FROZEN_COORDINATOR_BOUND_S = 40.0  # its heartbeat's TTL (4 s), the bound (3 s), the ping (5 s), Ray's kill (~5 s)
FROZEN_REPLICA_BOUND_S = 60.0  # 22.0 s measured (3 failed checks of 5 s, 2 s apart, then 1 s of grace)


def test_a_sigterm_to_the_whole_process_group_stops_it_promptly(model_dirs):
    """As systemd stops a service (SIGTERM to every process of it): Ray's own processes, Serve's
    controller among them, get it too. `folio serve` waited 30 s for that dead controller's
    graceful shutdown (38 s in all); a Ray started here now goes whole with the cluster."""
    with serve_in_its_own_group(model_dirs["llama"], "stopgroup") as (proc, _):
        lines = read_until_ready(proc)
        procs = "\n".join(" ".join(c.cmdline()) for c in psutil.Process(proc.pid).children(recursive=True))
        # one worker: the coordinator only watches for a frozen worker, every second (0.9 % of a core idle,
        # 2026-12-07; at its 0.1 s cadence for moves, 1.5 %)
        assert "EngineWorker" in procs and "CoordinatorActor" in procs, procs
        os.killpg(proc.pid, signal.SIGTERM)
        t0 = time.monotonic()
        out, _ = proc.communicate(timeout=60)
        assert time.monotonic() - t0 < 25, out  # 38 s before (Serve's 30 s controller timeout)
        assert_stopped_leaving_nothing(proc, out)
