"""Beyond one machine: a two-node Ray cluster made on this machine (`ray start --head --block`
and `ray start --address ... --block`, processes this module owns, each node with its own temp
dir, ports and logical GPUs), then on it

1. `folio serve --address <head>`: two workers, one per node; HTTP and gRPC streams equal to
   the offline engine; a cross-node migration (the KV goes through the object store from one
   node's plasma to the other's) keeps every stream exact;
2. the Helm chart's own serveConfigV2 application (rendered from helm/folio: model, ports,
   KV size and the bind address swapped for this machine's) deployed with `serve deploy`
   (the dashboard REST API that KubeRay's RayService controller uses): the workers land on
   the GPU node, the frontend on the head, HTTP and gRPC answer as the offline engine does.
   Two frontend replicas (`serve.frontendReplicas`) share the head's ports, the metrics port
   included (each scrape counts both replicas' requests); the coordinator, stopped (SIGSTOP) while
   both replicas watch it, is restarted once. (Their kills come within a second of each other, so
   both reach the same stopped process: this does not show the claim in Redis, which lets one
   replica kill; test_cluster_state.py does.)

Topology: the head has 1 logical GPU and the chart's `folio-frontend` resource, node2 has 2
GPUs. Test 1 holds one of node2's GPUs (a placement group) so that the two workers must land
one per node; test 2 holds the head's GPU instead, which is the chart's head (num-gpus 0).

Ray's multi-node mode turns a loopback node address into the machine's own IP (Ray's
resolve_ip_for_localhost), so the Ray servers listen there for the module's duration;
everything Folio starts, the dashboard and Serve's proxy bind 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

import pytest

ray = pytest.importorskip("ray")
grpc = pytest.importorskip("grpc")
openai = pytest.importorskip("openai")
psutil = pytest.importorskip("psutil")

from folio.cluster.router import Router  # noqa: E402
from folio.cluster.state import ClusterState  # noqa: E402
from folio.cluster.worker_client import RayWorkerClient, actor_name  # noqa: E402
from folio.v1 import generate_pb2 as pb  # noqa: E402
from folio.v1 import generate_pb2_grpc as pb_grpc  # noqa: E402
from folio.worker import LLM, SamplingParams  # noqa: E402
from folio.worker.messages import GenerateRequest  # noqa: E402

from conftest import PROMPTS, process_running, ray_step_delay, redis_url_of, wait_for  # noqa: E402

BIN = os.path.dirname(sys.executable)
ENV = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0",
           RAY_timeout_ms_task_wait_for_death_info="0", RAY_kill_worker_timeout_milliseconds="1000",
           RAY_SERVE_FORCE_STOP_UNHEALTHY_REPLICAS="1",  # the chart's env, as the two above
           FOLIO_WORKER_FROZEN_S="3")  # the frozen watches' bound (liveness.py; 20 s by default)
# not in the chart's env either (an import of folio's launcher in this process sets it): the Serve controller has it
# only from `folio serve`, which hands it over (test 1)
ENV.pop("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", None)
FRONTEND_RESOURCES = {"folio-frontend": 1000}  # what the chart's head advertises
HEAD_TAG, NODE2_TAG = "two-node-head", "two-node-node2"  # custom resources: pin a GPU hold to a node
# test 1: KV for 384 tokens per worker (blocks of 16 KiB with the tiny Llama's 1 KiB per token),
# so that three long requests on one worker must swap and the coordinator moves them
ENGINE = dict(block_size=16, num_kv_blocks=24, max_model_len=384, preemption_mode="swap")
PLASMA_MIN_BYTES = 100 * 1024  # Ray inlines smaller objects in the call; larger ones go through plasma


# ---- processes and ports ------------------------------------------------------------------
def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port_range(size: int = 100) -> tuple[int, int]:
    """Worker ports: a block between Ray's default worker range (10002-19999, the suite's other
    Rays) and the ephemeral range (32768-), every port free at the time of the check."""
    for _ in range(200):
        lo = random.randrange(20000, 32000 - size)
        try:
            for p in range(lo, lo + size):
                with socket.socket() as s:
                    s.bind(("0.0.0.0", p))
            return lo, lo + size - 1
        except OSError:
            continue
    raise RuntimeError("no free worker port range")


def spawn(cmd: list[str], log: str) -> subprocess.Popen:
    with open(log, "w") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=ENV, start_new_session=True)


def stop_trees(procs: list[subprocess.Popen], term_s: float = 5.0) -> None:
    """SIGTERM what this module started (each process group it made, and every descendant
    found by PID in case one left the group), then SIGKILL whatever is left."""
    victims = {}
    for p in procs:
        try:
            root = psutil.Process(p.pid)
            for q in [root, *root.children(recursive=True)]:
                victims[q.pid] = q
        except psutil.NoSuchProcess:
            pass
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, sig)
        for q in victims.values():
            with contextlib.suppress(psutil.NoSuchProcess):
                q.send_signal(sig)
        alive = [q for q in victims.values() if process_running(q)]
        _, alive = psutil.wait_procs(alive, timeout=term_s)
        if not alive:
            break
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=5)


def http_json(url: str, timeout_s: float = 10.0):
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, None
    except (OSError, ValueError):
        return None, None


def tail(path: str, n: int = 4000) -> str:
    with open(path, errors="replace") as f:
        return f.read()[-n:]


# ---- the two-node cluster ---------------------------------------------------------------
def start_node(head: bool, gcs: int, dashboard: int, gpus: int, resources: dict, tmp: str) -> subprocess.Popen:
    agent, agent_grpc, runtime_env, metrics, node_manager, object_manager, client = free_ports(7)
    lo, hi = free_port_range()
    # one logical CPU a node: room for the actors (a worker takes 0.5), and Ray prestarts one
    # idle worker process per logical CPU
    cmd = [os.path.join(BIN, "ray"), "start", "--block", "--disable-usage-stats", "--node-ip-address", "127.0.0.1",
           "--temp-dir", tmp, "--num-cpus", "1", "--num-gpus", str(gpus), "--resources", json.dumps(resources),
           "--object-store-memory", str(160 * 2**20), "--node-manager-port", str(node_manager),
           "--object-manager-port", str(object_manager), "--min-worker-port", str(lo), "--max-worker-port", str(hi),
           "--dashboard-agent-listen-port", str(agent), "--dashboard-agent-grpc-port", str(agent_grpc),
           "--runtime-env-agent-port", str(runtime_env), "--metrics-export-port", str(metrics)]
    if head:
        cmd += ["--head", "--port", str(gcs), "--ray-client-server-port", str(client), "--include-dashboard=true",
                "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard)]
    else:  # one log monitor per machine (Ray's advice): the head's
        cmd += ["--address", f"127.0.0.1:{gcs}", "--include-log-monitor=false"]
    return spawn(cmd, os.path.join(tmp, "ray-start.log"))


def node_of(resource: str) -> str:
    return next(n["NodeID"] for n in ray.nodes() if n["Alive"] and resource in n["Resources"])


def start_until(start, ready, log: str, procs: list, what: str) -> None:
    """Start a node (`start()`) and poll `ready()` until it holds. Ray gives a starting node a
    fixed 30 s to register with the GCS (ray/_private/node.py), which a loaded 2-core machine
    can miss: that attempt's processes are then stopped and it starts again, three times at most."""
    for _ in range(3):
        procs.append(start())
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and procs[-1].poll() is None:
            if ready():
                return
            time.sleep(0.2)
        text = tail(log)
        stop_trees([procs.pop()])
        if "timed out during startup" not in text:
            break
        wait_for(lambda: not ready(), 90, f"the failed start of {what} gone")  # a late registration too
    pytest.fail(f"{what} did not start:\n{text}")


