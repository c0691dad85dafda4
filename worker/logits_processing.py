"""Logits processing for a batch of rows (the sampler's first stage), in vLLM's order: the
structured-output grammar's mask (guided.py), allowed_token_ids, bad words, logit_bias,
min_tokens, then the repetition, frequency and presence penalties (penalties.py: from each
sequence's ids seen and their counts, kept as it grows). min_tokens yields where a grammar or an
allow list leaves only a stop token: the output ends there, short of min_tokens (a choice with
min_tokens 4 failed its request after its answer, "no token to draw"; vLLM's ends at the answer).

Each kind is one batched tensor operation over the rows that use it (gather / scatter), never
a dense [N, V] pass but for allowed_token_ids (everything else masked). A request's allowed ids
and logit_bias become tensors once (`_request_ids`, cached per request while it runs), and its n
rows share them: rebuilt from Python every step, 4,096 biases at n = 128 (half a million
tuples) made each step of the worker 2 s long (an attack, 2026-12-07).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Protocol, Sequence

import torch

from folio.worker.penalties import penalize

NEG_INF = float("-inf")


class History(Protocol):
    """What a row's penalties look at: its sequence's tokens so far (prompt, then output)."""
    token_ids: list[int]
    num_prompt_tokens: int


_CACHED = 1024  # requests whose id tensors are kept (a batch holds at most max_num_seqs)
_ids: "OrderedDict[int, tuple]" = OrderedDict()  # id(params) -> (params, key, allowed ids, bias ids, biases)
_ids_lock = threading.Lock()  # engines of one process step on threads of their own


def _request_ids(p, vocab: int, device) -> tuple:
    """(allowed ids or None, logit_bias ids, their biases) of one request's params, as tensors on
    `device`: ids outside the vocabulary dropped (check_vocab refused them before)."""
    key = (vocab, str(device))
    with _ids_lock:
        hit = _ids.get(id(p))
        if hit is not None and hit[0] is p and hit[1] == key:
            _ids.move_to_end(id(p))
            return hit[2:]
    allowed = None
    if p.allowed_token_ids is not None:
        allowed = torch.tensor(sorted({t for t in p.allowed_token_ids if 0 <= t < vocab}) or [0], device=device)
    bias = {t: b for t, b in (p.logit_bias or {}).items() if 0 <= t < vocab}
    got = (allowed, torch.tensor(list(bias), dtype=torch.long, device=device),
           torch.tensor(list(bias.values()), dtype=torch.float32, device=device))
    with _ids_lock:  # the entry holds `p`, so its id is not reused while it is cached
        _ids[id(p)] = (p, key) + got
        while len(_ids) > _CACHED:
            _ids.popitem(last=False)
    return got


def _by_request(rows: list[int], params: list) -> list[tuple[object, list[int]]]:
    """`rows` grouped by their params object (a request's n rows share it), in first-seen order."""
    groups: dict[int, tuple[object, list[int]]] = {}
    for i in rows:
        groups.setdefault(id(params[i]), (params[i], []))[1].append(i)
    return list(groups.values())


def _allow_only(logits: torch.Tensor, rows: list[int], params: list) -> None:
    """Each of `rows` keeps only its request's allowed ids (the rest -inf)."""
    device = logits.device
    for p, rs in _by_request(rows, params):
        ids = _request_ids(p, logits.shape[-1], device)[0]
        r = torch.tensor(rs, device=device)[:, None]
        kept = logits[r, ids[None, :]]
        logits[r] = NEG_INF
        logits[r, ids[None, :]] = kept


def _add_biases(logits: torch.Tensor, rows: list[int], params: list) -> None:
    """Each of `rows` gets its request's logit_bias added: one scatter for the whole batch."""
    device = logits.device
    r, t, v = [], [], []
    for p, rs in _by_request(rows, params):
        _, ids, biases = _request_ids(p, logits.shape[-1], device)
        if len(ids):
            r.append(torch.tensor(rs, device=device).repeat_interleave(len(ids)))
            t.append(ids.repeat(len(rs)))
            v.append(biases.to(logits.dtype).repeat(len(rs)))
    if r:
        logits.index_put_((torch.cat(r), torch.cat(t)), torch.cat(v), accumulate=True)


def _only(row: torch.Tensor, ids: set[int]) -> bool:
    """Whether every token the row still allows (a finite logit) is one of `ids`."""
    allowed = int(torch.isfinite(row).sum())
    return allowed == sum(1 for t in ids if 0 <= t < row.shape[0] and bool(torch.isfinite(row[t])))


def mask_grammars(logits: torch.Tensor, params: list, histories: Sequence[History] | None,
                  grammars=None) -> torch.Tensor:
    """float32 logits [N, V] with each structured-output row's grammar mask applied (-inf where its
    grammar forbids), a new tensor; `logits` itself when no row has a grammar. The sampler's
    logprobs are read here, as vLLM's are (its mask is applied before its sampler)."""
    guided = [i for i, p in enumerate(params) if p.guided is not None]
    if not guided:
        return logits
    if grammars is None:
        raise ValueError("structured output needs the engine's grammars")
    if histories is None:
        raise ValueError("logits processing needs each row's tokens (histories)")
    from folio.worker.guided import apply_bitmask
    logits = logits.clone()
    apply_bitmask(logits, guided, grammars.bitmask([histories[i] for i in guided]))
    return logits


def process_logits(logits: torch.Tensor, params: list, histories: Sequence[History] | None,
                   eos_ids=(), grammars=None, masked: bool = False, in_place: bool = False) -> torch.Tensor:
    """float32 logits [N, V] with each row's logits processing applied (a new tensor when any is;
    `logits` itself when no row asks for any). Each kind is one batched operation over the rows
    that use it, touching only the ids it concerns (gather / scatter), never a dense [N, V] pass
    but for allowed_token_ids (everything else masked). `masked`: the grammars' masks are applied
    already (mask_grammars); `in_place`: `logits` is the caller's own copy, processed as it is."""
    rows = [i for i, p in enumerate(params) if p.processes_logits]
    if not rows:
        return logits
    if histories is None:
        raise ValueError("logits processing needs each row's tokens (histories)")
    if not masked:
        masked_copy = mask_grammars(logits, params, histories, grammars)  # structured output first (vLLM's order)
        in_place, logits = in_place or masked_copy is not logits, masked_copy
    if not in_place:
        logits = logits.clone()
    vocab, device = logits.shape[-1], logits.device

    def put(r: list[int], t: list[int], values: list[float]) -> None:
        """logits[r, t] = values; ids outside the vocabulary were refused before (check_vocab)
        and are dropped here."""
        keep = [(a, b, v) for a, b, v in zip(r, t, values) if 0 <= b < vocab]
        if keep:
            ri, ti, vi = zip(*keep)
            logits.index_put_((torch.tensor(ri, device=device), torch.tensor(ti, device=device)),
                              torch.tensor(vi, dtype=logits.dtype, device=device))

    allowed = [i for i in rows if params[i].allowed_token_ids is not None]
    if allowed:
        _allow_only(logits, allowed, params)
    r, t = [], []
    for i in rows:  # bad words: ban a word's last token where the tokens before it end the sequence
        words = params[i].bad_words_token_ids
        if words:
            toks = histories[i].token_ids
            for w in words:
                k = len(w) - 1
                if k == 0 or (len(toks) >= k and toks[-k:] == w[:-1]):
                    r.append(i)
                    t.append(w[-1])
    if r:
        put(r, t, [NEG_INF] * len(r))
    biased = [i for i in rows if params[i].logit_bias]
    if biased:
        _add_biases(logits, biased, params)
    r, t = [], []
    for i in rows:  # min_tokens: nothing that ends the sequence before it has that many tokens
        p, h = params[i], histories[i]
        if p.min_tokens and len(h.token_ids) - h.num_prompt_tokens < p.min_tokens:
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids))
            if (p.guided is not None or p.allowed_token_ids is not None) and _only(logits[i], stops):
                continue  # the grammar (or allow list) leaves only the end: it wins, the output ends short
            r += [i] * len(stops)
            t += sorted(stops)
    if r:
        put(r, t, [NEG_INF] * len(r))
    penalize(logits, rows, params, histories)
    return logits
