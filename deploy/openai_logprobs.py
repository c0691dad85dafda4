"""Logprobs in OpenAI's shapes, from the engine's per-token {chosen id: logprob, top ids...}
entries: completions' {"tokens", "token_logprobs", "top_logprobs", "text_offset"} and chat's
{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}. `return_tokens_as_token_ids`
(vLLM) names tokens "token_id:<id>".

text_offset is each token's character offset in the choice's text (an echoed prompt
included): a delta's text starts where the text so far ends (`Choice` keeps the spans), and a
token inside a delta of several sits after the text the delta's tokens before it add when
decoded in sequence (a special token adds none), clipped to the delta's text (text cut by a
stop string starts where the delta's text ends).
"""

from __future__ import annotations


def _top(d: dict, k: int) -> list[tuple[int, float]]:
    """The k most likely tokens of a step (the engine sends the chosen token plus the top k)."""
    return sorted(d.items(), key=lambda kv: -kv[1])[:k]


def _token_text(tok, as_ids: bool):
    return (lambda t: f"token_id:{t}") if as_ids else (lambda t: tok.decode([t]))


def logprobs_completion(tok, entries: list[dict], k: int, spans: list[tuple[int, int, int]],
                        as_ids: bool = False) -> dict:
    """spans: (offset, characters, tokens) of each delta the entries came in, in order: a token's
    text_offset is where its delta's text starts in the choice's text plus the text of the
    delta's tokens before it (clipped to the delta's text: a held-back or stop-cut token's text
    starts where the delta's ends)."""
    text = _token_text(tok, as_ids)
    tokens, lps, tops, offsets = [], [], [], []
    for d in entries:
        chosen = next(iter(d))
        tokens.append(text(chosen))
        lps.append(d[chosen])
        # an echoed prompt's first token: nothing predicts it (null, as OpenAI and vLLM)
        tops.append(None if d[chosen] is None else {text(t): lp for t, lp in _top(d, k)})
    ids = [next(iter(d)) for d in entries]
    at = 0
    for offset, chars, count in spans:
        inner = 0
        for n in _span_lengths(tok, ids[at:at + count], chars):
            offsets.append(offset + min(inner, chars))
            inner += n
        at += count
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def joined(first: dict, then: dict) -> dict:
    """Two parts of one choice's completions logprobs (an echo's, then its text's), as one."""
    return {key: first[key] + then[key] for key in first}


def _span_lengths(tok, ids: list[int], chars: int) -> list[int]:
    """How many characters each token adds to a span's text (`chars` long) when the span's ids
    are decoded in sequence (a token inside a character: none until the one that completes it).
    A token decoded alone says otherwise: a SentencePiece word's leading space is dropped, and a
    text prompt's echo has no "<s>" (a token-id prompt's echo is decoded with it): special tokens
    count as the span's text has them."""
    from tokenizers.decoders import DecodeStream

    first = None
    for skip in (True, False):
        stream, backend, out = DecodeStream(skip_special_tokens=skip), tok.backend_tokenizer, []
        for t in ids:
            try:
                out.append(len(stream.step(backend, t) or ""))
            except Exception:  # noqa: BLE001 - an id the tokenizer cannot decode adds no text
                out.append(0)
        if sum(out) == chars:
            return out
        first = first or out
    return first  # neither adds up (a stop string cut the text): clipped by the caller


def logprobs_chat(tok, entries: list[dict], k: int, as_ids: bool = False) -> dict:
    text = _token_text(tok, as_ids)

    def item(t, lp):
        s = text(t)
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}
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

    def add(self, d) -> None:
        if d.logprobs:
            self.entries.extend(d.logprobs)
            self.spans.append((self.length, len(d.text), len(d.logprobs)))
        self.texts.append(d.text)
        self.length += len(d.text)
        if d.finish_reason:
            self.reason = d.finish_reason
