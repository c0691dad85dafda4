"""Sampler: filters, per-request seeds, logprobs."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from hypothesis import given, settings, strategies as st

from folio.worker.sampler import sample
from folio.worker.sampling_params import SamplingParams


def gen(seed):
    return torch.Generator().manual_seed(seed)


def test_greedy_and_degenerate_filters_pick_argmax():
    logits = torch.randn(4, 50, generator=gen(0))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=1),
              SamplingParams(temperature=1.0, top_p=1e-6), SamplingParams(temperature=1.0, min_p=1.0)]
    res = sample(logits, params, [None, gen(1), gen(2), gen(3)])
    assert res.token_ids == logits.argmax(-1).tolist()


def test_seeded_rows_do_not_depend_on_the_batch():
    logits = torch.randn(3, 100, generator=gen(5))
    p = SamplingParams(temperature=0.9, top_p=0.9, seed=7)
    alone = [sample(logits[1:2], [p], [gen(7)]).token_ids[0] for _ in range(1)]
    g = gen(7)
    in_batch = sample(logits, [SamplingParams(temperature=1.0), p, SamplingParams(temperature=0.0)],
                      [gen(99), g, None]).token_ids[1]
    assert alone[0] == in_batch


def test_the_kernel_path_and_the_torch_path_draw_alike(monkeypatch):
    """Every sampled row through the C++ sampler (bfloat16 logits read as they are, float32,
    and float32 after a logits processor) and through the torch path (the library off): with
    the same per-row seeds, the same tokens (both take one uniform a row and invert the same
    CDF, up to float rounding at a boundary: these logits have no near-ties there), and a
    seeded row draws the same beside greedy rows, processed rows and rows with logprobs."""
    from folio.kernels import cpu_ops

    logits = (torch.randn(6, 300, generator=gen(2)) * 3).bfloat16()
    ps = [SamplingParams(temperature=0.8, top_p=0.9, seed=1), SamplingParams(temperature=0.0),
          SamplingParams(temperature=1.3, top_k=20, seed=2), SamplingParams(temperature=1.0, min_p=0.05, seed=3),
          SamplingParams(temperature=0.5, seed=4), SamplingParams(temperature=1.0, top_k=5, top_p=0.5, seed=5)]

    def run(x, params, on=True):
        if not on:
            monkeypatch.setattr(cpu_ops, "can_sample", lambda x: False)
        try:
            histories = [SimpleNamespace(token_ids=[1, 2, 3], num_prompt_tokens=3)] * len(params)
            return sample(x, params, [gen(s) for s in range(len(params))], histories).token_ids
        finally:
            monkeypatch.undo()
    as_is = run(logits, ps)
    assert as_is == run(logits.float(), ps) == run(logits.float(), ps, on=False)
    mixed = [ps[0], ps[1], SamplingParams(temperature=1.3, top_k=20, seed=2, logprobs=2), ps[3],
             SamplingParams(temperature=0.5, seed=4, logit_bias={7: 0.0}), ps[5]]
    assert run(logits, mixed) == as_is  # the processed path (float copy), same draws


@settings(max_examples=100, deadline=None, derandomize=True)
@given(t=st.one_of(st.floats(1e-3, 1e308), st.sampled_from([1e-5, 1.0, 1e38, 1e300])),
       top_p=st.one_of(st.floats(0.0, 1.0, exclude_min=True), st.sampled_from([5e-324, 1e-300, 1e-40, 1.0])),
       min_p=st.one_of(st.floats(0.0, 1.0), st.sampled_from([-0.0, 0.0, 1.0, 5e-324])),
       top_k=st.sampled_from([0, 1, 3, 10**6]), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_every_value_the_params_accept_samples(t, top_p, min_p, top_k, dtype):
    """Whatever SamplingParams accepts (here: extremes of temperature, top_p and min_p, -0.0)
    the sampler draws with, a token the filters keep: never an error from the kernel (a min_p of
    -0.0 sent over gRPC failed its request in the engine, 2026-12-05)."""
    p = SamplingParams(temperature=t, top_p=top_p, min_p=min_p, top_k=top_k, seed=1)
    logits = (torch.randn(2, 50, generator=gen(4)) * 3).to(dtype)
    tok = sample(logits, [p, SamplingParams(temperature=0.0)], [gen(1), None]).token_ids
    assert 0 <= tok[0] < 50 and tok[1] == int(logits[1].float().argmax())


def test_distribution_follows_softmax_with_temperature():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(4000, 1)
    g = gen(11)
    p = SamplingParams(temperature=0.5)
    res = sample(logits, [p] * 4000, [g] * 4000)
    freq = torch.bincount(torch.tensor(res.token_ids), minlength=4).double() / 4000
    expected = torch.softmax(logits[0].double() / 0.5, -1)
    assert torch.allclose(freq, expected, atol=0.03), (freq, expected)


def test_top_k_top_p_min_p_never_leave_their_set():
    logits = torch.tensor([[3.0, 2.9, 0.0, -1.0, -2.0]]).repeat(500, 1)
    for p, allowed in [(SamplingParams(temperature=1.0, top_k=2), {0, 1}),
                       (SamplingParams(temperature=1.0, top_p=0.8), {0, 1}),
                       (SamplingParams(temperature=1.0, min_p=0.2), {0, 1})]:
        g = gen(3)
        toks = set(sample(logits, [p] * 500, [g] * 500).token_ids)
        assert toks == allowed, (p, toks)


def test_logprobs_of_chosen_and_top():
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    res = sample(logits, [SamplingParams(temperature=0.0, logprobs=2)], [None])
    lp = torch.log_softmax(logits[0], -1)
    assert res.token_ids == [1]
    assert res.logprobs[0] == {1: float(lp[1]), 2: float(lp[2])}



from folio.worker import sampler as sampler_module  # noqa: E402


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), vocab=st.sampled_from([7, 300, 3000]), rows=st.integers(1, 5),
       scale=st.sampled_from([0.3, 3.0, 12.0]), candidates=st.sampled_from([4, 64, 1024]),
       params=st.lists(st.builds(lambda t, k, p, m: SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m),
                                 st.sampled_from([0.5, 1.0, 1.7]), st.sampled_from([0, 0, 1, 5, 50, 2000]),
                                 st.sampled_from([1.0, 0.95, 0.5, 0.1]), st.sampled_from([0.0, 0.0, 0.1])),
                       min_size=5, max_size=5))
def test_candidate_nucleus_equals_the_full_sort(seed, vocab, rows, scale, candidates, params):
    """Where the candidate path draws (nucleus inside the K best tokens), its distribution is
    exactly _filter's over the whole vocabulary (which is 0 outside the candidates)."""
    kept, sampler_module.CANDIDATES = sampler_module.CANDIDATES, candidates
    try:
        _check_candidates(seed, vocab, rows, scale, params)
    finally:
        sampler_module.CANDIDATES = kept


