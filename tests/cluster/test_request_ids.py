"""Client-chosen request ids through the router (in-process workers, real engines, no Ray): an
id runs one request at a time through a router, whichever worker each would go to. Another
request with an id in use waits for it to end (a client that cancelled a stream and sent its
id again at once), then runs; one still waiting after the router's `id_wait_s` is refused
("already in use", INVALID_ARGUMENT over gRPC). Before, two at once through one frontend ran
on two workers, and an abort of the id stopped either."""

import asyncio
import random

import pytest

from folio.cluster.router import Router
from folio.cluster.worker_client import LocalWorkerClient
from folio.worker import InvalidRequestError, SamplingParams
from folio.worker.messages import GenerateRequest

from conftest import PROMPTS, step_delay
from test_worker_actor import GREEDY, _shutdown_workers, make_worker, model, offline, tokenizer  # noqa: F401 (fixtures)


class Tracking(LocalWorkerClient):
    """Fails the test if two requests with one id are on the workers at once."""

    def __init__(self, workers):
        super().__init__(workers)
        self.active: dict[str, str] = {}
        self.overlaps: list[tuple[str, str, str]] = []

    async def generate(self, wid, req):
        rid = req.request_id
        if rid in self.active:
            self.overlaps.append((rid, self.active[rid], wid))
        self.active[rid] = wid
        try:
            async for chunk in super().generate(wid, req):
                yield chunk
        finally:
            if self.active.get(rid) == wid:
                del self.active[rid]


def tokens_of(chunks) -> list[int]:
    return [t for c in chunks for d in c.deltas for t in d.token_ids]


async def idle(workers) -> None:
    for w in workers:
        st = await w.stats()
        assert st["num_free_blocks"] == st["num_kv_blocks"] and st["num_streams"] == 0, st
        await w.check_invariants()


def test_an_id_in_use_is_refused_on_the_other_worker_and_free_after(model, offline, tokenizer):
    a, b = make_worker(model, "a"), make_worker(model, "b")
    step_delay(a, 0.02)  # the first request (24 steps) outlasts the second's wait on any CPU
    client = Tracking({"a": a, "b": b})
    params = SamplingParams(**GREEDY)

    def req(i):
        return GenerateRequest(request_id="dup", prompt_token_ids=tokenizer(PROMPTS[i]).input_ids, params=params)

    async def main():
        router = Router(state=None, client=client)
        router.id_wait_s = 0.1
        first = router.generate(req(0), worker_id="a")
        got = [await first.__anext__()]
        with pytest.raises(InvalidRequestError, match="'dup' is already in use"):
            async for _ in router.generate(req(1), worker_id="b"):
                pass
        got += [c async for c in first]
        assert tokens_of(got) == offline[PROMPTS[0]]  # the first ran on, untouched
        again = [c async for c in router.generate(req(1), worker_id="b")]  # ended: the id is free
        assert tokens_of(again) == offline[PROMPTS[1]]
        assert not router._ids and not router._where and not client.overlaps
        await idle((a, b))

    asyncio.run(main())


def test_ids_shared_by_many_clients_run_one_at_a_time(model, offline, tokenizer):
    """Rounds of clients drawing their ids from a pool of four, each pinned to a random worker:
    some read to the end, some leave after 0-3 chunks, and some leave and send their id again
    *before* the old stream is closed (a gRPC cancel and retry, whose order the server may not
    keep). No id is ever on the workers twice at once; a retry runs, exact; a request is
    refused only while its id stayed in use past the wait; nothing is left behind."""
    a, b = make_worker(model, "a", num_kv_blocks=256), make_worker(model, "b", num_kv_blocks=256)
    client = Tracking({"a": a, "b": b})
    ids = {p: tokenizer(p).input_ids for p in PROMPTS}
    params = SamplingParams(**GREEDY)
    outcome = {"full": 0, "left": 0, "retried": 0, "refused": 0}

    async def one(router, rng, rid):
        prompt = rng.choice(PROMPTS)
        kind = rng.choice(("full", "left", "retried"))
        stream = router.generate(GenerateRequest(request_id=rid, prompt_token_ids=ids[prompt], params=params),
                                 worker_id=rng.choice("ab"))
        try:
            if kind == "full":
                assert tokens_of([c async for c in stream]) == offline[prompt]
            else:
                for _ in range(rng.randint(0, 3)):
                    await stream.__anext__()
                if kind == "retried":
                    retry = asyncio.ensure_future(one_full(router, rid, prompt, rng.choice("ab")))
                    await asyncio.sleep(0)  # the retry is waiting on the id before the old stream closes
                await stream.aclose()
                if kind == "retried":
                    await retry
            outcome[kind] += 1
        except InvalidRequestError as e:
            assert "already in use" in str(e)
            outcome["refused"] += 1

    async def one_full(router, rid, prompt, wid):
        chunks = [c async for c in router.generate(GenerateRequest(request_id=rid, prompt_token_ids=ids[prompt],
                                                                   params=params), worker_id=wid)]
        assert tokens_of(chunks) == offline[prompt]

    async def main():
        router = Router(state=None, client=client)
        router.id_wait_s = 0.2
        for rnd in range(6):
            rng = random.Random(rnd)
            await asyncio.gather(*(one(router, random.Random(rng.random()), f"id-{rng.randrange(4)}")
                                   for _ in range(16)))
            assert not router._ids and not router._where
        assert not client.overlaps, client.overlaps[:5]
        await idle((a, b))

    asyncio.run(main())
    print(outcome)
    assert min(outcome.values()) > 0, outcome  # every path was taken


def test_an_id_held_on_an_event_loop_that_is_gone_is_taken(model, offline, tokenizer):
    """A router used from several event loops (asyncio.run after asyncio.run, as tests and
    scripts do): an id left held by a request of a loop that is gone is stale, not in use."""
    a = make_worker(model, "a")
    router = Router(state=None, client=LocalWorkerClient({"a": a}))

    async def hold():  # an entry bound to this loop, as a request that never closed leaves it
        ev = router._ids["stale"] = asyncio.Event()
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(ev.wait(), 0.01)
    asyncio.run(hold())

    async def main():
        req = GenerateRequest(request_id="stale", prompt_token_ids=tokenizer(PROMPTS[0]).input_ids,
                              params=SamplingParams(**GREEDY))
        assert tokens_of([c async for c in router.generate(req, worker_id="a")]) == offline[PROMPTS[0]]
        assert not router._ids
    asyncio.run(main())
