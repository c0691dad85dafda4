"""Per-sequence KV memory: block tables on top of a block pool (paged) or one
contiguous reservation per sequence (the naive baseline), behind one interface.

Contract (both managers):
- `allocate_slots(seq, n, computed_blocks)` makes room for n more tokens of
  `seq` after its computed ones, or returns False and changes nothing.
- `free(seq)` releases every block of `seq`; calling it twice is harmless.
- `fork(parent, child)` gives `child` the parent's KV; returns False if it cannot.
- `take_copies()` returns the (src, dst) block copies that must run before the
  next forward (copy-on-write), and forgets them.
- A block table is valid only until the next call that changes it.
"""

from __future__ import annotations

from typing import Protocol

from folio.worker.block_pool import BlockPool
from folio.worker.hashing import DEFAULT_HASH_SEED, BlockHash, hash_block
from folio.worker.sequence import Sequence
from folio.worker.swap_space import SwapSpace


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager(Protocol):
    block_size: int
    num_blocks: int
    prefix_queries: int  # blocks looked up in the prefix cache (0 without one)
    prefix_hits: int  # blocks found there

    def get_computed_blocks(self, seq: Sequence, count: bool = True) -> tuple[list[int], int]: ...
    def allocate_slots(self, seq: Sequence, num_new_tokens: int, computed_blocks: list[int] = ...,
                       reserve: int = 0) -> bool: ...
    def free(self, seq: Sequence) -> None: ...
    def fork(self, parent: Sequence, child: Sequence) -> bool: ...
    def cache_blocks(self, seq: Sequence) -> None: ...
    def block_table(self, seq: Sequence) -> list[int]: ...
    def take_copies(self) -> list[tuple[int, int]]: ...
    def swap_out(self, seq: Sequence) -> bool: ...
    def swap_in(self, seq: Sequence, reserve: int = 0) -> bool: ...
    def swapped_blocks(self, seq: Sequence) -> int: ...
    def host_block_table(self, seq: Sequence) -> list[int]: ...  # a swapped sequence's swap-space blocks
    def adopt_swapped(self, seq: Sequence, num_blocks: int) -> list[int] | None: ...  # see SwapSpace.adopt
    def take_swaps(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]: ...
    def max_blocks_per_seq(self, num_tokens: int) -> int: ...
    @property
    def num_free_blocks(self) -> int: ...
    @property
    def usage(self) -> float: ...
    @property
    def num_free_cpu_blocks(self) -> int: ...  # free blocks of the swap space (0 without one)
    @property
    def cpu_usage(self) -> float: ...  # swap-space blocks in use / all (0.0 without one)
    def slot_stats(self, seqs: list[Sequence]) -> tuple[int, int]: ...
    def check_invariants(self, seqs: list[Sequence]) -> None: ...
    def cached_block_hashes(self) -> set[BlockHash]: ...
    def prefix_cache_changes(self) -> tuple[dict[BlockHash, bool], bool]: ...


