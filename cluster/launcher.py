"""Starting and stopping a Folio cluster: Ray, Redis, the workers, the coordinator, a router.

    cluster = FolioCluster(ClusterConfig(model=DIR, num_workers=2))
    cluster.start()                          # Ray (local, or --address), Redis, actors
    async for chunk in cluster.router.generate(GenerateRequest(...)): ...
    cluster.shutdown(grace_s=10)             # stop admitting, drain, release everything

One worker actor per GPU; a tensor-parallel worker of N ranks is a placement group of N
bundles (one GPU each, packed on one node), the worker actor in bundle 0 and its ranks 1..N-1
as actors it starts in the others (worker/tp_ranks.py). On a CPU-only machine
`ray.init(num_gpus=...)` declares logical GPUs and each rank runs on the CPU. Without a
`redis_url` the cluster starts an embedded Redis server it owns and stops it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# A call in flight on a worker whose process dies fails at once (ActorUnavailableError, ~10 ms after
# the kill). Ray's default for a restartable actor (max_restarts, start_worker) is to hold such a call
# up to 1 s for "death info" from the GCS, checked on a 1 s tick, so it failed 1.0-2.0 s after the kill;
# the info never comes for an actor that restarts (only DEAD releases the wait). Set before ray.init:
# the Ray started here (GCS, raylet) and every worker it spawns (router in Serve replicas, the
# coordinator) inherit it; KubeRay sets the same for a RayService.
os.environ.setdefault("RAY_timeout_ms_task_wait_for_death_info", "0")
# A process that does not exit when killed (stopped, or hung holding its GIL: liveness.py kills such a worker or
# coordinator) gets SIGKILL after this; Ray's default, 5 s, was 5 s of each such recovery (5.0 s against 1.0 s
# measured, 2026-12-07). A live actor that ray.kill reaches exits at once either way.
os.environ.setdefault("RAY_kill_worker_timeout_milliseconds", "1000")
# A frontend replica that fails its health checks (stopped, hung) is killed at once: by default Serve stopped it
# "gracefully", leaving its sockets on the shared ports for the grace period, now a drain of 30 s for the healthy
# replicas it stops (deploy/replica_drain.py). Read by Serve's controller, which inherits it as the GCS does.
os.environ.setdefault("RAY_SERVE_FORCE_STOP_UNHEALTHY_REPLICAS", "1")
DRAIN_MARGIN_S = 2.0  # past the grace period, how long a drain waits for the workers to answer
# Serve's controller reconciles every 0.1 s by default: the largest idle consumer of an idle
# `folio serve` (3.3 % of a core on a 2-core EPYC, 2026-12-02); at 0.5 s it took 1.1 %, and the
# whole idle cluster 9.3 % of a core instead of 14.4 %. Its health checks and scaling act on seconds.
os.environ.setdefault("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "0.5")
# What Serve's controller must see of the above: a Ray joined with --address has the env it was started with,
# so `folio serve` hands these to the controller it starts (serve.start's controller_options).
SERVE_CONTROLLER_ENV = ("RAY_SERVE_FORCE_STOP_UNHEALTHY_REPLICAS", "RAY_SERVE_CONTROL_LOOP_INTERVAL_S")

from folio.cluster.coordinator import CoordinatorActor  # noqa: E402
from folio.cluster.ray_start import RayStart  # noqa: E402
from folio.cluster.redis_server import EmbeddedRedis  # noqa: E402
from folio.cluster.router import Router  # noqa: E402
from folio.cluster.fencing import FencedPublisher  # noqa: E402
from folio.cluster.state import ClusterState, WorkerPublisher  # noqa: E402
from folio.cluster.worker_client import RayWorkerClient, actor_name  # noqa: E402
from folio.worker.actor import EngineWorker  # noqa: E402
from folio.worker.config import EngineConfig, server_engine_fields  # noqa: E402
from folio.worker.errors import ConfigError, UnavailableError  # noqa: E402
from folio.worker.models.model_config import ModelConfig  # noqa: E402


WORKER_EXIT_GRACE_S = 0.5  # a worker whose engine failed exits this long after failing its requests


@dataclass
class ClusterConfig:
    model: str
    num_workers: int = 2
    redis_url: str | None = None  # None: an embedded Redis server owned by the cluster
    router: str = "least-loaded"
    address: str | None = None  # join this Ray cluster instead of starting one
    host: str = "127.0.0.1"  # what a Ray started here binds to (ray_start.bind_ray_to); the embedded Redis is loopback
    namespace: str = "folio"  # Redis key prefix and actor-name prefix
    engine_args: dict = field(default_factory=dict)  # EngineConfig fields for every worker
    worker_num_cpus: float = 0.5  # fractional: several workers share this machine's cores
    torch_threads: int | None = None  # per worker (None: cores / workers)
    heartbeat_s: float = 0.1
    coordinator_interval_s: float = 0.1
    coordinator: bool = True  # moves requests across workers (two or more) and restarts a frozen one
    worker_frozen_s: float | None = None  # a worker silent this long and deaf to a ping is restarted (liveness.py)
    worker_start_s: float | None = None  # a restarted worker's time to publish before it is asked again (same)
    ready_timeout_s: float = 180.0
    # per worker: the ranks (GPUs) of its tensor-parallel group; None: engine_args' tensor_parallel_size
    tensor_parallel_sizes: list[int] | None = None
    detached: bool = False  # actors outlive their creator (a Serve app builder on KubeRay); reused if present

    def __post_init__(self) -> None:
        if self.num_workers < 1:
            raise ConfigError("num_workers must be >= 1")
        if self.torch_threads is not None and self.torch_threads < 1:
            raise ConfigError(f"torch_threads must be >= 1, got {self.torch_threads}")
        engine_config = EngineConfig(model=self.model, **self.engine_args)  # checks the engine fields up front
        if self.tensor_parallel_sizes is None:
            self.tensor_parallel_sizes = [engine_config.tensor_parallel_size] * self.num_workers
        if len(self.tensor_parallel_sizes) != self.num_workers or min(self.tensor_parallel_sizes) < 1:
            raise ConfigError(f"tensor_parallel_sizes must give each of the {self.num_workers} workers a size "
                              f">= 1, got {self.tensor_parallel_sizes}")
        ModelConfig.from_dir(self.model)  # and that the checkpoint is there (ModelLoadError)


def make_engine(config: EngineConfig, torch_threads: int | None):
    """Runs inside the worker actor: the engine on this worker's GPU, or the CPU."""
    import torch

    from folio.worker.engine import LLMEngine

    if torch_threads:
        torch.set_num_threads(torch_threads)
    if config.device == "auto":
        config.device = "cuda" if torch.cuda.is_available() else "cpu"
    return LLMEngine(config)


