"""Routing and cross-GPU preemption policies: pure functions, exact asserts, no Ray; the
router's accounting of what it sent since each heartbeat, against a real Redis."""

import asyncio
import random
import time

import pytest

from folio.cluster.placement import Move, plan_moves, starving
from folio.cluster.policies import Candidate, least_loaded, power_of_two, prefix_aware, round_robin
from folio.cluster.redis_server import EmbeddedRedis
from folio.cluster.router import Router
from folio.cluster.state import ClusterState, WorkerPublisher
from folio.cluster.worker_client import LocalWorkerClient
from folio.worker.hashing import hash_full_blocks
from folio.worker.messages import GenerateRequest, RequestSummary, WorkerLoad
from folio.worker.sampling_params import SamplingParams


def cand(wid, free=100, total=100, queued=0, waiting=0, swapped=0, bs=16):
    return Candidate(wid, total, free, queued, waiting, swapped, bs)


def test_round_robin_cycles_in_id_order():
    cs = [cand("b"), cand("a"), cand("c")]
    assert [round_robin(cs, i) for i in range(5)] == ["a", "b", "c", "a", "b"]


def test_least_loaded_counts_used_blocks_and_queued_tokens():
    cs = [cand("a", free=50), cand("b", free=90, queued=16 * 45), cand("c", free=60)]
    assert least_loaded(cs) == "c"  # a: 50/100 used; b: 10 used + 45 queued blocks; c: 40 used
    assert least_loaded([cand("a"), cand("b")]) == "a"  # ties by id: deterministic


def test_power_of_two_picks_the_less_loaded_of_two_samples():
    cs = [cand("a", free=10), cand("b", free=90)]
    rng = random.Random(0)
    assert {power_of_two(cs, rng) for _ in range(20)} == {"b"}
    many = [cand(f"w{i}", free=i) for i in range(10)]
    picks = [power_of_two(many, random.Random(s)) for s in range(200)]
    assert "w0" not in picks  # the most loaded worker always loses its comparison
    assert len(set(picks)) > 3  # and the choice spreads


def test_prefix_aware_prefers_longest_match_while_balanced():
    cs = [cand("a", free=60), cand("b", free=80), cand("c", free=70)]
    assert prefix_aware(cs, {"a": 5, "b": 0, "c": 2}) == "a"  # 0.4 vs least 0.2: within 0.25
    assert prefix_aware(cs, {"a": 5, "c": 5}) == "c"  # equal matches: the less loaded holder
    assert prefix_aware(cs, {}) == "b"  # no match: least-loaded
    skewed = [cand("a", free=10), cand("b", free=90)]
    assert prefix_aware(skewed, {"a": 8}) == "b"  # 0.9 vs 0.1: past the imbalance threshold
    assert prefix_aware(skewed, {"a": 8}, imbalance=1.0) == "a"


def load(wid, free, total=100, reqs=(), cpu_free=1000, draining=False, tp=1):
    return WorkerLoad(worker_id=wid, timestamp=0.0, num_kv_blocks=total, num_free_blocks=free, num_cpu_blocks=1000,
                      num_free_cpu_blocks=cpu_free, block_size=16, draining=draining,
                      requests=list(reqs), tensor_parallel_size=tp)


def req(rid, state, blocks, prio=0, arrival=0.0):
    return RequestSummary(request_id=rid, state=state, priority=prio, arrival_time=arrival, num_blocks=blocks)


def test_requests_move_only_between_tensor_parallel_groups_of_one_size():
    """A request's KV is sharded over its worker's ranks: a TP=2 worker's request goes to the
    other TP=2 worker, never to the roomier TP=1 one, and preempts nothing there either."""
    starved = [req("r1", "swapped", 10, arrival=1.0), req("r0", "running", 80)]
    loads = {"a": load("a", 2, reqs=starved, tp=2), "b": load("b", 90, tp=1,
                                                              reqs=[req("v", "running", 20, prio=5)]),
             "c": load("c", 40, tp=2)}
    assert plan_moves(loads, now=100.0) == [Move("r1", "a", "c", (), 10)]
    del loads["c"]
    assert plan_moves(loads, now=100.0) == []
    assert plan_moves({**loads, "b": load("b", 90, tp=2)}, now=100.0) == [Move("r1", "a", "b", (), 10)]


