"""Faults inside a step: only the requests the engine can blame fail, the engine keeps serving.

Poisons are injected where the engine cannot see them coming (validation at the boundary
is another layer): values set on SamplingParams after construction that the real sampler
chokes on, and a forward / sampler / detokenizer that raise for chosen requests once they
have produced k tokens (the forward raises after writing its KV, as a fault mid-step would).
"""

import dataclasses
import time

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from folio.worker import LLMEngine, EngineConfig, SamplingParams
from folio.worker.errors import EngineFailedError
from folio.worker.sampler import sample as real_sample
from conftest import run_all

# small: prompts are chunked (budget 32 tokens) and a burst preempts (swap or recompute)
ENGINE = dict(block_size=4, num_kv_blocks=24, num_cpu_blocks=24, max_model_len=128, max_num_batched_tokens=32,
              preemption_mode="auto", max_num_seqs=8)


class Poison(Exception):
    pass


class Faults:
    """Injected faults: request id -> (site, k): raise at `site` once the request has k output tokens."""

    def __init__(self, engine: LLMEngine) -> None:
        self.plan: dict[str, tuple[str, int]] = {}
        self.fired: set[str] = set()
        self.by_params: dict[int, str] = {}  # id(params) -> request id (the sampler sees params only)
        runner, det = engine.runner, engine.detokenizer
        real_prepare, real_execute, real_append = runner.prepare, runner.execute, det.append_token

        def prepare(scheduled, kv):
            inputs = real_prepare(scheduled, kv)
            inputs.scheduled = scheduled
            return inputs

        def execute(inputs):
            out = real_execute(inputs)  # the KV is written, then the step fails
            for seq, _ in inputs.scheduled:
                self._check(seq.group.request_id, "forward", seq.num_output_tokens)
            return out

        def append_token(seq, token):
            self._check(seq.group.request_id, "postprocess", seq.num_output_tokens - 1)
            return real_append(seq, token)
        runner.prepare, runner.execute, det.append_token = prepare, execute, append_token
        self.engine = engine

    def _check(self, rid: str, site: str, n_out: int) -> None:
        s, k = self.plan.get(rid, (None, 0))
        if s == site and n_out >= k:
            self.fired.add(rid)
            raise Poison(f"{site} poisoned for {rid}")

    def sample(self, real):
        def sample(logits, params, generators, *context):
            for p in params:
                rid = self.by_params.get(id(p))
                if rid is not None:
                    self._check(rid, "sample", max(s.num_output_tokens for s in self.engine.groups[rid].seqs))
            try:
                return real(logits, params, generators, *context)
            except Exception:
                for p in params:  # the real sampler's own fault (params poisoned after construction)
                    rid = self.by_params.get(id(p))
                    if rid is not None and self.plan.get(rid, ("",))[0] in ("logprobs", "top_k"):
                        self.fired.add(rid)
                raise
        return sample


def faults_site(rid, reqs):
    return reqs[int(rid[1:])]["poison"][0]


@pytest.fixture(scope="module")
def engine(model_dirs):
    # every batch of two or more requests split over two forward lanes (forward_lanes.py): a
    # fault raised in one lane is the batch's, and bisection blames the same requests
    import folio.worker.forward_lanes as forward_lanes

    min_seqs, forward_lanes.MIN_SEQS_PER_LANE = forward_lanes.MIN_SEQS_PER_LANE, 1
    yield LLMEngine(EngineConfig(model=model_dirs["llama"], forward_lanes=2, **ENGINE))
    forward_lanes.MIN_SEQS_PER_LANE = min_seqs


@pytest.fixture(scope="module")
def faults(engine):
    return Faults(engine)


