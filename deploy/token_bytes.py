"""A token's own UTF-8 bytes, for chat logprobs' `bytes`, which OpenAI documents as "useful in
instances where characters are represented by multiple tokens and their byte representations must
be combined to generate the correct text representation":

    tb = TokenBytes(tokenizer)
    tb(token_id)  # -> list[int]

A token holding part of a character decodes alone to "\\ufffd", whose 3 bytes (239, 191, 189) were
what `bytes` carried: the bytes of every token of a Chinese word or an emoji were those, and joined
they gave replacement characters, not the text. The bytes are read from the token's vocabulary
string instead: byte-level BPE (GPT-2's, Llama 3's, SmolLM2's) maps each byte to one printable
character, inverted here; SentencePiece vocabularies with byte fallback spell a lone byte
`<0xE6>` and a space `▁`. Added and special tokens are their text; a tokenizer of another kind
gives its decoded text, as before.
"""

from __future__ import annotations

import json
import re

_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_chars() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: the printable character each byte is written as."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _decoder_types(tok) -> set[str]:
    """The kinds of the fast tokenizer's decoder (a Sequence's parts included); none for a slow one."""
    backend = getattr(tok, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is None:
        return set()
    state = json.loads(decoder.__getstate__())
    return {d.get("type") for d in [state, *state.get("decoders", [])]}


class TokenBytes:
    def __init__(self, tok) -> None:
        self.tok = tok
        kinds = _decoder_types(tok)
        self.byte_level = _byte_level_chars() if "ByteLevel" in kinds else None
        self.byte_fallback = "ByteFallback" in kinds
        self.added = {i: t.content for i, t in getattr(tok, "added_tokens_decoder", {}).items()}
        self._cache: dict[int, list[int]] = {}

    def __call__(self, t: int) -> list[int]:
        got = self._cache.get(t)
        if got is None:
            got = self._cache[t] = list(self._bytes(t))
        return got

    def _bytes(self, t: int) -> bytes:
        if t in self.added:
            return self.added[t].encode()
        piece = self.tok.convert_ids_to_tokens(t)
        if piece is None:  # an id the vocabulary does not have: what decode makes of it
            return self.tok.decode([t]).encode()
        if self.byte_level is not None and all(c in self.byte_level for c in piece):
            return bytes(self.byte_level[c] for c in piece)
        if self.byte_fallback and (m := _BYTE.fullmatch(piece)):
            return bytes([int(m.group(1), 16)])
        if self.byte_fallback:
            return piece.replace("\u2581", " ").encode()
        return self.tok.decode([t]).encode()
