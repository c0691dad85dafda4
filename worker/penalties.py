"""The repetition, frequency and presence penalties (logits_processing.py's last stage), from
each sequence's ids seen and their counts, kept as it grows.

The penalties look at a sequence's whole history: the repetition penalty at every id of its
prompt and output (HF's RepetitionPenaltyLogitsProcessor), the frequency and presence penalties
at its output's counts (OpenAI's). Read from the history every step, they cost a Python pass
over it a row a step: at 64 rows of 1,000 prompt and 1,000 output tokens the repetition penalty
added 27 ms and frequency + presence 56 ms to every step (`benchmarks/logits_processing.py`,
2026-12-07), more as the outputs grow. Here a sequence keeps `Seen`: its distinct ids in the
order first seen and each one's count in the output, as arrays, extended by the tokens added
since its last step (one a step, as a rule). A step then costs a gather and a scatter over the
ids seen, whatever the history's length.

The result is the same as from the history (tests/engine/test_logits_processing.py): a repeated id
reads and writes one value, and an id of the prompt alone (count 0) is left as it is. A Seen
follows one token list as it is appended to (the engine's only change to a sequence's
tokens); another list (or a shorter one) is followed afresh.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


class Seen:
    """One sequence's distinct ids (prompt, then output, in first-seen order) and each one's
    count in the output, over the first `done` tokens of its history."""

    __slots__ = ("src", "pos", "ids", "counts", "n", "done", "prompt_len")

    def __init__(self, token_ids: list[int], num_prompt_tokens: int) -> None:
        self.src = token_ids  # the list it follows: a history grows by appending to it (engine_outputs.py)
        self.pos: dict[int, int] = {}
        self.ids = np.empty(64, dtype=np.int64)
        self.counts = np.zeros(64, dtype=np.float32)
        self.n = self.done = 0
        self.prompt_len = num_prompt_tokens
        self._add(token_ids[:num_prompt_tokens], 0.0)
        self.done = num_prompt_tokens

    def update(self, token_ids: list[int]) -> None:
        if len(token_ids) > self.done:
            self._add(token_ids[self.done:], 1.0)
            self.done = len(token_ids)

    def _add(self, tokens: list[int], count: float) -> None:
        pos, ids, counts = self.pos, self.ids, self.counts
        for t in tokens:
            p = pos.get(t)
            if p is None:
                p = pos[t] = self.n
                self.n += 1
                if p == len(ids):
                    ids = self.ids = np.concatenate([ids, np.empty_like(ids)])
                    counts = self.counts = np.concatenate([counts, np.zeros_like(counts)])
                ids[p] = t
            counts[p] += count


def seen(history) -> Seen:
    """`history`'s Seen, brought up to date; kept on the history (a Sequence's `penalty_seen`)
    where it can be, else made afresh."""
    s = getattr(history, "penalty_seen", None)
    toks, n_prompt = history.token_ids, history.num_prompt_tokens
    if s is None or s.src is not toks or len(toks) < s.done or s.prompt_len != n_prompt:  # new, or another list
        s = Seen(toks, n_prompt)
        try:
            history.penalty_seen = s
        except AttributeError:  # a history that keeps nothing: its Seen made each step
            pass
    s.update(toks)
    return s


def _padded(states: list[Seen], vocab: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """([R, widest] ids, their counts): each row's seen ids, padded with its own last id and count
    (a repeated id reads and writes the same value, so the padding changes nothing)."""
    width = max(s.n for s in states)
    ids = np.empty((len(states), width), dtype=np.int64)
    counts = np.empty((len(states), width), dtype=np.float32)
    for k, s in enumerate(states):
        ids[k, :s.n], ids[k, s.n:] = s.ids[:s.n], s.ids[s.n - 1]
        counts[k, :s.n], counts[k, s.n:] = s.counts[:s.n], s.counts[s.n - 1]
    return (torch.from_numpy(ids).to(device).clamp_(0, vocab - 1), torch.from_numpy(counts).to(device))


def penalize(logits: torch.Tensor, rows: list[int], params: list, histories: Sequence) -> None:
    """The repetition, frequency and presence penalties of `rows`, in place on float32 logits
    [N, V]: one gather / scatter per kind over the rows that use it and the ids they have seen."""
    vocab, device = logits.shape[-1], logits.device
    rep = [i for i in rows if params[i].repetition_penalty != 1.0]
    pen = [i for i in rows if (params[i].presence_penalty or params[i].frequency_penalty)
           and len(histories[i].token_ids) > histories[i].num_prompt_tokens]
    states = {i: seen(histories[i]) for i in rep + pen if len(histories[i].token_ids)}
    rep = [i for i in rep if i in states]
    flat = logits.view(-1)  # (contiguous: the processed copy) one index per element, not a pair
    if rep:  # every id of the prompt and the output, once
        ids, _ = _padded([states[i] for i in rep], vocab, device)
        at = (torch.tensor(rep, device=device)[:, None] * vocab + ids).view(-1)
        f = torch.tensor([params[i].repetition_penalty for i in rep], dtype=logits.dtype, device=device)[:, None]
        v = flat[at].view(ids.shape)
        flat[at] = torch.where(v > 0, v / f, v * f).view(-1)
    if pen:  # logit -= count * frequency + (count > 0) * presence, over the output's ids
        ids, c = _padded([states[i] for i in pen], vocab, device)
        at = (torch.tensor(pen, device=device)[:, None] * vocab + ids).view(-1)
        freq = torch.tensor([params[i].frequency_penalty for i in pen], dtype=logits.dtype, device=device)[:, None]
        pres = torch.tensor([params[i].presence_penalty for i in pen], dtype=logits.dtype, device=device)[:, None]
        v = flat[at].view(ids.shape)
        flat[at] = torch.where(c > 0, v - freq * c.to(logits.dtype) - pres, v).view(-1)