@pytest.fixture(scope="module")
def two_nodes():
    assert not ray.is_initialized(), "another test left a Ray driver connected in this process"
    procs, dirs = [], []
    try:
        gcs, dashboard = free_ports(2)
        dirs += [tempfile.mkdtemp(prefix="fn2h-", dir="/tmp"), tempfile.mkdtemp(prefix="fn2w-", dir="/tmp")]
        dash = f"http://127.0.0.1:{dashboard}"
        # ready: the GCS, and the dashboard's Serve API (what `serve deploy` talks to)
        start_until(lambda: start_node(True, gcs, dashboard, 1, {**FRONTEND_RESOURCES, HEAD_TAG: 1}, dirs[0]),
                    lambda: http_json(dash + "/api/serve/applications/")[0] == 200,
                    os.path.join(dirs[0], "ray-start.log"), procs, "the head")
        ray.init(address=f"127.0.0.1:{gcs}", namespace="two-node-test", log_to_driver=False)
        start_until(lambda: start_node(False, gcs, dashboard, 2, {NODE2_TAG: 1}, dirs[1]),
                    lambda: sum(n["Alive"] for n in ray.nodes()) == 2,
                    os.path.join(dirs[1], "ray-start.log"), procs, "node2")
        yield {"address": f"127.0.0.1:{gcs}", "dashboard": dash, "head": node_of(HEAD_TAG), "node2": node_of(NODE2_TAG),
               "serve_logs": os.path.join(dirs[0], "session_latest", "logs", "serve")}
    finally:
        with contextlib.suppress(Exception):
            ray.shutdown()
        stop_trees(procs[::-1])
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)