class PagedKVManager:
    """Block tables over a shared pool, with automatic prefix caching."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 hash_seed: bytes = DEFAULT_HASH_SEED, num_cpu_blocks: int = 0) -> None:
        self.num_blocks = num_blocks
        self.swap = SwapSpace(num_cpu_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_seed = hash_seed
        self.pool = BlockPool(num_blocks)
        self.tables: dict[int, list[int]] = {}
        self.num_cached: dict[int, int] = {}  # seq_id -> leading blocks already registered
        self._copies: list[tuple[int, int]] = []
        self.prefix_queries = 0  # blocks looked up
        self.prefix_hits = 0  # blocks found

    # ---- prefix cache ------------------------------------------------------------------
    def _ensure_hashes(self, seq: Sequence, n: int) -> None:
        B, hashes, toks = self.block_size, seq.block_hashes, seq.token_ids
        while len(hashes) < n:
            j = len(hashes)
            hashes.append(hash_block(hashes[-1] if j else None, toks[j * B : (j + 1) * B], self.hash_seed,
                                     seq.params.cache_salt))

    def cached_block_hashes(self) -> set[BlockHash]:
        """Every prefix block hash this cache can serve now (O(cached blocks): for a resync)."""
        return set(self.pool.cached) if self.enable_prefix_caching else set()

    def prefix_cache_changes(self) -> tuple[dict[BlockHash, bool], bool]:
        """The prefix hashes stored (True) or removed (False) since the last call, and whether
        the caller must resync from `cached_block_hashes()` instead (the first call, an overflow)."""
        if not self.enable_prefix_caching:
            return {}, False
        return self.pool.drain_events()

    def get_computed_blocks(self, seq: Sequence, count: bool = True) -> tuple[list[int], int]:
        """Cached blocks holding a prefix of `seq` (no reference taken yet) and the tokens they cover;
        `count=False`: a look that the prefix-cache hit rate does not count (the request is not
        admitted by it).

        At least the last token is always left to compute: its logits are needed.
        """
        if not self.enable_prefix_caching:
            return [], 0
        B = self.block_size
        max_blocks = (seq.num_tokens - 1) // B
        # a request that wants its prompt's logprobs computes every position it has none for yet
        # (position j gives token j + 1's): cached blocks may only cover those it has
        done = seq.group.prompt_logprobs_done
        if done < len(seq.group.prompt_token_ids):
            max_blocks = min(max_blocks, (done - 1) // B)
        self._ensure_hashes(seq, max_blocks)
        hits: list[int] = []
        for j in range(max_blocks):
            b = self.pool.lookup(seq.block_hashes[j], tuple(seq.token_ids[j * B : (j + 1) * B]))
            if b is None:
                break
            hits.append(b)
        if count:
            self.prefix_queries += max_blocks
            self.prefix_hits += len(hits)
        return hits, len(hits) * B

    def cache_blocks(self, seq: Sequence) -> None:
        """Register the blocks of `seq` that are full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        table = self.tables.get(seq.seq_id)
        if table is None:
            return
        B = self.block_size
        full = seq.num_computed_tokens // B
        start = self.num_cached.get(seq.seq_id, 0)
        if full <= start:
            return
        self._ensure_hashes(seq, full)
        for j in range(start, full):
            self.pool.cache(table[j], seq.block_hashes[j], tuple(seq.token_ids[j * B : (j + 1) * B]))
        self.num_cached[seq.seq_id] = full

    # ---- allocation --------------------------------------------------------------------
    def allocate_slots(self, seq: Sequence, num_new_tokens: int, computed_blocks: list[int] = (),
                       reserve: int = 0) -> bool:
        """Room for `num_new_tokens` after the computed ones; `reserve` blocks must stay free."""
        B, pool = self.block_size, self.pool
        table = self.tables.get(seq.seq_id)
        if table is None:
            table = []
        num_computed = len(computed_blocks) * B if computed_blocks else seq.num_computed_tokens
        need = cdiv(num_computed + num_new_tokens, B) - len(table) - len(computed_blocks)
        # Writing into a partial block that a fork shares: copy it first.
        j = num_computed // B
        cow = num_new_tokens > 0 and j < len(table) and pool.ref_cnt[table[j]] > 1
        revived = sum(1 for b in computed_blocks if pool.ref_cnt[b] == 0)  # leave the free queue
        if max(need, 0) + cow + reserve > pool.num_free - revived:
            return False
        if computed_blocks:
            pool.touch(computed_blocks)
            table.extend(computed_blocks)
            self.num_cached[seq.seq_id] = len(computed_blocks)
        if cow:
            new = pool.allocate(1)[0]
            self._copies.append((table[j], new))
            pool.free([table[j]])
            table[j] = new
        if need > 0:
            table.extend(pool.allocate(need))
        self.tables[seq.seq_id] = table
        return True

    def free(self, seq: Sequence) -> None:
        """Release everything `seq` holds: device blocks and host (swap) blocks."""
        self._free_device(seq)
        self.swap.drop(seq.seq_id)

    def _free_device(self, seq: Sequence) -> None:
        table = self.tables.pop(seq.seq_id, None)
        self.num_cached.pop(seq.seq_id, None)
        if table:
            self.pool.free(reversed(table))  # tail first: a request's last blocks are evicted first

    # ---- swapping (see swap_space.py for the copy ordering) ----------------------------
    def swap_out(self, seq: Sequence) -> bool:
        """Move `seq`'s KV to host blocks and free its device blocks; False (nothing
        changed) when the swap space cannot hold it. The caller must not have
        allocated for `seq` in this step (its pending writes would not be copied)."""
        table = self.tables.get(seq.seq_id)
        if not table or not self.swap.store(seq.seq_id, table):
            return False
        self._free_device(seq)
        return True

    def swap_in(self, seq: Sequence, reserve: int = 0) -> bool:
        """New device blocks for a swapped-out `seq`, filled from its host blocks before the
        next forward; False (nothing changed) unless `reserve` blocks stay free after."""
        n = len(self.swap.tables[seq.seq_id])
        if n + reserve > self.pool.num_free:
            return False
        device = self.pool.allocate(n)
        self.swap.load(seq.seq_id, device)
        self.tables[seq.seq_id] = device
        self.num_cached[seq.seq_id] = 0
        return True

    def swapped_blocks(self, seq: Sequence) -> int:
        return len(self.swap.tables[seq.seq_id])

    def host_block_table(self, seq: Sequence) -> list[int]:
        return self.swap.tables[seq.seq_id]

    def adopt_swapped(self, seq: Sequence, num_blocks: int) -> list[int] | None:
        """Swap-space blocks for `seq`, as if it had been swapped out (an imported request's KV
        is written there); None when they do not fit."""
        return self.swap.adopt(seq.seq_id, num_blocks)

    def take_swaps(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        return self.swap.take_swaps()

    def fork(self, parent: Sequence, child: Sequence) -> bool:
        table = self.tables[parent.seq_id]
        self.pool.touch(table)
        self.tables[child.seq_id] = list(table)
        self.num_cached[child.seq_id] = self.num_cached.get(parent.seq_id, 0)
        child.block_hashes = list(parent.block_hashes)
        return True

    def block_table(self, seq: Sequence) -> list[int]:
        return self.tables[seq.seq_id]

    def take_copies(self) -> list[tuple[int, int]]:
        out, self._copies = self._copies, []
        return out

    def max_blocks_per_seq(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    # ---- figures -----------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.num_blocks

    @property
    def num_free_cpu_blocks(self) -> int:
        return self.swap.num_free

    @property
    def cpu_usage(self) -> float:
        return self.swap.usage

    def slot_stats(self, seqs: list[Sequence]) -> tuple[int, int]:
        """(slots holding a computed token, slots in blocks owned by live sequences), shared blocks once."""
        B = self.block_size
        filled: dict[int, int] = {}
        for s in seqs:
            table = self.tables.get(s.seq_id)
            if not table:
                continue
            n = s.num_computed_tokens
            for j, b in enumerate(table):
                f = min(B, max(0, n - j * B))
                if f > filled.get(b, -1):
                    filled[b] = f
        return sum(filled.values()), len(filled) * B

    def check_invariants(self, seqs: list[Sequence]) -> None:
        live = {s.seq_id for s in seqs}
        assert set(self.tables) <= live, f"tables for dead sequences: {set(self.tables) - live}"
        assert not set(self.tables) & set(self.swap.tables), "a sequence holds device and host blocks"
        self.swap.check_invariants(live)
        refs = [0] * self.num_blocks
        for sid, table in self.tables.items():
            assert len(set(table)) == len(table), f"sequence {sid} holds a block twice"
            for b in table:
                refs[b] += 1
        self.pool.check_invariants(refs)
        for s in seqs:
            if s.seq_id in self.tables:
                assert len(self.tables[s.seq_id]) * self.block_size >= s.num_computed_tokens
