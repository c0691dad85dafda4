"""The router's prefix walk over its lean Redis connection (cluster/prefix_walk.py): the same
answers as redis-py's, concurrent calls, a Redis that restarts, stalls or refuses the password.

Real redis-server processes (EmbeddedRedis), stopped and continued by their PID."""

import asyncio
import os
import signal
import time

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from folio.cluster.prefix_walk import PrefixWalker
from folio.cluster.redis_server import EmbeddedRedis
from folio.cluster.state import _WALK_PREFIX, ClusterState
from folio.worker.hashing import hash_full_blocks


@pytest.fixture(scope="module")
def server():
    with EmbeddedRedis() as s:
        yield s


def reference(sets: dict[str, set], hashes: list[bytes]) -> dict[str, int]:
    out = {}
    for w, held in sets.items():
        n = 0
        while n < len(hashes) and hashes[n] in held:
            n += 1
        out[w] = n
    return out


_examples = iter(range(10**9))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(1, 12), st.integers(0, 40), st.data())
def test_the_lean_walk_answers_as_redis_py_does(server, workers, nblocks, data):
    ns = f"walk{next(_examples)}"
    r = redis.Redis.from_url(server.url)
    hashes = hash_full_blocks(list(range(nblocks * 16)), 16)
    sets = {}
    for i in range(workers):  # a leading run, then holes and strays
        run = data.draw(st.integers(0, nblocks))
        extra = data.draw(st.sets(st.integers(0, max(nblocks - 1, 0)), max_size=5)) if nblocks else set()
        sets[f"w{i}"] = {hashes[j] for j in range(run)} | {hashes[j] for j in extra} | {b"stray"}
        r.sadd(f"{ns}:prefix:w{i}", *sets[f"w{i}"])
    ids = list(sets) + ["nobody"]  # a worker without a set at all
    state = ClusterState(server.url, ns)
    want = reference({**sets, "nobody": set()}, hashes)
    assert state.prefix_matches(ids, hashes) == want
    assert asyncio.run(state.aprefix_matches(ids, hashes)) == want


def test_concurrent_walks_each_get_their_own_reply_even_with_callers_cancelled(server):
    ns = "walkc"
    r = redis.Redis.from_url(server.url)
    prompts = [list(range(k, k + 16 * (1 + k % 7))) for k in range(300)]
    chains = [hash_full_blocks(p, 16) for p in prompts]
    for k, h in enumerate(chains):  # worker k % 5 holds the first k % 4 blocks of prompt k
        if k % 4:
            r.sadd(f"{ns}:prefix:w{k % 5}", *h[: k % 4])
    ids = [f"w{i}" for i in range(5)]
    state = ClusterState(server.url, ns)
    want = [state.prefix_matches(ids, h) for h in chains]

    async def run():
        await state.aprefix_matches(ids, chains[0])  # connected
        tasks = [asyncio.ensure_future(state.aprefix_matches(ids, h)) for h in chains]
        await asyncio.sleep(0)  # all sent, no reply read yet
        for t in tasks[::10]:
            t.cancel()
        got = await asyncio.gather(*tasks, return_exceptions=True)
        after = await state.aprefix_matches(ids, chains[7])  # the connection is still in step
        return got, after

    got, after = asyncio.run(run())
    for k, g in enumerate(got):
        if k % 10:
            assert g == want[k], k
    assert after == want[7]


def _walk(url, ns, ids, hashes, walker=None):
    async def go():
        w = walker or PrefixWalker(url, _WALK_PREFIX)
        keys = [f"{ns}:prefix:{i}".encode() for i in ids]
        return await w.run(keys, [b"".join(hashes), b"16"])
    return go()


def test_a_restarted_redis_fails_the_call_then_the_next_reconnects_and_reloads_the_script():
    hashes = hash_full_blocks(list(range(64)), 16)
    with EmbeddedRedis() as server:
        redis.Redis.from_url(server.url).sadd("x:prefix:a", *hashes[:3])

        async def run():
            w = PrefixWalker(server.url, _WALK_PREFIX)
            assert await _walk(server.url, "x", ["a"], hashes, w) == b"3"
            redis.Redis.from_url(server.url).script_flush()
            assert await _walk(server.url, "x", ["a"], hashes, w) == b"3"  # NOSCRIPT: EVAL once
            server.restart()  # empty, its script cache too
            with pytest.raises(redis.ConnectionError):
                for _ in range(3):  # the first write may still go out before the close is seen
                    await _walk(server.url, "x", ["a"], hashes, w)
            redis.Redis.from_url(server.url).sadd("x:prefix:a", *hashes[:2])
            assert await _walk(server.url, "x", ["a"], hashes, w) == b"2"

        asyncio.run(run())


def test_a_stalled_redis_times_out_and_the_walk_recovers_when_it_answers_again():
    hashes = hash_full_blocks(list(range(32)), 16)
    with EmbeddedRedis() as server:
        redis.Redis.from_url(server.url).sadd("s:prefix:a", *hashes)

        async def run():
            w = PrefixWalker(server.url, _WALK_PREFIX, timeout_s=0.3)
            assert await _walk(server.url, "s", ["a"], hashes, w) == b"2"
            os.kill(server.proc.pid, signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                calls = [_walk(server.url, "s", ["a"], hashes, w) for _ in range(3)]
                got = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 30)
                assert all(isinstance(g, redis.TimeoutError) for g in got), got
                assert time.monotonic() - t0 < 30
            finally:
                os.kill(server.proc.pid, signal.SIGCONT)
            deadline = time.monotonic() + 30
            while True:  # answers again (the call that timed out dropped its connection)
                try:
                    assert await _walk(server.url, "s", ["a"], hashes, w) == b"2"
                    return
                except redis.TimeoutError:
                    assert time.monotonic() < deadline

        asyncio.run(run())


def test_a_wrong_password_is_a_redis_error_and_a_db_number_is_honoured(server):
    bad = server.url.replace(server.password, "wrong")
    with pytest.raises(redis.AuthenticationError):
        asyncio.run(_walk(bad, "p", ["a"], hash_full_blocks(list(range(16)), 16)))
    db3 = server.url.rsplit("/", 1)[0] + "/3"
    hashes = hash_full_blocks(list(range(48)), 16)
    redis.Redis.from_url(db3).sadd("p:prefix:a", *hashes[:2])
    assert asyncio.run(_walk(db3, "p", ["a"], hashes)) == b"2"
    assert asyncio.run(_walk(server.url, "p", ["a"], hashes)) == b"0"  # db 0 has no such set
    assert not PrefixWalker.supported("rediss://h:1") and not PrefixWalker.supported("unix:///tmp/r.sock")