def test_swapped_request_resumes_on_the_worker_with_room():
    loads = {"a": load("a", 2, reqs=[req("r1", "swapped", 10, arrival=1.0), req("r0", "running", 80)]),
             "b": load("b", 40), "c": load("c", 60)}
    assert plan_moves(loads, now=100.0) == [Move("r1", "a", "c", (), 10)]


def test_starving_order_is_priority_then_arrival_and_room_is_not_double_booked():
    loads = {"a": load("a", 0, reqs=[req("late", "swapped", 30, prio=0, arrival=5.0),
                                     req("low", "swapped", 30, prio=3, arrival=1.0),
                                     req("early", "waiting", 30, prio=0, arrival=2.0)]),
             "b": load("b", 70)}
    assert [r.request_id for _, r in starving(loads)] == ["early", "late", "low"]
    moves = plan_moves(loads, now=100.0)  # b has 70 - 5 headroom = 65: two of the three fit
    assert [(m.request_id, m.destination) for m in moves] == [("early", "b"), ("late", "b")]


def test_request_that_fits_at_home_or_just_moved_stays():
    loads = {"a": load("a", 20, reqs=[req("fits", "swapped", 10)]), "b": load("b", 90)}
    assert plan_moves(loads, now=100.0) == []
    loads = {"a": load("a", 0, reqs=[req("r", "swapped", 10)]), "b": load("b", 90)}
    assert plan_moves(loads, now=100.0, last_moved={"r": 99.5}, cooldown_s=1.0) == []
    assert plan_moves(loads, now=100.0, last_moved={"r": 98.0}, cooldown_s=1.0) != []


def test_no_move_into_a_draining_worker_or_without_swap_space():
    loads = {"a": load("a", 0, reqs=[req("r", "swapped", 10)]), "b": load("b", 90, draining=True)}
    assert plan_moves(loads, now=100.0) == []
    loads = {"a": load("a", 0, reqs=[req("r", "swapped", 10)]), "b": load("b", 90, cpu_free=5)}
    assert plan_moves(loads, now=100.0) == []


def test_victims_are_chosen_across_workers_lowest_priority_then_latest():
    loads = {
        "a": load("a", 0, reqs=[req("vip", "swapped", 20, prio=0)]),
        "b": load("b", 5, reqs=[req("b-low-early", "running", 15, prio=5, arrival=1.0),
                               req("b-low-late", "running", 15, prio=5, arrival=2.0),
                               req("b-vip", "running", 50, prio=0)]),
        "c": load("c", 5, reqs=[req("c-mid", "running", 40, prio=2, arrival=9.0)]),
    }
    # b's two prio-5 requests go first (latest first); with b's 5 - 5 headroom free = 0,
    # one frees 15 < 20, both free 30 >= 20: b takes the request.
    assert plan_moves(loads, now=100.0) == [Move("vip", "a", "b", ("b-low-late", "b-low-early"), 20)]
    # never preempt an equal or higher priority request
    loads["b"].requests = [req("b-vip", "running", 90, prio=0)]
    loads["c"].requests = [req("c-vip", "running", 90, prio=0)]
    assert plan_moves(loads, now=100.0) == []


@pytest.mark.parametrize("max_moves", [0, 1])
def test_max_moves_bounds_a_round(max_moves):
    loads = {"a": load("a", 0, reqs=[req(f"r{i}", "swapped", 5, arrival=i) for i in range(4)]), "b": load("b", 90)}
    assert len(plan_moves(loads, now=100.0, max_moves=max_moves)) == max_moves


