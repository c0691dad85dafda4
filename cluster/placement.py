"""Cross-GPU preemption policy: which requests to move where. Pure: the coordinator applies it.

A request *starves* when its worker lacks the device blocks to run it: it is swapped
out there (or waiting) and needs more blocks than the worker has free. For each
starving request, highest priority first (lowest value, then earliest arrival):

1. Resume it on another worker with room (its blocks plus headroom free): the one
   with the most free blocks. Its KV moves there through the object store and the
   next swap-in there resumes it.
2. Otherwise pick victims across all the other workers, among running requests of
   strictly lower priority (largest value first, then latest arrival), and take the
   first worker where they would free enough: those victims are swapped out to that
   worker's CPU memory and the starving request moves in.

A request that just moved waits `cooldown_s` before it may move again, so requests
do not ping-pong between workers on stale load figures.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from folio.worker.messages import RequestSummary, WorkerLoad


@dataclass(frozen=True)
class Move:
    request_id: str
    source: str
    destination: str
    preempt: tuple[str, ...] = field(default=())  # running requests to swap out on the destination first
    num_blocks: int = 0


def _headroom(load: WorkerLoad, fraction: float) -> int:
    return max(int(fraction * load.num_kv_blocks), 1)


def starving(loads: dict[str, WorkerLoad]) -> list[tuple[str, RequestSummary]]:
    out = []
    for w, load in loads.items():
        for r in load.requests:
            if r.state in ("swapped", "waiting") and r.num_blocks > load.num_free_blocks:
                out.append((w, r))
    out.sort(key=lambda wr: (wr[1].priority, wr[1].arrival_time, wr[1].request_id))
    return out


def victim_queries(loads: dict[str, WorkerLoad], headroom: float = 0.05) -> dict[str, int]:
    """{worker: priority} to ask `running_requests(priority)` of before planning: heartbeats
    list no running requests, so for each starving request that fits on no other worker as
    it is, the workers running anything less urgent than it (the smallest such priority)."""
    open_ = {w: l for w, l in loads.items() if not l.draining}
    asks: dict[str, int] = {}
    for src, r in starving(loads):
        kv = r.num_blocks if r.state == "swapped" else 0
        if any(d != src and l.num_free_blocks - _headroom(l, headroom) >= r.num_blocks and l.num_free_cpu_blocks >= kv
               for d, l in open_.items()):
            continue
        for d, l in open_.items():
            if d != src and l.max_running_priority is not None and l.max_running_priority > r.priority:
                asks[d] = min(asks.get(d, r.priority), r.priority)
    return asks


def plan_moves(loads: dict[str, WorkerLoad], now: float, last_moved: dict[str, float] | None = None,
               cooldown_s: float = 1.0, headroom: float = 0.05, max_moves: int = 8) -> list[Move]:
    last_moved = last_moved or {}
    open_ = {w: l for w, l in loads.items() if not l.draining}
    free = {w: l.num_free_blocks - _headroom(l, headroom) for w, l in open_.items()}
    cpu_free = {w: l.num_free_cpu_blocks for w, l in open_.items()}
    taken: set[str] = set()  # victims already claimed
    moves: list[Move] = []
    for src, r in starving(loads):
        if len(moves) >= max_moves:
            break
        if now - last_moved.get(r.request_id, float("-inf")) < cooldown_s:
            continue
        kv = r.num_blocks if r.state == "swapped" else 0  # what lands in the destination's swap space
        # its KV is sharded over the source's ranks: only a group of the same size can take it
        peers = [d for d in open_ if d != src and open_[d].tensor_parallel_size == loads[src].tensor_parallel_size]
        dests = [d for d in peers if free[d] >= r.num_blocks and cpu_free[d] >= kv]
        if dests:
            d = max(dests, key=lambda w: (free[w], w))
            moves.append(Move(r.request_id, src, d, (), r.num_blocks))
            free[d] -= r.num_blocks
            cpu_free[d] -= kv
            continue
        victims = sorted(((d, v) for d in peers for v in open_[d].requests
                          if v.state == "running" and v.priority > r.priority and v.request_id not in taken),
                         key=lambda dv: (-dv[1].priority, -dv[1].arrival_time, dv[1].request_id))
        gathered: dict[str, list[RequestSummary]] = {}
        for d, v in victims:
            gathered.setdefault(d, []).append(v)
            vs = gathered[d]
            freed = sum(x.num_blocks for x in vs)
            if free[d] + freed >= r.num_blocks and cpu_free[d] >= kv + freed:
                moves.append(Move(r.request_id, src, d, tuple(x.request_id for x in vs), r.num_blocks))
                free[d] += freed - r.num_blocks
                cpu_free[d] -= kv + freed
                taken.update(x.request_id for x in vs)
                break
    return moves
