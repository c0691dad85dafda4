"""What a request leaves behind once it is over: nothing. The per-request structures of a
worker and a router are empty after requests that finish, that are cancelled mid-stream
and that are cancelled while being admitted; the oneDNN linear path runs a bounded set of
row counts. (The RSS over 10,000 requests is measured in benchmarks/memory_growth.py.)"""

from __future__ import annotations

import asyncio
import functools
import random

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from folio.kernels.linear import Linear, row_bucket
from folio.worker import EngineConfig, LLMEngine, SamplingParams
from folio.worker.actor import EngineWorker
from folio.worker.messages import GenerateRequest

from conftest import until


@given(st.integers(1, 1 << 16))
def test_row_bucket_covers_and_pads_little(rows):
    b = row_bucket(rows)
    assert b >= rows
    assert b == rows if rows <= 16 else b - rows < max(8, rows / 16 + 1)
    assert row_bucket(b) == b  # a bucket is its own bucket: no drift


def test_row_buckets_are_few():
    assert len({row_bucket(r) for r in range(1, 2049)}) <= 100


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
@pytest.mark.parametrize("rows", [17, 63, 65, 130, 513])
def test_padded_rows_give_the_same_product(rows):
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(48, 40, generator=g), torch.randn(48, generator=g)
    x = torch.randn(rows, 40, generator=g)
    assert row_bucket(rows) != rows
    out = Linear(w, b, "onednn")(x)
    assert out.shape == (rows, 48) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


@pytest.fixture
def worker(model_dirs):
    cfg = EngineConfig(model=model_dirs["llama"], block_size=8, num_kv_blocks=64, max_model_len=256)
    w = EngineWorker("w0", functools.partial(LLMEngine, cfg), None)
    yield w
    w.shutdown()


async def _requests(w: EngineWorker, n: int, seed: int) -> None:
    """n requests, 8 at a time: a third read to the end, a third closed after their first
    token, a third cancelled at a random point (admission included)."""
    rng = random.Random(seed)
    sem = asyncio.Semaphore(8)

    async def one(i):
        async with sem:
            prompt = [rng.randrange(3, 500) for _ in range(rng.randint(2, 30))]
            req = GenerateRequest(request_id=f"r{seed}-{i}", prompt_token_ids=prompt,
                                  params=SamplingParams(max_tokens=rng.randint(2, 12), temperature=0.0,
                                                        ignore_eos=True))
            gen = w.generate(req)
            if i % 3 == 2:
                task = asyncio.ensure_future(_read(gen))
                await asyncio.sleep(rng.random() * 0.02)
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                return
            try:
                async for chunk in gen:
                    if i % 3 == 1 and any(d.token_ids for d in chunk.deltas):
                        break
            finally:
                await gen.aclose()

    await asyncio.gather(*(one(i) for i in range(n)))


async def _read(gen):
    try:
        async for _ in gen:
            pass
    finally:
        await gen.aclose()


def test_worker_forgets_every_request(worker):
    async def main():
        for rnd in range(3):
            await _requests(worker, 60, rnd)
        # the aborts the closed streams sent run between steps: wait until the engine is idle
        async def idle():
            return not await worker._call(lambda e: e.has_unfinished_requests())
        await until(idle, "the engine idle", 60, interval_s=0.01)
        await worker.check_invariants()
        return await worker._call(lambda e: (len(e.groups), len(e.output_kinds), e.kv.num_free_blocks))

    groups, kinds, free = asyncio.run(main())
    assert (len(worker._streams), len(worker._sent), groups, kinds) == (0, 0, 0, 0)
    assert free == 64


def test_router_decision_log_is_bounded():
    from folio.cluster.router import DECISIONS_KEPT, Router

    class NoState:  # pick() is not called: only the log's bound is under test
        pass

    r = Router(NoState(), None, "least-loaded")
    for i in range(DECISIONS_KEPT + 50):
        r.decision_seconds.append(float(i))
    assert len(r.decision_seconds) == DECISIONS_KEPT and r.decision_seconds[-1] == DECISIONS_KEPT + 49


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
def test_warm_up_runs_each_shape_once_per_bucket():
    from folio.kernels.linear import WARM_ROWS_MAX, warm_row_buckets

    a, a2 = Linear(torch.randn(48, 40), None, "onednn"), Linear(torch.randn(48, 40), None, "onednn")
    b, head = Linear(torch.randn(40, 48), torch.randn(40), "onednn"), Linear(torch.randn(96, 40), None, "onednn")
    plain = Linear(torch.randn(8, 8), None, "torch")  # not oneDNN: nothing to warm
    n = warm_row_buckets([a, a2, b, (head, 20), plain], 100)
    per = len({row_bucket(r) for r in range(1, 101)})
    assert n == 2 * per + len({row_bucket(r) for r in range(1, 21)})  # a and a2 share a shape
    assert warm_row_buckets([a], 10 * WARM_ROWS_MAX) == len({row_bucket(r) for r in range(1, WARM_ROWS_MAX + 1)})