@contextlib.contextmanager
def holding_gpu(node_tag: str):
    """One logical GPU of the node carrying `node_tag` reserved (a placement group), so
    that nothing else can be placed on it."""
    pg = ray.util.placement_group([{"GPU": 1, node_tag: 0.01}])
    try:
        ray.get(pg.ready(), timeout=60)
        yield
    finally:
        ray.util.remove_placement_group(pg)


def actors(cluster, namespace: str) -> dict[str, tuple[str, str]]:
    """Live actors of a Ray namespace: name -> (class name, node id), from the state API."""
    from ray.util.state import list_actors

    found = list_actors(address=cluster["dashboard"], filters=[("state", "=", "ALIVE")], limit=1000)
    return {a.name: (a.class_name, a.node_id) for a in found if a.ray_namespace == namespace}


def serve_controller_pid(cluster) -> int:
    from ray.util.state import list_actors

    found = list_actors(address=cluster["dashboard"], filters=[("state", "=", "ALIVE")], limit=1000, detail=True)
    return next(a.pid for a in found if a.class_name == "ServeController")


def worker_stats(ns: str, wids=("w0", "w1")) -> dict[str, dict]:
    return {w: ray.get(ray.get_actor(actor_name(ns, w), namespace=ns).stats.remote(), timeout=30) for w in wids}


def plasma_created_bytes(node_id: str) -> int:
    """Bytes ever created in a node's object store (what it received from other nodes included)."""
    from ray._private.internal_api import node_stats  # test-only: Ray has no public per-node store figure

    n = next(n for n in ray.nodes() if n["NodeID"] == node_id)
    return node_stats(n["NodeManagerAddress"], n["NodeManagerPort"]).store_stats.cumulative_created_bytes


def assert_idle(ns: str) -> None:
    def idle():
        st = worker_stats(ns)
        return all(s["num_free_blocks"] == s["num_kv_blocks"] and s["num_streams"] == 0 for s in st.values())
    wait_for(idle, 30, f"workers of {ns} idle with every block free")
    for w in ("w0", "w1"):
        ray.get(ray.get_actor(actor_name(ns, w), namespace=ns).check_invariants.remote(), timeout=30)


