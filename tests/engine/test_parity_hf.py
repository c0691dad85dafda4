"""Greedy outputs token-identical to transformers `generate` on the same float32 weights."""

from __future__ import annotations

import pytest

from folio.worker import LLM, SamplingParams
from conftest import PROMPTS

MAX_TOKENS = 24
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


def assert_same(outs, ref):
    for i, (o, r) in enumerate(zip(outs, ref)):
        assert o.token_ids == r, f"prompt {i} differs from transformers:\n folio {o.token_ids}\n hf    {r}"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("block_size", [1, 8, 16, 32])
def test_batched_matches_hf(model_dirs, hf_reference, arch, block_size):
    llm = LLM(model_dirs[arch], block_size=block_size, num_kv_blocks=4096 // block_size)
    assert_same(llm.generate(PROMPTS, GREEDY), hf_reference(model_dirs[arch], PROMPTS, MAX_TOKENS))
    llm.engine.check_invariants()
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_one_by_one_matches_hf(model_dirs, hf_reference, arch):
    llm = LLM(model_dirs[arch], block_size=8, num_kv_blocks=256)
    ref = hf_reference(model_dirs[arch], PROMPTS, MAX_TOKENS)
    for p, r in zip(PROMPTS, ref):
        assert llm.generate([p], GREEDY)[0].token_ids == r


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_small_chunked_prefill_matches_hf(model_dirs, hf_reference, arch):
    # 5 tokens a step: every prompt is prefilled in several chunks, mixed with decodes
    llm = LLM(model_dirs[arch], block_size=4, num_kv_blocks=512, max_num_batched_tokens=5)
    assert_same(llm.generate(PROMPTS, GREEDY), hf_reference(model_dirs[arch], PROMPTS, MAX_TOKENS))


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_preemption_matches_hf(model_dirs, hf_reference, arch):
    # 24 blocks of 4 tokens: the six requests cannot all hold their KV at once
    llm = LLM(model_dirs[arch], block_size=4, num_kv_blocks=24, enable_prefix_caching=False)
    outs = llm.generate(PROMPTS, GREEDY)
    assert llm.engine.stats().num_preemptions > 0, "the test did not cause preemption"
    assert_same(outs, hf_reference(model_dirs[arch], PROMPTS, MAX_TOKENS))
    llm.engine.check_invariants()
    assert llm.engine.kv.num_free_blocks == 24


def test_preemption_with_prefix_cache_matches_hf(model_dirs, hf_reference):
    llm = LLM(model_dirs["qwen2"], block_size=4, num_kv_blocks=24, enable_prefix_caching=True)
    outs = llm.generate(PROMPTS, GREEDY)
    assert llm.engine.stats().num_preemptions > 0
    assert_same(outs, hf_reference(model_dirs["qwen2"], PROMPTS, MAX_TOKENS))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_prefix_cache_hits_match_hf(model_dirs, hf_reference, arch):
    shared = ("import collections\nimport functools\nimport itertools\n\n"
              "def cached(func):\n    \"\"\"Memoize func.\"\"\"\n    memo = {}\n")
    prompts = [shared + s for s in ("    return memo", "    def wrapper(*args):", "\n", "    pass\n")]
    llm = LLM(model_dirs[arch], block_size=8, num_kv_blocks=256)
    first = llm.generate(prompts[:1], GREEDY)
    rest = llm.generate(prompts[1:], GREEDY)
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits >= 3 * 4, f"expected prefix-cache hits, got {stats}"
    assert_same(first + rest, hf_reference(model_dirs[arch], prompts, MAX_TOKENS))
    # the whole shared batch again, now fully cached
    assert_same(llm.generate(prompts, GREEDY), hf_reference(model_dirs[arch], prompts, MAX_TOKENS))


def test_a_cache_salt_shares_cached_prefixes_only_with_its_own(model_dirs, hf_reference):
    """vLLM's cache_salt (tenant isolation: another tenant cannot time your cached prefix): a request
    hits only blocks that requests of its own salt stored; the output is the same whatever hits."""
    prompt = ["import collections\nimport functools\nimport itertools\n\ndef cached(func):\n    memo = {}\n"]
    llm = LLM(model_dirs["llama"], block_size=8, num_kv_blocks=256)
    want = hf_reference(model_dirs["llama"], prompt, MAX_TOKENS)

    def hits(salt):
        before = llm.engine.stats().prefix_cache_hits
        out = llm.generate(prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, cache_salt=salt))
        assert_same(out, want)
        return llm.engine.stats().prefix_cache_hits - before
    assert hits("tenant-a") == 0
    assert [hits(s) for s in (None, "tenant-b", "tenant-a ")] == [0, 0, 0]  # no salt is a salt of its own
    assert hits("tenant-a") >= 4 and hits(None) >= 4 and hits("tenant-b") >= 4
    llm.engine.check_invariants()


def test_contiguous_baseline_matches_hf(model_dirs, hf_reference):
    llm = LLM(model_dirs["llama"], block_size=16, num_kv_blocks=64, max_model_len=256,
              kv_manager="contiguous")
    assert_same(llm.generate(PROMPTS, GREEDY), hf_reference(model_dirs["llama"], PROMPTS, MAX_TOKENS))
    llm.engine.check_invariants()


def test_n_greedy_completions_all_match_hf(model_dirs, hf_reference):
    llm = LLM(model_dirs["qwen2"], block_size=8, num_kv_blocks=256)
    outs = llm.generate(PROMPTS[:3], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, n=3))
    ref = hf_reference(model_dirs["qwen2"], PROMPTS[:3], MAX_TOKENS)
    for o, r in zip(outs, ref):
        assert [c.token_ids for c in o.outputs] == [r, r, r]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("chunk", [None, 7])
def test_a_batch_split_over_forward_lanes_matches_hf(model_dirs, hf_reference, arch, chunk, monkeypatch):
    # every batch of two or more requests split over two one-thread lanes (forward_lanes.py),
    # with chunked prefills beside decodes (7 tokens a step), n=2 kept in one lane, preemption
    import folio.worker.forward_lanes as forward_lanes

    monkeypatch.setattr(forward_lanes, "MIN_SEQS_PER_LANE", 1)
    llm = LLM(model_dirs[arch], block_size=4, num_kv_blocks=40, forward_lanes=2, max_num_batched_tokens=chunk)
    splits = []
    real_map = llm.engine.runner.lanes.map
    monkeypatch.setattr(llm.engine.runner.lanes, "map", lambda fn, items: splits.append(len(items)) or
                        real_map(fn, items))
    outs = llm.generate(PROMPTS, GREEDY)
    assert splits and set(splits) == {2}, "no batch was split"
    assert llm.engine.stats().num_preemptions > 0, "the test did not cause preemption"
    assert_same(outs, hf_reference(model_dirs[arch], PROMPTS, MAX_TOKENS))
    two = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, n=2))
    for o, r in zip(two, hf_reference(model_dirs[arch], PROMPTS[:2], MAX_TOKENS)):
        assert [c.token_ids for c in o.outputs] == [r, r]
    llm.engine.check_invariants()
    assert llm.engine.kv.num_free_blocks == 40
