"""forward_lanes.split: a step's batch in parts for the lanes. Every pair goes to exactly one
part, a request's sequences stay together and in order, parts are about equal in tokens, and
a batch too small (or one request) is not split."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from folio.worker.forward_lanes import split


@dataclass(eq=False)
class Group:
    name: int


@dataclass(eq=False)
class Seq:
    group: Group


batches = st.lists(st.tuples(st.integers(0, 9), st.integers(1, 600)), min_size=0, max_size=80)


def build(spec):
    groups = {}
    return [(Seq(groups.setdefault(g, Group(g))), n) for g, n in spec]


@settings(max_examples=300, deadline=None)
@given(spec=batches, lanes=st.integers(2, 4), min_per_lane=st.integers(0, 8))
def test_parts_cover_the_batch_keep_requests_whole_and_balance_tokens(spec, lanes, min_per_lane):
    scheduled = build(spec)
    parts = split(scheduled, lanes, min_per_lane)
    requests = {id(s.group) for s, _ in scheduled}
    if len(scheduled) < max(2 * min_per_lane, 2) or len(requests) < 2:
        assert parts is None
        return
    assert parts is not None and 2 <= len(parts) <= lanes and all(parts)
    flat = [x for p in parts for x in p]
    assert sorted((id(s), n) for s, n in flat) == sorted((id(s), n) for s, n in scheduled)  # each pair once
    where = {}
    for i, p in enumerate(parts):
        for s, _ in p:
            assert where.setdefault(id(s.group), i) == i  # a request in one part
    for g in requests:  # in their order
        assert [x for x in flat if id(x[0].group) == g] == [x for x in scheduled if id(x[0].group) == g]
    total = sum(n for _, n in scheduled)
    biggest = max(sum(n for _, n in pairs) for pairs in _by_request(scheduled))
    for p in parts:  # no part is more than its share by more than one request's tokens
        assert sum(n for _, n in p) <= total / len(parts) + biggest + total / lanes


def _by_request(scheduled):
    out = {}
    for s, n in scheduled:
        out.setdefault(id(s.group), []).append((s, n))
    return out.values()


def test_a_big_batch_of_decodes_halves():
    scheduled = build([(i, 1) for i in range(64)])
    parts = split(scheduled, 2, 16)
    assert [len(p) for p in parts] == [32, 32]
    assert split(scheduled[:31], 2, 16) is None
