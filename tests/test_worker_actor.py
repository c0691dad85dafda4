"""The worker (step thread + async API), the router and the coordinator in one process:
real engines on the tiny model, a real Redis, no Ray (the Ray cluster is test_cluster_ray.py)."""

import asyncio
import functools
import time

import pytest

from folio.cluster.coordinator import Coordinator
from folio.cluster.redis_server import EmbeddedRedis
from folio.cluster.router import Router
from folio.cluster.state import ClusterState, WorkerPublisher
from folio.cluster.worker_client import LocalWorkerClient
from folio.worker import LLM, EngineConfig, InvalidRequestError, LLMEngine, SamplingParams
from folio.worker.actor import EngineWorker
from folio.worker.errors import FolioError
from folio.worker.messages import GenerateRequest

from conftest import PROMPTS

ENGINE = dict(block_size=8, num_kv_blocks=40, max_model_len=256, num_cpu_blocks=80, preemption_mode="swap")
GREEDY = dict(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model(model_dirs):
    return model_dirs["llama"]


@pytest.fixture(scope="module")
def offline(model):
    llm = LLM(model, **ENGINE)
    return {p: out.token_ids for p, out in zip(PROMPTS, llm.generate(PROMPTS, SamplingParams(**GREEDY)))}


@pytest.fixture(scope="module")
def tokenizer(model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


_LIVE: list[EngineWorker] = []


@pytest.fixture(autouse=True)
def _shutdown_workers():
    yield
    while _LIVE:  # even when a test failed half-way: no step thread outlives its test
        _LIVE.pop().shutdown()


def make_worker(model, wid, redis_url=None, ns="t", **engine):
    pub = functools.partial(WorkerPublisher, redis_url, ns) if redis_url else None
    cfg = EngineConfig(model=model, **{**ENGINE, **engine})
    w = EngineWorker(wid, functools.partial(LLMEngine, cfg), pub, heartbeat_s=0.05)
    _LIVE.append(w)
    return w


async def collect(stream):
    tokens, chunks = {}, []
    async for chunk in stream:
        chunks.append(chunk)
        for d in chunk.deltas:
            tokens.setdefault(d.index, []).extend(d.token_ids)
    return tokens, chunks


def test_worker_streams_the_offline_engines_tokens_and_rejects_bad_input(model, offline, tokenizer):
    w = make_worker(model, "w0")

    async def main():
        reqs = [GenerateRequest(f"r{i}", tokenizer(p).input_ids, SamplingParams(**GREEDY)) for i, p in enumerate(PROMPTS)]
        results = await asyncio.gather(*(collect(w.generate(r)) for r in reqs))
        for p, (tokens, chunks) in zip(PROMPTS, results):
            assert tokens[0] == offline[p]
            assert chunks[-1].finished and chunks[-1].deltas[0].finish_reason == "length"
            assert [c.deltas[0].num_tokens for c in chunks] == sorted({c.deltas[0].num_tokens for c in chunks})
        for bad in ([], [10 ** 9], list(range(300))):
            with pytest.raises(InvalidRequestError):
                await collect(w.generate(GenerateRequest("bad", bad, SamplingParams(**GREEDY))))
        with pytest.raises(InvalidRequestError):
            await collect(w.generate(GenerateRequest("bad", [5, 6], SamplingParams(**GREEDY), priority="high")))
        st = await w.stats()
        assert st["num_streams"] == 0 and st["num_free_blocks"] == st["num_kv_blocks"]
        await w.check_invariants()

    asyncio.run(main())


def test_a_slow_reader_gets_the_steps_it_missed_merged_into_one_chunk(model, offline, tokenizer):
    w = make_worker(model, "w0")
    prompt = PROMPTS[0]
    n = 2  # two completions: the merge is per completion index
    params = SamplingParams(max_tokens=24, temperature=0.8, seed=7, n=n, ignore_eos=True, logprobs=1)

    async def read(slow: bool):
        chunks = []
        async for chunk in w.generate(GenerateRequest(f"r{slow}", tokenizer(prompt).input_ids, params)):
            chunks.append(chunk)
            if slow:
                await asyncio.sleep(0.15)  # several engine steps run meanwhile
        return chunks

    async def main():
        fast, slow = await read(False), await read(True)
        assert len(slow) < len(fast), "the slow reader should have received merged chunks"
        for chunks in (fast, slow):
            assert chunks[-1].finished and all(not c.finished for c in chunks[:-1])
        for i in range(n):
            def per(chunks, i=i):
                ds = [d for c in chunks for d in c.deltas if d.index == i]
                return ([t for d in ds for t in d.token_ids], "".join(d.text for d in ds),
                        [lp for d in ds for lp in d.logprobs], [d.num_tokens for d in ds], ds[-1].finish_reason)
            f, s_ = per(fast), per(slow)
            assert f[0] == s_[0] and len(f[0]) == 24 and f[1] == s_[1] and f[2] == s_[2] and f[4] == s_[4] == "length"
            # counts stay continuous: each chunk's num_tokens = previous + its tokens
            assert s_[3] == sorted(set(s_[3])) and s_[3][-1] == 24
        st = await w.stats()
        assert st["num_streams"] == 0 and st["num_free_blocks"] == st["num_kv_blocks"]

    asyncio.run(main())


def test_a_frontends_channel_batches_its_requests_and_orders_its_aborts(model, offline, tokenizer):
    """commands + subscribe (what RayWorkerClient uses): one message per wake-up carries
    several requests' chunks; an abort in the same batch as its submit wins; a duplicate
    id is refused on the stream; closing the stream aborts what still runs."""
    w = make_worker(model, "w0")

    async def main():
        reqs = [GenerateRequest(f"r{i}", tokenizer(p).input_ids, SamplingParams(**GREEDY)) for i, p in enumerate(PROMPTS)]
        long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        sub = w.subscribe("fe-1")
        assert await w.commands("fe-1", [("submit", r) for r in reqs] + [
            ("submit", reqs[0]), ("submit", GenerateRequest("gone", [5, 6, 7], long)), ("abort", "gone")]) == \
            [None] * (len(reqs) + 2) + [True]
        tokens, done, sizes, errors, gone = {}, set(), [], [], []
        while len(done) < len(reqs) + 1:
            batch = await sub.__anext__()
            sizes.append(len({rid for rid, _ in batch}))
            for rid, item in batch:
                if isinstance(item, BaseException):
                    errors.append((rid, item))
                    continue
                if rid == "gone":
                    gone.append(item)
                else:
                    tokens.setdefault(rid, []).extend(t for d in item.deltas for t in d.token_ids)
                if item.finished:
                    done.add(rid)
        for r, p in zip(reqs, PROMPTS):
            assert tokens[r.request_id] == offline[p]
        assert [(rid, type(e)) for rid, e in errors] == [("r0", InvalidRequestError)]
        assert gone[-1].deltas[0].finish_reason == "abort" and sum(len(d.token_ids) for c in gone for d in c.deltas) < 5
        assert max(sizes) > 1, "a step's outputs for several requests should share a message"
        gen0 = await w._call(lambda e: e.num_generated_tokens)
        await w.commands("fe-1", [("submit", GenerateRequest("long", tokenizer(PROMPTS[0]).input_ids, long))])
        await sub.__anext__()
        await sub.aclose()  # the frontend went away
        for _ in range(200):
            st = await w.stats()
            if st["num_streams"] == 0 and st["num_free_blocks"] == st["num_kv_blocks"]:
                break
            await asyncio.sleep(0.01)
        assert st["num_streams"] == 0 and st["num_free_blocks"] == st["num_kv_blocks"] and st["num_subscribers"] == 0
        assert await w._call(lambda e: e.num_generated_tokens) - gen0 < 150, "the request ran on after the close"
        await w.check_invariants()

    asyncio.run(main())


def test_merge_chunks_unit():
    from folio.worker.messages import CompletionDelta, StreamChunk, merge_chunks

    a = StreamChunk("r", "w0", [CompletionDelta(0, [1], "a", 1), CompletionDelta(1, [7], "x", 1)], queue_s=0.5)
    b = StreamChunk("r", "w0", [CompletionDelta(0, [2, 3], "bc", 3, "length")], finished=True, num_preemptions=1)
    m = merge_chunks(a, b)
    assert [(d.index, d.token_ids, d.text, d.num_tokens, d.finish_reason, d.logprobs) for d in m.deltas] == [
        (0, [1, 2, 3], "abc", 3, "length", None), (1, [7], "x", 1, None, None)]
    assert m.finished and m.queue_s == 0.5 and m.num_preemptions == 1 and m.migrated_to is None


def test_closing_a_stream_aborts_the_request_and_frees_its_blocks(model):
    w = make_worker(model, "w0")

    async def main():
        gen = w.generate(GenerateRequest("r", list(range(20, 60)), SamplingParams(max_tokens=200, ignore_eos=True)))
        first = await gen.__anext__()
        assert first.deltas[0].token_ids
        await gen.aclose()  # the client went away
        for _ in range(100):
            st = await w.stats()
            if st["num_free_blocks"] == st["num_kv_blocks"]:
                break
            await asyncio.sleep(0.01)
        assert st["num_free_blocks"] == st["num_kv_blocks"] and st["num_running"] == 0
        # an explicit abort ends the stream with finish_reason "abort"
        gen = w.generate(GenerateRequest("r2", list(range(20, 60)), SamplingParams(max_tokens=200, ignore_eos=True)))
        await gen.__anext__()
        assert await w.abort("r2")
        _, chunks = await collect(gen)
        assert chunks[-1].finished and chunks[-1].deltas[0].finish_reason == "abort"
        assert not await w.abort("r2")
        await w.check_invariants()

    asyncio.run(main())


def test_router_follows_a_migration_without_losing_or_repeating_tokens(model, tokenizer):
    params = SamplingParams(max_tokens=150, temperature=0.0, ignore_eos=True)
    expected = LLM(model, **ENGINE).generate([PROMPTS[2]], params)[0].token_ids
    a, b = make_worker(model, "a"), make_worker(model, "b")
    client = LocalWorkerClient({"a": a, "b": b})

    async def main():
        router = Router(state=None, client=client)
        ids = tokenizer(PROMPTS[2]).input_ids
        req = GenerateRequest("m", ids, params)
        stream = router.generate(req, worker_id="a")
        tokens, workers, moved = [], [], False
        async for chunk in stream:
            tokens += chunk.deltas[0].token_ids
            workers.append(chunk.worker_id)
            if len(tokens) >= 5 and not moved:
                await client.move("a", "b", "m")
                moved = True
        assert tokens == expected
        assert workers[0] == "a" and workers[-1] == "b"
        assert (await a.stats())["num_migrations_out"] == 1 and (await b.stats())["num_migrations_in"] == 1
        for w in (a, b):
            st = await w.stats()
            assert st["num_free_blocks"] == st["num_kv_blocks"]
            await w.check_invariants()

    asyncio.run(main())


def test_a_refused_migration_neither_stalls_nor_breaks_the_stream(model, tokenizer):
    """The destination refuses the import (another block size): the request goes on on the
    source, on the same stream, at once. Before the import was confirmed first, the source
    announced the move, the router attached to the destination and waited out its 10 s
    attach timeout (10.00 s measured in 3 of 3 runs)."""
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    expected = LLM(model, **ENGINE).generate([PROMPTS[1]], params)[0].token_ids
    a, b = make_worker(model, "a"), make_worker(model, "b", block_size=16)
    client = LocalWorkerClient({"a": a, "b": b})

    async def main():
        router = Router(state=None, client=client)
        req = GenerateRequest("m", tokenizer(PROMPTS[1]).input_ids, params)
        tokens, times, workers, moves = [], [], [], []

        async def refused_move():
            try:
                await client.move("a", "b", "m")
            except FolioError as e:
                return e
        async for chunk in router.generate(req, worker_id="a"):
            tokens += chunk.deltas[0].token_ids
            times.append(time.monotonic())
            workers.append(chunk.worker_id)
            if len(tokens) >= 5 * (len(moves) + 1) and len(moves) < 3:  # refused three times, at different points
                moves.append(asyncio.create_task(refused_move()))
                await asyncio.sleep(0)
        refusals = await asyncio.gather(*moves)
        stall = max(t2 - t1 for t1, t2 in zip(times, times[1:]))
        assert stall < 2.0, f"the stream stalled {stall:.2f} s on a refused migration"
        assert len(refusals) == 3 and all(isinstance(e, InvalidRequestError) and "block size" in str(e)
                                          for e in refusals), refusals
        assert tokens == expected and set(workers) == {"a"}
        for w in (a, b):
            st = await w.stats()
            assert st["num_free_blocks"] == st["num_kv_blocks"] and st["num_streams"] == 0
            await w.check_invariants()
        assert not getattr(a, "_moving", {}) and not getattr(b, "_arrivals", {})

    asyncio.run(main())


def test_coordinator_resumes_swapped_requests_on_the_idle_worker(model, tokenizer):
    """A burst pinned to one small worker (~4x its KV) swaps requests out there; the
    coordinator moves them to the other worker and every stream completes with the
    offline engine's tokens."""
    params = dict(GREEDY, max_tokens=100)
    small = dict(num_kv_blocks=24, num_cpu_blocks=96)
    ref = [o.token_ids for o in LLM(model, **{**ENGINE, **small}).generate(PROMPTS, SamplingParams(**params))]
    with EmbeddedRedis() as server:
        ns = "coord"
        a, b = make_worker(model, "a", server.url, ns, **small), make_worker(model, "b", server.url, ns, **small)
        client = LocalWorkerClient({"a": a, "b": b})
        state = ClusterState(server.url, ns)

        async def main():
            router = Router(state, client)
            coord = Coordinator(state, client, interval_s=0.05)
            coord.start()
            reqs = [GenerateRequest(f"r{i}", tokenizer(p).input_ids, SamplingParams(**params))
                    for i, p in enumerate(PROMPTS)]
            results = await asyncio.gather(*(collect(router.generate(r, worker_id="a")) for r in reqs))
            await coord.stop()
            return results, coord.stats()

        results, cstats = asyncio.run(main())
        for expected, (tokens, chunks) in zip(ref, results):
            assert tokens[0] == expected
        assert cstats["moves"] >= 1
        sa, sb = asyncio.run(a.stats()), asyncio.run(b.stats())
        assert sa["preemptions_by_mode"]["swap"] >= 1 and sb["num_migrations_in"] >= 1
        assert any(c.worker_id == "b" for _, chunks in results for c in chunks)


_OMP_CHECK = """
import asyncio, ctypes, functools, os, sys
import torch
torch.set_num_threads(2)
from folio.worker import EngineConfig, LLMEngine
from folio.worker.actor import EngineWorker
omp = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp.so.1"))
cfg = EngineConfig(model=sys.argv[1], block_size=8, num_kv_blocks=16, max_model_len=64)
w = EngineWorker("w", functools.partial(LLMEngine, cfg), None)
print("step thread omp threads", asyncio.run(w._call(lambda e: omp.omp_get_max_threads())))
w.shutdown()
"""


def test_step_thread_uses_the_engines_torch_threads(model, tmp_path):
    # Ray starts actors with OMP_NUM_THREADS=<num_cpus> (1 for a fractional CPU) and OpenMP
    # gives every new OS thread that count, whatever torch.set_num_threads said before
    import os
    import subprocess
    import sys

    import torch

    lib = os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp.so.1")
    if not os.path.exists(lib):
        pytest.skip("torch is not built with GNU OpenMP here")
    script = tmp_path / "omp_check.py"
    script.write_text(_OMP_CHECK)
    out = subprocess.run([sys.executable, str(script), model], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "step thread omp threads 2" in out.stdout, out.stdout


def test_the_engine_is_built_on_the_step_thread_and_a_failed_build_raises(model):
    # built elsewhere (the main thread), every step paid for that thread's OpenMP pool
    # (benchmarks/step_thread.py); a factory that raises leaves no thread behind
    import threading

    cfg = EngineConfig(model=model, block_size=8, num_kv_blocks=16, max_model_len=64)
    built_on = []

    def factory():
        built_on.append(threading.current_thread())
        return LLMEngine(cfg)
    w = EngineWorker("w", factory, None)
    try:
        assert built_on == [w._step_thread] and built_on[0] is not threading.current_thread()
        assert asyncio.run(w._call(lambda e: threading.current_thread())) is built_on[0]
    finally:
        w.shutdown()

    def broken():
        built_on.append(threading.current_thread())
        raise ValueError("no such checkpoint")
    class Publisher:
        closed = False

        def publish(self, load, cached_block_hashes=None, changes=None):
            return True

        def close(self):
            Publisher.closed = True
    with pytest.raises(ValueError, match="no such checkpoint"):
        EngineWorker("wb", broken, Publisher)
    built_on[-1].join(timeout=5)
    assert not built_on[-1].is_alive()
    assert Publisher.closed and not any(t.name == "folio-pub-wb" for t in threading.enumerate())


def test_router_takes_a_dead_worker_back_once_it_heartbeats_again():
    """A worker seen dying is skipped while Redis still holds its last heartbeat (up to the
    TTL), and used again at once when a heartbeat newer than its death arrives (a restart),
    not only after DEAD_HOLD_S."""
    from folio.worker.messages import WorkerLoad

    def load(ts):
        return WorkerLoad("w", ts, 8, 8, 0, 0, 8, 0, 0, 0, 0, 0.0, 0, 0, 0, 0, 0)
    with EmbeddedRedis() as server:
        pub, state = WorkerPublisher(server.url, "dead"), ClusterState(server.url, "dead")

        async def main():
            router = Router(state, LocalWorkerClient({}))
            pub.publish(load(time.time()), set())
            assert "w" in await router.live_loads(refresh=True)
            router.mark_dead("w")
            assert "w" not in await router.live_loads(refresh=True)  # its old heartbeat is still listed
            pub.publish(load(time.time() - 0.5), set())  # measured before it died
            assert "w" not in await router.live_loads(refresh=True)
            await asyncio.sleep(0.01)
            pub.publish(load(time.time()), set())  # restarted: a new heartbeat
            assert "w" in await router.live_loads(refresh=True)
        asyncio.run(main())

