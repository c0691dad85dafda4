"""Preemption by swapping KV to CPU memory, and moving requests between engines."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from folio.worker import LLM, SamplingParams
from folio.worker.preemption import PreemptionRates, choose_mode
from conftest import PROMPTS

MAX_TOKENS = 24
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


def run_all(engine, ids):
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
        engine.check_invariants()
    return [done[i] for i in ids]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_swapped_many_times_matches_hf(model_dirs, hf_reference, arch):
    # 28 blocks of 4 tokens (112 slots) for twelve requests growing to ~100 tokens each
    prompts, long = PROMPTS * 2, SamplingParams(max_tokens=64, temperature=0.0)
    llm = LLM(model_dirs[arch], block_size=4, num_kv_blocks=28, preemption_mode="swap", num_cpu_blocks=400,
              enable_prefix_caching=False, max_num_batched_tokens=16)
    outs = llm.generate(prompts, long)
    st = llm.engine.stats()
    swaps = [o.metrics.num_preemptions for o in outs]
    assert sum(n >= 2 for n in swaps) >= len(prompts) // 2, f"most requests must be swapped repeatedly: {swaps}"
    assert st.preemptions_by_mode["recompute"] == 0 and st.swapped_in_blocks == st.swapped_out_blocks > 0
    assert st.swap_bytes > 0
    for o, r in zip(outs, hf_reference(model_dirs[arch], prompts, 64)):
        assert o.token_ids == r
    calm = LLM(model_dirs[arch], block_size=4, num_kv_blocks=512).generate(prompts, long)
    assert [o.token_ids for o in outs] == [o.token_ids for o in calm]
    llm.engine.check_invariants()
    assert llm.engine.kv.num_free_blocks == 28 and llm.engine.kv.swap.num_free == 400


def test_auto_mode_and_small_swap_space_fall_back_to_recompute(model_dirs, hf_reference):
    # a swap space of 6 blocks cannot hold most victims: they are recomputed instead
    llm = LLM(model_dirs["llama"], block_size=4, num_kv_blocks=16, preemption_mode="auto", num_cpu_blocks=6)
    outs = llm.generate(PROMPTS, GREEDY)
    st = llm.engine.stats()
    assert st.preemptions_by_mode["swap"] > 0 and st.preemptions_by_mode["recompute"] > 0, st
    for o, r in zip(outs, hf_reference(model_dirs["llama"], PROMPTS, MAX_TOKENS)):
        assert o.token_ids == r


def test_seeded_sampling_survives_swapping(model_dirs):
    params = [SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, seed=100 + i) for i in range(len(PROMPTS))]
    calm = LLM(model_dirs["qwen2"], block_size=4, num_kv_blocks=512).generate(PROMPTS, params)
    pressured = LLM(model_dirs["qwen2"], block_size=4, num_kv_blocks=16, preemption_mode="swap",
                    num_cpu_blocks=200)
    outs = pressured.generate(PROMPTS, params)
    assert pressured.engine.stats().preemptions_by_mode["swap"] > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in calm]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_export_import_between_engines(model_dirs, hf_reference, temperature):
    def params(i):
        return SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, seed=7 + i, n=2 if i == 0 else 1)

    calm = LLM(model_dirs["mistral"], block_size=8, num_kv_blocks=256)
    want = calm.generate(PROMPTS, [params(i) for i in range(len(PROMPTS))])
    a = LLM(model_dirs["mistral"], block_size=8, num_kv_blocks=256).engine
    b = LLM(model_dirs["mistral"], block_size=8, num_kv_blocks=256, num_cpu_blocks=64).engine
    ids = [a.add_request(f"m{i}", p, params(i)) for i, p in enumerate(PROMPTS)]
    for _ in range(6):  # mid-decode: prompts done, some tokens generated
        a.step()
    states = [a.export_request(i) for i in ids]
    assert not a.has_unfinished_requests() and a.kv.num_free_blocks == 256, "export must free the source"
    a.check_invariants()
    assert all(s.kv_bytes > 0 for s in states)
    for s in states:
        b.import_request(s)
    assert b.stats().num_swapped == len(PROMPTS) + 1
    got = run_all(b, ids)
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in want]
    assert [o.text for o in got] == [o.text for o in want]
    if temperature == 0.0:
        for o, r in zip(got, hf_reference(model_dirs["mistral"], PROMPTS, MAX_TOKENS)):
            assert o.token_ids == r
    assert b.kv.swap.num_free == 64 and b.kv.num_free_blocks == 256


def test_layer_major_cache_swaps_and_migrates_to_block_major(model_dirs):
    """The opt-in layer-major cache under swap pressure gives the calm run's tokens, and its
    exported KV (the blocks-first wire format of either layout) resumes on a block-major engine."""
    long = SamplingParams(max_tokens=48, temperature=0.0)
    want = [o.token_ids for o in LLM(model_dirs["qwen2"], block_size=4, num_kv_blocks=512).generate(PROMPTS, long)]
    pressured = LLM(model_dirs["qwen2"], block_size=4, num_kv_blocks=28, preemption_mode="swap", num_cpu_blocks=200,
                    kv_cache_layout="layer_major")
    assert not pressured.engine.runner.kv_blocks.is_contiguous(), "layer_major must be a blocks-first view"
    outs = pressured.generate(PROMPTS, long)
    assert pressured.engine.stats().swapped_in_blocks > 0
    assert [o.token_ids for o in outs] == want
    a = LLM(model_dirs["qwen2"], block_size=4, num_kv_blocks=128, kv_cache_layout="layer_major").engine
    b = LLM(model_dirs["qwen2"], block_size=4, num_kv_blocks=128, num_cpu_blocks=64).engine
    ids = [a.add_request(f"l{i}", p, long) for i, p in enumerate(PROMPTS)]
    for _ in range(5):
        a.step()
    for i in ids:
        b.import_request(a.export_request(i))
    assert [o.token_ids for o in run_all(b, ids)] == want
    assert b.kv.swap.num_free == 64 and b.kv.num_free_blocks == 128


def test_import_without_swap_space_recomputes(model_dirs, hf_reference):
    a = LLM(model_dirs["llama"], block_size=8, num_kv_blocks=256).engine
    b = LLM(model_dirs["llama"], block_size=8, num_kv_blocks=256, preemption_mode="recompute").engine
    rid = a.add_request("x", PROMPTS[2], GREEDY)
    for _ in range(4):
        a.step()
    b.import_request(a.export_request(rid))
    assert b.stats().num_waiting == 1
    assert run_all(b, [rid])[0].token_ids == hf_reference(model_dirs["llama"], PROMPTS[2:3], MAX_TOKENS)[0]


def test_streamed_deltas_continue_across_migration(model_dirs):
    a = LLM(model_dirs["qwen2"], block_size=8, num_kv_blocks=128).engine
    b = LLM(model_dirs["qwen2"], block_size=8, num_kv_blocks=128).engine
    rid = a.add_request("s", PROMPTS[0], SamplingParams(max_tokens=16, temperature=0.0), output_kind="delta")
    toks = []
    for _ in range(5):
        for o in a.step():
            toks += o.outputs[0].token_ids
    b.import_request(a.export_request(rid))
    while b.has_unfinished_requests():
        for o in b.step():
            toks += o.outputs[0].token_ids
    full = LLM(model_dirs["qwen2"], block_size=8, num_kv_blocks=128).generate([PROMPTS[0]],
                                                                             SamplingParams(max_tokens=16, temperature=0.0))
    assert toks == full[0].token_ids, "a token was lost or repeated across the migration"


def test_abort_while_swapped_frees_host_blocks(model_dirs):
    llm = LLM(model_dirs["llama"], block_size=4, num_kv_blocks=16, preemption_mode="swap", num_cpu_blocks=200)
    eng = llm.engine
    ids = [eng.add_request(None, p, GREEDY) for p in PROMPTS]
    while not eng.scheduler.swapped:
        eng.step()
    victim = eng.scheduler.swapped[0]
    rid = victim.group.request_id
    assert eng.kv.swap.holds(victim.seq_id)
    assert eng.abort(rid)
    assert not eng.kv.swap.holds(victim.seq_id)
    eng.check_invariants()
    for i in ids:
        eng.abort(i)
    assert eng.kv.swap.num_free == 200 and eng.kv.num_free_blocks == 16


def test_export_of_unknown_request_and_bad_import(model_dirs):
    from folio.worker import InvalidRequestError

    a = LLM(model_dirs["llama"], block_size=8, num_kv_blocks=64).engine
    with pytest.raises(InvalidRequestError, match="unknown"):
        a.export_request("nope")
    rid = a.add_request("r", PROMPTS[0], GREEDY)
    a.step()
    state = a.export_request(rid)
    other = LLM(model_dirs["llama"], block_size=16, num_kv_blocks=64).engine
    with pytest.raises(InvalidRequestError, match="block size"):
        other.import_request(state)
    other.check_invariants()
    short = copy.copy(state)
    short.seqs = [dataclasses.replace(state.seqs[0], kv=state.seqs[0].kv[:-1])]
    with pytest.raises(InvalidRequestError, match="does not hold"):
        a.import_request(short)
    wrong = copy.copy(state)
    wrong.seqs = [dataclasses.replace(state.seqs[0], kv=state.seqs[0].kv[:, 1:])]  # a layer short
    with pytest.raises(InvalidRequestError, match="does not fit"):
        a.import_request(wrong)
    a.check_invariants()
    a.import_request(state)
    with pytest.raises(InvalidRequestError, match="already in use"):
        a.import_request(state)


def test_choose_mode_compares_measured_costs():
    rates = PreemptionRates(swap_bytes_per_s=1e9, prefill_tokens_per_s=1e3)
    assert choose_mode("auto", kv_bytes=10**6, num_computed_tokens=100, rates=rates) == "swap"  # 2 ms vs 100 ms
    assert choose_mode("auto", kv_bytes=10**9, num_computed_tokens=100, rates=rates) == "recompute"  # 2 s vs 0.1 s
    assert choose_mode("auto", 10**9, 1, PreemptionRates()) == "swap"  # unmeasured: swap
    assert choose_mode("recompute", 1, 10**6, rates) == "recompute"
