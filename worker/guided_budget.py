"""Structured output's share of a step: the grammars' masks of one step take at most about
STEP_FILL_S together, whatever the number of guided requests.

Each request's masks are timed as they are filled (guided.py: `fill_s`, all its sequences,
the last token's). A request whose masks took less than CHEAP_S always runs. When the costly
ones would take more than STEP_FILL_S together, those run that least recently ran, while they
fit (the first always), and the others sit the step out (the scheduler leaves them unscheduled,
as when the token budget runs out): a costly grammar slows its own request, not the step of
every stream. Before, each request had only its own bound (FILL_BUDGET_S a token): 32 requests
each just under it made every step of their worker ~1.4 s long, the other streams 18x slower
(an attack, 2026-12-07).
"""

from __future__ import annotations

STEP_FILL_S = 0.1
CHEAP_S = 0.002


def deferred(running: list, step: int) -> set[int]:
    """The ids of the requests (sequence groups) of `running` that sit step `step` out."""
    costly: dict[int, object] = {}
    for s in running:
        if s.group.fill_s > CHEAP_S:
            costly[id(s.group)] = s.group
    if sum(g.fill_s for g in costly.values()) <= STEP_FILL_S:
        for g in costly.values():
            g.fill_ran_at = step
        return set()
    spent, out = 0.0, set()
    for g in sorted(costly.values(), key=lambda g: g.fill_ran_at):
        if spent == 0.0 or spent + g.fill_s <= STEP_FILL_S:
            spent += g.fill_s
            g.fill_ran_at = step
        else:
            out.add(id(g))
    return out
