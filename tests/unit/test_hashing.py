"""The prefix-block hash chain is a cross-process contract (workers publish it, the router
looks it up): its digests are pinned here, and the fast paths equal the spec below."""

import hashlib
import struct

from hypothesis import given, settings
from hypothesis import strategies as st

from folio.worker.hashing import DEFAULT_HASH_SEED, hash_block, hash_full_blocks


def spec_block(parent, tokens, seed=DEFAULT_HASH_SEED, salt=None):
    """hash(block) = keyed BLAKE2b-128 over the parent digest (the first block's: 16 zero bytes, or
    with a cache_salt its BLAKE2b-128 keyed "folio-cache-salt") then the tokens as little-endian int64."""
    first = b"\0" * 16 if salt is None else hashlib.blake2b(salt.encode(), digest_size=16,
                                                              key=b"folio-cache-salt").digest()
    data = (parent or first) + struct.pack(f"<{len(tokens)}q", *tokens)
    return hashlib.blake2b(data, digest_size=16, key=seed).digest()


def test_digests_are_pinned():
    # computed with the implementation the workers in the field run (any change breaks routing)
    assert hash_block(None, [1, 2, 3]).hex() == "e4adf08a3b0e5ceef5b0a76b6b5ecf83"
    assert hash_block(b"\x01" * 16, list(range(16))).hex() == "4363a239613a16e9e9158e9f6586bf76"
    assert hash_block(None, [0, -1, 2**63 - 1, -(2**63)], seed=b"x").hex() == "38de4cc85ede67dc565f23dd7d42ede7"
    assert hash_block(None, []).hex() == "2231ca970490cdccdb7880e552e27cf2"
    assert [h.hex() for h in hash_full_blocks(list(range(40)), 16)] == [
        "fd14b64fff9486872021aeec6315877e", "7c199ad24931c3893b7863f2a1648637"]
    assert [h.hex() for h in hash_full_blocks([7] * 33, 16, b"other-seed")] == [
        "39caff464ed31def47dedf5f5a8e2f7d", "a64743554bc56c18b0fd24e1451dd3d9"]
    assert hash_full_blocks([1, 2, 3], 16) == []


tokens = st.lists(st.integers(-(2**63), 2**63 - 1), max_size=200)


@settings(max_examples=300, deadline=None)
@given(tokens, st.integers(1, 40), st.sampled_from([DEFAULT_HASH_SEED, b"", b"s" * 64]),
       st.none() | st.text(min_size=1, max_size=20))
def test_the_chain_equals_the_spec(toks, block_size, seed, salt):
    want, parent = [], None
    for j in range(len(toks) // block_size):
        parent = spec_block(parent, toks[j * block_size : (j + 1) * block_size], seed, salt)
        want.append(parent)
    assert hash_full_blocks(toks, block_size, seed, salt) == want
    # the engine's per-block path (block_manager) gives the same chain
    got, parent = [], None
    for j in range(len(toks) // block_size):
        parent = hash_block(parent, tuple(toks[j * block_size : (j + 1) * block_size]), seed, salt)
        got.append(parent)
    assert got == want
    if want and salt is not None:  # a salt names other blocks than no salt, and than another salt
        assert not set(want) & set(hash_full_blocks(toks, block_size, seed))
        assert not set(want) & set(hash_full_blocks(toks, block_size, seed, salt + "x"))