request = st.fixed_dictionaries({
    "prompt": st.lists(st.integers(1, 250), min_size=1, max_size=45),
    "max_tokens": st.integers(1, 10),
    "n": st.sampled_from([1, 1, 2]),
    "sampled": st.booleans(),
    "poison": st.one_of(st.none(), st.none(), st.tuples(st.sampled_from(["forward", "sample", "postprocess"]),
                                                        st.integers(0, 6)),
                        st.sampled_from([("logprobs", 0), ("top_k", 0)])),
})


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(reqs=st.lists(request, min_size=2, max_size=7))
def test_poisoned_requests_fail_alone_and_the_rest_match_a_clean_run(engine, faults, monkeypatch, reqs):
    monkeypatch.setattr(engine.runner, "sample", faults.sample(real_sample))
    faults.plan.clear(), faults.fired.clear(), faults.by_params.clear()
    batch, clean = [], []
    for i, r in enumerate(reqs):
        rid = f"r{i}"
        params = SamplingParams(max_tokens=r["max_tokens"], n=r["n"], ignore_eos=True, logprobs=1,
                                temperature=0.8 if r["sampled"] else 0.0, seed=1000 + i)
        clean.append((rid, r["prompt"], dataclasses.replace(params)))
        if r["poison"] is not None:
            site, k = r["poison"]
            if site == "logprobs":
                params.logprobs = 10 ** 4  # beyond the vocabulary: topk raises
            elif site == "top_k":
                params.temperature, params.top_k = 0.8, 10 ** 30  # beyond int64
            faults.plan[rid] = (site, k)
        faults.by_params[id(params)] = rid
        batch.append((rid, r["prompt"], params))
    preempted = engine.scheduler.stats.num_preemptions
    got = run_all(engine, batch)
    faults.plan.clear()
    expect = run_all(engine, [c for c in clean if c[0] not in faults.fired])
    assert set(got) == {rid for rid, _, _ in batch}
    for rid in faults.fired:
        event(f"fired: {faults_site(rid, reqs)}")
    event(f"preempted in the poisoned run: {engine.scheduler.stats.num_preemptions > preempted}")
    for rid, out in got.items():
        if rid in faults.fired:
            assert out.error and rid in out.error and all(c.finish_reason == "error" for c in out.outputs), out
        else:
            assert out.error is None
            assert [c.token_ids for c in out.outputs] == [c.token_ids for c in expect[rid].outputs], rid
            assert [c.finish_reason for c in out.outputs] == ["length"] * len(out.outputs)
    assert not engine.groups and not engine.scheduler.has_unfinished()
    engine.check_invariants()


def test_the_issues_values_fail_their_request_only(model_dirs):
    """logprobs beyond the vocabulary and top_k beyond int64 (set past any validation) made
    every later step raise; now the request fails and its neighbour is untouched."""
    e = LLMEngine(EngineConfig(model=model_dirs["llama"], **ENGINE))
    ref = run_all(e, [("g", [5, 6, 7], SamplingParams(max_tokens=6, temperature=0.0))])["g"].token_ids
    for field, value in (("logprobs", 10 ** 4), ("top_k", 10 ** 30)):
        bad = SamplingParams(max_tokens=6, temperature=0.7)
        setattr(bad, field, value)
        got = run_all(e, [("bad", [1, 2, 3], bad), ("g", [5, 6, 7], SamplingParams(max_tokens=6, temperature=0.0))])
        assert got["bad"].finish_reason == "error" and got["g"].token_ids == ref
        assert ("index" in got["bad"].error) if field == "logprobs" else ("Overflow" in got["bad"].error)


def test_a_fault_no_request_explains_fails_the_engine(model_dirs, monkeypatch):
    """The model itself raises (as a device error would): the probe fails too, nothing is
    blamed, the step raises EngineFailedError."""
    e = LLMEngine(EngineConfig(model=model_dirs["llama"], **ENGINE))
    e.add_request("a", [1, 2, 3], SamplingParams(max_tokens=4))
    e.add_request("b", [4, 5, 6], SamplingParams(max_tokens=4))

    def broken(*a, **kw):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    monkeypatch.setattr(e.runner.model, "forward", broken)
    with pytest.raises(EngineFailedError, match="illegal memory access"):
        e.step()


