"""Logprobs in OpenAI's shapes, from the engine's per-token {chosen id: logprob, top ids...}
entries: completions' {"tokens", "token_logprobs", "top_logprobs", "text_offset"} and chat's
{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}, `bytes` each token's own
(deploy/token_bytes.py). `return_tokens_as_token_ids`
(vLLM) names tokens "token_id:<id>".

text_offset: deploy/text_offsets.py.
"""

from __future__ import annotations

import functools

from folio.deploy.text_offsets import TextOffsets
from folio.deploy.token_bytes import TokenBytes


def _top(d: dict, k: int) -> list[tuple[int, float]]:
    """The k most likely tokens of a step (the engine sends the chosen token plus the top k)."""
    return sorted(d.items(), key=lambda kv: -kv[1])[:k]


def _token_text(tok, as_ids: bool):
    return (lambda t: f"token_id:{t}") if as_ids else (lambda t: tok.decode([t]))


def logprobs_completion(tok, entries: list[dict], k: int, spans: list[tuple[int, int, int]],
                        as_ids: bool = False, offsets: TextOffsets | None = None) -> dict:
    """spans: (offset, characters, tokens) of each delta the entries came in, in order (a delta
    of text only has 0 tokens); offsets: the choice's TextOffsets (a stream's, kept from delta
    to delta), else one with no context (an echoed prompt)."""
    text = _token_text(tok, as_ids)
    tokens, lps, tops, where = [], [], [], []
    for d in entries:
        chosen = next(iter(d))
        tokens.append(text(chosen))
        lps.append(d[chosen])
        # an echoed prompt's first token: nothing predicts it (null, as OpenAI and vLLM); else the top k and the
        # token itself, as the legacy API promises ("up to logprobs + 1") and vLLM does: it was the top k alone, so
        # logprobs 0 gave {} and top_logprobs[i][token] failed for a token outside them (a differential test).
        # The token last: where two ids read the same ("\ufffd", a character's partial bytes) its own logprob wins
        tops.append(None if d[chosen] is None else {text(t): lp for t, lp in _top(d, k) + [(chosen, d[chosen])]})
    ids, at = [next(iter(d)) for d in entries], 0
    offsets = offsets or TextOffsets()
    for offset, chars, count in spans:
        where.extend(offsets.offsets(tok, ids[at:at + count], offset, chars))
        at += count
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": where}


def joined(first: dict, then: dict) -> dict:
    """Two parts of one choice's completions logprobs (an echo's, then its text's), as one."""
    return {key: first[key] + then[key] for key in first}


@functools.lru_cache(maxsize=8)
def _token_bytes(tok) -> TokenBytes:
    return TokenBytes(tok)


def logprobs_chat(tok, entries: list[dict], k: int, as_ids: bool = False) -> dict:
    text = _token_text(tok, as_ids)
    own = _token_bytes(tok)  # a token's own bytes: one holding part of a character decodes to "\ufffd" alone

    def item(t, lp):
        s = text(t)
        return {"token": s, "logprob": lp, "bytes": own(t)}  # (named "token_id:N" too: vLLM's bytes are the token's)
    content = []
    for d in entries:
        chosen = next(iter(d))
        content.append({**item(chosen, d[chosen]), "top_logprobs": [item(t, lp) for t, lp in _top(d, k)]})
    return {"content": content}


def prompt_entries(prompt_ids: list[int], prompt_logprobs: list | None) -> list[dict]:
    """The engine's prompt logprobs (the first None) as completion entries: {token id: logprob
    (None for the first), top ids...}."""
    if prompt_logprobs is None:
        return []
    return [{prompt_ids[0]: None}] + list(prompt_logprobs[1:])


class Choice:
    """One choice's text so far and where each delta's text sits in it (for text_offset)."""

    def __init__(self, prefix: str = "") -> None:
        self.texts, self.length, self.entries, self.spans, self.reason = [prefix], len(prefix), [], [], None
        self.stop_reason = None  # the stop string or stop token id that ended it (vLLM's field)
        self.token_ids: list[int] = []  # (vLLM's return_token_ids)

    def add(self, d) -> None:
        self.token_ids.extend(d.token_ids)
        if d.logprobs or d.text:
            self.entries.extend(d.logprobs or [])
            self.spans.append((self.length, len(d.text), len(d.logprobs or [])))
        self.texts.append(d.text)
        self.length += len(d.text)
        if d.finish_reason:
            self.reason, self.stop_reason = d.finish_reason, d.stop_reason
