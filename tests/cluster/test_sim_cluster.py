"""The simulated engine (roofline step times, no tensors) and a simulated cluster of
8 workers with the real worker, router, coordinator and Redis."""

import asyncio
import random

import pytest

from folio.cluster.sim.cluster import SimCluster
from folio.worker import SamplingParams
from folio.worker.errors import InvalidRequestError
from folio.worker.messages import GenerateRequest
from folio.cluster.sim.roofline import Roofline
from folio.cluster.sim.runner import simulated_engine


def run_offline(engine, reqs):
    for rid, prompt, n in reqs:
        engine.add_request(rid, prompt, SamplingParams(max_tokens=n, ignore_eos=True))
    out = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id] = o.token_ids
    return out


def workload(n, seed=0, vocab=128000):
    rng = random.Random(seed)
    return [(f"r{i}", [rng.randrange(vocab) for _ in range(rng.randint(20, 200))], rng.randint(5, 40))
            for i in range(n)]


def test_roofline_step_times_are_those_of_the_named_hardware():
    r = Roofline.named("H200", "llama-3-8b")
    decode = r.step_seconds([(1, 1024)])
    assert 0.005 < decode < 0.007  # 16 GB of weights at 80 % of 4.8 TB/s, plus 2 ms overhead
    assert r.step_seconds([(1, 1024)] * 64) > decode  # KV reads grow with the batch
    assert r.step_seconds([(2048, 2048)]) > 0.05  # a 2k prefill is compute-bound
    assert r.step_seconds([], 55e9) == pytest.approx(1.0)  # swaps over the host link
    assert 50_000 < r.num_kv_blocks(16) < 56_000  # ~0.87 M tokens of KV beside 16 GB of weights


def test_simulated_engine_is_deterministic_under_preemption_and_migration():
    r = Roofline.named()
    reqs = workload(12)
    roomy = run_offline(simulated_engine(r, num_kv_blocks=4096, time_scale=0), reqs)
    tight_engine = simulated_engine(r, num_kv_blocks=20, time_scale=0)
    tight = run_offline(tight_engine, reqs)
    assert tight == roomy
    assert tight_engine.stats().preemptions_by_mode["swap"] > 0
    tight_engine.check_invariants()
    # migrate mid-way
    a, b = simulated_engine(r, num_kv_blocks=64, time_scale=0), simulated_engine(r, num_kv_blocks=64, time_scale=0)
    a.add_request("m", reqs[0][1], SamplingParams(max_tokens=30, ignore_eos=True), output_kind="delta")
    got = []
    for _ in range(5):
        got += [t for o in a.step() for t in o.token_ids]
    b.import_request(a.export_request("m"))
    while b.has_unfinished_requests():
        got += [t for o in b.step() for t in o.token_ids]
    assert got == run_offline(simulated_engine(r, time_scale=0, num_kv_blocks=64), [("m", reqs[0][1], 30)])["m"]
    a.check_invariants()
    b.check_invariants()
    with pytest.raises(InvalidRequestError):
        a.add_request("t", "text prompts need a tokenizer")


def test_simulated_cluster_serves_a_burst_with_migrations():
    reqs = workload(60, seed=1)
    expected = run_offline(simulated_engine(Roofline.named(), num_kv_blocks=4096, time_scale=0), reqs)

    async def main():
        cluster = await SimCluster(8, policy="least-loaded", time_scale=1.0, num_kv_blocks=40).start()
        try:
            async def one(rid, prompt, n, pin):
                toks = []
                req = GenerateRequest(request_id=rid, prompt_token_ids=prompt,
                                      params=SamplingParams(max_tokens=n, ignore_eos=True))
                async for chunk in cluster.router.generate(req, worker_id=pin):
                    toks += chunk.deltas[0].token_ids
                return rid, toks
            # a third of the burst is pinned to sim0 (far past its KV); the rest is routed
            got = dict(await asyncio.wait_for(asyncio.gather(
                *(one(rid, p, n, "sim0" if i % 3 == 0 else None) for i, (rid, p, n) in enumerate(reqs))), 120))
            stats = await cluster.stats()
            for w in cluster.workers.values():
                await w.check_invariants()
            return got, stats, cluster.coordinator.stats()
        finally:
            await cluster.stop()
    got, stats, coord = asyncio.run(main())
    assert got == expected
    assert coord["moves"] >= 1 and stats["sim0"]["num_migrations_out"] >= 1
    assert sum(s["num_generated_tokens"] > 0 for s in stats.values()) >= 6  # the load spread
    assert all(s["num_free_blocks"] == s["num_kv_blocks"] for s in stats.values())