def test_worker_fails_the_blamed_request_only_and_an_engine_fault_fails_the_worker(model_dirs, monkeypatch):
    """Through the worker: the poisoned request's stream ends with RequestFailedError and the
    worker keeps serving; a fault nothing explains fails every stream with WorkerFailedError
    and the worker refuses new work (in the cluster it then exits and Ray restarts it)."""
    import asyncio
    import functools

    from folio.worker.actor import EngineWorker
    from folio.worker.errors import RequestFailedError, UnavailableError, WorkerFailedError
    from folio.worker.messages import GenerateRequest

    cfg = EngineConfig(model=model_dirs["llama"], **ENGINE)
    w = EngineWorker("w", functools.partial(LLMEngine, cfg))
    greedy = dict(max_tokens=8, temperature=0.0, ignore_eos=True)
    ref = run_all(LLMEngine(cfg), [("g", [5, 6, 7], SamplingParams(**greedy))])["g"].token_ids

    async def collect(req):
        toks = []
        async for chunk in w.generate(req):
            toks += chunk.deltas[0].token_ids
        return toks

    async def main():
        bad = SamplingParams(**greedy)
        bad.logprobs = 10 ** 4
        got = await asyncio.gather(collect(GenerateRequest(request_id="bad", prompt_token_ids=[1, 2, 3], params=bad)),
                                   collect(GenerateRequest(request_id="g", prompt_token_ids=[5, 6, 7],
                                                           params=SamplingParams(**greedy))),
                                   return_exceptions=True)
        assert isinstance(got[0], RequestFailedError) and "bad" in str(got[0]), got[0]
        assert got[1] == ref and w.failed is None
        assert await collect(GenerateRequest(request_id="g2", prompt_token_ids=[5, 6, 7],
                                             params=SamplingParams(**greedy))) == ref
        st = await w.stats()
        assert st["num_streams"] == 0 and st["num_free_blocks"] == st["num_kv_blocks"]

        def broken(*a, **kw):
            raise RuntimeError("device lost")
        monkeypatch.setattr(w.engine.runner.model, "forward", broken)
        got = await asyncio.gather(*(collect(GenerateRequest(request_id=f"x{i}", prompt_token_ids=[5, 6, 7 + i],
                                                             params=SamplingParams(**greedy)))
                                     for i in range(2)), return_exceptions=True)
        # a request added after the failing step (the two submits race the step thread) is refused by the
        # failed worker instead: both right (a clean clone's run got one of each, 2026-12-07)
        lost = [e for e in got if isinstance(e, WorkerFailedError) and "device lost" in str(e)]
        assert lost and all(e in lost or (isinstance(e, UnavailableError) and "failed" in str(e)) for e in got), got
        with pytest.raises(UnavailableError, match="failed"):
            await collect(GenerateRequest(request_id="late", prompt_token_ids=[1, 2], params=SamplingParams(**greedy)))
    try:
        asyncio.run(main())
    finally:
        w.shutdown()


_EXIT_CHECK = """
import asyncio, functools, sys
from folio.worker import EngineConfig, LLMEngine, SamplingParams
from folio.worker.actor import EngineWorker
from folio.worker.messages import GenerateRequest
cfg = EngineConfig(model=sys.argv[1], block_size=8, num_kv_blocks=16, max_model_len=64)
w = EngineWorker("w", functools.partial(LLMEngine, cfg), None, exit_on_failure_s=0.2)
def broken(*a, **kw):
    raise RuntimeError("device lost")
w.engine.runner.model.forward = broken
async def main():
    try:
        async for _ in w.generate(GenerateRequest(request_id="r", prompt_token_ids=[1, 2, 3],
                                                  params=SamplingParams(max_tokens=4))):
            pass
    except Exception as e:
        print("stream error:", type(e).__name__, flush=True)
    await asyncio.sleep(30)
    print("still alive", flush=True)
asyncio.run(main())
"""


