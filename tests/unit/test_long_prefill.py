"""A long prompt's prefill neither holds back the requests that arrive during it nor stretches
the running streams' steps (scheduler.py, step 3): a prefill chunk is at most
`long_prefill_tokens`, as vLLM's long_prefill_token_threshold."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from folio.worker.block_manager import PagedKVManager
from folio.worker.sampling_params import SamplingParams
from folio.worker.scheduler import Scheduler
from folio.worker.sequence import SequenceGroup


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
    assert plan(out) == [("long", 25)]
    run_step(s, out, done)
    s.add(group("short", 20, 1.0, max_tokens=3))
    out = s.schedule()
    assert plan(out) == [("long", 25), ("short", 20)]
    run_step(s, out, done)
    out = s.schedule()
    assert plan(out) == [("long", 25), ("short", 1)]  # its decode steps stay short too
    while s.has_unfinished():
        out = s.schedule()
        assert out.num_batched_tokens <= 26
        run_step(s, out, done)
    assert done == ["short", "long"] and s.kv.num_free_blocks == 256


def test_without_the_threshold_the_request_waits_for_the_whole_prefill():
    """What the threshold changes (and what the test above would see without it)."""
    s = Scheduler(PagedKVManager(256, 4), max_num_seqs=8, max_num_batched_tokens=100, long_prefill_tokens=0)
    done: list[str] = []
    s.add(group("long", 400, 0.0))
    run_step(s, s.schedule(), done)
    s.add(group("short", 20, 1.0))
    assert plan(s.schedule()) == [("long", 100)]


def test_the_threshold_is_off_without_chunked_prefill():
    s = Scheduler(PagedKVManager(256, 4), max_num_seqs=8, max_num_batched_tokens=400,
                  enable_chunked_prefill=False, long_prefill_tokens=25)
    s.add(group("long", 400, 0.0))
    assert plan(s.schedule()) == [("long", 400)]


def test_one_long_prompt_is_prefilled_at_a_time_and_shorter_ones_pass_the_others():
    s = Scheduler(PagedKVManager(256, 4), max_num_seqs=8, max_num_batched_tokens=100, long_prefill_tokens=40)
    done: list[str] = []
    for i, n in enumerate((200, 60, 30)):
        s.add(group(f"r{i}", n, float(i)))
    out = s.schedule()
    assert plan(out) == [("r0", 40), ("r2", 30)]  # r1 (over 40) waits for r0; r2 goes past it
    for _ in range(4):
        run_step(s, out, done)
        out = s.schedule()
    assert plan(out) == [("r0", 40), ("r1", 40)]  # r0's last chunk: the next long one starts


def test_a_long_prompt_already_in_the_prefix_cache_is_not_held_back():
    """Held back is what has more than a chunk left to prefill, not what is long: a 200-token
    prompt served before comes back during another long prefill and is admitted at once; a look
    at the cache for a request not admitted leaves the hit rate alone."""
    kv = PagedKVManager(256, 4)
    s = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=100, long_prefill_tokens=40)
    done: list[str] = []
    s.add(group("first", 200, 5.0))
    while s.has_unfinished():
        run_step(s, s.schedule(), done)
    s.add(group("long", 400, 0.0))
    run_step(s, s.schedule(), done)
    queries = kv.prefix_queries
    s.add(group("again", 200, 5.0))  # the same tokens as "first"
    s.add(group("new", 200, 6.0))
    out = s.schedule()
    assert [(r, n) for r, n in plan(out) if r != "long"] == [("again", 4)]  # "new" waits for "long"
    assert kv.prefix_queries - queries == 199 // 4  # "again" counted once; "new" (held: looked at) not


def test_long_prompts_beside_scarce_blocks_do_not_preempt_each_other():
    """Several long prompts admitted together, a chunk each a step, ran out of blocks and
    recomputed each other's work: 16 prompts of 300 tokens, blocks for 800 tokens."""
    kv = PagedKVManager(200, 4)
    s = Scheduler(kv, max_num_seqs=16, max_num_batched_tokens=100, long_prefill_tokens=25)
    done: list[str] = []
    for i in range(16):
        s.add(group(f"r{i}", 300, float(i), max_tokens=8))
    while s.has_unfinished():
        run_step(s, s.schedule(), done)
    assert len(done) == 16 and s.stats.num_recomputed_tokens == 0


@settings(max_examples=150, deadline=None)
@given(budget=st.integers(8, 160), cap_share=st.floats(0.05, 1.0), block_size=st.sampled_from([1, 4, 16]),
       num_blocks=st.integers(8, 400), seats=st.integers(1, 8), swap=st.booleans(),
       reqs=st.lists(st.tuples(st.integers(0, 12), st.integers(1, 400), st.integers(1, 4)), min_size=1, max_size=12))
def test_any_workload_stays_within_its_limits_and_finishes(budget, cap_share, block_size, num_blocks, seats, swap,
                                                          reqs):
    """Generated workloads (arrival step, prompt, output length) on scarce or ample blocks and
    seats, recompute or swap: every step within the budget, every chunk within what is left of
    its sequence and within the threshold, a long prompt admitted only while no other is being
    prefilled, every request finished, every block free at the end."""
    cap = max(1, int(budget * cap_share))
    kv = PagedKVManager(num_blocks, block_size, num_cpu_blocks=num_blocks if swap else 0)
    s = Scheduler(kv, max_num_seqs=seats, max_num_batched_tokens=budget, long_prefill_tokens=cap,
                  preemption_mode="swap" if swap else "recompute", kv_bytes_per_block=1)
    fits = [(a, p, m) for a, p, m in reqs if -(-(p + m) // block_size) <= num_blocks]  # the engine refuses the rest
    done: list[str] = []
    last = max((a for a, _, _ in fits), default=0)
    for step in range(3000):
        for i, (a, p, m) in enumerate(fits):
            if a == step:
                s.add(group(f"r{i}", p, float(i), max_tokens=m))
        if step > last and not s.has_unfinished():
            break
        waiting = {q.seq_id for q in s.waiting_sequences()}
        longs_before = sum(q.num_tokens - q.num_computed_tokens > cap for q in s.running)
        out = s.schedule()
        assert out.num_batched_tokens <= budget
        new_longs = sum(q.seq_id in waiting and q.num_tokens - q.num_computed_tokens > cap for q, _ in out.scheduled)
        assert new_longs <= (0 if longs_before else 1)  # one long prompt prefilled at a time
        for seq, n in out.scheduled:
            assert 1 <= n <= min(cap, seq.num_tokens - seq.num_computed_tokens)
        kv.check_invariants(s.running + s.swapped + s.waiting_sequences())
        run_step(s, out, done)
    assert sorted(done) == sorted(f"r{i}" for i in range(len(fits)))
    assert kv.num_free_blocks == num_blocks
