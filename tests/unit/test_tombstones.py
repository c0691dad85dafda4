"""A worker's tombstones (worker/outbox.py): an abort that found nothing wins over its request
when that request was sent before the abort (it overtook it on the way), and only then: a
request sent after it is a new one and runs. Before, the tombstone refused every request with
the id for 60 s, so a client that aborted an id not running, or its own finished request (the
router asks every worker), had its next request with the id cancelled at once."""

import time

from hypothesis import given, settings
from hypothesis import strategies as st

from folio.worker import outbox
from folio.worker.outbox import Tombstones

IDS = st.sampled_from(["a", "b", "c"])
OPS = st.lists(st.one_of(st.tuples(st.just("abort"), IDS), st.tuples(st.just("seen"), IDS),
                         st.tuples(st.just("take"), IDS, st.sampled_from(["before", "after", "unknown"]))),
               max_size=40)


@settings(max_examples=300, deadline=None)
@given(OPS)
def test_an_abort_wins_over_a_request_sent_before_it_and_only_that(ops):
    t = Tombstones()
    dead: dict[str, float] = {}  # the model: id -> when its abort came
    seen: set[str] = set()
    for op in ops:
        if op[0] == "abort":
            t.abort_unknown(op[1])
            if op[1] not in seen:
                dead[op[1]] = time.time()
        elif op[0] == "seen":
            t.seen(op[1])
            seen.add(op[1])
        else:
            rid, when = op[1], op[2]
            at = dead.pop(rid, None)
            sent = {"before": (at or time.time()) - 0.5, "after": time.time() + 0.5, "unknown": None}[when]
            assert t.take(rid, sent) == (at is not None and when != "after"), (rid, when)
    assert len(t) == len(dead)


def test_a_tombstone_expires_and_the_kept_ones_are_bounded(monkeypatch):
    monkeypatch.setattr(outbox, "TOMBSTONE_S", 0.0)
    t = Tombstones()
    t.abort_unknown("a")
    assert not t.take("a", None)  # expired
    monkeypatch.setattr(outbox, "TOMBSTONE_S", 60.0)
    monkeypatch.setattr(outbox, "TOMBSTONES_KEPT", 3)
    for i in range(10):
        t.abort_unknown(f"r{i}")
    assert len(t) == 3 and t.take("r9", None) and not t.take("r0", None)
