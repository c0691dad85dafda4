"""worker/guided_budget.py: the costly grammars of a step share what the engine gives them,
earned a step at a time (deficit round robin); none starves; cheap ones always run; when
nothing else would run, one does."""

from __future__ import annotations

import math
from types import SimpleNamespace

from hypothesis import given, settings, strategies as st

from folio.worker import guided_budget as gb


@settings(max_examples=300, deadline=None)
@given(costs=st.lists(st.sampled_from([0.0, 0.001, 0.003, 0.02, 0.05, 0.09, 0.2]), min_size=1, max_size=12),
       n=st.lists(st.integers(1, 3), min_size=12, max_size=12), steps=st.integers(1, 120),
       share=st.sampled_from([0.01, 0.03, 0.1]))
def test_the_costly_grammars_share_the_steps_and_none_starves(costs, n, steps, share):
    groups = [SimpleNamespace(fill_s=c, fill_ran_at=0, fill_credit=0.0) for c in costs]
    running = [SimpleNamespace(group=g) for g, k in zip(groups, n) for _ in range(k)]  # n sequences a request
    costly = [g for g in groups if g.fill_s > gb.CHEAP_S]
    others = len(costly) < len(groups)
    last_ran = {id(g): 0 for g in groups}
    total = sum(g.fill_s for g in costly)
    # a costly request earns its cost in ceil(cost * K / share) steps, then waits at most for the others
    bound = len(costly) * (math.ceil(max([g.fill_s for g in costly], default=0) * len(costly) / share) + 1)
    spent_all = 0.0
    for step in range(1, steps + 1):
        out = gb.deferred(running, step, share)
        ran = [g for g in costly if id(g) not in out]
        assert all(id(g) not in out for g in groups if g.fill_s <= gb.CHEAP_S)  # cheap: always
        assert ran or others or not costly  # a step never runs nothing
        spent = sum(g.fill_s for g in ran)
        assert len(ran) <= 1 or spent <= max(share, total if total <= share else 0) + 1e-12
        spent_all += spent
        for g in ran:
            last_ran[id(g)] = step
        for g in costly:
            assert step - last_ran[id(g)] <= bound, "a costly request starves"
    if total > share and others:  # over the steps: about the share, never much more
        assert spent_all <= share * steps + max(g.fill_s for g in costly) * len(costly) + 1e-9