def test_swapped_out_kv_counts_as_load():
    idle = Candidate("idle", 100, 70, 0, 0, 0, 16)
    parked = Candidate("parked", 100, 90, 0, 0, 2, 16, swapped_blocks=60)  # few blocks in use, 60 coming back
    assert least_loaded([idle, parked]) == "idle"


# ---- the router's own figures: its heartbeat snapshot plus what it sent since -------------
def _beat(wid, free, queued=0, waiting=0):
    return WorkerLoad(worker_id=wid, timestamp=time.time(), num_kv_blocks=200, num_free_blocks=free, num_cpu_blocks=100,
                      num_free_cpu_blocks=100, block_size=16, num_waiting=waiting, queued_tokens=queued)


def _reference(loads, sent):
    """The per-pick accounting as first written (router.py before its caches): each pick
    counts every request sent after that worker's heartbeat."""
    return [Candidate(w, l.num_kv_blocks, l.num_free_blocks,
                      l.queued_tokens + sum(n for t, n in sent[w] if t > l.timestamp),
                      l.num_waiting + sum(1 for t, _ in sent[w] if t > l.timestamp), l.num_swapped, l.block_size,
                      l.num_cpu_blocks - l.num_free_cpu_blocks)
            for w, l in sorted(loads.items())]


@pytest.mark.parametrize("policy", ["least-loaded", "prefix-aware"])
def test_router_decisions_equal_the_reference_accounting_through_bursts_and_heartbeats(policy):
    """Bursts of picks between heartbeats (no refresh), heartbeats of some workers in between:
    every decision equals the policy over the reference figures, and a burst spreads."""
    rng = random.Random(3)
    systems = [[rng.randrange(50_000) for _ in range(64)] for _ in range(3)]
    with EmbeddedRedis() as server:
        pubs = {w: WorkerPublisher(server.url, "rt") for w in ("a", "b", "c", "d")}
        held = {"a": hash_full_blocks(systems[0], 16), "b": hash_full_blocks(systems[1], 16)[:2]}
        beats = {w: _beat(w, free=rng.randrange(120, 200)) for w in pubs}
        for w, p in pubs.items():
            p.publish(beats[w], set(held.get(w, ())))
        router = Router(ClusterState(server.url, "rt"), LocalWorkerClient({}), policy, refresh_s=3600.0)
        state = ClusterState(server.url, "rt")

        async def run():
            sent = {w: [] for w in pubs}
            picked = []
            for burst in range(6):
                for i in range(40):
                    prompt = rng.choice(systems) + [rng.randrange(50_000) for _ in range(rng.randrange(1, 200))]
                    cands = _reference(beats, sent)
                    if policy == "least-loaded":
                        want = least_loaded(cands)
                        cached = 0
                    else:
                        m = state.prefix_matches(sorted(beats), hash_full_blocks(prompt, 16))
                        want = prefix_aware(cands, m, router.imbalance)
                        cached = m[want] * 16
                    got = await router.pick(GenerateRequest(request_id=f"r{burst}-{i}", prompt_token_ids=prompt,
                                                            params=SamplingParams(max_tokens=1)))
                    assert got == want, (burst, i)
                    sent[got].append((time.time(), len(prompt) - cached))
                    picked.append(got)
                for w in rng.sample(sorted(pubs), 2):  # two heartbeats arrive: they count what was sent
                    beats[w] = _beat(w, free=rng.randrange(120, 200), queued=rng.randrange(0, 3000),
                                     waiting=rng.randrange(0, 5))
                    pubs[w].publish(beats[w], set(held.get(w, ())))
                assert sorted(await router.live_loads(refresh=True)) == sorted(pubs)
            return picked

        picked = asyncio.run(run())
    assert len(set(picked[:40])) > 1  # a burst between two heartbeats does not pile onto one worker
