"""The frontend replicas' metrics summed through Redis (deploy/replica_metrics.py), against a real
redis-server: every replica answers the same sum; no scrape is lower than an earlier one, whichever
replicas publish, go silent, are folded as gone or come back; Redis away keeps the last figures."""

import shutil
import subprocess
import uuid

import pytest
import redis
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from folio.cluster.redis_server import EmbeddedRedis
from folio.cluster.state import ClusterState
from folio.deploy.metrics import Metrics
from folio.deploy.replica_metrics import RETIRED, figures

RETIRE_S = 100.0


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def redis_server():
    with EmbeddedRedis() as server:
        yield server


def replicas(url: str, n: int, clock=None, ns: str | None = None) -> list[Metrics]:
    ns = ns or f"t-{uuid.uuid4().hex[:8]}"
    out = []
    for _ in range(n):
        m = Metrics(ClusterState(url, ns), "m")
        if clock is not None:
            m.replicas.clock, m.replicas.retire_s = clock, RETIRE_S
        out.append(m)
    return out


def scraped(m: Metrics) -> dict:
    """(sample name, labels) -> value of the frontend families in one scrape, Prometheus' text."""
    body, _ = m.render()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(body.decode())
            for s in f.samples if s.name.startswith(("folio_requests_total", "folio_time_to_first_token"))}


def requests(figs: dict) -> float:
    return sum(v for (name, _), v in figs.items() if name == "folio_requests_total")


def test_every_replica_answers_the_sum_of_all(redis_server):
    a, b = replicas(redis_server.url, 2)
    for _ in range(3):
        a.requests.labels(finish_reason="stop").inc()
        a.ttft.observe(0.004)
    for t in (0.3, 0.4):
        b.requests.labels(finish_reason="length").inc()
        b.ttft.observe(t)
    b.requests.labels(finish_reason="error").inc()
    b.replicas.publish()
    got = [scraped(m) for m in (a, b, a)]
    assert got[0] == got[1] == got[2]
    by = {dict(labels).get("finish_reason"): v for (name, labels), v in got[0].items()
          if name == "folio_requests_total"}
    assert by == {"stop": 3, "length": 2, "error": 1}
    m = {(name, dict(labels).get("le")): v for (name, labels), v in got[0].items()}
    assert m[("folio_time_to_first_token_seconds_count", None)] == 5
    assert m[("folio_time_to_first_token_seconds_bucket", "0.005")] == 3
    assert m[("folio_time_to_first_token_seconds_bucket", "0.5")] == 5
    assert m[("folio_time_to_first_token_seconds_sum", None)] == pytest.approx(0.712)
    if shutil.which("promtool"):  # the summed families are still valid exposition, in both formats
        for accept in (None, "application/openmetrics-text; version=1.0.0"):
            body, _ = a.render(accept)
            r = subprocess.run(["promtool", "check", "metrics"], input=body.decode(), capture_output=True, text=True,
                               timeout=60)
            assert r.returncode == 0 or "openmetrics" in str(accept), r.stdout + r.stderr


def test_redis_away_keeps_the_last_figures(redis_server):
    """Its own live figures and every other replica's last read, summed (the others' values
    overwrote one another: 2 of 3 replicas' counts went missing, an attack, 2026-12-07)."""
    with EmbeddedRedis() as own_redis:
        a, b, c = replicas(own_redis.url, 3)
        b.requests.labels(finish_reason="stop").inc(4)
        b.replicas.publish()
        c.requests.labels(finish_reason="stop").inc(7)
        c.e2e.observe(0.5)
        c.replicas.publish()
        a.requests.labels(finish_reason="stop").inc()
        a.e2e.observe(0.5)
        before = scraped(a)
        assert requests(before) == 12
        own_redis.stop()
        a.requests.labels(finish_reason="stop").inc()
        during = scraped(a)
        assert requests(during) == 13
        assert all(during.get(k, 0) >= v for k, v in before.items())  # no total went down


def test_a_field_that_is_not_a_replicas_figures_counts_as_none(redis_server):
    a, b = replicas(redis_server.url, 2)
    a.requests.labels(finish_reason="stop").inc()
    a.replicas.publish()
    a.replicas.r.hset(a.replicas.key, mapping={"junk": b"not json", "junk2": b'{"t": 1}', RETIRED: b"[1, 2]"})
    assert requests(scraped(b)) == 1


