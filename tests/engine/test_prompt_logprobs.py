"""Prompt logprobs (`SamplingParams.prompt_logprobs`, completions' echo + logprobs): each prompt
token's logprob equals what transformers computes on the same weights, however the prefill ran
(in one step, in chunks beside other requests, after a preemption by recompute or swap, across
a migration mid-prefill, with the prompt's blocks in the prefix cache), and asking for them
changes no generated token."""

from __future__ import annotations

import pytest
import torch

from folio.worker import LLM, SamplingParams
from conftest import PROMPTS

LONG = [PROMPTS[2] * 2, PROMPTS[5] + PROMPTS[0], PROMPTS[4]]  # 18-60 tokens: several blocks and chunks
TOL = 1e-4


@pytest.fixture(scope="module")
def hf(model_dirs):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    cache = {}

    def ref(arch: str, prompt: str) -> tuple[list[int], torch.Tensor]:
        """(prompt ids, log_softmax of the logits at every position) from transformers."""
        if arch not in cache:
            d = model_dirs[arch]
            cache[arch] = (AutoTokenizer.from_pretrained(d),
                           AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval())
        tok, model = cache[arch]
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            return ids[0].tolist(), torch.log_softmax(model(ids).logits[0].float(), -1)
    return ref


def check(out, arch, prompt, hf, k):
    ids, lp = hf(arch, prompt)
    pl = out.prompt_logprobs
    assert out.prompt_token_ids == ids and pl is not None and len(pl) == len(ids) and pl[0] is None
    for j in range(1, len(ids)):
        d = pl[j]
        assert next(iter(d)) == ids[j], "the prompt's own token comes first"
        assert abs(d[ids[j]] - float(lp[j - 1, ids[j]])) < TOL, (j, d[ids[j]], float(lp[j - 1, ids[j]]))
        top = lp[j - 1].topk(k)
        assert set(top.indices.tolist()) <= set(d) and len(d) <= k + 1
        for t, v in zip(top.indices.tolist(), top.values.tolist()):
            assert abs(d[t] - v) < TOL


ENGINES = {
    "one step": dict(block_size=8, num_kv_blocks=256),
    "chunks of 5 tokens": dict(block_size=4, num_kv_blocks=512, max_num_batched_tokens=5),
    "recompute preemption": dict(block_size=4, num_kv_blocks=40, preemption_mode="recompute",
                                 enable_prefix_caching=False),
    "swap preemption": dict(block_size=4, num_kv_blocks=40, preemption_mode="swap", num_cpu_blocks=200),
}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("how", list(ENGINES))
def test_prompt_logprobs_match_hf_however_the_prefill_runs(model_dirs, hf, arch, how):
    llm = LLM(model_dirs[arch], **ENGINES[how])
    plain = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    asked = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, prompt_logprobs=3)
    prompts = LONG + PROMPTS[:3]
    params = [asked if i % 2 == 0 else plain for i in range(len(prompts))]  # mixed in one batch
    outs = llm.generate(prompts, params)
    if "preemption" in how:
        assert llm.engine.stats().num_preemptions > 0, "the test did not preempt"
    for i, (p, o) in enumerate(zip(prompts, outs)):
        if i % 2 == 0:
            check(o, arch, p, hf, 3)
        else:
            assert o.prompt_logprobs is None
    want = LLM(model_dirs[arch], block_size=8, num_kv_blocks=256).generate(prompts, plain)
    assert [o.token_ids for o in outs] == [o.token_ids for o in want], "prompt logprobs changed the output"
    llm.engine.check_invariants()
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks


def test_a_prefix_cache_hit_loses_no_prompt_logprob(model_dirs, hf):
    llm = LLM(model_dirs["llama"], block_size=4, num_kv_blocks=256, enable_prefix_caching=True)
    p = SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=0)
    llm.generate(LONG[:1], SamplingParams(max_tokens=4, temperature=0.0))  # the prompt's blocks cached
    before = llm.engine.stats().prefix_cache_hits
    for _ in range(2):
        check(llm.generate(LONG[:1], p)[0], "llama", LONG[0], hf, 0)
    assert llm.engine.stats().prefix_cache_hits == before, "a request that wants prompt logprobs used the cache"
    llm.generate(LONG[:1], SamplingParams(max_tokens=4, temperature=0.0))  # others still hit it
    assert llm.engine.stats().prefix_cache_hits > before


def test_n_completions_and_streaming_get_them_once(model_dirs, hf):
    eng = LLM(model_dirs["qwen2"], block_size=8, num_kv_blocks=256).engine
    eng.add_request("s", LONG[1], SamplingParams(max_tokens=6, temperature=0.8, seed=1, n=3, prompt_logprobs=1),
                    output_kind="delta")
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    with_pl = [o for o in outs if o.prompt_logprobs is not None]
    assert len(with_pl) == 1 and with_pl[0] is next(o for o in outs if any(c.token_ids for c in o.outputs))
    check(with_pl[0], "qwen2", LONG[1], hf, 1)


def test_migration_mid_prefill_keeps_them(model_dirs, hf):
    a = LLM(model_dirs["llama"], block_size=4, num_kv_blocks=256, max_num_batched_tokens=8).engine
    b = LLM(model_dirs["llama"], block_size=4, num_kv_blocks=256, num_cpu_blocks=64).engine
    a.add_request("m", LONG[0], SamplingParams(max_tokens=5, temperature=0.0, prompt_logprobs=2))
    for _ in range(3):  # 24 of its ~60 prompt tokens computed
        a.step()
    state = a.export_request("m")
    assert 1 < len(state.prompt_logprobs) < len(state.prompt_token_ids)
    b.import_request(state)
    done = []
    while b.has_unfinished_requests():
        done += [o for o in b.step() if o.finished]
    check(done[0], "llama", LONG[0], hf, 2)


def test_bounds():
    from folio.worker.errors import InvalidRequestError
    for bad in (-1, 21, 1.5, True):
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(prompt_logprobs=bad)
        assert e.value.param == "prompt_logprobs"


def test_a_forward_run_again_adds_nothing_twice(model_dirs, hf):
    """Fault isolation re-runs a batch's forward (fault_isolation.py); a recompute runs a
    prompt's positions again: the logprobs of a position are kept once."""
    llm = LLM(model_dirs["llama"], block_size=4, num_kv_blocks=256, max_num_batched_tokens=8)
    real = llm.engine.runner.execute

    def twice(inputs):
        real(inputs)
        return real(inputs)
    llm.engine.runner.execute = twice
    out = llm.generate(LONG[:1], SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=1))[0]
    check(out, "llama", LONG[0], hf, 1)
