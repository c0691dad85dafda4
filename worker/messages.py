"""Messages that cross the Ray boundary between a worker and the cluster.

Small dataclasses of plain values (STYLE.md 3): a stream sends what is new, never
the whole request. The cluster reads them; the worker never imports the cluster.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from folio.worker.sampling_params import SamplingParams


@dataclass
class GenerateRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0  # lower runs first; the largest value is preempted first
    arrival_time: float | None = None  # time.time() at the frontend; None: when the worker sees it


@dataclass
class CompletionDelta:
    index: int  # which of the n completions
    token_ids: list[int]  # new output tokens since the previous chunk of this completion
    text: str  # their detokenized text ("" when the request asked for no detokenization)
    num_tokens: int  # output tokens of this completion so far, these included (checks continuity)
    finish_reason: str | None = None  # "stop" | "length" | "abort" once finished
    logprobs: list[dict[int, float]] | None = None


@dataclass
class StreamChunk:
    request_id: str
    worker_id: str  # who produced it
    deltas: list[CompletionDelta] = field(default_factory=list)
    finished: bool = False  # the last chunk of the request
    migrated_to: str | None = None  # the stream continues on this worker (attach there)
    num_preemptions: int = 0
    queue_s: float | None = None  # arrival to first scheduled, on the request's first chunk with tokens
    prompt_logprobs: list | None = None  # per prompt token (the first None), once, on the first chunk with tokens


def merge_chunks(a: StreamChunk, b: StreamChunk) -> StreamChunk:
    """`b` follows `a` on one stream: a single chunk carrying both (tokens and text
    appended per completion, counts and finish state from `b`)."""
    deltas = {d.index: d for d in a.deltas}
    for d in b.deltas:
        p = deltas.get(d.index)
        if p is None:
            deltas[d.index] = d
            continue
        logprobs = None if p.logprobs is None and d.logprobs is None else (p.logprobs or []) + (d.logprobs or [])
        deltas[d.index] = CompletionDelta(d.index, p.token_ids + d.token_ids, p.text + d.text, d.num_tokens,
                                          d.finish_reason, logprobs)
    return StreamChunk(b.request_id, b.worker_id, list(deltas.values()), b.finished, b.migrated_to,
                       b.num_preemptions, a.queue_s if a.queue_s is not None else b.queue_s,
                       a.prompt_logprobs if a.prompt_logprobs is not None else b.prompt_logprobs)


@dataclass
class RequestSummary:
    """What the coordinator needs to know of one request on a worker."""

    request_id: str
    state: str  # "running" | "waiting" | "swapped"
    priority: int
    arrival_time: float  # time.time() clock, comparable across workers
    num_blocks: int  # device blocks it holds (running) or needs to run (waiting / swapped)


@dataclass
class WorkerLoad:
    """A worker's heartbeat: its load, published to the cluster state every ~100 ms."""

    worker_id: str
    timestamp: float  # time.time() when measured
    num_kv_blocks: int
    num_free_blocks: int
    num_cpu_blocks: int
    num_free_cpu_blocks: int
    block_size: int
    num_running: int
    num_waiting: int
    num_swapped: int
    queued_tokens: int  # prompt tokens not yet computed, over waiting and running requests
    tokens_per_s: float  # generated tokens per second over the last few seconds
    num_preemptions: int
    swapped_out_blocks: int
    swapped_in_blocks: int
    num_migrations_in: int
    num_migrations_out: int
    draining: bool = False
    requests: list[RequestSummary] = field(default_factory=list)
    counters: dict = field(default_factory=dict)  # cumulative engine figures for /metrics
    # `requests` lists only the requests waiting for room (the most urgent QUEUED_IN_LOAD);
    # running ones are asked for (EngineWorker.running_requests) when a preemption is planned
    max_running_priority: int | None = None  # the least urgent running request's priority

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_kv_blocks if self.num_kv_blocks else 1.0


# Times on the wire are wall clock (time.time()): processes and nodes share it; an engine
# keeps monotonic times. These convert one to the other at the boundary.
def wall_from_mono(t: float) -> float:
    return time.time() - (time.monotonic() - t)


def mono_from_wall(t: float) -> float:
    return time.monotonic() - (time.time() - t)
