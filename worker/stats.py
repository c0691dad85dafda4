"""Figures the engine keeps about itself (published by the cluster later)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepTimings:
    """Cumulative seconds per phase of step(): where the time goes (see benchmarks/)."""

    schedule: float = 0.0  # scheduler + block manager
    prepare: float = 0.0  # building the batch tensors
    forward: float = 0.0  # the model, logits included
    sample: float = 0.0  # sampler
    postprocess: float = 0.0  # appending tokens, detokenizing, stop checks, outputs
    steps: int = 0


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_kv_blocks: int
    kv_usage: float
    num_preemptions: int
    num_recomputed_tokens: int
    prefix_cache_queries: int  # blocks looked up
    prefix_cache_hits: int  # blocks found
    num_steps: int
    num_generated_tokens: int