def test_move_with_victims_preempts_them_on_the_destination_and_runs_the_request_there():
    """The coordinator's second rule, as carried out: a high-priority request that fits
    nowhere moves to a worker whose low-priority request is swapped out to make room."""
    from folio.cluster.worker_client import LocalWorkerClient
    from folio.worker.actor import EngineWorker

    r = Roofline.named()
    workers = {w: EngineWorker(w, lambda: simulated_engine(r, num_kv_blocks=40, time_scale=1.0)) for w in ("a", "b")}
    client = LocalWorkerClient(workers)
    low = [("low-a", list(range(1, 401)), 100), ("low-b", list(range(2, 402)), 100)]
    hi = ("hi", list(range(3, 303)), 20)
    expected = run_offline(simulated_engine(r, num_kv_blocks=4096, time_scale=0), low + [hi])

    async def collect(gen):
        toks = []
        async for chunk in gen:
            toks += chunk.deltas[0].token_ids
        return toks

    async def main():
        def req(rid, prompt, n, prio):
            return GenerateRequest(request_id=rid, prompt_token_ids=prompt,
                                   params=SamplingParams(max_tokens=n, ignore_eos=True), priority=prio)
        lows = [asyncio.create_task(collect(client.generate(w, req(*low[i], prio=5)))) for i, w in enumerate("ab")]
        await asyncio.sleep(0.1)  # both workers hold their low-priority request (25+ of 40 blocks)
        hi_stream = client.generate("a", req(*hi, prio=0))
        hi_task = asyncio.create_task(collect(_follow(client, hi_stream)))
        await asyncio.sleep(0.02)  # on a it waits or runs a first prefill chunk in the ~14 free blocks
        await client.move("a", "b", "hi", preempt=("low-b",))
        load_b = await workers["b"].load()
        assert {q.request_id: q.state for q in load_b.requests}["low-b"] == "swapped"
        got = {"hi": await hi_task, "low-a": await lows[0], "low-b": await lows[1]}
        stats = {w: await workers[w].stats() for w in workers}
        for w in workers.values():
            await w.check_invariants()
        return got, stats
    try:
        got, stats = asyncio.run(main())
    finally:
        for w in workers.values():
            w.shutdown()
    assert got == expected
    assert stats["b"]["preemptions_by_mode"]["swap"] >= 1 and stats["b"]["num_migrations_in"] == 1


async def _follow(client, stream):
    """A client stream that follows `migrated_to` (what the router does)."""
    async for chunk in stream:
        if chunk.migrated_to is not None:
            async for later in client.attach(chunk.migrated_to, chunk.request_id):
                yield later
            return
        yield chunk


def test_no_live_worker_is_a_clear_unavailable_error():
    from folio.cluster.redis_server import EmbeddedRedis
    from folio.cluster.router import Router
    from folio.cluster.state import ClusterState
    from folio.cluster.worker_client import LocalWorkerClient
    from folio.worker.errors import UnavailableError

    req = GenerateRequest(request_id="r", prompt_token_ids=[1, 2, 3], params=SamplingParams(max_tokens=2))

    async def pick(url):
        return await Router(ClusterState(url, "empty"), LocalWorkerClient({})).pick(req)
    with EmbeddedRedis() as redis:
        with pytest.raises(UnavailableError, match="no worker is alive"):
            asyncio.run(pick(redis.url))
        url = redis.url
    with pytest.raises(UnavailableError, match="unreachable"):
        asyncio.run(pick(url))  # Redis itself is gone
