"""worker/guided_budget.py: the costly grammars of a step share STEP_FILL_S, least recently run
first; none starves; cheap ones always run."""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import given, settings, strategies as st

from folio.worker import guided_budget as gb


@settings(max_examples=200, deadline=None)
@given(costs=st.lists(st.sampled_from([0.0, 0.001, 0.003, 0.02, 0.05, 0.09, 0.2]), min_size=1, max_size=12),
       n=st.lists(st.integers(1, 3), min_size=12, max_size=12), steps=st.integers(1, 40))
def test_a_step_runs_its_costly_grammars_within_the_share_and_none_starves(costs, n, steps):
    groups = [SimpleNamespace(fill_s=c, fill_ran_at=0) for c in costs]
    running = [SimpleNamespace(group=g) for g, k in zip(groups, n) for _ in range(k)]  # n sequences a request
    costly = [g for g in groups if g.fill_s > gb.CHEAP_S]
    last_ran = {id(g): 0 for g in groups}
    for step in range(1, steps + 1):
        out = gb.deferred(running, step)
        ran = [g for g in costly if id(g) not in out]
        assert all(id(g) not in out for g in groups if g.fill_s <= gb.CHEAP_S)  # cheap: always
        assert ran or not costly  # something runs
        assert len(ran) == 1 or sum(g.fill_s for g in ran) <= gb.STEP_FILL_S + 1e-12
        for g in ran:
            last_ran[id(g)] = step
        for g in costly:  # round robin: each runs at least once in any len(costly) steps
            assert step - last_ran[id(g)] < len(costly)
