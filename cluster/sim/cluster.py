"""A simulated cluster in one process: N simulated GPU workers (runner.py: simulated_engine)
with the real worker actor code, a real Redis, the real router and coordinator.

No Ray: the workers are in-process EngineWorker objects reached through
LocalWorkerClient, so a laptop runs 8-64 simulated H200 workers. Used by the tests
and by benchmarks/cluster_sim.py.
"""

from __future__ import annotations

import functools

from folio.cluster.coordinator import Coordinator
from folio.cluster.redis_server import EmbeddedRedis
from folio.cluster.router import Router
from folio.cluster.state import ClusterState, WorkerPublisher
from folio.cluster.worker_client import LocalWorkerClient
from folio.worker.actor import EngineWorker
from folio.cluster.sim.roofline import Roofline
from folio.cluster.sim.runner import simulated_engine


class SimCluster:
    def __init__(self, num_workers: int, gpu: str = "H200", model: str = "llama-3-8b", policy: str = "prefix-aware",
                 redis_url: str | None = None, namespace: str = "sim", time_scale: float = 1.0,
                 coordinator: bool = True, heartbeat_s: float = 0.1, **engine) -> None:
        self.roofline = Roofline.named(gpu, model)
        self.num_workers = num_workers
        self.policy = policy
        self.namespace = namespace
        self.time_scale = time_scale
        self.engine = engine
        self.heartbeat_s = heartbeat_s
        self.use_coordinator = coordinator
        self.redis = None if redis_url else EmbeddedRedis()
        self.redis_url = redis_url
        self.workers: dict[str, EngineWorker] = {}
        self.router: Router | None = None
        self.coordinator: Coordinator | None = None

    async def start(self) -> "SimCluster":
        """Call from the event loop that will drive the cluster."""
        import asyncio

        if self.redis is not None:
            self.redis.start()
            self.redis_url = self.redis.url
        for i in range(self.num_workers):
            wid = f"sim{i}"
            factory = functools.partial(simulated_engine, self.roofline, time_scale=self.time_scale, **self.engine)
            self.workers[wid] = EngineWorker(wid, factory, functools.partial(WorkerPublisher, self.redis_url,
                                                                             self.namespace), self.heartbeat_s)
        state = ClusterState(self.redis_url, self.namespace)
        client = LocalWorkerClient(self.workers)
        self.router = Router(state, client, self.policy)
        if self.use_coordinator:
            self.coordinator = Coordinator(ClusterState(self.redis_url, self.namespace), client)
            self.coordinator.start()
        for _ in range(200):
            if len(state.live_loads()) == self.num_workers:
                break
            await asyncio.sleep(0.02)
        return self

    async def stop(self) -> None:
        if self.coordinator is not None:
            await self.coordinator.stop()
        for w in self.workers.values():
            w.shutdown()
        if self.redis is not None:
            self.redis.stop()

    async def stats(self) -> dict[str, dict]:
        return {w: await worker.stats() for w, worker in self.workers.items()}