class FolioCluster:
    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.redis: EmbeddedRedis | None = None
        self.redis_url = config.redis_url
        self.workers: dict[str, object] = {}  # worker id -> actor handle
        self.coordinator = None
        self.router: Router | None = None
        self.state: ClusterState | None = None
        self._started_ray = False
        self._ray_temp_dir: str | None = None  # removed on shutdown
        self._ray_start: RayStart | None = None
        self.groups: dict[str, object] = {}  # worker id -> the placement group of its ranks (TP > 1)

    # ---- start ------------------------------------------------------------------------
    def start(self, on_ray_up=None) -> "FolioCluster":
        """`on_ray_up`: called once Ray is up (its core worker installs its own signal handlers).
        ray.init runs off this thread (RayStart): a signal that lands meanwhile interrupts only the
        wait, and `shutdown` lets ray.init end before it releases anything."""
        import ray

        cfg = self.config
        if not ray.is_initialized():
            self._started_ray = True  # before: a stop inside ray.init still shuts down what it started
            if not cfg.address:
                self._ray_temp_dir = tempfile.mkdtemp(prefix="folio-ray-", dir="/tmp")
            self._ray_start = RayStart(address=cfg.address, namespace=cfg.namespace,
                                       num_gpus=sum(cfg.tensor_parallel_sizes), host=cfg.host,
                                       temp_dir=self._ray_temp_dir)
            self._ray_start.run()
        if on_ray_up is not None:
            on_ray_up()
        if self.redis_url is None:
            self.redis = EmbeddedRedis().start(supervise=True)  # restarted if it dies
            self.redis_url = self.redis.url
        self.state = ClusterState(self.redis_url, cfg.namespace)
        threads = cfg.torch_threads or max((os.cpu_count() or 1) // cfg.num_workers, 1)
        engine_fields = server_engine_fields(cfg.engine_args)  # a server: memory flat under load
        Worker = ray.remote(EngineWorker)
        for i in range(cfg.num_workers):
            tp = cfg.tensor_parallel_sizes[i]
            self.start_worker(f"w{i}", Worker, {**engine_fields, "tensor_parallel_size": tp}, threads)
        self.wait_ready(cfg.num_workers)
        client = RayWorkerClient(cfg.namespace, cfg.namespace)
        # one worker: no move can be planned (it takes two), so the coordinator only watches for a frozen
        # worker, every second (at 0.1 s it took 1.5 % of a core idle)
        interval = cfg.coordinator_interval_s if cfg.num_workers > 1 else max(cfg.coordinator_interval_s, 1.0)
        if cfg.coordinator:
            self.coordinator = ray.remote(CoordinatorActor).options(  # restarted when its process dies
                num_cpus=0.05, name=f"{cfg.namespace}-coordinator", namespace=cfg.namespace, max_restarts=-1,
                **self._lifetime()).remote(
                self.redis_url, cfg.namespace, cfg.namespace, frozen_s=cfg.worker_frozen_s,
                start_s=cfg.worker_start_s, interval_s=interval)
            ray.get(self.coordinator.start.remote())
        self.router = Router(ClusterState(self.redis_url, cfg.namespace), client, cfg.router)
        return self

    def start_worker(self, wid: str, Worker, engine_fields: dict, threads: int):
        cfg = self.config
        engine_config = EngineConfig(model=os.path.abspath(cfg.model), **engine_fields)
        handle = Worker.options(name=actor_name(cfg.namespace, wid), namespace=cfg.namespace,
                                **self._placement(wid, engine_config.tensor_parallel_size), max_concurrency=1000,
                                # a worker that dies (or exits after its engine failed) is restarted:
                                # a new engine, and its heartbeats register it again
                                max_restarts=-1, max_task_retries=0,
                                **self._lifetime()).remote(
            wid, functools.partial(make_engine, engine_config, threads),
            functools.partial(FencedPublisher, self.redis_url, cfg.namespace), cfg.heartbeat_s,
            exit_on_failure_s=WORKER_EXIT_GRACE_S)
        self.workers[wid] = handle
        return handle

    def _placement(self, wid: str, ranks: int) -> dict:
        """Where a worker actor goes: anywhere with a GPU; for N ranks, bundle 0 of a placement
        group of N bundles (a GPU and 1/N of worker_num_cpus each, on one node: STRICT_PACK), its
        ranks 1..N-1 in the others. A restarted worker comes back to bundle 0 and starts its ranks
        again (the old ones die with their owner, the worker's old process)."""
        cfg = self.config
        if ranks == 1:
            return {"num_gpus": 1, "num_cpus": cfg.worker_num_cpus}
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = {"GPU": 1, "CPU": cfg.worker_num_cpus / ranks}
        name, pg = f"{actor_name(cfg.namespace, wid)}-ranks", None
        if cfg.detached:  # a builder run again on the same cluster finds its groups
            with contextlib.suppress(ValueError):
                pg = ray.util.get_placement_group(name)
        if pg is None:
            pg = ray.util.placement_group([bundle] * ranks, strategy="STRICT_PACK", name=name,
                                          lifetime="detached" if cfg.detached else None)
        self.groups[wid] = pg
        if not pg.wait(cfg.ready_timeout_s):
            raise UnavailableError(f"worker {wid}: no node has {ranks} GPUs free for its tensor-parallel group")
        return {"num_gpus": 1, "num_cpus": bundle["CPU"],
                "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0)}

    def _lifetime(self) -> dict:
        return {"lifetime": "detached", "get_if_exists": True} if self.config.detached else {}

    def wait_ready(self, n: int) -> None:
        import ray
        import redis

        deadline = time.monotonic() + self.config.ready_timeout_s
        up = 0
        while up < n:
            try:
                up = len(self.state.live_loads())
            except redis.RedisError:  # one read timed out (0.5 s) on a busy machine: not a failed start
                pass
            for wid, h in self.workers.items():  # surface a worker that failed to start
                ready, _ = ray.wait([h.ping.remote()], timeout=0)
                if ready:
                    ray.get(ready[0])
            if up < n and time.monotonic() > deadline:
                raise UnavailableError(f"only {up} of {n} workers came up")
            if up < n:
                time.sleep(0.1)

    # ---- stop -------------------------------------------------------------------------
    def drain(self, grace_s: float) -> None:
        """Workers stop admitting; in-flight requests get `grace_s` to finish, then are aborted."""
        import ray

        drains = [h.drain.remote(grace_s) for h in self.workers.values()]
        with contextlib.suppress(Exception):  # a worker stuck in a step never answers: the grace period bounds it
            if drains:  # no Ray call without an actor: ray.get([]) starts a Ray where a stop cut ray.init short
                ray.get(drains, timeout=grace_s + DRAIN_MARGIN_S)

    def settle(self) -> None:
        """A stop that interrupted `start` while ray.init ran: ray.init ends first (it goes on,
        on its own thread; a shutdown in the middle of it is undefined)."""
        if self._ray_start is not None:
            self._ray_start.settle()

    def shutdown(self, grace_s: float = 10.0) -> None:
        """Stop admitting, let in-flight requests finish for `grace_s`, abort the rest,
        then release the actors, Redis (if owned) and Ray (if started here)."""
        import ray

        self.settle()
        if self.coordinator is not None:
            try:
                ray.get(self.coordinator.stop.remote(), timeout=5)
            except Exception:
                pass
            ray.kill(self.coordinator)
            self.coordinator = None
        self.drain(grace_s)
        pub = None
        try:
            pub = WorkerPublisher(self.redis_url, self.config.namespace)
        except Exception:
            pass
        stops = [h.shutdown.remote() for h in self.workers.values()]  # at once: 5 s in all, not each
        with contextlib.suppress(Exception):
            if stops:
                ray.get(stops, timeout=5)
        for wid, h in self.workers.items():
            ray.kill(h)
            if pub is not None:
                try:
                    pub.withdraw(wid)
                except Exception:
                    pass
        self.workers.clear()
        for pg in self.groups.values():  # and with them any rank still running
            with contextlib.suppress(Exception):
                ray.util.remove_placement_group(pg)
        self.groups.clear()
        if self.redis is not None:
            self.redis.stop()
            self.redis = None
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False
        if self._ray_start is not None:
            self._ray_start.release()
            self._ray_start = None
        if self._ray_temp_dir is not None:  # Ray's session logs and sockets: nothing outlives a clean exit
            shutil.rmtree(self._ray_temp_dir, ignore_errors=True)
            self._ray_temp_dir = None
