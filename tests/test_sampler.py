"""Sampler: filters, per-request seeds, logprobs."""

from __future__ import annotations

import torch

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
