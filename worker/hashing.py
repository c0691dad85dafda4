"""Prefix-block hashing, shared by workers and the router so hashes agree across processes.

    hash(block j) = H(seed, hash(block j-1), tokens of block j)

A hash names a candidate only: a cache hit is confirmed by comparing the tokens
stored with the block (block_pool.py), never by trusting the hash.
"""

from __future__ import annotations

import hashlib
from array import array

# Explicit, fixed seed: Python's hash() of str/bytes is randomized per process.
DEFAULT_HASH_SEED = b"folio-prefix-v1"

BlockHash = bytes  # 16-byte digest


def hash_block(parent: BlockHash | None, tokens: list[int] | tuple[int, ...], seed: bytes = DEFAULT_HASH_SEED) -> BlockHash:
    h = hashlib.blake2b(digest_size=16, key=seed)
    h.update(parent or b"\0" * 16)
    h.update(array("q", tokens).tobytes())
    return h.digest()


def hash_full_blocks(tokens: list[int], block_size: int, seed: bytes = DEFAULT_HASH_SEED) -> list[BlockHash]:
    """Chained hashes of every full block of `tokens`."""
    out: list[BlockHash] = []
    parent = None
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash_block(parent, tokens[start : start + block_size], seed)
        out.append(parent)
    return out
