"""Continuous (iteration-level) batching.

Each step produces {sequence: num_new_tokens}; a sequence just advances its
`num_computed_tokens` — there are no separate prefill and decode phases. A
prompt longer than the step's token budget is prefilled in chunks across steps.

    schedule():
      1. running sequences, in order: each gets min(uncomputed tokens, budget);
         when blocks run out, preempt the victim (lowest priority, then latest
         arrival) until this sequence fits or is itself the victim;
      2. if nothing was preempted: admit waiting requests (priority, then
         arrival), reusing prefix-cached blocks, while budget, seats and blocks
         (above the watermark) last. Head-of-line blocking keeps the order fair.

The scheduler knows nothing of tensors; the engine runs what it returns.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from folio.worker.block_manager import KVCacheManager
from folio.worker.sequence import Sequence, SequenceGroup, SequenceStatus


def choose_victim(running: list[Sequence]) -> Sequence:
    """Policy: the lowest priority (largest value) first, then the latest arrival."""
    return max(running, key=lambda s: (s.priority, s.arrival_time, s.seq_id))


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # in batch order
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)
    preempted: list[Sequence] = field(default_factory=list)
    num_batched_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SchedulerStats:
    num_preemptions: int = 0  # recompute preemptions
    num_recomputed_tokens: int = 0  # computed tokens thrown away by preemption


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool = True, watermark_blocks: int = 0) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.watermark_blocks = watermark_blocks
        self.running: list[Sequence] = []
        self._waiting: list[tuple[int, float, int, Sequence]] = []  # heap (priority, arrival, id, seq)
        self._num_waiting = 0
        self.stats = SchedulerStats()

    # ---- queue management --------------------------------------------------------------
    def add(self, group: SequenceGroup) -> None:
        for seq in group.seqs:
            self._push_waiting(seq)

    def _push_waiting(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        heapq.heappush(self._waiting, (seq.priority, seq.arrival_time, seq.seq_id, seq))
        self._num_waiting += 1

    def _peek_waiting(self) -> Sequence | None:
        while self._waiting and self._waiting[0][3].status is not SequenceStatus.WAITING:
            heapq.heappop(self._waiting)  # lazily drop aborted entries
        return self._waiting[0][3] if self._waiting else None

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.running) or self._num_waiting > 0

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire `seq` (finished or aborted) from whichever queue holds it and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self._num_waiting -= 1  # its heap entry is dropped lazily
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = seq.finish_reason or reason
        self.kv.free(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence forked from a running one joins the batch directly."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def requeue(self, seq: Sequence) -> None:
        """A forked sequence that could not get blocks waits and recomputes its tokens."""
        seq.num_computed_tokens = 0
        self._push_waiting(seq)

    # ---- the policy --------------------------------------------------------------------
    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption: drop the KV, requeue. (Swap is the seam for a later issue.)"""
        self.running.remove(seq)
        self.kv.free(seq)
        self.stats.num_preemptions += 1
        self.stats.num_recomputed_tokens += seq.num_computed_tokens
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self._push_waiting(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled: dict[int, int] = {}  # seq_id -> num tokens, in insertion order
        by_id: dict[int, Sequence] = {}

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.kv.allocate_slots(seq, n):
                victim = choose_victim(self.running)
                vi = self.running.index(victim)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim.seq_id in scheduled:
                    budget += scheduled.pop(victim.seq_id)
                if vi < i:
                    i -= 1
                if victim is seq:
                    break
            else:
                scheduled[seq.seq_id] = n
                by_id[seq.seq_id] = seq
                budget -= n
                i += 1

        if not out.preempted:
            while budget > 0 and len(self.running) < self.max_num_seqs:
                seq = self._peek_waiting()
                if seq is None:
                    break
                group = seq.group
                if not group.forked and len(self.running) + group.params.n > self.max_num_seqs:
                    break  # keep seats for the n completions it will fork into
                blocks, num_cached = self.kv.get_computed_blocks(seq)
                n = seq.num_tokens - num_cached
                if n > budget:
                    if not self.enable_chunked_prefill:
                        break
                    n = budget
                reserve = self.watermark_blocks if self.running else 0  # alone, a request may use every block
                if not self.kv.allocate_slots(seq, n, blocks, reserve=reserve):
                    break
                heapq.heappop(self._waiting)
                self._num_waiting -= 1
                seq.num_computed_tokens = num_cached
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                scheduled[seq.seq_id] = n
                by_id[seq.seq_id] = seq
                budget -= n

        out.scheduled = [(by_id[sid], n) for sid, n in scheduled.items()]
        out.num_batched_tokens = self.max_num_batched_tokens - budget
        out.block_copies = self.kv.take_copies()
        return out
