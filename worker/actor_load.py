"""Part of EngineWorker (actor.py): what the worker reports to the cluster. The step thread
offers its load every heartbeat_s; the publisher thread (heartbeat.py) sends the newest one
to Redis, and keeps the worker alive in Redis while a step runs long."""

from __future__ import annotations

import time

from folio.worker.messages import RequestSummary, WorkerLoad, wall_from_mono

QUEUED_IN_LOAD = 64  # the most waiting / swapped requests a heartbeat lists (the most urgent)


class LoadReports:
    STEP_STALL_S = 60.0  # a step running longer than this is stuck: the worker's heartbeat lapses

    def _load(self) -> WorkerLoad:
        e = self.engine
        st = e.stats()
        now = time.monotonic()
        t0, n0, rate = self._rate
        if now - t0 >= 1.0:
            rate = (e.num_generated_tokens - n0) / (now - t0)
            self._rate = (now, e.num_generated_tokens, rate)
        # the requests that wait for room, most urgent first; running ones only on request
        reqs = [RequestSummary(rid, state, prio, wall_from_mono(arr), blocks)
                for rid, state, prio, arr, blocks in e.request_summaries(e.queued_request_ids()) if state != "running"]
        reqs.sort(key=lambda r: (r.priority, r.arrival_time, r.request_id))
        queued, least_urgent = e.queue_figures()
        return WorkerLoad(self.worker_id, time.time(), st.num_kv_blocks, st.num_free_blocks, st.num_cpu_blocks,
                          st.num_free_cpu_blocks, e.config.block_size, st.num_running,
                          st.num_waiting, st.num_swapped, queued, rate, st.num_preemptions, st.swapped_out_blocks,
                          st.swapped_in_blocks, self.num_migrations_in, self.num_migrations_out, self._draining,
                          reqs[:QUEUED_IN_LOAD],
                          {"prompt_tokens": self.num_prompt_tokens, "generation_tokens": st.num_generated_tokens,
                           "preemptions_swap": st.preemptions_by_mode.get("swap", 0),
                           "preemptions_recompute": st.preemptions_by_mode.get("recompute", 0),
                           "prefix_cache_queries": st.prefix_cache_queries, "prefix_cache_hits": st.prefix_cache_hits,
                           "cpu_usage": st.cpu_usage, "steps": e.timings.steps,
                           **{f"step_s_{k}": v for k, v in vars(e.timings).items() if k != "steps"}},
                          least_urgent)

    def _alive(self) -> bool:
        """For the heartbeat's keep-alive (publisher thread): the step thread runs, has not
        failed, and is not stuck in one step."""
        t = self._step_thread  # set by the step thread itself once it runs
        started = self._step_started
        return (not self.failed and not self._stop and t is not None and t.is_alive()
                and (started is None or time.monotonic() - started < self.STEP_STALL_S))

    def _offer_load(self) -> None:
        if self._heartbeat is not None and not self.failed:
            self._heartbeat.beat(self._load, self.engine.kv)
