"""The worker (step thread + async API) in this process: real engines on the tiny model, a
real Redis, no Ray. The router and the coordinator over such workers: test_router_coordinator.py;
the Ray cluster: test_cluster_ray.py."""

import asyncio
import functools

import pytest

from folio.cluster.state import WorkerPublisher
from folio.worker import LLM, EngineConfig, InvalidRequestError, LLMEngine, SamplingParams
from folio.worker.actor import EngineWorker
from folio.worker.messages import GenerateRequest

from conftest import PROMPTS, until

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
        reqs = [GenerateRequest(request_id=f"r{i}", prompt_token_ids=tokenizer(p).input_ids,
                                params=SamplingParams(**GREEDY)) for i, p in enumerate(PROMPTS)]
        results = await asyncio.gather(*(collect(w.generate(r)) for r in reqs))
        for p, (tokens, chunks) in zip(PROMPTS, results):
            assert tokens[0] == offline[p]
            assert chunks[-1].finished and chunks[-1].deltas[0].finish_reason == "length"
            assert [c.deltas[0].num_tokens for c in chunks] == sorted({c.deltas[0].num_tokens for c in chunks})
        for bad in ([], [10 ** 9], list(range(300))):
            with pytest.raises(InvalidRequestError):
                await collect(w.generate(GenerateRequest(request_id="bad", prompt_token_ids=bad,
                                                         params=SamplingParams(**GREEDY))))
        with pytest.raises(InvalidRequestError):
            await collect(w.generate(GenerateRequest(request_id="bad", prompt_token_ids=[5, 6],
                                                     params=SamplingParams(**GREEDY), priority="high")))
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
        async for chunk in w.generate(GenerateRequest(request_id=f"r{slow}",
                                                      prompt_token_ids=tokenizer(prompt).input_ids, params=params)):
            chunks.append(chunk)
            if slow:
                await asyncio.sleep(0.15)  # several engine steps run meanwhile
        return chunks

    async def main():
        fast, slow = await read(False), await read(True)
        # Unmerged, each of the 24 steps would be a chunk of its own. (How many chunks the fast
        # reader gets depends on how the event loop and the step thread share the cores: on a
        # loaded machine it can read only after the last step, so it is not the yardstick.)
        assert len(slow) < 24 and any(len(d.token_ids) > 1 for c in slow for d in c.deltas), \
            "the slow reader should have received merged chunks"
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
        reqs = [GenerateRequest(request_id=f"r{i}", prompt_token_ids=tokenizer(p).input_ids,
                                params=SamplingParams(**GREEDY)) for i, p in enumerate(PROMPTS)]
        long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        sub = w.subscribe("fe-1")
        assert await w.commands("fe-1", [("submit", r) for r in reqs] + [
            ("submit", reqs[0]), ("submit", GenerateRequest(request_id="gone", prompt_token_ids=[5, 6, 7],
                                                            params=long)), ("abort", "gone")]) == \
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
        await w.commands("fe-1",
                         [("submit",
                           GenerateRequest(request_id="long", prompt_token_ids=tokenizer(PROMPTS[0]).input_ids,
                                           params=long))])
        await sub.__anext__()
        await sub.aclose()  # the frontend went away
        async def idle():
            st = await w.stats()
            return st if st["num_streams"] == 0 and st["num_free_blocks"] == st["num_kv_blocks"] else None
        st = await until(idle, "the stream gone and its blocks free", 60, interval_s=0.01)
        assert st["num_streams"] == 0 and st["num_free_blocks"] == st["num_kv_blocks"] and st["num_subscribers"] == 0
        assert await w._call(lambda e: e.num_generated_tokens) - gen0 < 150, "the request ran on after the close"
        await w.check_invariants()

    asyncio.run(main())


