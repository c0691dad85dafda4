"""The frontends' watch of the coordinator (cluster/liveness.py CoordinatorWatch), one read of its
heartbeat at a time: what /health reports (`silent_s`) and when the coordinator is pinged. The
state and the actor are stand-ins; the watch against a real Ray actor, a real Redis and a real
SIGSTOP is tests/cluster/test_cluster_ray.py::test_a_frozen_coordinator_is_restarted_by_the_frontends_watch."""

import asyncio

import redis
from hypothesis import given, settings
from hypothesis import strategies as st

from folio.cluster.liveness import CoordinatorWatch

BEAT = {"rounds": 1, "time": 0.0}


class State:
    def __init__(self) -> None:
        self.now = BEAT  # BEAT (its key alive), None (lapsed) or "away" (Redis does not answer)

    def coordinator(self):
        if self.now == "away":
            raise redis.TimeoutError("Timeout reading from socket")
        return self.now


def make(frozen_s: float = 3600.0) -> tuple[CoordinatorWatch, State, list]:
    state, pings = State(), []
    w = CoordinatorWatch(state, "ns", frozen_s=frozen_s, ping_timeout_s=0.001)

    class Actor:
        class stats:
            @staticmethod
            def remote():
                pings.append(state.now)
                return asyncio.sleep(3600)  # stopped: never answers

    async def actor():
        return Actor()
    w._actor = actor
    return w, state, pings


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([BEAT, None, "away"]), min_size=1, max_size=12))
def test_silent_only_when_redis_answers_without_its_heartbeat_after_it_was_seen(reads):
    """/health says degraded (`silent_s` > 0) exactly when the last read answered without the
    heartbeat, a heartbeat was seen before, and the read before that one answered too (after
    Redis was away the coordinator gets one read's time to beat again)."""
    w, state, _ = make()

    async def main():
        silent, seen, answered_before = [], False, True
        for r in reads:
            state.now = r
            await w.check()
            if r != "away":
                expect = r is None and seen and answered_before
                assert (w.silent_s() > 0) == expect, (reads, r)
                seen = seen or r is not None
            answered_before = r != "away"
        await w.watch.stop()
    asyncio.run(main())


def checks(w: CoordinatorWatch, state: State, first, then, n: int = 5) -> None:
    """One read with the key as `first`, then `n` reads with it as `then`, 3 ms apart."""
    async def main():
        state.now = first
        await w.check()
        state.now = then
        for _ in range(n):
            await asyncio.sleep(0.003)
            await w.check()
        await w.watch.stop()
    asyncio.run(main())


def test_a_coordinator_never_seen_is_never_pinged_nor_reported():
    """None runs (`coordinator=False`), or it has not started yet."""
    w, state, pings = make(frozen_s=0.0)
    checks(w, state, None, None)
    assert w.silent_s() == 0 and pings == []


def test_silent_past_the_bound_it_is_pinged():
    w, state, pings = make(frozen_s=0.005)
    checks(w, state, BEAT, None)
    assert pings  # (and killed when the ping goes unanswered: the Ray test)
