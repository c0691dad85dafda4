"""Part of EngineWorker (actor.py): what the worker reports to the cluster. The step thread
offers its load every heartbeat_s; the publisher thread (heartbeat.py) sends the newest one
to Redis, and keeps the worker alive in Redis while a step runs long."""

from __future__ import annotations

import dataclasses
import os
import time

from folio.worker.messages import EngineCounters, QueueState, RequestSummary, WorkerLoad, wall_from_mono

QUEUED_IN_LOAD = 64  # the most waiting / swapped requests a heartbeat lists (the most urgent)


class LoadReports:
    # a step running longer than this is stuck: the worker's heartbeat lapses, and its watchdog
    # fails it so that the cluster restarts it (actor_steps.py)
    STEP_STALL_S = float(os.environ.get("FOLIO_STEP_STALL_S", "60"))

    def _load(self) -> WorkerLoad:
        e = self.engine
        st = e.stats()
        now = time.monotonic()
        t0, n0, rate = self._rate
        if now - t0 >= 1.0:
            rate = (e.num_generated_tokens - n0) / (now - t0)
            self._rate = (now, e.num_generated_tokens, rate)
        # the requests that wait for room, most urgent first; running ones only on request
        reqs = [RequestSummary(request_id=rid, state=state, priority=prio, arrival_time=wall_from_mono(arr),
                               num_blocks=blocks)
                for rid, state, prio, arr, blocks in e.request_summaries(e.queued_request_ids())
                if state is not QueueState.RUNNING]
        reqs.sort(key=lambda r: (r.priority, r.arrival_time, r.request_id))
        queued, least_urgent = e.queue_figures()
        counters = EngineCounters(prompt_tokens=self.num_prompt_tokens, generation_tokens=st.num_generated_tokens,
                                  preemptions_swap=st.preemptions_by_mode.get("swap", 0),
                                  preemptions_recompute=st.preemptions_by_mode.get("recompute", 0),
                                  prefix_cache_queries=st.prefix_cache_queries, prefix_cache_hits=st.prefix_cache_hits,
                                  timings=dataclasses.replace(e.timings))
        return WorkerLoad(worker_id=self.worker_id, timestamp=time.time(), num_kv_blocks=st.num_kv_blocks,
                          num_free_blocks=st.num_free_blocks, block_size=e.config.block_size,
                          tensor_parallel_size=e.config.tensor_parallel_size,
                          num_cpu_blocks=st.num_cpu_blocks, num_free_cpu_blocks=st.num_free_cpu_blocks,
                          cpu_usage=st.cpu_usage, num_running=st.num_running, num_waiting=st.num_waiting,
                          num_swapped=st.num_swapped, queued_tokens=queued, tokens_per_s=rate,
                          num_preemptions=st.num_preemptions, swapped_out_blocks=st.swapped_out_blocks,
                          swapped_in_blocks=st.swapped_in_blocks, num_migrations_in=self.num_migrations_in,
                          num_migrations_out=self.num_migrations_out, draining=self._draining,
                          requests=reqs[:QUEUED_IN_LOAD], counters=counters, max_running_priority=least_urgent)

    def _alive(self) -> bool:
        """For the heartbeat's keep-alive (publisher thread): the step thread runs, has not
        failed, and is not stuck in one step."""
        t = self._step_thread  # set by the step thread itself once it runs
        started = self._step_started
        return (not self.failed and not self._stop and t is not None and t.is_alive()
                and (started is None or time.monotonic() - started < self.STEP_STALL_S))

    def _offer_load(self) -> None:
        if self._heartbeat is not None and not self.failed:
            self._heartbeat.beat(self._load, self.engine)