def test_closing_a_stream_aborts_the_request_and_frees_its_blocks(model):
    w = make_worker(model, "w0")

    async def main():
        gen0 = await w._call(lambda e: e.num_generated_tokens)
        gen = w.generate(GenerateRequest(request_id="r", prompt_token_ids=list(range(20, 60)),
                                         params=SamplingParams(max_tokens=200, ignore_eos=True)))
        first = await gen.__anext__()
        assert first.deltas[0].token_ids
        await gen.aclose()  # the client went away

        async def free():
            st = await w.stats()
            return st if st["num_free_blocks"] == st["num_kv_blocks"] else None
        st = await until(free, "the closed stream's blocks free", 60, interval_s=0.01)
        assert st["num_running"] == 0
        assert await w._call(lambda e: e.num_generated_tokens) - gen0 < 150, "the request ran on after the close"
        # an explicit abort ends the stream with finish_reason "abort"
        gen = w.generate(GenerateRequest(request_id="r2", prompt_token_ids=list(range(20, 60)),
                                         params=SamplingParams(max_tokens=200, ignore_eos=True)))
        await gen.__anext__()
        assert await w.abort("r2")
        _, chunks = await collect(gen)
        assert chunks[-1].finished and chunks[-1].deltas[0].finish_reason == "abort"
        assert not await w.abort("r2")
        await w.check_invariants()

    asyncio.run(main())


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
        # top -H and benchmarks/served_ab.py find it (and the OpenMP threads it starts) by name
        assert open(f"/proc/self/task/{built_on[0].native_id}/comm").read().strip() == "folio-step"
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


def test_a_submits_grammar_compiles_off_the_step_thread(model, tokenizer, monkeypatch):
    """A guided request's grammar is compiled on a thread before the step thread adds it (a
    0.7 s schema compiled by add_request held every stream of the worker as long): the step
    thread compiles nothing, and a spec that does not compile is still the request's error."""
    import threading

    import folio.worker.guided as guided
    from folio.worker.guided import GuidedSpec

    where, compile_ = [], guided.Grammars._compile

    def spy(self, spec):
        where.append(threading.current_thread().name)
        return compile_(self, spec)

    monkeypatch.setattr(guided.Grammars, "_compile", spy)
    w = make_worker(model, "wg")

    async def main():
        sub = w.subscribe("fe-g")
        ids = tokenizer(PROMPTS[0]).input_ids
        good = GenerateRequest(request_id="good", prompt_token_ids=ids, params=SamplingParams(
            max_tokens=6, temperature=0.0, guided=GuidedSpec("regex", "[a-z]{2,5}")))
        bad = GenerateRequest(request_id="bad", prompt_token_ids=ids, params=SamplingParams(
            max_tokens=6, guided=GuidedSpec("regex", "(unclosed")))
        await w.commands("fe-g", [("submit", good), ("submit", bad)])
        finished, errors = set(), {}
        while finished | set(errors) != {"good", "bad"}:
            for rid, item in await sub.__anext__():
                if isinstance(item, BaseException):
                    errors[rid] = item
                elif item.finished:
                    finished.add(rid)
        assert finished == {"good"} and isinstance(errors["bad"], InvalidRequestError), errors
        await sub.aclose()

    asyncio.run(main())
    assert where and "folio-step" not in where and all(n != w._step_thread.name for n in where), where


def test_a_grammar_too_slow_to_follow_is_the_requests_400_through_the_worker(model, tokenizer, monkeypatch):
    """The engine blames a request whose masks take longer than FILL_BUDGET_S (guided.py); through
    the worker its error is the request's InvalidRequestError (HTTP 400, as any bad grammar), not
    an engine failure (500): the engine's "request X failed in the engine: " line hid the type."""
    from types import SimpleNamespace

    import folio.worker.guided as guided
    from folio.worker.guided import GuidedSpec

    clock = iter(range(10**6))
    monkeypatch.setattr(guided, "time", SimpleNamespace(perf_counter=lambda: 0.1 * next(clock)))
    monkeypatch.setattr(guided, "FILL_BUDGET_S", 0.25)
    w = make_worker(model, "ws")

    async def main():
        sub = w.subscribe("fe-s")
        req = GenerateRequest(request_id="slow", prompt_token_ids=tokenizer(PROMPTS[0]).input_ids,
                              params=SamplingParams(n=4, max_tokens=6, guided=GuidedSpec("regex", "[a-z]{2,5}")))
        await w.commands("fe-s", [("submit", req)])
        while True:
            for rid, item in await sub.__anext__():
                if isinstance(item, BaseException):
                    await sub.aclose()
                    return item
                assert not item.finished, "the request was not refused"

    err = asyncio.run(main())
    assert isinstance(err, InvalidRequestError) and "too ambiguous" in str(err) and err.param == "response_format", err
