"""Heartbeats that cost what changed: a worker (simulated engine: the real scheduler and
block manager) publishing to a real Redis keeps the Redis prefix index equal to its
cache map from changes alone, resyncs only when Redis lost the index, and lists no
running request; the coordinator asks for victims when it plans a preemption."""

import asyncio
import functools
import random
import time

import pytest
import redis

from folio.cluster.redis_server import EmbeddedRedis
from folio.cluster.state import ClusterState, WorkerPublisher
from folio.cluster.worker_client import LocalWorkerClient
from folio.worker.actor import EngineWorker
from folio.worker.errors import WorkerFailedError
from folio.worker.messages import GenerateRequest
from folio.cluster.sim.roofline import Roofline
from folio.worker.sampling_params import SamplingParams
from folio.cluster.sim.runner import simulated_engine


class CountingPublisher(WorkerPublisher):
    """The real publisher, recording what each heartbeat carried."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.sent: list[tuple[str, int]] = []  # ("whole" | "changes", number of hashes)

    def publish(self, load, cached_block_hashes=None, changes=None):
        self.sent.append(("whole", len(cached_block_hashes)) if cached_block_hashes is not None
                         else ("changes", len(changes or {})))
        return super().publish(load, cached_block_hashes, changes)


def _worker(url, ns, wid="w0", blocks=64):
    pub = functools.partial(CountingPublisher, url, ns)
    eng = functools.partial(simulated_engine, Roofline.named(), block_size=4, num_kv_blocks=blocks, time_scale=0.0)
    return EngineWorker(wid, eng, pub, heartbeat_s=0.01)


def _redis_index(url, ns, wid):
    return set(redis.Redis.from_url(url).smembers(f"{ns}:prefix:{wid}"))


def _wait_equal(w, url, ns, deadline_s=10.0):
    end = time.monotonic() + deadline_s
    while True:
        want = w.engine.kv.cached_block_hashes()  # read while idle: nothing runs on the step thread
        got = _redis_index(url, ns, w.worker_id)
        if got == want or time.monotonic() > end:
            return got, want
        time.sleep(0.02)


async def _run(w, rng, n):
    families = [[rng.randrange(1, 50) for _ in range(rng.randrange(4, 24))] for _ in range(4)]

    async def one(i):
        prompt = rng.choice(families) + [rng.randrange(1, 50) for _ in range(rng.randrange(0, 12))]
        req = GenerateRequest(request_id=f"r{i}", prompt_token_ids=prompt,
                              params=SamplingParams(max_tokens=rng.randrange(1, 12), ignore_eos=True))
        async for _ in w.generate(req):
            pass
    await asyncio.gather(*(one(i) for i in range(n)))


def test_the_redis_prefix_index_follows_the_cache_by_changes_alone():
    rng = random.Random(0)
    with EmbeddedRedis() as server:
        w = _worker(server.url, "hb")
        try:
            for round_ in range(6):  # cache churn in a small pool: stores and evictions
                asyncio.run(_run(w, rng, 30))
                got, want = _wait_equal(w, server.url, "hb")
                assert got == want, f"round {round_}: Redis index != the cache map"
            sent = w._heartbeat.publisher.sent
            assert [k for k, _ in sent].count("whole") == 1 == w._heartbeat.num_resyncs, "only the first is whole"
            assert sum(n for k, n in sent if k == "changes") > 0
            idle = len(sent)
            time.sleep(0.2)  # idle: heartbeats go on, carrying nothing
            assert len(sent) > idle and all(n == 0 for _, n in sent[idle + 1:])

            server.restart()  # Redis lost everything, between two heartbeats that succeed
            got, want = _wait_equal(w, server.url, "hb")
            assert got == want and want, "a Redis restart is followed by a resync"
            assert w._heartbeat.num_resyncs >= 2
            asyncio.run(_run(w, rng, 30))
            got, want = _wait_equal(w, server.url, "hb")
            assert got == want
        finally:
            w.shutdown()


def test_heartbeats_list_no_running_request_and_the_coordinator_asks_for_victims():
    """A low-priority request runs on b; a high-priority one starves on a. b's heartbeat
    lists none of its running requests; the coordinator asks b and preempts it there."""
    from folio.cluster.coordinator import Coordinator

    with EmbeddedRedis() as server:
        eng = functools.partial(simulated_engine, Roofline.named(), block_size=16, num_kv_blocks=40, time_scale=1.0)
        pub = functools.partial(WorkerPublisher, server.url, "v")
        workers = {w: EngineWorker(w, eng, pub, heartbeat_s=0.02) for w in ("a", "b")}
        client = LocalWorkerClient(workers)
        coord = Coordinator(ClusterState(server.url, "v"), client, interval_s=0.05)

        async def main():
            def req(rid, prompt, n, prio):
                return GenerateRequest(request_id=rid, prompt_token_ids=prompt,
                                       params=SamplingParams(max_tokens=n, ignore_eos=True), priority=prio)
            low = [asyncio.create_task(_drain(client.generate(w, req(f"low-{w}", list(range(1 + i, 401 + i)), 100, 5))))
                   for i, w in enumerate("ab")]
            await asyncio.sleep(0.2)
            load_b = await workers["b"].load()
            assert load_b.num_running == 1 and load_b.requests == [] and load_b.max_running_priority == 5
            hi = asyncio.create_task(_drain(client.generate("a", req("hi", list(range(3, 303)), 20, 0))))
            deadline = time.monotonic() + 20
            while coord.num_moves == 0 and time.monotonic() < deadline:
                await coord.round()
                await asyncio.sleep(0.05)
            assert coord.num_moves >= 1 and coord.num_victim_queries >= 1 and coord.num_preempted >= 1
            for t in [hi, *low]:
                t.cancel()
            await asyncio.gather(hi, *low, return_exceptions=True)
        try:
            asyncio.run(main())
        finally:
            for w in workers.values():
                w.shutdown()


async def _drain(stream):
    async for _ in stream:
        pass


def test_a_step_longer_than_the_ttl_keeps_the_worker_alive_and_a_stuck_one_does_not(monkeypatch):
    """A step that outlasts the load's TTL in Redis (1.5 s) does not make its worker vanish
    (the router answered 503 "no worker is alive" during long prefills of a real model): the
    heartbeat renews the last load. A step stuck past EngineWorker.STEP_STALL_S lets it lapse,
    and the watchdog fails the worker (its requests get the reason; in a cluster its process
    then exits and restarts, tests/engine/test_faults.py): it does not beat again."""
    with EmbeddedRedis() as server:
        w = _worker(server.url, "long")
        state = ClusterState(server.url, "long")
        real, slow_s = w.engine.step, [4.0]

        def slow():
            time.sleep(slow_s[0])
            return real()
        w.engine.step = slow

        async def main():
            task = asyncio.create_task(_drain(w.generate(GenerateRequest(
                request_id="r", prompt_token_ids=list(range(10, 30)), 
                params=SamplingParams(max_tokens=2, ignore_eos=True)))))
            await asyncio.sleep(0.3)
            seen = []
            for _ in range(30):  # 3 s, all within the first 4 s step
                seen.append("w0" in state.live_loads())
                await asyncio.sleep(0.1)
            assert all(seen), seen
            assert w._heartbeat.num_keepalives >= 3
            await task
            monkeypatch.setattr(EngineWorker, "STEP_STALL_S", 0.5)
            slow_s[0] = 5.0
            task = asyncio.create_task(_drain(w.generate(GenerateRequest(
                request_id="s", prompt_token_ids=list(range(40, 60)), 
                params=SamplingParams(max_tokens=1, ignore_eos=True)))))
            deadline = time.monotonic() + 4.5
            while "w0" in state.live_loads():  # stuck for 0.5 s, then the 1.5 s TTL runs out
                assert time.monotonic() < deadline, "a stuck worker stayed alive"
                await asyncio.sleep(0.1)
            with pytest.raises(WorkerFailedError, match="a step ran longer than 0.5 s"):
                await task
            assert w.failed
            await asyncio.sleep(0.3)
            assert "w0" not in state.live_loads()  # failed: no heartbeat until a restart
        try:
            asyncio.run(main())
        finally:
            w.shutdown()


def _load(wid="w1", free=32):
    from folio.worker.messages import WorkerLoad

    return WorkerLoad(worker_id=wid, timestamp=time.time(), num_kv_blocks=32, num_free_blocks=free, num_cpu_blocks=0,
                      num_free_cpu_blocks=0, block_size=16, requests=[])


@pytest.mark.parametrize("flush", [False, True])
def test_a_worker_process_ray_replaced_ends_itself_and_its_successor_keeps_the_name(flush):
    """Ray restarts a worker whose node it calls dead elsewhere, while the old process runs on: both
    beat as w1 (a two-node attack, 2026-12-08: its metrics flapped, frontends kept the old one). Each
    process's first beat claims the name; the old one, at its next check, finds another's claim and
    ends (on_replaced), beating no more. A lone process is never replaced by its own claims, nor by a
    Redis that lost its data (FLUSHALL: the first to beat claims it again)."""
    from folio.cluster.fencing import FencedPublisher

    with EmbeddedRedis() as server:
        state = ClusterState(server.url, "fence")
        ended = []
        old = FencedPublisher(server.url, "fence", check_every=3, on_replaced=ended.append)
        for _ in range(20):
            old.publish(_load(free=1))
        if flush:
            redis.Redis.from_url(server.url).flushall()
            for _ in range(6):
                old.publish(_load(free=1))
        assert ended == [] and state.live_loads()["w1"].num_free_blocks == 1
        new = FencedPublisher(server.url, "fence", check_every=3, on_replaced=ended.append)
        new.publish(_load(free=2))
        for _ in range(5):  # its next check comes within check_every beats; after it, nothing more
            old.publish(_load(free=1))
        assert ended == ["w1"] and old.replaced
        new.publish(_load(free=2))
        for _ in range(5):
            old.publish(_load(free=1))  # (a test's on_replaced goes on: the real one ended the process)
        assert state.live_loads()["w1"].num_free_blocks == 2  # the successor's load, not the old one's
        for _ in range(10):
            new.publish(_load(free=2))
        assert ended == ["w1"] and not new.replaced  # the successor keeps the name
        other = FencedPublisher(server.url, "fence", check_every=3, on_replaced=ended.append)
        for _ in range(10):
            other.publish(_load("w2"))  # another worker's name is its own
        assert ended == ["w1"]


REPLACED = """
import sys, time
from folio.cluster.fencing import FencedPublisher
from folio.worker.messages import WorkerLoad
pub = FencedPublisher(sys.argv[1], "fence", check_every=2)
for i in range(600):
    pub.publish(WorkerLoad(worker_id="w1", timestamp=time.time(), num_kv_blocks=1, num_free_blocks=1, num_cpu_blocks=0,
                           num_free_cpu_blocks=0, block_size=16, requests=[]))
    print(i, flush=True)
    time.sleep(0.05)
"""


def test_a_replaced_worker_process_is_ended_for_good():
    """By default a replaced process ends at once (SIGKILL to itself): its connections close, so its
    frontends fail or re-run its requests and open channels to its successor."""
    import subprocess
    import sys

    from folio.cluster.fencing import FencedPublisher

    with EmbeddedRedis() as server:
        old = subprocess.Popen([sys.executable, "-c", REPLACED, server.url], stdout=subprocess.PIPE, text=True)
        try:
            assert old.stdout.readline().strip() == "0"
            FencedPublisher(server.url, "fence").publish(_load())
            assert old.wait(timeout=10) == -9
        finally:
            if old.poll() is None:
                old.kill()
