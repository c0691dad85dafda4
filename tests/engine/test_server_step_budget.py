"""A server's step budget (worker/config.py: server_engine_fields): with chunked prefill, 2,048
tokens as vLLM's API server on CPU has it, so a prompt longer than that is prefilled in chunks
beside the running decodes (one 7,700-token prompt in one step held every other stream of its
worker for 35 s); a budget given, or chunked prefill off, stays as the engine sizes it."""

import dataclasses

import pytest

from folio.worker import LLM, SamplingParams
from folio.worker.config import SERVER_STEP_TOKENS, EngineConfig, server_engine_fields
from folio.worker.models.model_config import ModelConfig
from folio.worker.sizing import size_engine


@pytest.mark.parametrize("args, budget", [
    ({}, SERVER_STEP_TOKENS),
    ({"max_num_batched_tokens": None}, SERVER_STEP_TOKENS),  # as `folio serve`'s flags pass it
    ({"max_num_batched_tokens": 512}, 512),
    ({"enable_chunked_prefill": False}, 8192),  # the whole longest prompt in one step
    ({"enable_chunked_prefill": False, "max_num_batched_tokens": 9000}, 9000),
])
def test_the_server_budget_by_what_was_given(model_dirs, args, budget):
    mc = dataclasses.replace(ModelConfig.from_dir(model_dirs["llama"]), max_position_embeddings=8192)
    fields = server_engine_fields(args)
    assert fields["device"] == "auto" and fields["warm_up"] is True
    assert size_engine(EngineConfig(model=model_dirs["llama"], **fields), mc).max_num_batched_tokens == budget


def test_a_prompt_past_the_budget_is_prefilled_in_chunks_beside_a_decode(model_dirs):
    """The mechanism the server's budget relies on, at a scale a tiny model runs in a second: a
    running stream gets a token in every step of a long prompt's prefill."""
    llm = LLM(model_dirs["llama"], block_size=8, num_kv_blocks=256, max_num_batched_tokens=64)
    eng = llm.engine
    eng.add_request("decode", [5, 6, 7], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
                    output_kind="delta")
    eng.step()
    eng.add_request("long", list(range(10, 310)), SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    decode_tokens = []
    for _ in range(50):
        outs = {o.request_id: o for o in eng.step()}
        decode_tokens.append(len(outs["decode"].outputs[0].token_ids) if "decode" in outs else 0)
        if "long" in outs and outs["long"].finished:
            break
    assert len(decode_tokens) >= 5 and all(decode_tokens), decode_tokens  # 300 tokens in chunks of <= 64


@pytest.mark.parametrize("args, threshold", [
    ({}, SERVER_STEP_TOKENS // 4), ({"long_prefill_token_threshold": 0}, 0),
    ({"long_prefill_token_threshold": 100}, 100), ({"max_num_batched_tokens": 4096}, 1024),
    ({"enable_chunked_prefill": False}, 0)])
def test_the_long_prefill_threshold_by_what_was_given(model_dirs, args, threshold):
    mc = ModelConfig.from_dir(model_dirs["llama"])
    sizes = size_engine(EngineConfig(model=model_dirs["llama"], **server_engine_fields(args)), mc)
    assert sizes.long_prefill_tokens == threshold


def test_the_offline_engine_takes_the_whole_budget_per_prompt(model_dirs):
    """As vLLM's offline LLM: the threshold is a server's default, throughput is the LLM's."""
    assert LLM(model_dirs["llama"], num_kv_blocks=64).engine.scheduler.long_prefill_tokens == 0


def test_a_request_arriving_during_a_long_prefill_gets_its_token_in_the_next_step(model_dirs):
    """scheduler.py step 3 through the engine: the long prompt's chunks leave room for a short
    request that arrives meanwhile, and neither output changes (greedy, as each alone)."""
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    short, long = list(range(40, 52)), list(range(100, 400))
    alone = {rid: LLM(model_dirs["llama"], block_size=8, num_kv_blocks=256).generate([p], sp)[0].outputs[0].token_ids
             for rid, p in (("short", short), ("long", long))}
    llm = LLM(model_dirs["llama"], block_size=8, num_kv_blocks=256, max_num_batched_tokens=64,
              long_prefill_token_threshold=16)
    eng = llm.engine
    eng.add_request("long", long, sp)
    eng.step()
    eng.add_request("short", short, sp)
    got, steps = {}, {}
    for step in range(1, 40):
        for o in eng.step():
            if o.finished:
                got[o.request_id], steps[o.request_id] = o.outputs[0].token_ids, step
        if len(got) == 2:
            break
    assert steps["short"] == 4, steps  # its prompt in the first step after it arrived, then 3 decodes
    assert got == alone
