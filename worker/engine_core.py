"""EngineCore: what the worker (actor*.py), the heartbeat and the cluster's simulation may
ask of an engine. LLMEngine (engine.py) is the one implementation, on a real model or on a
simulated runner (cluster/sim/); nothing outside worker/engine*.py touches more of it.

The contract (LLMEngine's docstrings hold the details):
- one caller (the worker's step thread) drives it; nothing here is thread-safe but
  compile_grammar and grammar_compiled;
- a call that raises InvalidRequestError changed nothing;
- a request is forgotten after its final output, its abort, or its export.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from folio.worker.config import EngineConfig
    from folio.worker.engine_migration import RequestState
    from folio.worker.guided import GuidedSpec
    from folio.worker.messages import QueueState
    from folio.worker.sampling_params import SamplingParams
    from folio.worker.sequence import RequestOutput
    from folio.worker.stats import EngineStats, StepTimings


class EngineCore(Protocol):
    config: EngineConfig  # block_size is what the cluster reads
    num_generated_tokens: int  # cumulative, every completion
    timings: StepTimings  # cumulative seconds per step phase
    tokenizer: Any  # the model's Hugging Face tokenizer; None: token ids only (a simulated runner)

    # ---- requests
    def add_request(self, request_id: str | None, prompt: str | list[int], params: SamplingParams | None = None,
                    priority: int = 0, arrival_time: float | None = None, output_kind: str = "final") -> str: ...
    def abort(self, request_id: str) -> bool: ...
    def step(self) -> list[RequestOutput]: ...
    def has_unfinished_requests(self) -> bool: ...
    # the one call safe from another thread: a grammar compiled off the step thread, before
    # add_request asks for it (the worker's channel does this); a refusal is kept for add_request
    def compile_grammar(self, spec: GuidedSpec) -> None: ...
    def grammar_compiled(self, spec: GuidedSpec) -> bool: ...  # add_request would compile nothing

    # ---- moving requests (engine_migration.py) and preempting them for the coordinator
    def export_request(self, request_id: str) -> RequestState: ...
    def import_request(self, state: RequestState) -> str: ...
    def preempt_request(self, request_id: str) -> bool: ...

    # ---- what the heartbeat and the coordinator plan with (engine_queries.py)
    def request_summaries(self, request_ids: Iterable[str] | None = None
                          ) -> list[tuple[str, QueueState, int, float, int]]: ...
    def request_ids(self) -> list[str]: ...
    def queued_request_ids(self) -> list[str]: ...
    def running_request_ids(self, min_priority: int | None = None) -> list[str]: ...
    def queue_figures(self) -> tuple[int, int | None]: ...
    def stats(self) -> EngineStats: ...  # KV capacity and swap capacity (num_cpu_blocks) included

    # ---- the prefix index the router routes by (published as changes: heartbeat.py)
    def cached_block_hashes(self) -> set[bytes]: ...
    def prefix_cache_changes(self) -> tuple[dict[bytes, bool], bool]: ...

    # ---- tests and fault checks
    def check_invariants(self) -> None: ...  # AssertionError on a leaked block or a wrong ref count
    def process_ids(self) -> list[int]: ...  # this process, then each follower rank's
