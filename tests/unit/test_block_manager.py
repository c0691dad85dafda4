"""Block pool / block manager: exact unit checks and a property-based state machine."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from folio.worker.block_manager import PagedKVManager
from folio.worker.contiguous_kv import ContiguousKVManager
from folio.worker.hashing import hash_block, hash_full_blocks
from folio.worker.sampling_params import SamplingParams
from folio.worker.sequence import Sequence, SequenceGroup

_arrival = iter(range(10**9))


def new_seq(tokens: list[int]) -> Sequence:
    g = SequenceGroup(f"r{next(_arrival)}", tokens, SamplingParams(temperature=0.0), float(next(_arrival)))
    return g.seqs[0]


def run(kv, seq, n):
    """Allocate and 'compute' n more tokens of seq, as the engine does."""
    assert kv.allocate_slots(seq, n)
    seq.num_computed_tokens += n
    kv.cache_blocks(seq)


def test_hash_chain_is_deterministic_and_chained():
    a = hash_full_blocks(list(range(10)), 4)
    assert len(a) == 2 and a == hash_full_blocks(list(range(10)), 4)
    assert a[1] == hash_block(a[0], [4, 5, 6, 7])
    assert hash_block(None, [4, 5, 6, 7]) != a[1]  # same tokens, other parent
    assert hash_block(None, [1], seed=b"x") != hash_block(None, [1], seed=b"y")


def test_allocate_grow_and_free_tail_first():
    kv = PagedKVManager(num_blocks=8, block_size=4)
    s = new_seq(list(range(6)))
    run(kv, s, 6)
    assert len(kv.block_table(s)) == 2 and kv.num_free_blocks == 6
    for t in range(3):  # grow token by token: 6 -> 9 tokens needs a third block at token 9
        s.token_ids.append(100 + t)
        run(kv, s, 1)
    assert len(kv.block_table(s)) == 3
    table = list(kv.block_table(s))
    kv.free(s)
    kv.free(s)  # harmless twice
    assert kv.num_free_blocks == 8
    # uncached blocks are reused first (the partial one, then the never-used ones);
    # of the two cached full blocks the tail one is evicted before the head one
    order = kv.pool.allocate(8)
    assert order[0] == table[2] and order[-2:] == [table[1], table[0]]
    assert kv.pool.num_evictions == 2


def test_prefix_hit_confirmed_by_tokens_and_lru_eviction():
    kv = PagedKVManager(num_blocks=6, block_size=4)
    a = new_seq(list(range(13)))
    run(kv, a, 13)
    a_blocks = list(kv.block_table(a))
    kv.free(a)
    b = new_seq(list(range(12)) + [99, 98])
    blocks, n = kv.get_computed_blocks(b)
    assert n == 12 and blocks == a_blocks[:3]
    assert kv.allocate_slots(b, 2, blocks) and kv.block_table(b)[:3] == a_blocks[:3]
    assert kv.pool.ref_cnt[a_blocks[0]] == 1
    kv.free(b)
    # a forged hash collision is rejected by the token comparison
    c = new_seq([7] * 9)
    kv._ensure_hashes(c, 2)
    kv.pool.cached[c.block_hashes[0]] = blocks[0]
    assert kv.pool.lookup(c.block_hashes[0], tuple(c.token_ids[:4])) is None
    del kv.pool.cached[c.block_hashes[0]]
    # the whole prompt cached: the last block is still recomputed (its logits are needed)
    d = new_seq(list(range(12)))
    assert kv.get_computed_blocks(d)[1] == 8


def test_fork_shares_blocks_and_copies_on_write():
    kv = PagedKVManager(num_blocks=8, block_size=4)
    p = new_seq(list(range(6)))
    run(kv, p, 6)
    c = Sequence(p.group, 1, p.token_ids)
    c.num_computed_tokens = 6
    assert kv.fork(p, c)
    assert kv.block_table(c) == kv.block_table(p)
    assert kv.pool.ref_cnt[kv.block_table(p)[1]] == 2
    shared_partial = kv.block_table(p)[1]
    p.token_ids.append(1)
    run(kv, p, 1)  # writes into the shared partial block: copy first
    copies = kv.take_copies()
    assert len(copies) == 1 and copies[0][0] == shared_partial and kv.block_table(p)[1] == copies[0][1]
    assert kv.block_table(p)[0] == kv.block_table(c)[0]  # the full block stays shared
    c.token_ids.append(2)
    run(kv, c, 1)  # now the child owns the old partial block alone: no copy
    assert kv.take_copies() == [] and kv.block_table(c)[1] == shared_partial
    kv.check_invariants([p, c])


def test_allocation_failure_changes_nothing():
    kv = PagedKVManager(num_blocks=3, block_size=4)
    s = new_seq(list(range(20)))
    before = (list(kv.pool.ref_cnt), kv.num_free_blocks)
    assert not kv.allocate_slots(s, 20)
    assert (list(kv.pool.ref_cnt), kv.num_free_blocks) == before
    assert not kv.allocate_slots(s, 4, reserve=3)
    kv.check_invariants([s])


def test_contiguous_first_fit_and_waste():
    kv = ContiguousKVManager(num_blocks=10, block_size=4, max_model_len=12)  # 3 blocks per request
    seqs = [new_seq([1, 2]) for _ in range(4)]
    assert [kv.allocate_slots(s, 2) for s in seqs] == [True, True, True, False]
    kv.free(seqs[1])
    assert kv.allocate_slots(seqs[3], 2)  # first fit reuses the freed gap
    assert kv.block_table(seqs[3]) == [3, 4, 5]
    for s in seqs:
        s.num_computed_tokens = 2
    used, allocated = kv.slot_stats([seqs[0], seqs[2], seqs[3]])
    assert (used, allocated) == (6, 36)
    kv.check_invariants([seqs[0], seqs[2], seqs[3]])


class PagedMachine(RuleBasedStateMachine):
    """Random allocate / append / fork / free / abort / preempt (recompute or swap) /
    swap-in / export-import sequences, across two managers (two engines)."""

    def __init__(self):
        super().__init__()
        self.kv = PagedKVManager(num_blocks=16, block_size=4, num_cpu_blocks=10)
        self.other = PagedKVManager(num_blocks=16, block_size=4, num_cpu_blocks=10)  # an import target
        self.live: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self.moved: list[Sequence] = []  # imported into self.other, held in its swap space
        self.index: set[bytes] | None = None  # a heartbeat reader's prefix index, built from changes only

    @rule()
    def beat(self):  # what a heartbeat publishes: the changes since the last one, after one full copy
        changes, resync = self.kv.prefix_cache_changes()
        if resync or self.index is None:
            assert resync == (self.index is None), "a resync asked for only on the first call"
            self.index = self.kv.cached_block_hashes()
        else:
            for h, cached in changes.items():
                (self.index.add if cached else self.index.discard)(h)
        assert self.index == self.kv.cached_block_hashes(), "changes applied in order != the cache map"

    @rule(prompt=st.lists(st.integers(0, 2), min_size=1, max_size=30), chunk=st.integers(1, 12))
    def admit(self, prompt, chunk):
        s = new_seq(prompt)
        blocks, n = self.kv.get_computed_blocks(s)
        todo = min(s.num_tokens - n, chunk)
        if self.kv.allocate_slots(s, todo, blocks):
            s.num_computed_tokens = n + todo
            self.kv.cache_blocks(s)
            self.live.append(s)
        else:
            assert s.seq_id not in self.kv.tables

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100), tok=st.integers(0, 2), chunk=st.integers(1, 8))
    def advance(self, i, tok, chunk):
        s = self.live[i % len(self.live)]
        if s.num_computed_tokens == s.num_tokens:
            s.token_ids.append(tok)  # a sampled token
        n = min(chunk, s.num_tokens - s.num_computed_tokens)
        if self.kv.allocate_slots(s, n):
            s.num_computed_tokens += n
            self.kv.cache_blocks(s)
        self.kv.take_copies()

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100))
    def fork(self, i):
        p = self.live[i % len(self.live)]
        if p.num_computed_tokens != p.num_tokens:
            return
        c = Sequence(p.group, len(p.group.seqs), p.token_ids)
        c.num_computed_tokens = p.num_computed_tokens
        assert self.kv.fork(p, c)
        self.live.append(c)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100))
    def finish(self, i):  # finish and abort free the same way
        self.kv.free(self.live.pop(i % len(self.live)))

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100))
    def preempt(self, i):  # recompute preemption: free, then re-admit from scratch
        s = self.live.pop(i % len(self.live))
        self.kv.free(s)
        s.num_computed_tokens = 0  # its block hashes stay valid: they depend on tokens only
        blocks, n = self.kv.get_computed_blocks(s)
        if self.kv.allocate_slots(s, s.num_tokens - n, blocks):
            s.num_computed_tokens = s.num_tokens
            self.kv.cache_blocks(s)
            self.live.append(s)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100))
    def swap_out(self, i):  # swap preemption; a swap-out that cannot fit falls back to recompute
        s = self.live.pop(i % len(self.live))
        free_host = self.kv.swap.num_free
        if self.kv.swap_out(s):
            assert self.kv.swap.num_free == free_host - len(self.kv.swap.tables[s.seq_id])
            self.swapped.append(s)
        else:
            assert self.kv.swap.num_free == free_host and s.seq_id in self.kv.tables
            self.kv.free(s)
        self.kv.take_swaps()  # the step runs its copies

    @precondition(lambda self: self.swapped)
    @rule(i=st.integers(0, 100))
    def swap_in(self, i):
        s = self.swapped[i % len(self.swapped)]
        if self.kv.swap_in(s):
            self.swapped.remove(s)
            self.live.append(s)
        self.kv.take_swaps()

    @precondition(lambda self: self.swapped)
    @rule(i=st.integers(0, 100))
    def export_import(self, i):  # export frees it here; the importer adopts host blocks or recomputes
        s = self.swapped.pop(i % len(self.swapped))
        n = self.kv.swapped_blocks(s)
        self.kv.free(s)
        if self.other.swap.adopt(s.seq_id, n) is not None:
            self.moved.append(s)

    @precondition(lambda self: self.swapped)
    @rule(i=st.integers(0, 100))
    def abort_swapped(self, i):
        self.kv.free(self.swapped.pop(i % len(self.swapped)))

    @invariant()
    def consistent(self):
        self.kv.check_invariants(self.live + self.swapped)
        self.other.check_invariants(self.moved)
        swap = self.kv.swap  # every host block either free or held by a swapped-out table, never both
        held = {b for t in swap.tables.values() for b in t}
        assert len(held) <= swap.num_blocks == 10 and swap.num_free == swap.num_blocks - len(held), "over-committed"

    def teardown(self):
        for s in self.live + self.swapped:
            self.kv.free(s)
        for s in self.moved:
            self.other.free(s)
        self.kv.take_swaps()
        for kv in (self.kv, self.other):
            kv.check_invariants([])
            assert kv.num_free_blocks == kv.num_blocks, "device blocks leaked"
            assert kv.swap.num_free == kv.swap.num_blocks, "host blocks leaked"


TestPagedMachine = PagedMachine.TestCase
TestPagedMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_prefix_change_log_overflow_asks_for_a_resync():
    kv = PagedKVManager(num_blocks=4, block_size=2)
    assert kv.prefix_cache_changes() == ({}, True)  # the first call: start from the cache map
    for i in range(4 * 4 + 1024 + 8):  # never drained: cache / evict churn past the log's bound
        s = new_seq([i % 7, i % 5, i % 3, 1])
        blocks, n = kv.get_computed_blocks(s)
        assert kv.allocate_slots(s, s.num_tokens - n, blocks)
        s.num_computed_tokens = s.num_tokens
        kv.cache_blocks(s)
        kv.free(s)
    changes, resync = kv.prefix_cache_changes()
    assert resync, "an overflowed log must say so"
    assert kv.prefix_cache_changes() == ({}, False)  # logging again, nothing changed since
    off = PagedKVManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    assert off.prefix_cache_changes() == ({}, False) and off.cached_block_hashes() == set()
