"""Tensor parallelism on CPU (gloo): tensor_parallel_size=2 gives transformers' greedy tokens
(float32) with chunked prefill, prefix-cache hits and preemption by swap and by recompute;
a request moves between two TP=2 engines with every rank's KV; a killed rank fails the engine
with a clear error."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from folio.worker import LLM, SamplingParams
from folio.worker.errors import ConfigError, EngineFailedError, InvalidRequestError
from folio.worker.tensor_parallel import Shards
from conftest import PROMPTS

MAX_TOKENS = 16
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


@settings(max_examples=200, deadline=None)
@given(size=st.sampled_from([1, 2, 4, 8]), kv=st.sampled_from([1, 2, 4, 8, 16]), group=st.sampled_from([1, 2, 4]),
       vocab=st.integers(1, 5000), inter=st.sampled_from([8, 64, 1408]))
def test_shards_partition_heads_mlp_and_vocab(size, kv, group, vocab, inter):
    heads = kv * group
    try:
        shards = [Shards.of(r, size, heads, kv, inter, vocab) for r in range(size)]
    except ConfigError:
        assert heads % size or (kv % size if kv >= size else size % kv) or inter % size
        return
    assert [h for s in shards for h in s.heads] == list(range(heads))
    assert [i for s in shards for i in s.intermediate] == list(range(inter))
    assert [v for s in shards for v in s.vocab] == list(range(vocab))
    for s in shards:  # each rank's query heads attend to KV heads it holds (GQA: head h uses h // group)
        assert {h // group for h in s.heads} <= set(s.kv_heads)
        assert s.vocab_shard_size * size >= vocab and len(s.vocab) <= s.vocab_shard_size
    if kv >= size:
        assert sorted(h for s in shards for h in s.kv_heads) == list(range(kv))  # split, not replicated


def same(outs, ref):
    for i, (o, r) in enumerate(zip(outs, ref)):
        assert o.outputs[0].token_ids == r, f"prompt {i}:\n tp2 {o.outputs[0].token_ids}\n hf  {r}"


@pytest.mark.parametrize("arch,mode", [("llama", "swap"), ("qwen2", "recompute"), ("mistral", "swap")])
def test_tp2_matches_hf_with_chunks_prefix_hits_and_preemption(model_dirs, hf_reference, arch, mode):
    # 28 blocks of 4 tokens for six prompts, 7 tokens a step: chunked prefills, preemptions
    llm = LLM(model_dirs[arch], block_size=4, num_kv_blocks=28, max_num_batched_tokens=7, preemption_mode=mode,
              num_cpu_blocks=64 if mode == "swap" else None, tensor_parallel_size=2)
    try:
        ref = hf_reference(model_dirs[arch], PROMPTS, MAX_TOKENS)
        same(llm.generate(PROMPTS, GREEDY), ref)
        st_ = llm.engine.stats()
        assert st_.num_preemptions > 0 and st_.preemptions_by_mode.get(mode, 0) > 0, st_
        hits = llm.engine.stats().prefix_cache_hits
        for _ in range(2):  # the second run starts from the first one's cached blocks
            same(llm.generate([PROMPTS[2]], GREEDY), ref[2:3])
        assert llm.engine.stats().prefix_cache_hits > hits
        llm.engine.check_invariants()
        assert llm.engine.kv.num_free_blocks == 28
    finally:
        llm.engine.runner.close()


def test_a_request_moves_between_tp2_engines_with_every_ranks_kv(model_dirs, hf_reference):
    path = model_dirs["qwen2"]
    a = LLM(path, block_size=4, num_kv_blocks=64, num_cpu_blocks=64, tensor_parallel_size=2)
    b = LLM(path, block_size=4, num_kv_blocks=64, num_cpu_blocks=64, tensor_parallel_size=2)
    one = LLM(path, block_size=4, num_kv_blocks=64, num_cpu_blocks=64)
    try:
        a.engine.add_request("m", PROMPTS[2], GREEDY)
        for _ in range(6):  # the prompt and a few tokens: KV in the cache of both ranks
            a.engine.step()
        state = a.engine.export_request("m")
        assert state.seqs[0].num_computed_tokens > 0 and state.seqs[0].kv.shape[-2] == 2  # 1 KV head x 2 ranks
        with pytest.raises(InvalidRequestError, match="does not fit"):
            one.engine.import_request(state)  # a group of another size refuses it
        b.engine.import_request(state)
        out = None
        while b.engine.has_unfinished_requests():
            for o in b.engine.step():
                out = o
        assert out.outputs[0].token_ids == hf_reference(path, [PROMPTS[2]], MAX_TOKENS)[0]
        assert b.engine.stats().swapped_in_blocks > 0  # resumed from the moved KV, not recomputed
    finally:
        a.engine.runner.close()
        b.engine.runner.close()


def test_a_killed_rank_fails_the_engine_with_a_clear_error(model_dirs):
    llm = LLM(model_dirs["llama"], block_size=4, num_kv_blocks=64, tensor_parallel_size=2)
    try:
        assert llm.generate([PROMPTS[0]], GREEDY)[0].outputs[0].token_ids
        follower = llm.engine.runner.followers[0]
        follower.kill()
        follower.wait()
        with pytest.raises(EngineFailedError):
            llm.generate([PROMPTS[1]], GREEDY)
    finally:
        llm.engine.runner.close()


def test_tp2_prompt_logprobs_and_logprobs_match_one_rank(model_dirs):
    """Prompt logprobs make extra LM-head calls (chunks of PROMPT_LOGITS_ROWS): the follower
    replays the same calls, and the values equal one rank's up to rounding."""
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=3, prompt_logprobs=2)
    prompts = [PROMPTS[2], list(range(3, 300))]  # the second: two LM-head chunks of prompt rows
    one = LLM(model_dirs["mistral"], block_size=8, num_kv_blocks=128).generate(prompts, params)
    llm = LLM(model_dirs["mistral"], block_size=8, num_kv_blocks=128, tensor_parallel_size=2)
    try:
        two = llm.generate(prompts, params)
    finally:
        llm.engine.runner.close()
    for a, b in zip(one, two):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.prompt_logprobs[1:] + a.outputs[0].logprobs, b.prompt_logprobs[1:] + b.outputs[0].logprobs):
            assert x.keys() == y.keys() and all(abs(x[k] - y[k]) < 1e-4 for k in x), (x, y)


