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
      3. a prefill chunk is at most `long_prefill_tokens` (vLLM's
         long_prefill_token_threshold): a long prompt's prefill leaves room in
         every step for the requests that arrive during it, and a step lasts what
         that many tokens take, so no stream waits longer than that for its next
         token and no newcomer for its first. One long prompt is prefilled at a
         time (MAX_LONG_PREFILLS); shorter requests are admitted past the others.

A preempted sequence is swapped out to CPU memory (its KV kept) or recomputed
(its KV dropped), per `preemption.choose_mode`. Swapped sequences come back
before any new admission, and only when the blocks they need leave headroom for
every running sequence to grow, so a request is not swapped in only to be
preempted again at once.

The scheduler knows nothing of tensors; the engine runs what it returns.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from folio.worker import guided_budget
from folio.worker.block_manager import KVCacheManager
from folio.worker.preemption import PreemptionRates, choose_mode, choose_victim
from folio.worker.sequence import Sequence, SequenceGroup, SequenceStatus

# Long prompts (over long_prefill_tokens) prefilled at once, as vLLM's max_long_partial_prefills:
# several long prefills admitted together, each a chunk a step, ran out of blocks and preempted
# each other (8 prompts of 16x the chunk, blocks for 3 of them: 1,377 tokens recomputed, 0 without
# the chunk limit); the others wait, while shorter requests are admitted past them.
MAX_LONG_PREFILLS = 1

