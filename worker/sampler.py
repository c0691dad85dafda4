"""Token sampling for a batch of logits rows.

Greedy rows take the argmax. Sampled rows go through temperature, top-k, top-p
and min-p (batched over rows), then each row draws with its own generator, so a
seeded request gets the same tokens whatever else shares its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from folio.worker.sampling_params import SamplingParams


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]  # per row: {chosen: lp, top-k...} when asked


def _filter(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Apply temperature, top-k, top-p, min-p to float32 logits [N, V]; returns probabilities."""
    device = logits.device
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
    logits = logits / temps[:, None]
    need_sort = any(p.top_k > 0 or p.top_p < 1.0 for p in params)
    if need_sort:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        vocab = logits.shape[-1]
        ks = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)
        ranks = torch.arange(vocab, device=device)[None, :]
        drop = ranks >= ks[:, None]
        top_ps = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
        probs_sorted = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
        # drop a token when the mass strictly before it already reaches top_p (the top one always stays)
        mass_before = probs_sorted.cumsum(dim=-1) - probs_sorted
        drop |= mass_before >= top_ps[:, None]
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    probs = torch.softmax(logits, dim=-1)
    if any(p.min_p > 0.0 for p in params):
        min_ps = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)
        keep = probs >= probs.max(dim=-1, keepdim=True).values * min_ps[:, None]
        probs = probs * keep
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> SampleResult:
    """logits [N, V] (any float dtype) -> one token per row."""
    logits = logits.float()
    n = logits.shape[0]
    tokens = logits.argmax(dim=-1)
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if sampled:
        idx = torch.tensor(sampled, dtype=torch.long, device=logits.device)
        probs = _filter(logits.index_select(0, idx), [params[i] for i in sampled])
        # Exponential race: argmax(p / E), E ~ Exp(1), is a draw from p; E comes from
        # the row's own generator.
        noise = torch.empty_like(probs)
        for r, i in enumerate(sampled):
            noise[r].exponential_(generator=generators[i])
        noise.clamp_min_(1e-30)  # an exact 0 would turn p = 0 into NaN, which argmax picks
        tokens.index_copy_(0, idx, (probs / noise).argmax(dim=-1))
    token_list = tokens.tolist()
    lps: list[dict[int, float] | None] = [None] * n
    want = [i for i, p in enumerate(params) if p.logprobs is not None]
    if want:
        rows = torch.log_softmax(logits.index_select(0, torch.tensor(want, dtype=torch.long)), dim=-1)
        for r, i in enumerate(want):
            d = {token_list[i]: float(rows[r, token_list[i]])}
            k = params[i].logprobs
            if k:
                top = rows[r].topk(k)
                for lp, t in zip(top.values.tolist(), top.indices.tolist()):
                    d.setdefault(t, lp)
            lps[i] = d
    return SampleResult(token_list, lps)
