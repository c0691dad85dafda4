"""Engine configuration: one dataclass whose __post_init__ checks and derives fields."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from folio.worker.errors import ConfigError

if TYPE_CHECKING:
    import torch

KV_CACHE_LAYOUTS = ("block_major", "layer_major")
DTYPES = ("float32", "float16", "bfloat16")  # torch's names (torch is imported only for torch_dtype)


@dataclass
class EngineConfig:
    model: str  # local Hugging Face checkpoint directory
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None  # None: derived from kv_cache_memory_gb
    kv_cache_memory_gb: float = 1.0  # KV budget when num_kv_blocks is None
    max_num_seqs: int = 256  # sequences running at once
    max_num_batched_tokens: int | None = None  # token budget per step (None: max(2048, max_model_len))
    max_model_len: int | None = None  # None: the checkpoint's max_position_embeddings
    dtype: str = "float32"
    device: str = "cpu"
    kv_manager: str = "paged"  # "paged" | "contiguous"
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    preemption_mode: str = "auto"  # "auto" | "recompute" | "swap" (see worker/preemption.py)
    swap_space_gb: float = 4.0  # CPU memory for swapped-out KV (pinned on CUDA), at most the device cache's size
    num_cpu_blocks: int | None = None  # overrides swap_space_gb, in blocks
    kv_cache_layout: str = "block_major"  # "block_major" | "layer_major" (see worker/model_runner.py)
    watermark: float = 0.01  # fraction of blocks kept free when admitting (anti-thrash)
    seed: int = 0  # seed for requests that carry none
    tokenizer: str | None = None  # defaults to `model`
    # build the linear kernels' per-shape state for every batch size at load (kernels/linear.py):
    # a server's memory stays flat under any batch mix; off by default (costs seconds at load)
    warm_up: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {self.block_size}")
        if self.kv_manager not in ("paged", "contiguous"):
            raise ConfigError(f"kv_manager must be 'paged' or 'contiguous', got {self.kv_manager!r}")
        if self.preemption_mode not in ("auto", "recompute", "swap"):
            raise ConfigError(f"preemption_mode must be auto|recompute|swap, got {self.preemption_mode!r}")
        if self.kv_cache_layout not in KV_CACHE_LAYOUTS:
            raise ConfigError(f"kv_cache_layout must be one of {KV_CACHE_LAYOUTS}, got {self.kv_cache_layout!r}")
        if self.swap_space_gb < 0 or (self.num_cpu_blocks is not None and self.num_cpu_blocks < 0):
            raise ConfigError("the swap space cannot be negative")
        if self.max_num_seqs < 1:
            raise ConfigError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ConfigError("max_num_batched_tokens must be >= 1")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ConfigError("num_kv_blocks must be >= 1")
        if not 0.0 <= self.watermark < 1.0:
            raise ConfigError("watermark must be in [0, 1)")
        if self.tokenizer is None:
            self.tokenizer = self.model

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)
