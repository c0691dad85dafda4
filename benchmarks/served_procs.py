"""The processes of a `folio serve` (or `vllm serve`) that the serving benchmarks start and
read: start, wait for and stop one (its whole process tree), and what each process costs
(CPU by role, the engine's involuntary context switches and nice values, its /metrics
counters). Used by serving_path_cost.py, cpu_contention.py (through it) and served_ab.py.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
import urllib.request

from serve_local import free_port, serve_command  # one copy: the main job's


def engine_counters(port: int) -> dict:
    """The worker's step count and forward seconds, from `folio serve`'s /metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    got = {"steps": 0.0, "forward": 0.0}
    for line in text.splitlines():
        if line.startswith("folio_engine_steps_total{"):
            got["steps"] += float(line.rsplit(" ", 1)[1])
        elif line.startswith("folio_engine_step_seconds_total{") and 'phase="forward"' in line:
            got["forward"] += float(line.rsplit(" ", 1)[1])
    return got


def cpu_by_role(root: int) -> dict:
    """CPU seconds (user + system) so far of `folio serve`'s process tree, by role."""
    import psutil

    out: dict = {}
    procs = [psutil.Process(root)] + psutil.Process(root).children(recursive=True)
    for p in procs:
        try:
            cmd = " ".join(p.cmdline()) + " " + p.name()  # vLLM names its engine process (comm) only
            t = p.cpu_times()
        except psutil.Error:
            continue
        # vLLM's engine: its engine core and, on the CPU build, the executor's worker process
        # that runs the forward (VLLM::Worker; counted with "the rest" before 2026-12-06)
        role = ("engine worker" if "EngineWorker" in cmd or "EngineCor" in cmd or "VLLM::Worker" in cmd else
                "frontend replica" if "FolioFrontend" in cmd or "api_server" in cmd else
                "Ray, Redis, driver (the rest)")
        out[role] = out.get(role, 0.0) + t.user + t.system
    return out


def thread_preemptions(pid: int) -> int:
    """Involuntary context switches so far of every thread of process `pid` (a thread taken
    off its core by another runnable thread)."""
    n = 0
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{t}/status") as f:
                n += int(f.read().split("nonvoluntary_ctxt_switches:")[1].split()[0])
        except (OSError, IndexError, ValueError):  # a thread that ended meanwhile
            continue
    return n


def engine_pid(root: int) -> int | None:
    """The engine's process in `folio serve`'s (or vLLM's) tree."""
    import psutil

    for p in psutil.Process(root).children(recursive=True):
        try:
            cmd = " ".join(p.cmdline()) + " " + p.name()
        except psutil.Error:
            continue
        if "EngineWorker" in cmd or "EngineCor" in cmd:
            return p.pid
    return None


def engine_preemptions(root: int) -> int:
    """thread_preemptions of the engine's process in `folio serve`'s (or vLLM's) tree."""
    pid = engine_pid(root)
    return thread_preemptions(pid) if pid else 0


def thread_nice(pid: int | None) -> list[int]:
    """The nice values a process's threads run at (Ray starts its workers at 15 unless told)."""
    seen = set()
    for tid in os.listdir(f"/proc/{pid}/task") if pid else []:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                seen.add(int(f.read().rsplit(")", 1)[1].split()[16]))
        except (OSError, IndexError, ValueError):
            continue
    return sorted(seen)


SERVE_ENV = dict(os.environ, RAY_AUTH_MODE="disabled", HF_HUB_OFFLINE="1")


def start_folio(model: str, kv_blocks: int, threads: int | None = None,
                env: dict | None = None) -> tuple[subprocess.Popen, int, int]:
    """`folio serve` with one worker and `kv_blocks` blocks of 16 tokens, in a session of its
    own, not waited for: (process, HTTP port, gRPC port). `env`: more environment for it (and
    so for its engine worker)."""
    port, grpc_port = free_port(), free_port()
    log = tempfile.NamedTemporaryFile("w", suffix=".log", delete=False)
    srv = subprocess.Popen(serve_command(model, 1, port, grpc_port, "--block-size", "16", "--num-kv-blocks", str(kv_blocks),
                                         "--max-model-len", "1024", "--max-num-requests", "1024",
                                         "--namespace", f"cost{os.getpid()}p{port}", "--grace-period-s", "1",
                                         *(["--torch-threads", str(threads)] if threads else [])),
                           env=dict(SERVE_ENV, **(env or {})), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return srv, port, grpc_port


def wait_ready(srv: subprocess.Popen, port: int, ready_s: float = 300) -> None:
    for _ in range(int(ready_s)):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2)
            return
        except OSError:
            if srv.poll() is not None:
                raise SystemExit(f"the server exited with {srv.returncode} before it was ready")
            time.sleep(1)
    raise SystemExit(f"the server was not ready in {ready_s:.0f} s")


def stop_tree(srv: subprocess.Popen) -> None:
    """The whole tree gone before the next run starts: Ray's workers outlive the driver by
    seconds, and a cluster still stopping took half the next mode's cores."""
    import psutil

    tree = psutil.Process(srv.pid).children(recursive=True)
    os.killpg(srv.pid, 15)
    srv.wait(120)
    _, alive = psutil.wait_procs(tree, timeout=60)
    for p in alive:
        p.kill()