def _check_candidates(seed, vocab, rows, scale, params):
    logits = torch.randn(rows, vocab, generator=gen(seed)) * scale
    ps = [p for p in params[:rows] if p.top_k > 0 or p.top_p < 1.0] or [SamplingParams(top_p=0.5)]
    logits = logits[:len(ps)]
    dense = sampler_module._filter(logits, ps)
    probs, ids, inside = sampler_module._candidate_probs(logits, ps)
    for r in range(len(ps)):
        if not inside[r]:
            continue
        on = dense[r].gather(0, ids[r])
        torch.testing.assert_close(probs[r], on, rtol=1e-5, atol=1e-6)
        assert float(dense[r].sum() - on.sum()) < 1e-5  # nothing of the nucleus outside the candidates


def test_a_peaked_distribution_draws_among_the_candidates():
    """A trained model's next-token distribution (most mass on few tokens): top-p and top-k
    rows take the candidate path, and the draw follows the nucleus."""
    logits = torch.full((3, 5000), -10.0)
    logits[:, :5] = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    ps = [SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=0.7, top_k=3),
          SamplingParams(temperature=1.0, top_p=0.95, top_k=40, min_p=0.05)]
    _, _, inside = sampler_module._candidate_probs(logits, ps)
    assert inside.tolist() == [True, True, True]
    for p in ps:
        drawn = [sample(logits[:1], [p], [gen(s)]).token_ids[0] for s in range(400)]
        want = sampler_module._filter(logits[:1], [p])[0]
        freq = torch.bincount(torch.tensor(drawn), minlength=5000).double()[:5] / 400
        assert set(drawn) <= set(torch.nonzero(want).flatten().tolist())
        assert torch.allclose(freq, want[:5].double(), atol=0.07), (p, freq, want[:5])


def test_a_flat_distribution_falls_back_to_the_full_sort_and_stays_in_its_nucleus(monkeypatch):
    monkeypatch.setattr(sampler_module, "CANDIDATES", 16)
    logits = torch.zeros(1, 400)
    logits[0, :200] = 1.0  # 200 equally likely tokens above the rest: top_p 0.5 needs ~110 of them
    p = SamplingParams(temperature=1.0, top_p=0.5, seed=0)
    _, _, inside = sampler_module._candidate_probs(logits, [p])
    assert not bool(inside[0])
    drawn = {sample(logits, [p], [gen(s)]).token_ids[0] for s in range(300)}
    assert drawn <= set(range(200)) and len(drawn) > 16  # the dense path: more than the 16 candidates
