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
    swap: float = 0.0  # device <-> host block copies
    steps: int = 0


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_swapped: int
    num_free_blocks: int
    num_kv_blocks: int
    kv_usage: float  # device blocks in use / all
    num_cpu_blocks: int
    num_free_cpu_blocks: int  # of the swap space
    cpu_usage: float  # swap-space blocks in use / all
    num_preemptions: int
    preemptions_by_mode: dict  # {"swap": n, "recompute": n}
    num_recomputed_tokens: int
    swapped_out_blocks: int
    swapped_in_blocks: int
    swap_bytes: int  # bytes moved either way
    swap_calls: int  # steps that moved blocks
    swap_seconds: float
    prefix_cache_queries: int  # blocks looked up
    prefix_cache_hits: int  # blocks found
    num_steps: int
    num_generated_tokens: int
