"""Messages that cross the Ray boundary between a worker and the cluster.

Small keyword-only dataclasses of plain values (STYLE.md 3), one comment per field: a
stream sends what is new, never the whole request. The cluster reads them; the worker
never imports the cluster. States and finish reasons are StrEnums: they compare equal to,
and serialise as, their string values (JSON in Redis, OpenAI's finish_reason).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import StrEnum

from folio.worker.sampling_params import SamplingParams
from folio.worker.stats import StepTimings


class FinishReason(StrEnum):
    STOP = "stop"  # an EOS or stop token, a stop string, or the grammar's end
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # cancelled (the client left, an abort, a drain's deadline)
    ERROR = "error"  # the engine failed this request alone (fault_isolation.py); the chunk says why
    MIGRATED = "migrated"  # engine-internal: exported to another worker (never on a stream)


class QueueState(StrEnum):
    RUNNING = "running"  # scheduled: holds device blocks
    WAITING = "waiting"  # queued, or preempted by recompute: holds no blocks
    SWAPPED = "swapped"  # preempted by swap: its KV is in the worker's swap space


@dataclass(kw_only=True)
class GenerateRequest:
    request_id: str  # unique in the cluster while the request lives
    prompt_token_ids: list[int]  # tokenized by the frontend
    params: SamplingParams  # validated by the frontend, again by the engine
    priority: int = 0  # lower runs first; the largest value is preempted first
    arrival_time: float | None = None  # time.time() at the frontend; None: when the worker sees it


@dataclass(kw_only=True)
class CompletionDelta:
    index: int  # which of the n completions
    token_ids: list[int]  # new output tokens since the previous chunk of this completion
    text: str  # their detokenized text ("" when the request asked for no detokenization)
    num_tokens: int  # output tokens of this completion so far, these included (checks continuity)
    finish_reason: FinishReason | None = None  # set on the completion's last delta
    logprobs: list[dict[int, float]] | None = None  # per new token: {token id: logprob}, when asked
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it (set by the frontend)


@dataclass(kw_only=True)
class StreamChunk:
    request_id: str  # the request it belongs to
    worker_id: str  # who produced it
    deltas: list[CompletionDelta] = field(default_factory=list)  # one per completion that changed
    finished: bool = False  # the last chunk of the request
    migrated_to: str | None = None  # the stream continues on this worker (attach there)
    num_preemptions: int = 0  # of the request so far
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
        deltas[d.index] = CompletionDelta(index=d.index, token_ids=p.token_ids + d.token_ids, text=p.text + d.text,
                                          num_tokens=d.num_tokens, finish_reason=d.finish_reason, logprobs=logprobs,
                                          stop_reason=d.stop_reason)
    return StreamChunk(request_id=b.request_id, worker_id=b.worker_id, deltas=list(deltas.values()),
                       finished=b.finished, migrated_to=b.migrated_to, num_preemptions=b.num_preemptions,
                       queue_s=a.queue_s if a.queue_s is not None else b.queue_s,
                       prompt_logprobs=a.prompt_logprobs if a.prompt_logprobs is not None else b.prompt_logprobs)


@dataclass(kw_only=True)
class RequestSummary:
    """What the coordinator needs to know of one request on a worker."""

    request_id: str
    state: QueueState
    priority: int  # lower runs first
    arrival_time: float  # time.time() clock, comparable across workers
    num_blocks: int  # device blocks it holds (running) or needs to run (waiting / swapped)


@dataclass(kw_only=True)
class EngineCounters:
    """Cumulative figures of a worker's engine since it started, for /metrics (deploy/metrics.py)."""

    prompt_tokens: int = 0  # prompt tokens admitted
    generation_tokens: int = 0  # tokens generated, every completion
    preemptions_swap: int = 0  # preemptions that swapped the victim's KV out
    preemptions_recompute: int = 0  # preemptions that dropped it (recomputed on resume)
    prefix_cache_queries: int = 0  # blocks looked up in the prefix cache
    prefix_cache_hits: int = 0  # blocks found there
    timings: StepTimings = field(default_factory=StepTimings)  # seconds per step phase, and the steps


@dataclass(kw_only=True)
class WorkerLoad:
    """A worker's heartbeat: its load, published to the cluster state every ~100 ms."""

    worker_id: str
    timestamp: float  # time.time() when measured
    num_kv_blocks: int  # device KV blocks, all
    num_free_blocks: int  # of those, free
    block_size: int  # tokens per block
    tensor_parallel_size: int = 1  # ranks (GPUs) of the worker's group: requests move only between equal groups
    num_cpu_blocks: int = 0  # swap-space blocks, all (0: no swapping)
    num_free_cpu_blocks: int = 0  # of those, free
    cpu_usage: float = 0.0  # swap-space blocks in use / all
    num_running: int = 0  # sequences scheduled
    num_waiting: int = 0  # sequences queued (recompute-preempted included)
    num_swapped: int = 0  # sequences swapped out
    queued_tokens: int = 0  # prompt tokens not yet computed, over waiting and running requests
    tokens_per_s: float = 0.0  # generated tokens per second over the last few seconds
    num_preemptions: int = 0  # cumulative, as every count below
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0
    num_migrations_in: int = 0  # requests imported
    num_migrations_out: int = 0  # requests exported
    draining: bool = False  # admits no new request (folio drain, shutdown)
    # only the requests waiting for room (the most urgent QUEUED_IN_LOAD); running ones are
    # asked for (EngineWorker.running_requests) when a preemption is planned
    requests: list[RequestSummary] = field(default_factory=list)
    counters: EngineCounters = field(default_factory=EngineCounters)
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
