"""Scheduler policy without a model: budgets, seats, chunking, preemption order, priority."""

from __future__ import annotations

from folio.worker.block_manager import PagedKVManager
from folio.worker.sampling_params import SamplingParams
from folio.worker.scheduler import Scheduler, choose_victim
from folio.worker.sequence import SequenceGroup, SequenceStatus


def group(rid, n_tokens, arrival, priority=0, n=1):
    return SequenceGroup(rid, list(range(n_tokens)), SamplingParams(temperature=0.0, n=n), arrival, priority)


def advance(sched, out, token=7):
    """What the engine does after the model ran: count tokens, append a sampled one."""
    for seq, n in out.scheduled:
        seq.num_computed_tokens += n
        sched.kv.cache_blocks(seq)
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(token)


def test_token_budget_chunks_prefill_and_mixes_decode():
    kv = PagedKVManager(64, 4)
    s = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=10)
    a, b = group("a", 6, 0.0), group("b", 25, 1.0)
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert [(q.group.request_id, n) for q, n in out.scheduled] == [("a", 6), ("b", 4)]
    advance(s, out)
    out = s.schedule()  # a decodes (1), b continues its prefill with the rest of the budget
    assert [(q.group.request_id, n) for q, n in out.scheduled] == [("a", 1), ("b", 9)]
    assert out.num_batched_tokens == 10


def test_max_num_seqs_limits_admission():
    s = Scheduler(PagedKVManager(64, 4), max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(4):
        s.add(group(f"r{i}", 3, float(i)))
    out = s.schedule()
    assert len(out.scheduled) == 2 and s.num_waiting == 2


def test_n_completions_reserve_their_seats():
    s = Scheduler(PagedKVManager(64, 4), max_num_seqs=3, max_num_batched_tokens=100)
    s.add(group("one", 3, 0.0))
    s.add(group("three", 3, 1.0, n=3))
    out = s.schedule()
    assert [q.group.request_id for q, _ in out.scheduled] == ["one"]  # 1 + 3 seats > 3


def test_preemption_picks_lowest_priority_then_latest_and_requeues():
    kv = PagedKVManager(6, 4)  # 24 slots
    s = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=100)
    for rid, arrival, prio in [("old", 0.0, 0), ("new", 2.0, 0), ("mid", 1.0, 0)]:
        s.add(group(rid, 8, arrival, prio))  # 2 blocks each: all 6 blocks taken
    advance(s, s.schedule())
    assert kv.num_free_blocks == 0
    out = s.schedule()  # every sequence needs a third block: preempt the latest arrival
    assert [q.group.request_id for q in out.preempted] == ["new"]
    assert {q.group.request_id for q, _ in out.scheduled} == {"old", "mid"}
    victim = out.preempted[0]
    assert victim.status is SequenceStatus.WAITING and victim.num_computed_tokens == 0
    assert s.stats.num_preemptions == 1 and s.stats.num_recomputed_tokens == 8
    kv.check_invariants([q for q, _ in out.scheduled] + [victim])


def test_victim_policy_is_priority_first():
    a, b, c = group("a", 1, 0.0, priority=3), group("b", 1, 5.0), group("c", 1, 1.0, priority=3)
    assert choose_victim([a.seqs[0], b.seqs[0], c.seqs[0]]).group.request_id == "c"


def test_waiting_order_is_priority_then_arrival():
    s = Scheduler(PagedKVManager(64, 4), max_num_seqs=1, max_num_batched_tokens=100)
    s.add(group("late-urgent", 2, 5.0, priority=-1))
    s.add(group("early", 2, 0.0))
    assert s.schedule().scheduled[0][0].group.request_id == "late-urgent"


def test_watermark_keeps_blocks_free_when_admitting():
    kv = PagedKVManager(10, 4)
    s = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=100, watermark_blocks=3)
    s.add(group("a", 16, 0.0))  # 4 blocks; alone it may use the reserve
    s.add(group("b", 16, 1.0))  # 4 more would leave 2 < 3 free: must wait
    out = s.schedule()
    assert [q.group.request_id for q, _ in out.scheduled] == ["a"] and s.num_waiting == 1


def test_finish_frees_and_forgets():
    kv = PagedKVManager(8, 4)
    s = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=100)
    g = group("a", 5, 0.0)
    s.add(g)
    s.schedule()
    s.finish(g.seqs[0], "abort")
    assert not s.has_unfinished() and kv.num_free_blocks == 8
    s.add(group("b", 5, 1.0))
    s.finish(s._peek_waiting(), "abort")  # abort while waiting
    assert not s.has_unfinished() and s.schedule().is_empty


def test_swapped_requests_yield_only_to_strictly_higher_priority_waiting_ones():
    kv = PagedKVManager(8, 4, num_cpu_blocks=8)
    s = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=100, preemption_mode="swap")
    victim = group("victim", 8, 0.0, priority=5)
    s.add(victim)
    advance(s, s.schedule())
    s.preempt(victim.seqs[0])  # the coordinator's order: swap it out to make room...
    assert victim.seqs[0].status is SequenceStatus.SWAPPED
    same = group("same", 8, 1.0, priority=5)
    vip = group("vip", 16, 2.0, priority=0)
    s.add(same)
    s.add(vip)  # ...for a request moved in at the same moment
    out = s.schedule()
    assert out.swap_out and not out.swap_in
    # vip (priority 0) is admitted ahead of the swapped victim; the victim (priority 5)
    # still comes back ahead of the equal-priority newcomer, and only with room to spare
    assert [q.group.request_id for q, _ in out.scheduled] == ["vip"]
    assert victim.seqs[0].status is SequenceStatus.SWAPPED and same.seqs[0].status is SequenceStatus.WAITING
    advance(s, out)
    s.finish(vip.seqs[0], "stop")
    out = s.schedule()
    assert [q.group.request_id for q, _ in out.scheduled][0] == "victim"
