"""Token sampling for a batch of logits rows.

Rows whose requests ask for it first have their logits processed (logits_processing.py,
batched: one masked or scattered tensor operation per kind over all the rows that use it, in
vLLM's order): the structured-output grammar's mask (guided.py), allowed_token_ids, bad words,
logit_bias, min_tokens, then the repetition, frequency and presence penalties.
Greedy rows then take the argmax. Sampled rows go through temperature, top-k, top-p and min-p,
then draw by the inverse CDF at one uniform from their own generator (a seeded request gets the
same tokens whatever shares its batch): in C++ (cpu_ops.sample_rows), else in torch, alike.
Logprobs are those of the logits with only the structured-output grammar's mask applied, as
vLLM's default `raw_logprobs` are (its grammar mask is applied before its sampler): a choice's
logprobs are over the choices, and a token the grammar forbids has MASKED_LOGPROB (vLLM's -9999,
since JSON has no -inf) where it is among the top k.
A row without a grammar that its allow list and bad words leave empty draws NO_TOKEN: the engine
fails that request alone (engine_outputs.py; a grammar's row is its matcher's to refuse).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from folio.kernels import cpu_ops
from folio.worker.logits_processing import NEG_INF, History, mask_grammars, process_logits
from folio.worker.sampling_params import SamplingParams


MASKED_LOGPROB = -9999.0  # a token the grammar forbids (log 0), as vLLM sends it
NO_TOKEN = -1  # drawn from a row the request's own masks left empty (a token id never is)


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


def _emptied(logits: torch.Tensor, params: list[SamplingParams]) -> list[int]:
    """The rows without a grammar that nothing is left to draw from: the model's logits are finite and
    logit_bias bounded, so only bad words banning all that an allow list (or the vocabulary) holds."""
    rows = [i for i, p in enumerate(params) if p.guided is None and p.bad_words_token_ids
            and (p.allowed_token_ids is not None or len(p.bad_words_token_ids) >= logits.shape[-1])]
    if not rows:
        return []
    idx = torch.tensor(rows, dtype=torch.long, device=logits.device)
    alive = torch.isfinite(logits.index_select(0, idx)).any(dim=1).tolist()
    return [i for i, a in zip(rows, alive) if not a]


def _uniforms(generators: list) -> torch.Tensor:
    """One float64 uniform in [0, 1) a row, from its own generator (else torch's default one)."""
    if all(g is None for g in generators):
        return torch.rand(len(generators), dtype=torch.float64)
    return torch.cat([torch.rand(1, dtype=torch.float64, generator=g) for g in generators])


def _draw(probs: torch.Tensor, generators: list) -> torch.Tensor:
    """One draw per row of `probs` (non-negative, some mass) by the inverse CDF: the first token
    whose cumulative mass exceeds u * total, u from `_uniforms` (never one of probability 0).
    The exponential race before it drew a number per vocabulary entry (torch: ~19 ns each)."""
    u = _uniforms(generators)[:, None]
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    # u < 1, but u * total may round up to total: keep the target strictly below the last step
    target = torch.minimum((u * total.double()).to(cdf.dtype), torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, side="right")[:, 0]


CANDIDATES = 1024  # top-k / top-p rows draw among this many best tokens when their nucleus fits


def _truncates(p: SamplingParams) -> bool:
    return p.top_k > 0 or p.top_p < 1.0


def _candidate_probs(logits: torch.Tensor, ps: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(probabilities [R, K] over each row's K best tokens, their ids [R, K], whether the row's
    nucleus lies inside them [R]) after temperature, top-k, top-p and min-p as `_filter` applies them."""
    vocab, device = logits.shape[-1], logits.device
    k = min(vocab, max([CANDIDATES] + [p.top_k for p in ps]))
    temps = torch.tensor([p.temperature for p in ps], dtype=torch.float32, device=device)
    scaled = logits / temps[:, None]
    vals, ids = scaled.topk(k, dim=-1)  # sorted, best first
    ranks = torch.arange(k, device=device)[None, :]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in ps], device=device)
    drop = ranks >= top_k[:, None]
    # probabilities as _filter has them: over the top-k set when top-k is on, else over the vocabulary
    full = torch.exp(vals - torch.logsumexp(scaled, dim=-1, keepdim=True))
    probs = torch.where((top_k < vocab)[:, None], torch.softmax(vals.masked_fill(drop, NEG_INF), dim=-1), full)
    probs = probs.masked_fill(drop, 0.0)
    top_p = torch.tensor([p.top_p for p in ps], dtype=torch.float32, device=device)
    inside = ((top_k >= vocab) | (top_k <= k)) & ((top_p >= 1.0) | (probs.sum(dim=-1) >= top_p))
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= top_p[:, None]
    drop[:, 0] = False
    probs = torch.softmax(vals.masked_fill(drop, NEG_INF), dim=-1)
    min_p = torch.tensor([p.min_p for p in ps], dtype=torch.float32, device=device)
    if (min_p > 0).any():
        probs = probs * (probs >= probs[:, :1] * min_p[:, None])
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs, ids, inside


def _sample_truncated(logits: torch.Tensor, tokens: torch.Tensor, rows: list[int], params: list,
                      generators: list) -> list[int]:
    """Draw the rows that use top-k or top-p among their CANDIDATES best tokens (a topk, not a
    sort of the whole vocabulary: at batch 64 x 49,152 the sort took 214 ms and 64 full rows of
    exponential noise 138 ms). Exact: a row is drawn here only when its nucleus lies inside
    the candidates (its top-k fits, and its top-p mass is reached within them); the filters
    are those of `_filter`, in its order. Returns the rows left for the dense path."""
    if not rows:
        return []
    device = logits.device
    idx = torch.tensor(rows, dtype=torch.long, device=device)
    probs, ids, inside = _candidate_probs(logits.index_select(0, idx), [params[i] for i in rows])
    ok = inside.tolist()
    here = [r for r, good in enumerate(ok) if good]
    if here:
        sel = torch.tensor(here, dtype=torch.long, device=device)
        # the CDF in vocabulary order, as the dense path and the C++ sampler invert it
        cand, order = ids.index_select(0, sel).sort(dim=-1)
        pick = _draw(probs.index_select(0, sel).gather(1, order), [generators[rows[r]] for r in here])
        chosen = cand.gather(1, pick[:, None])[:, 0]
        tokens.index_copy_(0, idx.index_select(0, sel), chosen)
    return [rows[r] for r, good in enumerate(ok) if not good]


def _draw_rows(x: torch.Tensor, tokens: torch.Tensor, rows: list[int], params: list, generators: list) -> bool:
    """Draw `rows` of x into `tokens`, all in one C++ pass a row (cpu_ops.sample_rows); False,
    no generator touched, where the library cannot."""
    if not cpu_ops.can_sample(x):
        return False
    idx = torch.tensor(rows, dtype=torch.long, device=x.device)
    ps = [params[i] for i in rows]
    # in float32's range (a top_p of 1e-300 is 0 there, a temperature of 1e300 inf): the same filters
    got = cpu_ops.sample_rows(x, idx, torch.tensor([min(p.temperature, 3.4e38) for p in ps], dtype=torch.float32),
                              torch.tensor([p.top_k for p in ps], dtype=torch.long),
                              torch.tensor([max(p.top_p, 1e-38) for p in ps], dtype=torch.float32),
                              torch.tensor([p.min_p + 0.0 for p in ps], dtype=torch.float32),
                              _uniforms([generators[i] for i in rows]))
    tokens.index_copy_(0, idx, got)
    return True


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           histories: Sequence[History] | None = None, eos_ids=(), grammars=None) -> SampleResult:
    """logits [N, V] (any float dtype) -> one token per row. `histories` (each row's tokens so
    far) and `eos_ids` are needed by rows whose params process logits (penalties, min_tokens...)."""
    n = logits.shape[0]
    as_is = not any(p.logprobs is not None or p.processes_logits for p in params)
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if as_is and (not sampled or logits.dtype in (torch.float32, torch.bfloat16)):
        # nothing to process: the kernels read the logits as they are (bfloat16 too: no float copy)
        tokens = cpu_ops.argmax_rows(logits)
        if not sampled or _draw_rows(logits, tokens, sampled, params, generators):
            return SampleResult(tokens.tolist(), [None] * n)
    given = logits
    logits = mask_grammars(logits.float(), params, histories, grammars)  # a copy (bfloat16's, or a grammar's)
    # the logprobs are read after the grammars' masks and before the rest, as vLLM's are: their rows copied
    # first, the rest processed in that copy (a second copy of the batch: 1.4 ms a step at 64 x 49,152 here)
    want = [i for i, p in enumerate(params) if p.logprobs is not None]
    masked_rows = logits.index_select(0, torch.tensor(want, dtype=torch.long, device=logits.device)) if want else None
    processed = process_logits(logits, params, histories, eos_ids, grammars, masked=True, in_place=logits is not given)
    tokens = cpu_ops.argmax_rows(processed)  # torch.argmax's indices, ~10x faster on a CPU's vocab rows
    if sampled and not _draw_rows(processed, tokens, sampled, params, generators):
        # the torch path, where the library is not built (and the kernel's oracle in the tests)
        dense = _sample_truncated(processed, tokens, [i for i in sampled if _truncates(params[i])], params,
                                  generators)
        dense += [i for i in sampled if not _truncates(params[i])]
        if dense:
            dense.sort()
            idx = torch.tensor(dense, dtype=torch.long, device=logits.device)
            probs = _filter(processed.index_select(0, idx), [params[i] for i in dense])
            tokens.index_copy_(0, idx, _draw(probs, [generators[i] for i in dense]))
    token_list = tokens.tolist()
    lps: list[dict[int, float] | None] = [None] * n
    for i in _emptied(processed, params):  # whatever was drawn there, no token the request allows
        token_list[i] = NO_TOKEN
    if want:  # batched: one gather, one topk (per row, topk took ~150 us of a 49,152-token row)
        rows = torch.log_softmax(masked_rows, dim=-1)
        chosen = rows.gather(1, torch.tensor([[max(token_list[i], 0)] for i in want])).flatten().tolist()
        kmax = max(params[i].logprobs or 0 for i in want)  # > the vocabulary (past validation): raises
        top_v, top_i = rows.topk(kmax, dim=-1) if kmax else (rows[:, :0], rows[:, :0])
        for r, (i, vs, ts) in enumerate(zip(want, top_v.tolist(), top_i.tolist())):
            if token_list[i] == NO_TOKEN:
                continue  # its request fails (no logprobs)
            lps[i] = {token_list[i]: max(chosen[r], MASKED_LOGPROB)}
            for lp, t in zip(vs[:params[i].logprobs or 0], ts):
                lps[i].setdefault(int(t), max(lp, MASKED_LOGPROB))
    return SampleResult(token_list, lps)
