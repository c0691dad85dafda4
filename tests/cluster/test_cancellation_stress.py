"""Cancellation through the real path (Ray actors, the router, the frontend's one channel
per worker): rounds of ~100 streaming clients that leave after 0-5 chunks, by closing
their stream or by being cancelled mid-wait (an HTTP handler whose client disconnected).
After each round nothing runs, every KV block is free, and the workers generated barely
more than what the clients read: a request whose abort was lost would run on to its
1,900 tokens. An abort that reaches a worker before its request wins, in-process and
through Ray."""

import asyncio
import functools
import random
import time

import pytest

ray = pytest.importorskip("ray")

from folio.cluster.launcher import ClusterConfig, FolioCluster  # noqa: E402
from folio.worker import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from folio.worker.actor import EngineWorker  # noqa: E402
from folio.worker.messages import GenerateRequest  # noqa: E402

ENGINE = dict(block_size=16, num_kv_blocks=1024, max_model_len=2048, max_num_seqs=128)
ROUNDS, CLIENTS, MAX_TOKENS = 5, 100, 1900
SLACK_PER_CLIENT = 24  # tokens a worker may make between a client leaving and its abort applying
IDLE_TIMEOUT_S = 60


@pytest.fixture(scope="module")
def cluster(model_dirs):
    c = FolioCluster(ClusterConfig(model=model_dirs["llama"], num_workers=2, engine_args=ENGINE, router="least-loaded",
                                   namespace="fcancel", coordinator=False)).start()
    yield c
    c.shutdown(grace_s=2)


async def stats(cluster):
    return {w: await h.stats.remote() for w, h in cluster.workers.items()}


async def wait_idle(cluster):
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while True:
        st = await stats(cluster)
        if all(s["num_free_blocks"] == s["num_kv_blocks"] and s["num_streams"] == 0 and
               s["num_running"] + s["num_waiting"] + s["num_swapped"] == 0 for s in st.values()):
            return st
        assert time.monotonic() < deadline, f"requests or blocks left behind: {st}"
        await asyncio.sleep(0.05)


async def client(router, rid: str, leave_after: int, cancel: bool) -> int:
    """Read `leave_after` chunks, then close the stream; or, with `cancel`, be cancelled
    while waiting for the next one (an HTTP handler whose client disconnected; with 0,
    while its request is being submitted). Returns the tokens it read."""
    rng = random.Random(rid)
    req = GenerateRequest(request_id=rid, prompt_token_ids=[rng.randrange(3, 500) for _ in range(rng.randint(4, 40))],
                          params=SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    got = 0
    stream = router.generate(req)
    enough = asyncio.Event()

    async def read():
        nonlocal got
        n = 0
        try:
            while True:
                if n >= leave_after:
                    enough.set()
                    if not cancel:
                        return
                chunk = await stream.__anext__()
                got += sum(len(d.token_ids) for d in chunk.deltas)
                n += 1
                assert not chunk.finished, f"{rid} finished: {chunk}"
        finally:  # as the frontends do: the stream is closed, not left to the garbage collector
            enough.set()  # (a read that failed must fail the test, not leave it waiting)
            await stream.aclose()

    task = asyncio.ensure_future(read())
    await enough.wait()
    if cancel:
        await asyncio.sleep(0)  # in the next chunk's wait (or, at 0, in the submit)
        task.cancel()
    err = (await asyncio.gather(task, return_exceptions=True))[0]
    if isinstance(err, BaseException) and not isinstance(err, asyncio.CancelledError):
        raise err
    return got


async def round_of_clients(router, seed: int) -> int:
    rng = random.Random(seed)
    plans = [(f"s{seed}-{i}", rng.randint(0, 5), i % 2 == 1) for i in range(CLIENTS)]
    return sum(await asyncio.gather(*(client(router, *p) for p in plans)))


def test_clients_that_leave_leave_nothing_running(cluster):
    router = cluster.router

    async def main():  # one event loop: the frontend's channels stay open across the rounds
        for rnd in range(ROUNDS):
            before = {w: s["num_generated_tokens"] for w, s in (await wait_idle(cluster)).items()}
            read = await round_of_clients(router, rnd)
            idle = await wait_idle(cluster)
            after = {w: s["num_generated_tokens"] for w, s in idle.items()}
            made = sum(after[w] - before[w] for w in after)
            print(f"round {rnd}: {made} tokens generated, {read} read by the clients")
            assert made < 0.05 * CLIENTS * MAX_TOKENS, f"round {rnd}: {made} tokens generated"
            # a request that ran on after its client left would add up to 1,900 tokens
            assert made - read < SLACK_PER_CLIENT * CLIENTS, f"round {rnd}: {made} generated, {read} read"
            assert [s["num_subscribers"] for s in idle.values()] == [1, 1]  # one stream per frontend and worker
    asyncio.run(main())
    ray.get([h.check_invariants.remote() for h in cluster.workers.values()])


def test_an_abort_that_overtakes_its_request_wins_through_ray(cluster):
    router = cluster.router

    def request(rid: str, max_tokens: int) -> GenerateRequest:
        return GenerateRequest(request_id=rid, prompt_token_ids=[5, 6, 7, 8], arrival_time=time.time(),
                               params=SamplingParams(max_tokens=max_tokens, ignore_eos=True))

    async def main():
        for i in range(10):
            rid = f"early-{i}"
            wid = "w0" if i % 2 == 0 else "w1"
            req = request(rid, MAX_TOKENS)  # sent (its arrival stamped by a router), then its abort
            assert not await router.client.abort(wid, rid)  # it has not arrived yet
            chunks = [c async for c in router.generate(req, worker_id=wid)]
            assert chunks[-1].finished and chunks[-1].deltas[0].finish_reason == "abort"
            assert sum(len(d.token_ids) for c in chunks for d in c.deltas) == 0
            # a request sent after an abort that found nothing is a new one: it runs
            assert not await router.client.abort(wid, rid + "-new")
            chunks = [c async for c in router.generate(request(rid + "-new", 5), worker_id=wid)]
            assert chunks[-1].finished and chunks[-1].deltas[0].finish_reason == "length"
        await wait_idle(cluster)
    asyncio.run(main())


def test_an_abort_that_overtakes_its_request_wins_in_process(model_dirs):
    cfg = EngineConfig(model=model_dirs["llama"], block_size=8, num_kv_blocks=64, max_model_len=256)
    w = EngineWorker("w0", functools.partial(LLMEngine, cfg), None)

    async def main():
        assert not await w.abort("a")
        chunks = [c async for c in w.generate(GenerateRequest(request_id="a", prompt_token_ids=[5, 6, 7],
                                                              params=SamplingParams(max_tokens=50)))]
        assert [c.deltas[0].finish_reason for c in chunks] == ["abort"]
        # the tombstone is spent: the same id runs normally now, and an abort after its end leaves none
        chunks = [c async for c in w.generate(GenerateRequest(request_id="a", prompt_token_ids=[5, 6, 7],
                                                              params=SamplingParams(max_tokens=5, ignore_eos=True)))]
        assert chunks[-1].deltas[0].finish_reason == "length"
        assert not await w.abort("a")
        chunks = [c async for c in w.generate(GenerateRequest(request_id="a", prompt_token_ids=[5, 6, 7],
                                                              params=SamplingParams(max_tokens=5, ignore_eos=True)))]
        assert chunks[-1].deltas[0].finish_reason == "length"
        st = await w.stats()
        assert st["num_streams"] == 0 and st["num_free_blocks"] == st["num_kv_blocks"]
    try:
        asyncio.run(main())
    finally:
        w.shutdown()
