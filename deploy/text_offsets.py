"""Completions' text_offset: where each generated token's text starts in its choice's text.

The frontend's text stream (worker/detokenizer.py's TextStream) decodes a choice's ids with one
DecodeStream, primed with its prompt's tail, and hands text out in deltas; a delta may hold
back text that could begin a stop string, and the next delta starts with it. `TextOffsets`
follows one choice the same way, delta by delta:

- one DecodeStream, primed as the text stream's, steps through the choice's ids: a token adds
  what the text stream got from it (nothing while its character is unfinished; a token that
  completes a character begun in an earlier token or delta, a byte-level piece of an emoji or
  a CJK character, adds that character; a SentencePiece word keeps its leading space);
- text held back from earlier deltas comes first in a delta's text; a token's offset is where
  its text starts in the choice's text, in whichever delta that text goes out (vLLM's, and
  `text[offset:offset + len(token)] == token`). They were clipped to the token's own delta,
  so a token whose text a stop string held back pointed at its delta's end: 3 of 8 offsets
  wrong for `stop: "akSet"` against vLLM's (a differential test, 2026-12-07). A token at or
  after a stop string's cut points at or past the text's end, as vLLM's do.

Decoding each delta's ids alone (what this replaced) put every token after a character split
over two deltas one character early.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream


class TextOffsets:
    """One choice's text_offset, delta by delta. Not thread-safe: one per choice, its deltas
    in order."""

    def __init__(self, prompt_tail: list[int] | tuple = (), skip_special_tokens: bool | None = None) -> None:
        self.prompt_tail = list(prompt_tail)
        self.skip = skip_special_tokens  # None: whichever makes a delta's tokens add up to its text
        self.stream = None if skip_special_tokens is None else DecodeStream(ids=self.prompt_tail,
                                                                          skip_special_tokens=skip_special_tokens)
        self.held = 0  # characters the tokens so far made that no delta's text has carried yet

    def offsets(self, tok, ids: list[int], offset: int, chars: int) -> list[int]:
        """text_offset of a delta's tokens, its text `chars` long from `offset` in the choice's
        text (ids may be empty: a delta of held-back text only)."""
        if self.stream is not None:
            lengths = _step(tok, self.stream, ids)
        else:  # an echoed prompt: one delta, special tokens as its text has them
            tries = [_step(tok, DecodeStream(ids=self.prompt_tail, skip_special_tokens=s), ids) for s in (True, False)]
            lengths = next((t for t in tries if sum(t) == chars - self.held), tries[0])
        out, inner = [], self.held
        for n in lengths:
            # an echoed prompt (one delta) is clipped to its text; generated text is where it goes out
            out.append(offset + (min(inner, chars) if self.stream is None else inner))
            inner += n
        self.held = max(0, self.held + sum(lengths) - chars)  # what a stop string cut stays cut
        return out


def _step(tok, stream: DecodeStream, ids: list[int]) -> list[int]:
    """Characters each id adds to the stream's text."""
    out = []
    for t in ids:
        try:
            out.append(len(stream.step(tok.backend_tokenizer, t) or ""))
        except Exception:  # noqa: BLE001 - an id the tokenizer cannot decode adds no text
            out.append(0)
    return out