def test_a_failed_worker_exits_its_process_so_the_cluster_restarts_it(model_dirs, tmp_path):
    """With exit_on_failure_s (what the cluster sets), an engine failure first reaches the
    request's stream, then the process exits non-zero: Ray restarts the actor (the SIGKILL
    test in test_cluster_ray.py covers the restart itself)."""
    import subprocess
    import sys

    script = tmp_path / "exit_check.py"
    script.write_text(_EXIT_CHECK)
    out = subprocess.run([sys.executable, str(script), model_dirs["llama"]], capture_output=True, text=True,
                         timeout=120)
    assert "stream error: WorkerFailedError" in out.stdout, (out.stdout, out.stderr[-2000:])
    assert out.returncode == 1 and "still alive" not in out.stdout


_STUCK_CHECK = """
import asyncio, functools, sys, time
from folio.worker import EngineConfig, LLMEngine, SamplingParams
from folio.worker.actor import EngineWorker
from folio.worker.guided import GuidedSpec
from folio.worker.messages import GenerateRequest
EngineWorker.STEP_STALL_S = 2.0
cfg = EngineConfig(model=sys.argv[1], block_size=8, num_kv_blocks=64, max_model_len=512)
w = EngineWorker("w", functools.partial(LLMEngine, cfg), None, exit_on_failure_s=1.0)
real_step = w.engine.step
def slower():  # 2 ms more a step: early's 500 steps outlast the stuck submit on any CPU
    time.sleep(0.002)
    return real_step()
w.engine.step = slower
async def run(rid, params):
    t0 = time.monotonic()
    try:
        async for _ in w.generate(GenerateRequest(request_id=rid, prompt_token_ids=[1, 2, 3], params=params)):
            pass
        print(rid, "finished", flush=True)
    except Exception as e:
        print(rid, type(e).__name__, "after %.1f s:" % (time.monotonic() - t0), e, flush=True)
async def late():
    await asyncio.sleep(1.5)  # its submit waits behind the stuck step (or gets in just before)
    await run("late", SamplingParams(max_tokens=4))
async def main():
    early = asyncio.ensure_future(run("early", SamplingParams(max_tokens=500, ignore_eos=True)))
    await asyncio.sleep(0.05)
    # its first token the vocabulary's longest (no newline): the grammar's second mask never ends
    tok = w.engine.tokenizer
    longest = max((t for t in range(len(tok)) if "\\n" not in tok.decode([t])), key=lambda t: len(tok.decode([t])))
    stuck = SamplingParams(max_tokens=8, temperature=0.0, logit_bias={longest: 100.0},
                           guided=GuidedSpec("regex", sys.argv[2]))
    await asyncio.gather(run("stuck", stuck), late())
    await early
    await asyncio.sleep(30)
    print("still alive", flush=True)
asyncio.run(main())
"""


def test_a_step_stuck_in_a_grammar_fails_its_requests_and_the_worker_restarts(model_dirs, tmp_path):
    """A grammar whose first token's mask xgrammar never finishes (nested repetitions of `.`:
    minutes here) holds the step in C++, where nothing can interrupt it. The watchdog sees the
    step over STEP_STALL_S: the request whose grammar it was evaluating gets a 400 naming it,
    the other running request a WorkerFailedError, a submit queued behind the stuck step an
    UnavailableError (it used to wait forever), then the process exits non-zero so
    that the cluster restarts the worker (a stuck worker used to stay stuck, out of the
    router's view, while the client waited forever)."""
    import subprocess
    import sys

    script = tmp_path / "stuck_check.py"
    script.write_text(_STUCK_CHECK)
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, str(script), model_dirs["llama"], r"(.{0,64}){0,64}(.{0,64}){0,64}"],
                         capture_output=True, text=True, timeout=120)
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)
    assert lines.get("stuck", "").startswith("InvalidRequestError") and "too ambiguous" in lines["stuck"], out
    assert lines.get("early", "").startswith("WorkerFailedError"), out  # it had streamed: not resumable
    # sent behind the stuck step: refused (UnavailableError) if still queued, failed if it got in
    assert lines.get("late", "").split(" ")[0] in ("UnavailableError", "WorkerFailedError"), out
    assert out.returncode == 1 and "still alive" not in out.stdout, out.stderr[-2000:]
    assert time.monotonic() - t0 < 60
