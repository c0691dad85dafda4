"""Prefix-block hashing, shared by workers and the router so hashes agree across processes.

    hash(block j) = H(seed, hash(block j-1), tokens of block j)

H is keyed BLAKE2b with a 16-byte digest over the parent's digest (16 zero bytes for the
first block; with a request's `cache_salt`, vLLM's tenant isolation, the salt's own digest)
followed by the block's token ids as native int64 (array "q"): requests of different salts
never name the same blocks, so one tenant cannot time another's cached prefixes.
A hash names a candidate only: a cache hit is confirmed by comparing the tokens
stored with the block (block_pool.py), never by trusting the hash.

Speed (the router hashes every prompt it routes prefix-aware): the keyed state is made
once per seed and copied per block, and a prompt's full blocks are converted to bytes
in one go; the digests are the same as hashing each block from scratch
(tests/unit/test_hashing.py pins them).
"""

from __future__ import annotations

import hashlib
from array import array
from functools import lru_cache

# Explicit, fixed seed: Python's hash() of str/bytes is randomized per process.
DEFAULT_HASH_SEED = b"folio-prefix-v1"

BlockHash = bytes  # 16-byte digest
_NO_PARENT = b"\0" * 16
_INT64 = array("q").itemsize  # 8


@lru_cache(maxsize=16)
def _keyed(seed: bytes):
    """BLAKE2b already keyed with `seed`: .copy() skips the key block per hash."""
    return hashlib.blake2b(digest_size=16, key=seed)


@lru_cache(maxsize=1024)
def _first_parent(salt: str | None) -> bytes:
    """The first block's parent: none, or the salt's digest (under a key of its own)."""
    if salt is None:
        return _NO_PARENT
    return hashlib.blake2b(salt.encode("utf-8", "surrogatepass"), digest_size=16, key=b"folio-cache-salt").digest()


def hash_block(parent: BlockHash | None, tokens: list[int] | tuple[int, ...], seed: bytes = DEFAULT_HASH_SEED,
               salt: str | None = None) -> BlockHash:
    h = _keyed(seed).copy()
    h.update(parent or _first_parent(salt))
    h.update(array("q", tokens))
    return h.digest()


def hash_full_blocks(tokens: list[int], block_size: int, seed: bytes = DEFAULT_HASH_SEED,
                     salt: str | None = None) -> list[BlockHash]:
    """Chained hashes of every full block of `tokens` (the partial tail block is not read)."""
    n = len(tokens) // block_size
    if n <= 0:
        return []
    data = memoryview(array("q", tokens[: n * block_size])).cast("B")
    step = block_size * _INT64
    base = _keyed(seed)
    out: list[BlockHash] = []
    parent = _first_parent(salt)
    for off in range(0, n * step, step):
        h = base.copy()
        h.update(parent)
        h.update(data[off : off + step])
        parent = h.digest()
        out.append(parent)
    return out
