"""Engine configuration: one dataclass whose __post_init__ checks and derives fields.

EngineConfig is the one definition of the engine's options: each field carries its help
text (and its choices, from the tuples below) in `metadata`, from which `folio serve` and
`folio generate` build their `--flag-name` options (deploy/engine_flags.py). This module
stays pure: no torch (imported only for `torch_dtype`), no argparse.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

from folio.worker.errors import ConfigError

if TYPE_CHECKING:
    import torch

KV_CACHE_LAYOUTS = ("block_major", "layer_major")
DTYPES = ("float32", "float16", "bfloat16")  # torch's names (torch is imported only for torch_dtype)
PREEMPTION_MODES = ("auto", "recompute", "swap")  # see worker/preemption.py
KV_MANAGERS = ("paged", "contiguous")
# a server's engines (the cluster's workers, `folio serve`): on the worker's GPU if it has one
# ("auto": cluster/launcher.py's make_engine picks), the linear kernels' state built at load
SERVER_DEFAULTS = {"device": "auto", "warm_up": True}
# a server's step budget when chunked prefill is on (vLLM's API server on CPU): a long prompt's
# prefill goes in 2,048-token chunks beside the running decodes; one 7,700-token prompt in one
# step held every other stream of its worker for its whole length (35 s on 2 cores)
SERVER_STEP_TOKENS = 2048


def server_engine_fields(engine_args: dict) -> dict:
    """A server's engine fields: SERVER_DEFAULTS, then `engine_args`, then with chunked prefill
    SERVER_STEP_TOKENS as the step budget and a quarter of the budget as the longest prefill
    chunk, unless given (scheduler.py: newcomers are not held up by a long prompt)."""
    fields = {**SERVER_DEFAULTS, **engine_args}
    if fields.get("enable_chunked_prefill", True):
        if fields.get("max_num_batched_tokens") is None:
            fields["max_num_batched_tokens"] = SERVER_STEP_TOKENS
        if fields.get("long_prefill_token_threshold") is None:
            fields["long_prefill_token_threshold"] = fields["max_num_batched_tokens"] // 4
    return fields


def _opt(default, help: str, choices: tuple | None = None):
    """A field with its CLI help (and choices): the metadata deploy/engine_flags.py reads."""
    return field(default=default, metadata={"help": help, "choices": choices})


def check_choice(name: str, value, choices: tuple) -> None:
    """The one check (and message) for a field with choices: here and in the CLI's parsing."""
    if value not in choices:
        raise ConfigError(f"{name} must be one of {list(choices)}, got {value!r}")


@dataclass
class EngineConfig:
    model: str = field(metadata={"help": "a local Hugging Face checkpoint directory or a GGUF file"})
    block_size: int = _opt(16, "tokens per KV block")
    num_kv_blocks: int | None = _opt(None, "KV blocks on the device (default: derived from --kv-cache-memory-gb)")
    kv_cache_memory_gb: float = _opt(1.0, "the device's KV cache budget when --num-kv-blocks is not given")
    max_num_seqs: int = _opt(256, "sequences running at once")
    max_num_batched_tokens: int | None = _opt(None, "the token budget of one step (default: max(2048, "
                                                    "the max model length); a server's with chunked "
                                                    "prefill: 2048, as vLLM's on CPU)")
    long_prefill_token_threshold: int | None = _opt(None, "the most tokens of one prompt prefilled in one step, "
                                                          "so a long prompt leaves room to the requests that "
                                                          "arrive during it (0: the whole budget; default: a "
                                                          "server's a quarter of its budget, the offline "
                                                          "LLM's 0)")
    max_model_len: int | None = _opt(None, "the longest prompt + output (default: the checkpoint's "
                                           "max_position_embeddings)")
    dtype: str = _opt("float32", "weights' and activations' dtype", DTYPES)
    device: str = _opt("cpu", "the torch device the engine runs on ('auto' in `folio serve`: a worker's GPU "
                              "if it has one)")
    kv_manager: str = _opt("paged", "paged: PagedAttention blocks; contiguous: one max-length slab per "
                                    "sequence (the baseline)", KV_MANAGERS)
    enable_prefix_caching: bool = _opt(True, "reuse the KV blocks of a prompt prefix seen before")
    enable_chunked_prefill: bool = _opt(True, "split long prefills across steps, beside the decodes")
    preemption_mode: str = _opt("auto", "what a preempted sequence's KV does: auto, recompute (dropped) or "
                                        "swap (to CPU memory); see worker/preemption.py", PREEMPTION_MODES)
    swap_space_gb: float = _opt(4.0, "CPU memory for swapped-out KV (pinned on CUDA), at most the device "
                                     "cache's size")
    num_cpu_blocks: int | None = _opt(None, "the swap space in blocks (overrides --swap-space-gb)")
    kv_cache_layout: str = _opt("block_major", "block_major: a block's KV for all layers contiguous (fast "
                                               "swaps); layer_major: a layer's blocks contiguous (faster CPU "
                                               "attention gathers); see worker/model_runner.py",
                                KV_CACHE_LAYOUTS)
    watermark: float = _opt(0.01, "fraction of blocks kept free when admitting (anti-thrash)")
    seed: int = _opt(0, "the sampling seed of requests that carry none")
    tokenizer: str | None = _opt(None, "the tokenizer's directory (default: the model's own)")
    tensor_parallel_size: int = _opt(1, "ranks (processes, one device each) the model is sharded over "
                                        "(worker/tensor_parallel.py)")
    forward_lanes: int | None = _opt(None, "on a CPU: split a step's batch over this many threads of one OpenMP "
                                           "thread each (worker/forward_lanes.py; an experiment, no served gain "
                                           "measured yet); default: $FOLIO_FORWARD_LANES, else 1 (one forward "
                                           "on torch's threads)")
    warm_up: bool = _opt(False, "build the linear kernels' per-shape state for every batch size at load "
                                "(kernels/linear.py): a server's memory stays flat under any batch mix; costs seconds")

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.metadata.get("choices"):
                check_choice(f.name, getattr(self, f.name), f.metadata["choices"])
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.forward_lanes is not None and self.forward_lanes < 1:
            raise ConfigError(f"forward_lanes must be >= 1, got {self.forward_lanes}")
        if self.block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {self.block_size}")
        if self.swap_space_gb < 0 or (self.num_cpu_blocks is not None and self.num_cpu_blocks < 0):
            raise ConfigError("the swap space cannot be negative")
        if self.max_num_seqs < 1:
            raise ConfigError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ConfigError("max_num_batched_tokens must be >= 1")
        if self.long_prefill_token_threshold is not None and self.long_prefill_token_threshold < 0:
            raise ConfigError("long_prefill_token_threshold must be >= 0")
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
