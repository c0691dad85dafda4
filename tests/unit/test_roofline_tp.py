"""The roofline's tensor-parallel terms (cluster/sim/roofline.py): one GPU unchanged, each of
N GPUs reading and computing its share, the all-reduces added, KV heads replicated below N."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings, strategies as st

from folio.cluster.sim.roofline import GPUS, LINKS, MODELS, Roofline

scheduled = st.lists(st.tuples(st.integers(1, 4096), st.integers(1, 8192)), min_size=1, max_size=64).map(
    lambda xs: [(n, max(n, ctx)) for n, ctx in xs])


@settings(max_examples=100, deadline=None)
@given(model=st.sampled_from(sorted(MODELS)), batch=scheduled)
def test_more_gpus_never_cost_more_than_their_collectives_and_never_more_than_linear_gain(model, batch):
    one = Roofline.named("H200", model)
    assert one.all_reduce_seconds(sum(n for n, _ in batch)) == 0.0
    prev = None
    for tp in (1, 2, 4, 8):
        r = dataclasses.replace(one, tensor_parallel_size=tp)
        step = r.step_seconds(batch)
        body = step - r.all_reduce_seconds(sum(n for n, _ in batch)) - r.step_overhead_s
        one_body = one.step_seconds(batch) - one.step_overhead_s
        assert abs(body - one_body / tp) <= 1e-12 + 1e-9 * one_body  # each GPU does 1/N of the bound
        if prev is not None:
            assert r.all_reduce_seconds(64) > prev.all_reduce_seconds(64)
            assert r.num_kv_blocks(16) >= prev.num_kv_blocks(16)
        prev = r


def test_one_gpu_is_the_plain_roofline():
    r = Roofline.named("H200", "llama-3-8b")
    m, g = r.model, r.gpu
    mem = (m.weight_bytes + 2048 * m.kv_bytes_per_token) / (g.hbm_bytes_per_s * 0.8)
    assert abs(r.step_seconds([(1, 2048)]) - (mem + 0.002)) < 1e-12


def test_kv_heads_fewer_than_the_ranks_are_replicated():
    m = dataclasses.replace(MODELS["llama-3-8b"], num_kv_heads=2)
    r = Roofline(GPUS["H200"], m, tensor_parallel_size=8, link=LINKS["NVLink4"])
    assert r.kv_bytes_per_token_per_gpu == m.kv_bytes_per_token / 2  # 8 ranks, 2 heads: each holds one


def test_an_all_reduce_costs_its_latency_plus_the_ring_bytes():
    r = Roofline.named("H200", "llama-3-70b", tensor_parallel_size=4)
    m, link = r.model, r.link
    each = link.latency_s + 2 * 3 / 4 * 10 * m.hidden_size * 2 / link.bus_bytes_per_s
    assert abs(r.all_reduce_seconds(10) - (1 + 2 * m.num_layers) * each) < 1e-12