def test_a_replica_folded_as_gone_then_back_counts_again(redis_server):
    """A replica silent past RETIRE_S (a partition, a long GC) is folded into "retired" by
    another's scrape; back, it goes on under a new id with what it counted since its last
    publish: every total from then on has all its counts, once (until 2026-12-07 it published
    no more, and what it counted after the fold was missing from every total for good), and
    so has its own answer while Redis is away."""
    clock = Clock()
    a, b = replicas(redis_server.url, 2, clock)
    a.requests.labels(finish_reason="stop").inc(3)
    a.replicas.publish()
    clock.now += RETIRE_S + 1
    b.requests.labels(finish_reason="stop").inc(1)
    assert requests(scraped(b)) == 4  # a folded: its 3 now in "retired"
    assert a.replicas.id.encode() not in a.replicas.r.hkeys(a.replicas.key)
    a.requests.labels(finish_reason="length").inc(2)  # a is back
    assert a.replicas.publish()
    assert requests(scraped(b)) == 6 and requests(scraped(a)) == 6
    for _ in range(3):  # folded again and back again: never counted twice
        clock.now += RETIRE_S + 1
        want = requests(figures(a.own)) + 1
        assert requests(scraped(b)) == want
        a.requests.labels(finish_reason="stop").inc(1)
        assert requests(scraped(a)) == requests(scraped(b)) == want + 1
    assert requests(scraped(a)) == 9
    a.replicas.r = b.replicas.r = redis.Redis(port=1, socket_connect_timeout=0.2)  # Redis away: nothing reached
    a.requests.labels(finish_reason="stop").inc(1)
    assert requests(scraped(a)) == 10  # its own (all of it, once) and the others' as last read


OPS = st.lists(st.one_of(
    st.tuples(st.just("inc"), st.integers(0, 2), st.sampled_from(["stop", "length", "error"]), st.integers(1, 5)),
    st.tuples(st.just("publish"), st.integers(0, 2)),
    st.tuples(st.just("scrape"), st.integers(0, 2)),
    st.tuples(st.just("gone"), st.integers(0, 2)),  # never publishes nor is scraped again
    st.tuples(st.just("tick"), st.sampled_from([0.5, 60.0, 150.0])),
), min_size=1, max_size=40)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS)
@example(ops=[("scrape", 0), ("tick", 150.0), ("scrape", 1), ("inc", 0, "stop", 1), ("scrape", 0)])  # folded, back
def test_totals_are_what_every_replica_published_and_never_go_down(redis_server, ops):
    """Oracle: a scrape's totals are the sum of every replica's last published figures (the
    scraped one publishes first; one folded as gone, then back, goes on under a new id with
    what it counted since: until 2026-12-07 it published no more, and its counts after the
    fold were lost from every total). And no total is lower than in an earlier scrape, from
    whichever replica."""
    clock = Clock()
    ms = replicas(redis_server.url, 3, clock)
    published: list[dict] = [{}, {}, {}]
    gone, last = set(), {}
    for op in ops:
        kind, i = op[0], op[1]
        if kind == "tick":
            clock.now += i
            continue
        if i in gone:
            continue
        if kind == "inc":
            ms[i].requests.labels(finish_reason=op[2]).inc(op[3])
            ms[i].e2e.observe(0.01 * op[3])
        elif kind == "gone":
            gone.add(i)
        elif kind == "publish":
            if ms[i].replicas.publish():
                published[i] = figures(ms[i].own)
        else:
            published[i] = figures(ms[i].own)
            got = ms[i].replicas.total()
            want: dict = {}
            for figs in published:
                for k, v in figs.items():
                    want[k] = want.get(k, 0.0) + v
            assert {k: v for k, v in got.items() if v} == pytest.approx({k: v for k, v in want.items() if v})
            for k, v in last.items():
                assert got.get(k, 0.0) >= v - 1e-9, k
            last = got
    fields = {f.decode() for f in ms[0].replicas.r.hkeys(ms[0].replicas.key)}
    assert len(fields) <= 4  # three replicas and "retired" at most: the gone are folded, not kept


def test_many_replicas_gone_leave_one_field(redis_server):
    clock = Clock()
    ns = f"t-{uuid.uuid4().hex[:8]}"
    for _ in range(20):  # replicas started, served, published and gone
        (m,) = replicas(redis_server.url, 1, clock, ns)
        m.requests.labels(finish_reason="stop").inc()
        m.replicas.publish()
    clock.now += RETIRE_S + 1
    (live,) = replicas(redis_server.url, 1, clock, ns)
    assert requests(scraped(live)) == 20
    assert {f.decode() for f in live.replicas.r.hkeys(live.replicas.key)} == {RETIRED, live.replicas.id}
    assert requests(scraped(live)) == 20