__all__ = ["Scheduler", "SchedulerOutput", "SchedulerStats", "choose_victim"]


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # in batch order
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    preempted: list[Sequence] = field(default_factory=list)
    num_batched_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SchedulerStats:
    num_preemptions: int = 0  # all preemptions
    preemptions_by_mode: dict = field(default_factory=lambda: {"swap": 0, "recompute": 0})
    num_recomputed_tokens: int = 0  # computed tokens thrown away by recompute preemption
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool = True, watermark_blocks: int = 0,
                 preemption_mode: str = "recompute", kv_bytes_per_block: int = 0,
                 rates: PreemptionRates | None = None, long_prefill_tokens: int = 0) -> None:
        self.kv = kv
        # 0: off; only with chunked prefill (without, a prompt goes in one step whole)
        self.long_prefill_tokens = long_prefill_tokens if enable_chunked_prefill else 0
        self.preemption_mode = preemption_mode
        self.kv_bytes_per_block = kv_bytes_per_block
        self.rates = rates or PreemptionRates()
        self.swapped: list[Sequence] = []  # KV in CPU memory, waiting to come back
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.watermark_blocks = watermark_blocks
        self.running: list[Sequence] = []
        self._waiting: list[tuple[int, float, int, Sequence]] = []  # heap (priority, arrival, id, seq)
        self._num_waiting = 0
        self.stats = SchedulerStats()
        self.steps, self.mask_share_s = 0, guided_budget.STEP_FILL_S  # (the engine sets the share)

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

    def waiting_sequences(self) -> list[Sequence]:
        """The waiting sequences, in no particular order."""
        return list(dict.fromkeys(e[3] for e in self._waiting if e[3].status is SequenceStatus.WAITING))

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_swapped(self) -> int:
        return len(self.swapped)

    def has_unfinished(self) -> bool:
        return bool(self.running) or self._num_waiting > 0 or bool(self.swapped)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire `seq` (finished or aborted) from whichever queue holds it and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.SWAPPED:
            self.swapped.remove(seq)
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
    def add_swapped(self, seq: Sequence) -> None:
        """An imported sequence whose KV sits in this engine's swap space."""
        seq.status = SequenceStatus.SWAPPED
        self.swapped.append(seq)

    def preempt(self, seq: Sequence) -> None:
        """Preempt a running sequence between steps (an order from the cluster's coordinator)."""
        if seq.status is SequenceStatus.RUNNING:
            self._preempt(seq, allocated_this_step=False)

    def _preempt(self, seq: Sequence, allocated_this_step: bool) -> None:
        """Swap `seq` out or drop its KV, per the preemption mode; it leaves the batch."""
        self.running.remove(seq)
        self.stats.num_preemptions += 1
        seq.num_preemptions += 1
        seq.group.metrics.num_preemptions += 1
        mode = "recompute"
        # A sequence allocated for in this step may have pending writes (copy-on-write)
        # that a swap-out would miss: it is recomputed.
        if self.preemption_mode != "recompute" and not allocated_this_step:
            blocks = len(self.kv.block_table(seq))
            mode = choose_mode(self.preemption_mode, blocks * self.kv_bytes_per_block, seq.num_computed_tokens,
                               self.rates)
            if mode == "swap" and self.kv.swap_out(seq):
                self.stats.preemptions_by_mode["swap"] += 1
                self.stats.swapped_out_blocks += blocks
                seq.status = SequenceStatus.SWAPPED
                self.swapped.append(seq)
                return
        # recompute: drop the KV, requeue
        self.stats.preemptions_by_mode["recompute"] += 1
        self.kv.free(seq)
        self.stats.num_recomputed_tokens += seq.num_computed_tokens
        seq.num_computed_tokens = 0
        self._push_waiting(seq)

    def _swap_in(self, budget: int, scheduled: dict[int, int], by_id: dict[int, Sequence]) -> int:
        """Bring swapped sequences back (priority, then arrival) while they fit with headroom."""
        self.swapped.sort(key=lambda s: (s.priority, s.arrival_time, s.seq_id))
        while self.swapped and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.swapped[0]
            head = self._peek_waiting()
            if head is not None and head.priority < seq.priority:
                break  # a higher-priority request waits: it is admitted first
            n = min(seq.num_tokens - seq.num_computed_tokens, budget, self.long_prefill_tokens or budget)
            # room for its next tokens, plus headroom: the watermark and one block per
            # running sequence (each may grow), so it is not preempted again at once
            held = self.kv.swapped_blocks(seq)
            grow = max(0, self.kv.max_blocks_per_seq(seq.num_computed_tokens + n) - held)
            reserve = grow + (self.watermark_blocks + len(self.running) if self.running else 0)
            if not self.kv.swap_in(seq, reserve=reserve):
                break
            if not self.kv.allocate_slots(seq, n):
                raise RuntimeError("headroom reserved for a swapped-in sequence was not there")
            self.swapped.pop(0)
            self.stats.swapped_in_blocks += held
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled[seq.seq_id] = n
            by_id[seq.seq_id] = seq
            budget -= n
        return budget

    def _long_prefills(self, cap: int) -> int:
        """Running sequences with more than a chunk of their prompt still to prefill."""
        if not self.long_prefill_tokens:
            return 0
        return sum(1 for q in self.running if q.num_tokens - q.num_computed_tokens > cap)

    def _long_prefill(self, seq: Sequence, cap: int) -> bool:
        """More than a chunk of `seq`'s prompt is not in the prefix cache."""
        return seq.num_tokens - self.kv.get_computed_blocks(seq, count=False)[1] > cap

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled: dict[int, int] = {}  # seq_id -> num tokens, in insertion order
        by_id: dict[int, Sequence] = {}
        cap = self.long_prefill_tokens or budget  # step 3

        i, self.steps = 0, self.steps + 1
        sit_out = guided_budget.deferred(self.running, self.steps, self.mask_share_s)  # costly grammars
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if sit_out and id(seq.group) in sit_out:
                i += 1
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, budget, cap)
            while not self.kv.allocate_slots(seq, n):
                victim = choose_victim(self.running)
                vi = self.running.index(victim)
                self._preempt(victim, allocated_this_step=victim.seq_id in scheduled)
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
            budget = self._swap_in(budget, scheduled, by_id)
        if not out.preempted:
            # swapped requests go first, except where a waiting one has strictly higher
            # priority (a victim swapped out to make room for it must not take the room back)
            blocking = min((s.priority for s in self.swapped), default=None)
            longs, held = self._long_prefills(cap), []
            while budget > 0 and len(self.running) < self.max_num_seqs:
                seq = self._peek_waiting()
                if seq is None or (blocking is not None and seq.priority >= blocking):
                    break
                if seq.num_tokens > cap and longs >= MAX_LONG_PREFILLS and self._long_prefill(seq, cap):
                    held.append(heapq.heappop(self._waiting))  # waits for the long one; others go on
                    continue
                group = seq.group
                if not group.forked and len(self.running) + group.params.n > self.max_num_seqs:
                    break  # keep seats for the n completions it will fork into
                blocks, num_cached = self.kv.get_computed_blocks(seq)
                n = seq.num_tokens - num_cached
                if n > budget:
                    if not self.enable_chunked_prefill:
                        break
                    n = budget
                n = min(n, cap)
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
                longs += seq.num_tokens - num_cached > cap
            for entry in held:
                heapq.heappush(self._waiting, entry)

        out.scheduled = [(by_id[sid], n) for sid, n in scheduled.items()]
        out.num_batched_tokens = self.max_num_batched_tokens - budget
        out.block_copies = self.kv.take_copies()
        out.swap_out, out.swap_in = self.kv.take_swaps()
        return out
