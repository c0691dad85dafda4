"""Guided output is well-formed UTF-8: what xgrammar's byte-level matcher lets through and a
strict decoder refuses, taken out of the packed token bitmask.

xgrammar 0.2.9 reads a character class ([^"\\], `.`, [^a]) over the bytes with a UTF-8 decoder
that takes an encoded surrogate (ED A0..BF xx, U+D800..U+DFFF, which UTF-8 forbids) as one
character. A JSON string of maxLength 5 came back as ',ift' and a surrogate's 3 bytes: 5
characters to the grammar, ',ift' and three U+FFFD (7) to Python's decoder and the detokenizer,
so jsonschema refused it.
Its other refusals (overlongs, above U+10FFFF, C0/C1/F5..FF, stray continuation bytes, cut
sequences) agree with Python's; tests/engine/test_guided_utf8.py checks both, byte by byte.

The rule checked here (Unicode Table 3-7): a well-formed sequence is a lead byte and 1-3
continuation bytes 80..BF, but the byte after 4 of the leads has a narrower range, and some
bytes never occur:

    lead   E0       ED       F0       F4        never: C0 C1 F5..FF
    next   A0..BF   80..9F   90..BF   80..8F

Checked on the token's own bytes once (`allowed`), and across the boundary when the output so
far ends on one of the 4 leads: then only tokens whose first byte is in that lead's range
(`after_lead`). Per step that is one AND of int32 words for the batch, and one more for the
rows that end on such a lead. The count of continuation bytes is left to xgrammar (it gets that
right).
Why not mend the grammar's classes instead: a user's regex or EBNF is not ours to rewrite, and
the mask holds for every kind of grammar at once.
"""

from __future__ import annotations

import re

import torch

SECOND_BYTE = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}
# a byte that never occurs, or one of the 4 leads followed by a byte outside its range (a lead
# that ends the token is left to the next token: `after_lead`)
ILL_FORMED = re.compile(rb"[\xc0\xc1\xf5-\xff]" + b"".join(b"|%c(?=[^%c-%c])" % (lead, lo, hi)
                                                      for lead, (lo, hi) in SECOND_BYTE.items()))


def pack(allowed: list[bool]) -> torch.Tensor:
    """int32 [ceil(n / 32)]: xgrammar's packed layout, token t is bit t % 32 of word t // 32."""
    bits = torch.tensor(allowed + [False] * (-len(allowed) % 32), dtype=torch.int64).reshape(-1, 32)
    words = (bits << torch.arange(32)).sum(1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


class Utf8Mask:
    """The tokens that keep an output well-formed UTF-8, for one tokenizer's decoded vocabulary
    (xgrammar's TokenizerInfo.decoded_vocab: each token's bytes)."""

    def __init__(self, decoded_vocab: list[bytes], vocab_size: int) -> None:
        vocab = list(decoded_vocab[:vocab_size]) + [b""] * (vocab_size - len(decoded_vocab))
        ok = [ILL_FORMED.search(b) is None for b in vocab]
        self.allowed = pack(ok)
        # a token with no bytes (padding past the tokenizer's) leaves the lead open: xgrammar decides
        self.after_lead = {lead: pack([o and (not b or lo <= b[0] <= hi) for o, b in zip(ok, vocab)])
                           for lead, (lo, hi) in SECOND_BYTE.items()}
        self._last_byte = [b[-1] if b else None for b in vocab]

    def pending_lead(self, token_ids: list[int], start: int) -> int | None:
        """The lead byte the output token_ids[start:] ends on when it is one of SECOND_BYTE's."""
        for i in range(len(token_ids) - 1, start - 1, -1):
            t = token_ids[i]
            last = self._last_byte[t] if 0 <= t < len(self._last_byte) else None
            if last is not None:
                return last if last in SECOND_BYTE else None
        return None

    def restrict(self, bitmask: torch.Tensor, seqs: list) -> list[int]:
        """bitmask (int32 [len(seqs), words], xgrammar's) &= what keeps each sequence's output
        well-formed; `seqs` have token_ids and num_prompt_tokens (only the output's end is read).
        Returns the rows it narrowed after a lead that are left with no token (a grammar that
        allows only ill-formed bytes there): the caller decides."""
        bitmask &= self.allowed
        pending: dict[int, list[int]] = {}
        for i, s in enumerate(seqs):
            lead = self.pending_lead(s.token_ids, s.num_prompt_tokens)
            if lead is not None:
                pending.setdefault(lead, []).append(i)
        empty: list[int] = []
        for lead, rows in pending.items():
            idx = torch.tensor(rows)
            narrowed = bitmask[idx] & self.after_lead[lead]
            bitmask[idx] = narrowed
            empty += [r for r, ok in zip(rows, narrowed.any(dim=1).tolist()) if not ok]
        return empty
