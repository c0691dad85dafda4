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

A request that fails alone is blamed only while the engine is healthy: a probe forward
of one dummy token (its KV write skipped: slot -1) must still pass. If it does not (a
device error, a broken kernel), or the batch fails and no request does alone, nothing
can be blamed and EngineFailedError says the worker must go.
"""

from __future__ import annotations

import traceback

import torch

from folio import kernels
from folio.worker.errors import EngineFailedError
from folio.worker.models.llama import AttentionMetadata
from folio.worker.sequence import Sequence

Scheduled = list[tuple[Sequence, int]]


def describe(e: BaseException) -> str:
    """One line for the client: the exception's type and message, no traceback."""
    line = traceback.format_exception_only(type(e), e)[-1].strip()
    return line[:500]


def _by_request(items: list, key) -> list[list]:
    groups: dict[str, list] = {}
    for it in items:
        groups.setdefault(key(it).group.request_id, []).append(it)
    return list(groups.values())


def engine_healthy(engine) -> bool:
    """A forward of one dummy token that writes no KV: False if the engine itself is broken."""
    try:
        dev, runner = engine.device, engine.runner
        meta = AttentionMetadata(slot_mapping=torch.tensor([-1], dtype=torch.long, device=dev),
                                 block_tables=torch.zeros((1, 1), dtype=torch.int32, device=dev),
                                 seq_lens=torch.ones(1, dtype=torch.int32, device=dev),
                                 query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=dev))
        model = engine.model
        meta.plan = model.ops.plan_attention(meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                             runner.block_size, kernels.kv_bytes_per_token(runner.kv_caches[0][0]))
        zero = torch.zeros(1, dtype=torch.long, device=dev)
        hidden = model.forward(zero, zero, meta, runner.kv_caches)
        model.compute_logits(hidden).float().sum().item()  # .item() syncs: a device error surfaces here
        return True
    except Exception:
        return False


MAX_ALL_BLAMED = 8  # failed phases in a row where every request failed alone: the engine is broken


def _check_attributable(engine, some_passed: bool, first: Exception) -> None:
    """Raise EngineFailedError unless blaming the requests that failed alone is sound: some
    requests passed, or all failed but the engine's probe passes (and that has not happened
    MAX_ALL_BLAMED times in a row: a fault no probe sees but every request hits)."""
    if some_passed:
        engine.num_all_blamed = 0
        return
    engine.num_all_blamed = getattr(engine, "num_all_blamed", 0) + 1
    if engine.num_all_blamed >= MAX_ALL_BLAMED or not engine_healthy(engine):
        raise EngineFailedError(f"a step failed and no request can be blamed: {describe(first)}") from first


def _run(engine, scheduled: Scheduled) -> tuple[list[Sequence], torch.Tensor | None]:
    inputs = engine.runner.prepare(scheduled, engine.kv)
    return inputs.sample_seqs, engine.runner.execute(inputs)


def forward(engine, scheduled: Scheduled, blamed: dict[str, str]):
    """Run the batch: (the sequences that sample, their logits or None, the sequences that
    ran). Requests that fail alone go into `blamed` (request id -> why)."""
    try:
        seqs, logits = _run(engine, scheduled)
        engine.num_all_blamed = 0
        return seqs, logits, scheduled
    except Exception as e:
        first = e
    pieces: list[tuple[list[Sequence], torch.Tensor | None, Scheduled]] = []
    _bisect(engine, _by_request(scheduled, lambda x: x[0]), first, blamed, pieces)
    _check_attributable(engine, bool(pieces), first)
    seqs = [s for p in pieces for s in p[0]]
    ran = [x for p in pieces for x in p[2]]
    parts = [p[1] for p in pieces if p[1] is not None]
    return seqs, (torch.cat(parts) if parts else None), ran


def _bisect(engine, groups: list[Scheduled], err: Exception, blamed: dict[str, str], pieces: list) -> None:
    """`groups` (one per request) failed together with `err`: run halves until the failing
    requests stand alone."""
    if len(groups) == 1:
        blamed[groups[0][0][0].group.request_id] = describe(err)
        return
    mid = len(groups) // 2
    for half in (groups[:mid], groups[mid:]):
        flat = [x for g in half for x in g]
        try:
            seqs, logits = _run(engine, flat)
        except Exception as e:
            _bisect(engine, half, e, blamed, pieces)
            continue
        pieces.append((seqs, logits, flat))


def sample(engine, sample_fn, seqs: list[Sequence], logits: torch.Tensor, blamed: dict[str, str]):
    """(the sequences sampled, their SampleResult). Requests whose rows fail alone go into `blamed`."""
    # a seeded draw must not depend on a retry: keep the generators' state to put it back
    saved = [(s.generator, s.generator.get_state()) for s in seqs
             if s.generator is not None and s.params.seed is not None]
    try:
        return seqs, sample_fn(logits, [s.params for s in seqs], [s.generator for s in seqs], seqs,
                               engine.eos_token_ids, engine.grammars)
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
            result = sample_fn(logits.index_select(0, idx), [s.params for s in group], [s.generator for s in group],
                               group, engine.eos_token_ids, engine.grammars)
        except Exception as e:
            blamed[group[0].group.request_id] = describe(e)
            continue
        kept += group
        tokens += result.token_ids
        lps += result.logprobs
    _check_attributable(engine, bool(kept), first)
    if result is None:
        return [], None
    return kept, type(result)(tokens, lps)
