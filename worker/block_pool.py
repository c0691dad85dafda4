"""Physical KV blocks: ref counts, the prefix-cache map and the LRU free queue.

    free_queue (front = evicted first)
    +-----------+-----------+-----------+----------------------+
    | uncached  | uncached  | cached A3 | cached A2 | cached A1|  <- tail-first frees
    +-----------+-----------+-----------+----------------------+

A free block may still hold a cached prefix block: it stays findable through
`cached` until `allocate` takes it from the front of the queue and evicts it.
Blocks with no hash are put at the front (nothing is lost by reusing them).

With `record_events()` the pool also logs every hash it starts or stops caching
(vLLM's BlockStored / BlockRemoved events), so a heartbeat sends the prefix index's
changes in O(changes) instead of copying `cached` (O(cached blocks)) every time.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable

from folio.worker.hashing import BlockHash


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.cached: dict[BlockHash, int] = {}
        self.num_evictions = 0
        self._events: list[tuple[BlockHash, bool]] | None = None  # (hash, cached now?), oldest first
        self._events_lost = False

    @property
    def num_free(self) -> int:
        """Blocks that `allocate` can hand out now (cached-but-unused ones included)."""
        return len(self.free_queue)

    def allocate(self, n: int) -> list[int]:
        """Take n blocks from the front of the free queue (ref count 1). Caller checks num_free."""
        if n > len(self.free_queue):
            raise RuntimeError(f"allocate({n}) with {len(self.free_queue)} free blocks")
        out = []
        for _ in range(n):
            b, _ = self.free_queue.popitem(last=False)
            h = self.block_hash[b]
            if h is not None:  # evict the cached prefix block it held
                if self.cached.get(h) == b:
                    del self.cached[h]
                    self._log(h, False)
                self.block_hash[b] = None
                self.block_tokens[b] = None
                self.num_evictions += 1
            self.ref_cnt[b] = 1
            out.append(b)
        return out

    def touch(self, blocks: Iterable[int]) -> None:
        """Take one more reference on each block (a prefix hit or a fork)."""
        for b in blocks:
            if self.ref_cnt[b] == 0:
                del self.free_queue[b]
            self.ref_cnt[b] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference on each block, in the order given (pass the tail first)."""
        for b in blocks:
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self.free_queue[b] = None
                if self.block_hash[b] is None:
                    self.free_queue.move_to_end(b, last=False)

    def lookup(self, h: BlockHash, tokens: tuple[int, ...]) -> int | None:
        """The block caching `tokens` under hash `h`, confirmed by comparing the tokens."""
        b = self.cached.get(h)
        if b is None or self.block_tokens[b] != tokens:
            return None
        return b

    def cache(self, b: int, h: BlockHash, tokens: tuple[int, ...]) -> None:
        """Register a full, computed block under its chained hash (first writer wins)."""
        if self.block_hash[b] is not None or h in self.cached:
            return
        self.block_hash[b] = h
        self.block_tokens[b] = tokens
        self.cached[h] = b
        self._log(h, True)

    def reset_prefix_cache(self) -> None:
        for h, b in list(self.cached.items()):
            self.block_hash[b] = None
            self.block_tokens[b] = None
            self._log(h, False)
        self.cached.clear()

    # ---- the change log ----------------------------------------------------------------
    def record_events(self) -> None:
        """Start logging cache changes for `drain_events` (from now on; `cached` is the past)."""
        self._events, self._events_lost = [], False

    def _log(self, h: BlockHash, stored: bool) -> None:
        ev = self._events
        if ev is not None:
            ev.append((h, stored))
            if len(ev) > 4 * self.num_blocks + 1024:  # nobody drains: stop, and say so once asked
                self._events, self._events_lost = [], True

    def drain_events(self) -> tuple[dict[BlockHash, bool], bool]:
        """({hash: cached now?} for each hash whose state changed since the last drain, lost):
        `lost` says the log overflowed and the caller must start again from `cached`."""
        ev, lost = self._events, self._events_lost
        if ev is None:  # the first call starts the log
            self.record_events()
            return {}, True
        self._events, self._events_lost = [], False
        return dict(ev), lost  # a later event for the same hash wins

    def check_invariants(self, expected_refs: list[int]) -> None:
        """Raise AssertionError unless ref counts equal `expected_refs` and the queue matches them."""
        assert self.ref_cnt == expected_refs, "ref counts differ from block-table references"
        free = {b for b in range(self.num_blocks) if self.ref_cnt[b] == 0}
        assert set(self.free_queue) == free, "free queue differs from the blocks with ref count 0"
        assert all(r >= 0 for r in self.ref_cnt)
        for h, b in self.cached.items():
            assert self.block_hash[b] == h, f"cache map points at block {b} that lost its hash"
        hashed = sum(1 for h in self.block_hash if h is not None)
        assert hashed == len(self.cached), "a block holds a hash the cache map does not know"
