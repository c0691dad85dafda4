"""A long prompt's prefill chunks do not hold back the requests that arrive behind it
(scheduler.py, step 3): a chunk over `long_prefill_tokens` is held at that many tokens until
every other sequence had its turn, then takes what budget is left."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from folio.worker.block_manager import PagedKVManager
from folio.worker.sampling_params import SamplingParams
from folio.worker.scheduler import Scheduler
from folio.worker.sequence import SequenceGroup, SequenceStatus


def group(rid, n_tokens, arrival, max_tokens=1):
    """A prompt of its own tokens (no prefix shared with another request's)."""
    first = 1000 * (int(arrival) + 1)
    return SequenceGroup(rid, list(range(first, first + n_tokens)),
                         SamplingParams(temperature=0.0, max_tokens=max_tokens), arrival, 0)


def run_step(sched, out, finished):
    """The engine's part: count the tokens, sample one at the prompt's end, retire the done."""
    for seq, n in out.scheduled:
        seq.num_computed_tokens += n
        sched.kv.cache_blocks(seq)
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(7)
            if seq.num_output_tokens >= seq.group.params.max_tokens:
                sched.finish(seq, "length")
                finished.append(seq.group.request_id)


def plan(out):
    return [(q.group.request_id, n) for q, n in out.scheduled]


def test_a_request_arriving_during_a_long_prefill_is_served_in_the_next_step():
    s = Scheduler(PagedKVManager(256, 4), max_num_seqs=8, max_num_batched_tokens=100, long_prefill_tokens=25)
    done: list[str] = []
    s.add(group("long", 400, 0.0))
    out = s.schedule()
    assert plan(out) == [("long", 100)]  # alone, it still takes the whole budget
    run_step(s, out, done)
    s.add(group("short", 30, 1.0))
    out = s.schedule()
    assert plan(out) == [("long", 70), ("short", 30)] and out.num_batched_tokens == 100
    run_step(s, out, done)
    assert done == ["short"]
    while s.has_unfinished():
        out = s.schedule()
        assert out.num_batched_tokens <= 100
        run_step(s, out, done)
    assert done == ["short", "long"] and s.kv.num_free_blocks == 256


def test_without_the_threshold_the_request_waits_for_the_whole_prefill():
    """What the threshold changes (and what the test above would see without it)."""
    s = Scheduler(PagedKVManager(256, 4), max_num_seqs=8, max_num_batched_tokens=100, long_prefill_tokens=0)
    done: list[str] = []
    s.add(group("long", 400, 0.0))
    run_step(s, s.schedule(), done)
    s.add(group("short", 30, 1.0))
    assert plan(s.schedule()) == [("long", 100)]


def test_the_threshold_is_off_without_chunked_prefill():
    s = Scheduler(PagedKVManager(256, 4), max_num_seqs=8, max_num_batched_tokens=400,
                  enable_chunked_prefill=False, long_prefill_tokens=25)
    s.add(group("long", 400, 0.0))
    assert plan(s.schedule()) == [("long", 400)]


def test_two_long_prefills_share_the_step_and_fill_it():
    s = Scheduler(PagedKVManager(256, 4), max_num_seqs=8, max_num_batched_tokens=100, long_prefill_tokens=25)
    s.add(group("a", 300, 0.0))
    s.add(group("b", 300, 1.0))
    assert plan(s.schedule()) == [("a", 75), ("b", 25)]  # b is not starved until a is done


def test_the_budget_left_completes_the_shortest_held_prefill_first():
    s = Scheduler(PagedKVManager(256, 4), max_num_seqs=8, max_num_batched_tokens=100, long_prefill_tokens=10)
    s.add(group("long", 400, 0.0))
    s.add(group("mid", 60, 1.0))
    s.add(group("short", 30, 2.0))
    assert plan(s.schedule()) == [("long", 10), ("mid", 60), ("short", 30)]


@settings(max_examples=150, deadline=None)
@given(budget=st.integers(8, 160), cap_share=st.floats(0.05, 0.9), block_size=st.sampled_from([1, 4, 16]),
       num_blocks=st.integers(8, 400), seats=st.integers(1, 8),
       reqs=st.lists(st.tuples(st.integers(0, 12), st.integers(1, 400), st.integers(1, 4)), min_size=1, max_size=12))
def test_any_workload_stays_within_the_budget_and_finishes(budget, cap_share, block_size, num_blocks, seats, reqs):
    """Generated workloads (arrival step, prompt, output length) on scarce or ample blocks and
    seats: every step within the budget, every chunk within what is left of its sequence, a
    step that leaves budget unused only when no held prefill could take more, every request
    finished, every block free at the end."""
    cap = max(1, int(budget * cap_share))
    kv = PagedKVManager(num_blocks, block_size)
    s = Scheduler(kv, max_num_seqs=seats, max_num_batched_tokens=budget, long_prefill_tokens=cap)
    fits = [(a, p, m) for a, p, m in reqs if -(-(p + m) // block_size) <= num_blocks]  # the engine refuses the rest
    done: list[str] = []
    for step in range(2000):
        for i, (a, p, m) in enumerate(fits):
            if a == step:
                s.add(group(f"r{i}", p, float(i), max_tokens=m))
        if step > max((a for a, _, _ in fits), default=0) and not s.has_unfinished():
            break
        out = s.schedule()
        assert out.num_batched_tokens <= budget
        for seq, n in out.scheduled:
            assert 1 <= n <= seq.num_tokens - seq.num_computed_tokens
        if out.num_batched_tokens < budget:
            for seq, n in out.scheduled:
                short = seq.num_tokens - seq.num_computed_tokens - n
                if short > 0 and seq.status is SequenceStatus.RUNNING:  # budget left, tokens left: no room
                    assert not kv.allocate_slots(seq, n + min(short, budget - out.num_batched_tokens))
        kv.check_invariants([q for q, _ in out.scheduled])
        run_step(s, out, done)
    assert sorted(done) == sorted(f"r{i}" for i in range(len(fits)))
    assert kv.num_free_blocks == num_blocks
