"""Structured output's share of a step: the costly grammars' masks take, over the steps, about
the share the engine gives them (`share`: the last forward's time, between MIN_SHARE_S and
STEP_FILL_S), so a costly grammar slows its own request, not every stream of its worker.

Each request's masks are timed as they are filled (guided.py: `fill_s`, all its sequences, the
last token's). A request whose masks took less than CHEAP_S always runs. When the costly ones
would take more than the share together, each earns share / (their number) a step, up to its
cost (deficit round robin), and runs once it has earned its cost: those ready, least recently
run first, while they fit the share (one alone may pass it: a request's own bound is
guided.FILL_BUDGET_S). The others sit the step out (the scheduler leaves them unscheduled, as
when the token budget runs out); when nothing else would run, the readiest runs. Before, each
request had only its own bound: 32 requests each just under it made every step of their worker
~1.4 s long, the other streams 18x slower (an attack, 2026-12-07).
"""

from __future__ import annotations

STEP_FILL_S = 0.1
MIN_SHARE_S = 0.01
CHEAP_S = 0.002


def share(forward_s: float) -> float:
    """The costly masks' share of a step, from the last forward's time."""
    return min(STEP_FILL_S, max(forward_s, MIN_SHARE_S))


def deferred(running: list, step: int, share_s: float = STEP_FILL_S) -> set[int]:
    """The ids of the requests (sequence groups) of `running` that sit step `step` out."""
    costly: dict[int, object] = {}
    others = False
    for s in running:
        if s.group.fill_s > CHEAP_S:
            costly[id(s.group)] = s.group
        else:
            others = True
    if sum(g.fill_s for g in costly.values()) <= share_s:
        for g in costly.values():
            g.fill_ran_at = step
        return set()
    grant = share_s / len(costly)
    spent, out = 0.0, set()
    for g in sorted(costly.values(), key=lambda g: g.fill_ran_at):
        g.fill_credit = min(g.fill_credit + grant, g.fill_s)
        if g.fill_credit >= g.fill_s * (1 - 1e-9) and (spent == 0.0 or spent + g.fill_s <= share_s):
            spent += g.fill_s
            g.fill_credit, g.fill_ran_at = 0.0, step
        else:
            out.add(id(g))
    if spent == 0.0 and not others:  # nothing else would run: the readiest runs
        g = max(costly.values(), key=lambda g: (g.fill_credit / g.fill_s, -g.fill_ran_at))
        out.discard(id(g))
        g.fill_credit, g.fill_ran_at = 0.0, step
    return out
