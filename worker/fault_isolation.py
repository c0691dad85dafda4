"""Fault isolation inside a step: when a step raises, find the requests to blame.

Validation at the boundary keeps bad values out; this is the defence behind it. A step
is schedule -> swap / copy-on-write -> forward -> sample -> postprocess, and the two
phases that run many requests at once are isolated here:

- forward: if the batch raises, it is bisected by request (each half run again on its
  own) down to the requests that fail alone. Re-running is sound because nothing a
  forward does is kept until it returns: it writes the KV of slots
  [num_computed, num_computed + n) of each sequence, a pure function of its tokens, so a
  second run writes the same values, and `num_computed_tokens` only advances (and full
  blocks only enter the prefix cache) after a successful run, for the sequences in it.
  Shared blocks (prefix cache, forks) are full or copied-on-write before the forward, so
  no slot of another request is written.
- sample: if the batch raises, the seeded generators are put back to their state before
  it and each request's rows are sampled alone (a row's draw uses only its own logits and
  generator, so the tokens are the same as in the batch).

A request that fails alone is blamed only while the engine is healthy: the runner's probe
(Runner.healthy: a forward of one dummy token, its KV write skipped) must still pass. If it does not (a
device error, a broken kernel), or the batch fails and no request does alone, nothing
can be blamed and EngineFailedError says the worker must go.
"""

from __future__ import annotations

import traceback

import torch

from folio.worker.errors import EngineFailedError, InvalidRequestError
from folio.worker.sequence import Sequence

Scheduled = list[tuple[Sequence, int]]


class Fault(str):
    """describe's line; `param`: the request field an InvalidRequestError named (or None)."""
    param: str | None = None


def describe(e: BaseException) -> Fault:
    """One line for the client: the exception's type and message, no traceback."""
    line = Fault(traceback.format_exception_only(type(e), e)[-1].strip()[:500])
    line.param = e.param if isinstance(e, InvalidRequestError) else None
    return line


def _by_request(items: list, key) -> list[list]:
    groups: dict[str, list] = {}
    for it in items:
        groups.setdefault(key(it).group.request_id, []).append(it)
    return list(groups.values())


MAX_ALL_BLAMED = 8  # failed phases in a row where every request failed alone: the engine is broken


class Streak:
    """Failed phases in a row where every request failed alone (one per engine)."""

    def __init__(self) -> None:
        self.all_blamed = 0


def _check_attributable(runner, streak: Streak, some_passed: bool, first: Exception) -> None:
    """Raise EngineFailedError unless blaming the requests that failed alone is sound: some
    requests passed, or all failed but the runner's probe passes (and that has not happened
    MAX_ALL_BLAMED times in a row: a fault no probe sees but every request hits)."""
    if some_passed:
        streak.all_blamed = 0
        return
    streak.all_blamed += 1
    if streak.all_blamed >= MAX_ALL_BLAMED or not runner.healthy():
        raise EngineFailedError(f"a step failed and no request can be blamed: {describe(first)}") from first


def forward(runner, kv, scheduled: Scheduled, blamed: dict[str, str], streak: Streak):
    """Run the batch on `runner` (runner.Runner): (the sequences that sample, their logits or
    None, the sequences that ran). Requests that fail alone go into `blamed` (request id -> why)."""
    try:
        seqs, logits = runner.run(scheduled, kv)
        streak.all_blamed = 0
        return seqs, logits, scheduled
    except Exception as e:
        first = e
    pieces: list[tuple[list[Sequence], torch.Tensor | None, Scheduled]] = []
    _bisect(runner, kv, _by_request(scheduled, lambda x: x[0]), first, blamed, pieces)
    _check_attributable(runner, streak, bool(pieces), first)
    seqs = [s for p in pieces for s in p[0]]
    ran = [x for p in pieces for x in p[2]]
    parts = [p[1] for p in pieces if p[1] is not None]
    return seqs, (torch.cat(parts) if parts else None), ran


def _bisect(runner, kv, groups: list[Scheduled], err: Exception, blamed: dict[str, str], pieces: list) -> None:
    """`groups` (one per request) failed together with `err`: run halves until the failing
    requests stand alone."""
    if len(groups) == 1:
        blamed[groups[0][0][0].group.request_id] = describe(err)
        return
    mid = len(groups) // 2
    for half in (groups[:mid], groups[mid:]):
        flat = [x for g in half for x in g]
        try:
            seqs, logits = runner.run(flat, kv)
        except Exception as e:
            _bisect(runner, kv, half, e, blamed, pieces)
            continue
        pieces.append((seqs, logits, flat))


def sample(runner, seqs: list[Sequence], logits: torch.Tensor, blamed: dict[str, str], streak: Streak,
           eos_token_ids, grammars):
    """(the sequences sampled, their SampleResult) by runner.sample. Requests whose rows fail
    alone go into `blamed`."""
    # a seeded draw must not depend on a retry: keep the generators' state to put it back
    saved = [(s.generator, s.generator.get_state()) for s in seqs
             if s.generator is not None and s.params.seed is not None]
    try:
        return seqs, runner.sample(logits, [s.params for s in seqs], [s.generator for s in seqs], seqs,
                                   eos_token_ids, grammars)
    except Exception as e:
        first = e
    for g, state in saved:
        g.set_state(state)
    kept: list[Sequence] = []
    tokens: list[int] = []
    lps: list = []
    result = None
    for rows in _by_request(list(enumerate(seqs)), lambda x: x[1]):
        idx = torch.tensor([r for r, _ in rows], dtype=torch.long, device=logits.device)
        group = [s for _, s in rows]
        try:
            result = runner.sample(logits.index_select(0, idx), [s.params for s in group],
                                   [s.generator for s in group], group, eos_token_ids, grammars)
        except Exception as e:
            blamed[group[0].group.request_id] = describe(e)
            continue
        kept += group
        tokens += result.token_ids
        lps += result.logprobs
    _check_attributable(runner, streak, bool(kept), first)
    if result is None:
        return [], None
    return kept, type(result)(tokens, lps)