def test_a_size_the_model_cannot_split_into_is_refused_before_any_rank_starts(model_dirs):
    import psutil

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(ConfigError, match="must divide"):
        LLM(model_dirs["llama"], tensor_parallel_size=3)  # 4 heads
    with pytest.raises(ConfigError, match=">= 1"):
        LLM(model_dirs["llama"], tensor_parallel_size=0)
    assert {p.pid for p in psutil.Process().children(recursive=True)} == before


def test_a_fault_inside_a_tp_step_fails_the_engine_at_once(model_dirs, monkeypatch):
    """Rank 0's forward raises on every step after it was announced (the followers wait in its
    collectives), as a lost device would: rank 0 drains the step's collectives, every request
    fails alone, rank 0's probe fails too, so nothing is blamed and the engine fails now with
    a clear error, not after gloo's timeout. (A fault that one request explains fails that
    request only: test_tensor_parallel_faults.py.)"""
    import time

    llm = LLM(model_dirs["llama"], block_size=4, num_kv_blocks=64, tensor_parallel_size=2)
    try:
        def broken(*a, **kw):
            raise RuntimeError("device lost on rank 0")
        monkeypatch.setattr(llm.engine.runner.model, "forward", broken)
        t0 = time.monotonic()
        with pytest.raises(EngineFailedError, match="no request can be blamed.*rank 0 of the tensor-parallel group.*device lost"):
            llm.generate(PROMPTS[:2], GREEDY)
        assert time.monotonic() - t0 < 10
    finally:
        t0 = time.monotonic()
        llm.engine.runner.close()  # the follower is stopped or killed: bounded either way
        assert time.monotonic() - t0 < 30
        assert all(p.poll() is not None for p in llm.engine.runner.followers)


def test_a_rank_reads_only_its_slices_of_the_checkpoint(model_dirs):
    """Weights.get(name, part) reads rows or columns straight from the safetensors file: the
    same values as the whole tensor's slice, and only that many elements."""
    from folio.worker.models.loader import Weights

    w = Weights(model_dirs["qwen2"])
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight",
                 "model.layers.0.self_attn.k_proj.bias"):
        whole = w.get(name)
        n = whole.shape[0]
        rows = w.get(name, (0, n // 4, n // 2))
        assert rows.shape[0] == n // 2 - n // 4 and (rows == whole[n // 4: n // 2]).all()
        if whole.dim() == 2:
            cols = w.get(name, (1, 8, 24))
            assert cols.shape == (n, 16) and (cols == whole[:, 8:24]).all()


@pytest.fixture(scope="module")
def engines(model_dirs):
    """One TP=1 and one TP=2 engine on GQA 4/2, 40 blocks of 4 tokens, 9 tokens a step."""
    cfg = dict(block_size=4, num_kv_blocks=40, num_cpu_blocks=40, max_num_batched_tokens=9)
    one = LLM(model_dirs["qwen2"], **cfg)
    two = LLM(model_dirs["qwen2"], tensor_parallel_size=2, **cfg)
    yield one, two
    two.engine.runner.close()


@settings(max_examples=25, deadline=None, derandomize=True)
@given(batch=st.lists(st.tuples(st.lists(st.integers(3, 1000), min_size=1, max_size=60), st.integers(1, 12)),
                      min_size=1, max_size=6))
def test_generated_batches_give_one_ranks_tokens(engines, batch):
    """Generated batches (chunked, preempted, prefix-shared as they fall) on TP=2 and TP=1."""
    one, two = engines
    prompts = [p for p, _ in batch]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for _, m in batch]
    got, want = two.generate(prompts, params), one.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert two.engine.kv.num_free_blocks == 40
    two.engine.check_invariants()