# ---- the two APIs -------------------------------------------------------------------------
def http_streams(url: str, model: str, prompts: list[str], max_tokens: int) -> list[tuple[str, str]]:
    """(text, finish reason) of each prompt, streamed over HTTP, all at once."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)

    def one(p):
        chunks = list(client.completions.create(model=model, prompt=p, max_tokens=max_tokens, temperature=0,
                                                stream=True))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        return text, next(c.choices[0].finish_reason for c in reversed(chunks) if c.choices)
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as ex:
        return list(ex.map(one, prompts))


def grpc_streams(addr: str, prompts: list[str], max_tokens: int) -> list[list[int]]:
    """Output token ids of each prompt, streamed over gRPC, all at once."""
    with grpc.insecure_channel(addr) as ch:
        grpc.channel_ready_future(ch).result(timeout=60)
        stub = pb_grpc.GenerationStub(ch)

        def one(p):
            r = pb.GenerateRequest(text=p, sampling=pb.SamplingParameters(max_tokens=max_tokens, temperature=0))
            msgs = list(stub.GenerateStream(r, timeout=120))
            assert msgs[-1].finished
            return [t for m in msgs for d in m.deltas for t in d.token_ids]
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as ex:
            return list(ex.map(one, prompts))


def check_apis(http: str, grpc_addr: str, model: str, engine: dict) -> None:
    want = LLM(model, **engine).generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0))
    assert http_streams(http, os.path.basename(model), PROMPTS, 12) == [(w.text, w.finish_reason) for w in want]
    assert grpc_streams(grpc_addr, PROMPTS, 12) == [w.token_ids for w in want]


# ---- 1. folio serve --address ---------------------------------------------------------------
@contextlib.contextmanager
def folio_serve(cluster, model: str, ns: str):
    """`folio serve` joined to the cluster, until `stop()` (SIGTERM, as a user stops it);
    killed with its process group if the test fails first."""
    http, grpc_port = free_ports(2)
    cmd = [sys.executable, "-m", "folio.deploy.cli", "serve", "--model", model, "--address", cluster["address"],
           "--num-workers", "2", "--namespace", ns, "--router", "least-loaded", "--host", "127.0.0.1",
           "--http-port", str(http), "--grpc-port", str(grpc_port), "--grace-period-s", "2",
           "--block-size", str(ENGINE["block_size"]), "--num-kv-blocks", str(ENGINE["num_kv_blocks"]),
           "--max-model-len", str(ENGINE["max_model_len"]), "--preemption-mode", ENGINE["preemption_mode"]]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV,
                            start_new_session=True)
    lines: list[str] = []

    def read():
        for line in proc.stdout:
            lines.append(line)
    threading.Thread(target=read, daemon=True).start()

    def ready():
        assert proc.poll() is None, "folio serve exited:\n" + "".join(lines)
        return next((line for line in lines if "folio serve: ready" in line), None)

    def stop():
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=90)
        assert proc.returncode == 0 and any("folio serve: stopped" in line for line in lines), "".join(lines)
    try:
        line = wait_for(ready, 240, "folio serve ready")
        yield {"http": f"http://127.0.0.1:{http}", "grpc": f"127.0.0.1:{grpc_port}", "redis": redis_url_of(line),
               "stop": stop}
    finally:
        if proc.poll() is None:
            stop_trees([proc])


def migrate_across_nodes(ns: str, redis_url: str, nodes: dict[str, str], model: str) -> None:
    """Three requests pinned to w0 need ~2.5x its KV. All are admitted at once (one-block
    prompts: none waits, so every move carries KV); when the blocks run out, w0 swaps one
    out (8 blocks, 128 KiB: past Ray's inline limit), later a second (12 blocks), and the
    coordinator moves them to w1 on the other node through the object store. Every stream
    stays exact. The window for a move, from the first swap-out until w0 has room to swap
    back in, is ~190 steps (the two left grow from 8 to 12 blocks, then one alone from 12 to
    20): with 200 tokens per request it was ~80 steps, ~0.4 s, and one run in three missed."""
    src, dst = "w0", "w1"
    params = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
    prompts = [[(7 * i + j) % 1000 + 3 for j in range(10 + i)] for i in range(3)]
    want = [o.token_ids for o in LLM(model, **ENGINE).generate(prompts, params)]
    before, plasma_before = worker_stats(ns), plasma_created_bytes(nodes[dst])
    router = Router(ClusterState(redis_url, ns), RayWorkerClient(ns, ns), "least-loaded")

    async def run(i):
        tokens, workers = [], []
        async for chunk in router.generate(GenerateRequest(request_id=f"move-{i}", prompt_token_ids=prompts[i],
                                                           params=params), worker_id=src):
            for d in chunk.deltas:
                tokens.extend(d.token_ids)
            workers.append(chunk.worker_id)
        return tokens, workers

    async def main():
        return await asyncio.wait_for(asyncio.gather(*(run(i) for i in range(len(prompts)))), 180)
    w0 = ray.get_actor(actor_name(ns, src), namespace=ns)
    ray_step_delay(w0, 0.01)  # 10 ms more a step: the ~190 steps of window last >= 1.9 s on any CPU
    try:
        results = asyncio.run(main())
    finally:
        ray_step_delay(w0, 0)
    assert [t for t, _ in results] == want  # nothing lost or repeated across the move
    assert any(dst in ws for _, ws in results)  # streams that continued on the other node
    after = worker_stats(ns)
    assert after[src]["preemptions_by_mode"]["swap"] > before[src]["preemptions_by_mode"]["swap"]
    assert after[dst]["num_migrations_in"] > before[dst]["num_migrations_in"]
    assert plasma_created_bytes(nodes[dst]) - plasma_before >= PLASMA_MIN_BYTES  # KV pulled into dst's plasma


def test_folio_serve_address_joins_a_two_node_cluster(two_nodes, model_dirs):
    model, ns = model_dirs["llama"], "twonode"
    with holding_gpu(NODE2_TAG), folio_serve(two_nodes, model, ns) as server:
        where = actors(two_nodes, ns)
        nodes = {w: where[actor_name(ns, w)][1] for w in ("w0", "w1")}
        assert sorted(nodes.values()) == sorted([two_nodes["head"], two_nodes["node2"]])  # one per node
        # Serve's controller, started by folio serve on a Ray it joined, has folio's settings for it: the nodes'
        # env here lacks RAY_SERVE_CONTROL_LOOP_INTERVAL_S (and a joined cluster's may lack the force stop)
        env = psutil.Process(serve_controller_pid(two_nodes)).environ()
        assert env.get("RAY_SERVE_CONTROL_LOOP_INTERVAL_S") == "0.5" and "RAY_SERVE_CONTROL_LOOP_INTERVAL_S" not in ENV
        assert env.get("RAY_SERVE_FORCE_STOP_UNHEALTHY_REPLICAS") == "1"
        before = worker_stats(ns)
        check_apis(server["http"], server["grpc"], model, ENGINE)
        after = worker_stats(ns)
        assert all(after[w]["num_generated_tokens"] > before[w]["num_generated_tokens"] for w in nodes), (before, after)
        assert_idle(ns)
        migrate_across_nodes(ns, server["redis"], nodes, model)
        assert_idle(ns)
        server["stop"]()
    wait_for(lambda: not actors(two_nodes, ns), 60, "folio serve's actors gone with it")


# ---- 2. the Helm chart's application through `serve deploy` -------------------------------
CHART = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "helm", "folio")
# the chart's cpu-only shape (one worker pod of 2 logical GPUs), sized for the tiny model: a
# 4 MiB KV cache is 256 blocks of 16 (the chart's 40 GB would be allocated on this CPU)
CHART_ENGINE = dict(block_size=16, dtype="float32", kv_cache_layout="layer_major", kv_cache_memory_gb=0.004,
                    swap_space_gb=0.004)


def chart_serve_config(model: str, http: int, grpc_port: int, metrics: int, redis_url: str) -> tuple[dict, str]:
    """The RayService's serveConfigV2 rendered from helm/folio with this machine's model,
    ports and Redis; then its two binds on every interface (0.0.0.0) narrowed to loopback."""
    helm = pytest.importorskip("helm_python")
    yaml = pytest.importorskip("yaml")
    values = {"cpuOnly": True, "workers": {"replicas": 1, "gpusPerPod": 2}, "model": {"path": model},
              "redis": {"enabled": False, "url": redis_url},
              "serve": {"dtype": "float32", "kvCacheLayout": "layer_major",
                        "kvCacheMemoryGb": CHART_ENGINE["kv_cache_memory_gb"],
                        "swapSpaceGb": CHART_ENGINE["swap_space_gb"], "blockSize": CHART_ENGINE["block_size"],
                        "httpPort": http, "grpcPort": grpc_port, "metricsPort": metrics,
                        "frontendReplicas": 2}}
    chart = helm.Chart.load(CHART)
    chart.validate_schema(values)
    docs = [d for path, text in chart.render(values, name="demo", namespace="ai").items() if path.endswith(".yaml")
            for d in yaml.safe_load_all(text) if d]
    cluster = next(d for d in docs if d["kind"] == "RayService")["spec"]
    head = cluster["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]
    group = cluster["rayClusterConfig"]["workerGroupSpecs"][0]["rayStartParams"]
    # the nodes made here are the chart's: a head with the frontend resource (its GPU held
    # during this test: the chart's head has none), a worker group of 2 GPUs
    assert head["num-gpus"] == "0" and json.loads(json.loads(head["resources"])) == FRONTEND_RESOURCES
    assert group["num-gpus"] == "2"
    config = yaml.safe_load(cluster["serveConfigV2"])
    assert config["http_options"]["host"] == "0.0.0.0"
    config["http_options"]["host"] = "127.0.0.1"
    argv = config["applications"][0]["args"]["argv"]
    assert argv[argv.index("--host") + 1] == "0.0.0.0"
    argv[argv.index("--host") + 1] = "127.0.0.1"
    return config, argv[argv.index("--namespace") + 1]


def serve_cli(cluster, *args: str) -> None:
    cmd = [os.path.join(BIN, "serve"), *args, "--address", cluster["dashboard"]]
    r = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=180)
    assert r.returncode == 0, f"{cmd}: {r.stdout}\n{r.stderr}"


def app_status(cluster) -> str | None:
    _, body = http_json(cluster["dashboard"] + "/api/serve/applications/")
    app = ((body or {}).get("applications") or {}).get("folio")
    if app is not None and app["status"] == "DEPLOY_FAILED":
        pytest.fail(f"the chart's application failed to deploy: {app.get('message')}")
    return None if app is None else app["status"]


def frontend_nodes(cluster) -> list[str]:
    return [node for cls, node in actors(cluster, "serve").values() if cls.endswith(":FolioFrontend")]


def requests_counted(port: int) -> float:
    """folio_requests_total on the metrics port, summed over its labels."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "folio_requests_total")


def coordinator_restarts(cluster, ns: str) -> int:
    from ray.util.state import list_actors

    found = list_actors(address=cluster["dashboard"], filters=[("name", "=", f"{ns}-coordinator")], detail=True)
    return max(a.num_restarts for a in found if a.ray_namespace == ns)


def stop_the_coordinator_once(cluster, ns: str, http: int) -> None:
    """SIGSTOP the coordinator: both frontend replicas' watches find it silent and ping it, and
    Ray restarts it once; /health is ok again after it."""
    coordinator = ray.get_actor(f"{ns}-coordinator", namespace=ns)
    pid, before = ray.get(coordinator.pid.remote(), timeout=30), coordinator_restarts(cluster, ns)
    os.kill(pid, signal.SIGSTOP)
    try:
        def new_pid():
            with contextlib.suppress(Exception):
                return ray.get(coordinator.pid.remote(), timeout=5) != pid
        wait_for(new_pid, 90, "a new coordinator process")
        health = f"http://127.0.0.1:{http}/health"
        wait_for(lambda: (http_json(health)[1] or {}).get("status") == "ok", 30, "/health ok")
        time.sleep(3)  # what a second kill would have needed to show
        assert coordinator_restarts(cluster, ns) == before + 1
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def replica_logs(cluster) -> dict[str, str]:
    """The head's frontend replica logs: replica id -> text."""
    import glob

    out = {}
    for path in glob.glob(os.path.join(cluster["serve_logs"], "replica_folio_FolioFrontend_*.log")):
        with open(path, errors="replace") as f:
            out[path.rsplit("_", 1)[-1][:-4]] = f.read()
    return out


def live_replicas(cluster) -> set[str]:
    """The ids of the live FolioFrontend replicas (Serve's actor names end "#<replica id>")."""
    return {name.rsplit("#", 1)[-1] for name, (cls, _) in actors(cluster, "serve").items()
            if cls.endswith(":FolioFrontend")}


def roll_the_frontends_with_streams_in_flight(cluster, config: dict, path, ns: str, http: int, grpc_port: int,
                                              metrics: int, model: str) -> None:
    """A Helm upgrade that changes the application's arguments (here --max-num-requests):
    Serve replaces both frontend replicas, the new ones first (max_surge_percent), then stops the
    old ones. Streams in flight on them, HTTP and gRPC, end whole: each old replica drains them
    before it goes (deploy/replica_drain.py; it was killed 1 s after its stop, cutting them), and
    every scrape counts their requests once they are gone. The workers step once a second until
    both old replicas drain, so the streams are in flight then on any machine."""
    yaml = pytest.importorskip("yaml")
    old = live_replicas(cluster)  # (the module's first test left the log of its own replica)
    assert len(old) == 2 and old <= set(replica_logs(cluster))
    counted = 4 * len(PROMPTS)  # check_apis twice: each request over HTTP and over gRPC
    prompts, n = PROMPTS[:4], 40
    want = LLM(model, **CHART_ENGINE).generate(prompts + PROMPTS[4:6], SamplingParams(max_tokens=n, temperature=0.0))
    workers = [ray.get_actor(actor_name(ns, w), namespace=ns) for w in ("w0", "w1")]
    for w in workers:
        ray_step_delay(w, 1.0)
    ex = concurrent.futures.ThreadPoolExecutor(3)
    try:
        streams = [ex.submit(http_streams, f"http://127.0.0.1:{http}", os.path.basename(model), prompts, n)]
        streams += [ex.submit(grpc_streams, f"127.0.0.1:{grpc_port}", [p], n) for p in PROMPTS[4:6]]  # 2 channels
        wait_for(lambda: sum(s["num_streams"] for s in worker_stats(ns).values()) == 6, 60, "6 streams running")
        argv = config["applications"][0]["args"]["argv"]
        argv[argv.index("--max-num-requests") + 1] = str(int(argv[argv.index("--max-num-requests") + 1]) - 1)
        path.write_text(yaml.safe_dump(config))
        serve_cli(cluster, "deploy", str(path))

        def draining() -> bool:
            ended = [s.exception() or s.result() for s in streams if s.done()]
            assert not ended, f"streams ended before both old replicas began to drain: {ended}"
            return all("folio: draining" in text for rid, text in replica_logs(cluster).items() if rid in old)
        wait_for(draining, 240, "both old replicas draining")
    finally:
        for w in workers:
            ray_step_delay(w, 0)
    assert streams[0].result(120) == [(w.text, w.finish_reason) for w in want[:4]]  # whole: nothing cut
    assert [s.result(120)[0] for s in streams[1:]] == [w.token_ids for w in want[4:]]
    ex.shutdown()
    wait_for(lambda: app_status(cluster) == "RUNNING" and len(frontend_nodes(cluster)) == 2 and all(
        "folio: drained" in text for rid, text in replica_logs(cluster).items() if rid in old), 120,
        "the new replicas running, the old ones drained")
    drained = [re.search(r"folio: drained: (\d+) requests in flight at the start, (\d+) left and cut", text).groups()
               for rid, text in replica_logs(cluster).items() if rid in old]
    # every stream was on an old replica and ended there: 6 at the drains' start, none cut
    assert sum(int(n) for n, _ in drained) == 6 and all(left == "0" for _, left in drained), drained
    assert frontend_nodes(cluster) == [cluster["head"]] * 2
    seen: list[set] = []
    try:
        # (a scrape queued on an old replica's metrics listener as Serve ends that process is reset: a listener's
        # close resets its queued connections, a known gap; a clean clone of 2cc1461 met it once here)
        wait_for(lambda: seen.append({requests_counted(metrics) for _ in range(8)}) or seen[-1] == {counted + 6},
                 20, "every scrape counting the drained requests", ignore=(ConnectionResetError,))
    except AssertionError as e:
        raise AssertionError(f"{e}: {counted} + 6 wanted, the last scrapes read {seen[-3:]}") from None


def scale_the_frontends_down(cluster, config: dict, path) -> None:
    """The chart's frontendReplicas 2 -> 1: the count is the deployment's (not an argument of
    the application, part of its code version for Serve), so one replica goes and the other
    stays; as an argument it replaced both (an attack, 2026-12-07)."""
    yaml = pytest.importorskip("yaml")
    before = live_replicas(cluster)
    config["applications"][0]["deployments"][0]["num_replicas"] = 1  # as the chart renders frontendReplicas: 1
    path.write_text(yaml.safe_dump(config))
    serve_cli(cluster, "deploy", str(path))
    wait_for(lambda: len(live_replicas(cluster)) == 1 and app_status(cluster) == "RUNNING", 120, "one replica left")
    assert live_replicas(cluster) < before  # one of the two kept serving


def test_helm_chart_serve_config_deploys_with_serve_deploy(two_nodes, model_dirs, tmp_path):
    from folio.cluster.redis_server import EmbeddedRedis

    yaml = pytest.importorskip("yaml")
    model = model_dirs["llama"]
    http, grpc_port, metrics = free_ports(3)
    with EmbeddedRedis() as redis, holding_gpu(HEAD_TAG):
        config, ns = chart_serve_config(model, http, grpc_port, metrics, redis.url)
        assert config["applications"][0]["deployments"] == [{"name": "FolioFrontend", "num_replicas": 2}]
        path = tmp_path / "serve_config.yaml"
        path.write_text(yaml.safe_dump(config))
        serve_cli(two_nodes, "deploy", str(path))
        try:
            wait_for(lambda: app_status(two_nodes) == "RUNNING", 300, "the chart's application RUNNING")
            where = actors(two_nodes, ns)
            assert {where[actor_name(ns, w)][1] for w in ("w0", "w1")} == {two_nodes["node2"]}  # the GPU node
            assert frontend_nodes(two_nodes) == [two_nodes["head"]] * 2  # pinned by folio-frontend
            assert http_json(f"http://127.0.0.1:{http}/health")[0] == 200
            check_apis(f"http://127.0.0.1:{http}", f"127.0.0.1:{grpc_port}", model, CHART_ENGINE)
            assert_idle(ns)
            # both replicas serve the metrics port, each with both replicas' requests (replica_metrics.py)
            state = ClusterState(redis.url, ns)
            wait_for(lambda: len(state.r.hkeys(f"{ns}:frontend_metrics")) == 2, 10, "both replicas' metrics published")
            wait_for(lambda: {requests_counted(metrics) for _ in range(8)} == {2 * len(PROMPTS)}, 20,
                     "every scrape of the metrics port counting the requests of both replicas")
            stop_the_coordinator_once(two_nodes, ns, http)
            check_apis(f"http://127.0.0.1:{http}", f"127.0.0.1:{grpc_port}", model, CHART_ENGINE)
            roll_the_frontends_with_streams_in_flight(two_nodes, config, path, ns, http, grpc_port, metrics, model)
            scale_the_frontends_down(two_nodes, config, path)
            check_apis(f"http://127.0.0.1:{http}", f"127.0.0.1:{grpc_port}", model, CHART_ENGINE)
        finally:
            serve_cli(two_nodes, "shutdown", "-y")
            # the builder's workers and coordinator are detached (they outlive a redeploy):
            # `serve shutdown` leaves them, so they go here, before their Redis does
            for name in actors(two_nodes, ns):
                with contextlib.suppress(ValueError):
                    ray.kill(ray.get_actor(name, namespace=ns))
        wait_for(lambda: app_status(two_nodes) is None and not frontend_nodes(two_nodes), 120, "the app shut down")
        wait_for(lambda: not actors(two_nodes, ns), 60, "the detached workers gone")
