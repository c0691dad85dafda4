"""Routing policies: pure functions from live load figures to a worker id.

Load score (lower is better): the fraction of a worker's KV cache that its current
and queued work needs, blocks in use plus queued prompt tokens in blocks plus blocks
swapped out to its CPU memory (they come back), plus the
requests the router sent since that worker's last heartbeat (so a burst between two
heartbeats does not pile onto one worker).
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field
from functools import cached_property

POLICIES = ("round-robin", "least-loaded", "power-of-two", "prefix-aware")


@dataclass
class SentSince:
    """What the router sent a worker that its last heartbeat may not show yet: send times
    (non-decreasing) and prompt tokens, with their sum, trimmed from the oldest end."""
    times: deque = field(default_factory=deque)  # (time.time(), tokens)
    tokens: int = 0

    def add(self, t: float, n: int) -> None:
        if self.times and t < self.times[-1][0]:
            t = self.times[-1][0]  # a wall clock stepped back: keep the order trim() relies on
        self.times.append((t, n))
        self.tokens += n

    def trim(self, heartbeat_time: float) -> None:
        """Drop what was sent at or before `heartbeat_time`: that heartbeat counts it."""
        times = self.times
        while times and times[0][0] <= heartbeat_time:
            self.tokens -= times.popleft()[1]


@dataclass(frozen=True)
class Candidate:
    worker_id: str
    num_kv_blocks: int
    num_free_blocks: int
    queued_tokens: int  # prompt tokens not yet computed, heartbeat + sent since
    num_waiting: int
    num_swapped: int
    block_size: int
    swapped_blocks: int = 0  # KV parked in CPU memory: demand that comes back

    @cached_property  # computed once per candidate: policies compare it many times
    def load(self) -> float:
        used = self.num_kv_blocks - self.num_free_blocks
        queued = -(-self.queued_tokens // self.block_size)
        return ((used + queued + self.swapped_blocks) / max(self.num_kv_blocks, 1)
                + 0.01 * (self.num_waiting + self.num_swapped))


def round_robin(cands: list[Candidate], counter: int) -> str:
    ids = sorted(c.worker_id for c in cands)
    return ids[counter % len(ids)]


def least_loaded(cands: list[Candidate]) -> str:
    return min(cands, key=lambda c: (c.load, c.worker_id)).worker_id


def power_of_two(cands: list[Candidate], rng: random.Random) -> str:
    """Two workers at random, the less loaded of them: near least-loaded balance with
    stale figures, without every router herding onto the same minimum."""
    if len(cands) == 1:
        return cands[0].worker_id
    a, b = rng.sample(cands, 2)
    return a.worker_id if (a.load, a.worker_id) <= (b.load, b.worker_id) else b.worker_id


def prefix_aware(cands: list[Candidate], matches: dict[str, int], imbalance: float = 0.25) -> str:
    """The worker holding the longest cached prefix of the prompt, while its load is within
    `imbalance` of the least-loaded worker's; otherwise (or with no match) least-loaded."""
    fallback = min(cands, key=lambda c: (c.load, c.worker_id))
    best = max(matches.get(c.worker_id, 0) for c in cands)
    if best == 0:
        return fallback.worker_id
    holders = [c for c in cands if matches.get(c.worker_id, 0) == best]
    pick = min(holders, key=lambda c: (c.load, c.worker_id))
    return pick.worker_id if pick.load - fallback.load <= imbalance else fallback.worker_id
