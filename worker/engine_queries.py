"""Part of LLMEngine (engine.py): what the worker asks of the engine's requests between
steps, for its heartbeat and for the coordinator's plans. Each is one pass over the
queues it names (never over every request when it need not)."""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from folio.worker.messages import QueueState
from folio.worker.sequence import Sequence, SequenceStatus


class RequestQueries:
    def request_summaries(self, request_ids: Iterable[str] | None = None
                          ) -> list[tuple[str, QueueState, int, float, int]]:
        """(request id, its QueueState, priority, arrival (monotonic), device
        blocks held or needed) for every unfinished request (or those of `request_ids` still
        here): what the coordinator plans with."""
        out = []
        groups = self.groups
        items = groups.items() if request_ids is None else ((r, groups[r]) for r in request_ids if r in groups)
        for rid, group in items:
            live = [s for s in group.seqs if not s.is_finished]
            if not live:
                continue
            states = {s.status for s in live}
            state = (QueueState.RUNNING if SequenceStatus.RUNNING in states
                     else QueueState.SWAPPED if SequenceStatus.SWAPPED in states else QueueState.WAITING)
            blocks = sum(len(self.kv.block_table(s)) if s.status is SequenceStatus.RUNNING
                         else self.kv.max_blocks_per_seq(s.num_tokens + 1) for s in live)
            out.append((rid, state, group.priority, group.arrival_time, blocks))
        return out

    def request_ids(self) -> list[str]:
        """Every request here that has not ended (a copy: the caller may abort them)."""
        return list(self.groups)

    def queued_request_ids(self) -> list[str]:
        """The requests with a sequence waiting or swapped out (O(queued), not O(all requests))."""
        sch = self.scheduler
        seqs = itertools.chain(sch.swapped, sch.waiting_sequences())
        return list(dict.fromkeys(s.group.request_id for s in seqs))

    def running_request_ids(self, min_priority: int | None = None) -> list[str]:
        """The requests with a running sequence, of priority > `min_priority` when given."""
        run = self.scheduler.running
        return list(dict.fromkeys(s.group.request_id for s in run if min_priority is None or s.priority > min_priority))

    def queue_figures(self) -> tuple[int, int | None]:
        """(prompt tokens not yet computed, over waiting, swapped and running sequences; the
        largest priority value, the least urgent, among running ones): one pass, for the
        heartbeat (running sequences still prefilling are the only running ones that count)."""
        sch = self.scheduler
        queued = sum(max(s.num_prompt_tokens - s.num_computed_tokens, 0)
                     for s in itertools.chain(sch.swapped, sch.waiting_sequences()))
        worst = None
        for s in sch.running:
            if s.num_computed_tokens < s.num_prompt_tokens:
                queued += s.num_prompt_tokens - s.num_computed_tokens
            p = s.group.priority
            if worst is None or p > worst:
                worst = p
        return queued, worst

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    def live_sequences(self) -> list[Sequence]:
        return [s for g in self.groups.values() for s in g.seqs if not s.is_finished]
