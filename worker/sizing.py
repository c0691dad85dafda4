"""How big an engine is: context length, token budget, device and host KV blocks.

Derived once from the configuration and the checkpoint; every inconsistency is a ConfigError.
"""

from __future__ import annotations

from dataclasses import dataclass

from folio.worker.config import EngineConfig
from folio.worker.errors import ConfigError
from folio.worker.models.model_config import ModelConfig


@dataclass(frozen=True)
class EngineSizes:
    max_model_len: int  # tokens per sequence, prompt included
    max_num_batched_tokens: int  # token budget of one step
    num_kv_blocks: int  # device blocks
    num_cpu_blocks: int  # swap-space blocks (0: no swapping)
    bytes_per_block: int  # K + V of one block, all layers
    long_prefill_tokens: int = 0  # a longer prefill chunk takes what a step leaves (scheduler.py; 0: off)


def max_model_len(config: EngineConfig, mc: ModelConfig) -> int:
    limit = mc.max_position_embeddings
    if mc.sliding_window is not None:
        # Within the window, sliding-window attention equals full attention.
        limit = min(limit, mc.sliding_window)
    if config.max_model_len is None:
        return limit
    if not 1 < config.max_model_len <= limit:
        raise ConfigError(f"max_model_len {config.max_model_len} must be in (1, {limit}] for this model "
                          "(max_position_embeddings / sliding_window)")
    return config.max_model_len


def size_engine(config: EngineConfig, mc: ModelConfig) -> EngineSizes:
    length = max_model_len(config, mc)
    bytes_per_block = mc.kv_bytes_per_token(config.torch_dtype.itemsize) * config.block_size
    num_kv_blocks = config.num_kv_blocks or int(config.kv_cache_memory_gb * (1 << 30)) // bytes_per_block
    if num_kv_blocks < 1:
        raise ConfigError("kv_cache_memory_gb is too small for one KV block")
    reserve = -(-length // config.block_size)  # contiguous_kv.py: every request holds max_model_len's blocks
    if config.kv_manager == "contiguous" and reserve > num_kv_blocks:
        raise ConfigError(f"the contiguous baseline reserves {reserve} blocks per request but the cache has "
                          f"{num_kv_blocks}")
    budget = config.max_num_batched_tokens or max(2048, length)
    if not config.enable_chunked_prefill and budget < length:
        raise ConfigError("without chunked prefill, max_num_batched_tokens must be >= max_model_len")
    num_cpu_blocks = 0
    if config.kv_manager == "paged" and config.preemption_mode != "recompute":
        # swap_space_gb, capped at the device cache's size unless num_cpu_blocks says more:
        # the swap space is committed up front (model_runner.py), and more host blocks
        # than device blocks mostly let requests sit swapped rather than waiting
        num_cpu_blocks = (config.num_cpu_blocks if config.num_cpu_blocks is not None
                          else min(int(config.swap_space_gb * (1 << 30)) // bytes_per_block, num_kv_blocks))
    return EngineSizes(length, budget, num_kv_blocks, num_cpu_blocks, bytes_per_block,
                       config.long_prefill_token_threshold or 0)
