"""What LLMEngine steps with: a Runner, and the loader of the real one.

The engine owns the requests, the scheduler and the block manager; a runner owns what
runs a step on a device: the model and its KV tensors (model_runner.ModelRunner, made
by `load_runner` from a checkpoint) or a clock that only simulates them
(cluster/sim/runner.py's RooflineRunner). Either way the engine's code is the same:

    engine = LLMEngine(config)                                  # load_runner(config)
    engine = LLMEngine(config, runner=RooflineRunner(...))      # the simulation

A runner is driven by the engine's step thread alone, in this order per step:
swap -> copy_blocks -> run -> sample. `run` and `sample` may be called again on parts of
a batch after a fault (fault_isolation.py): they keep nothing until they return.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from folio.worker.sizing import EngineSizes

if TYPE_CHECKING:
    import torch

    from folio.worker.block_manager import KVCacheManager
    from folio.worker.config import EngineConfig
    from folio.worker.model_runner import ModelRunner
    from folio.worker.sampler import SampleResult
    from folio.worker.sampling_params import SamplingParams
    from folio.worker.sequence import Sequence


@dataclass(frozen=True)
class ModelInfo:
    """What the engine knows of the model a runner runs."""

    vocab_size: int  # token ids are in [0, vocab_size)
    sizes: EngineSizes  # context length, token budget, device and host KV blocks
    eos_token_ids: frozenset[int]  # the checkpoint's (config, generation config, tokenizer)
    tokenizer: Any = None  # a Hugging Face tokenizer; None: prompts are token ids, outputs carry no text


class Runner(Protocol):
    info: ModelInfo
    block_shape: tuple[int, ...]  # one KV block's shape: [layers, k|v, block_size, kv_heads, head_dim]

    def swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> int:
        """Copy (device, host) block pairs out, then (host, device) pairs in; bytes moved."""

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: (source, destination) device blocks."""

    def run(self, scheduled: list[tuple[Sequence, int]], kv: KVCacheManager
            ) -> tuple[list[Sequence], torch.Tensor | None]:
        """The forward of `scheduled` ((sequence, new tokens) each): the sequences that sample
        and their logits rows, or None when none samples. Writes those tokens' KV."""

    def sample(self, logits: torch.Tensor, params: list[SamplingParams], generators: list,
               seqs: list[Sequence], eos_token_ids, grammars) -> SampleResult:
        """One token (and its logprobs, when asked) per row of `logits`."""

    def healthy(self) -> bool:
        """A probe forward that writes no KV: False when the device or the model is broken."""

    def process_ids(self) -> list[int]:
        """The processes holding the model: this one, then each follower rank's (fault tests)."""

    def read_blocks(self, blocks: list[int], on_host: bool) -> torch.Tensor:
        """A copy on the CPU of device (or swap-space) blocks: [len(blocks), *block_shape]."""

    def write_host_blocks(self, blocks: list[int], data: torch.Tensor) -> None:
        """Write `data` ([len(blocks), *block_shape]) into swap-space blocks."""


def load_runner(config: EngineConfig) -> ModelRunner:
    """The checkpoint of `config.model` on `config.device`: its weights, a KV cache sized by
    size_engine, its tokenizer and EOS ids; with tensor_parallel_size N > 1, rank 0's shard
    and N - 1 followers holding the others (Ray actors in this worker's placement group, or
    processes: tp_ranks.py). Every inconsistency is a
    ConfigError or a ModelLoadError, raised before the weights load where it can be."""
    if config.tensor_parallel_size == 1:
        return load_shard(config)[0]
    import torch

    from folio.worker.tp_ranks import free_port, start_followers

    port = free_port()
    shard_config(config, 0)  # a ConfigError before any process starts
    procs, own_device = start_followers(config, port, max(torch.get_num_threads() // config.tensor_parallel_size, 1))
    try:
        runner, _ = load_shard(config, 0, port, procs, own_device)
    except BaseException:
        for p in procs:
            p.kill()
        raise
    return runner


def shard_config(config: EngineConfig, rank: int):
    from folio.worker.models.model_config import ModelConfig
    from folio.worker.tensor_parallel import Shards

    mc = ModelConfig.from_dir(config.model)
    return mc, Shards.of(rank, config.tensor_parallel_size, mc.num_heads, mc.num_kv_heads, mc.intermediate_size,
                         mc.vocab_size)


def load_shard(config: EngineConfig, rank: int = 0, port: int | None = None, followers: list = (),
               own_device: bool = False):
    """(rank `rank`'s runner, its group): the whole model when tensor_parallel_size is 1.
    `own_device`: this process sees only its rank's GPU (Ray gave it one): config.device as is."""
    import torch

    from folio.worker.detokenizer import load_tokenizer
    from folio.worker.model_runner import ModelRunner
    from folio.worker.models.model_config import generation_eos_ids
    from folio.worker.models.loader import load_model
    from folio.worker.sizing import size_engine
    from folio.worker.tensor_parallel import Group

    mc, shards = shard_config(config, rank)
    sizes = size_engine(config, mc)
    device, dtype = torch.device(config.device), config.torch_dtype
    if device.type == "cuda" and shards.size > 1 and not own_device:  # rank r: the r-th device from config.device's
        device = torch.device("cuda", (device.index or 0) + rank)
    group = Group(shards) if shards.size == 1 else Group.join(shards, "127.0.0.1", port, device)
    model = load_model(config.model, dtype, device, sizes.max_model_len, mc, group)
    if device.type == "cpu":  # a forward's activations stay mapped between steps (host_malloc.py); set
        # after the load, whose temporaries are not worth keeping
        from folio.worker.host_malloc import keep_freed_memory

        keep_freed_memory()
    if rank > 0:
        follower = ModelRunner(model, sizes.num_kv_blocks, config.block_size, dtype, device, sizes.num_cpu_blocks,
                               layout=config.kv_cache_layout)
        if config.warm_up:  # its own linear layers: no collective, and its memory flat too
            follower.warm_up(sizes.max_num_batched_tokens, config.max_num_seqs)
        return follower, group
    tokenizer = load_tokenizer(config.tokenizer)
    eos = set(mc.eos_token_ids) | generation_eos_ids(config.model)
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    info = ModelInfo(mc.vocab_size, sizes, frozenset(eos), tokenizer)
    cls = ModelRunner
    if shards.size > 1:
        from folio.worker.tp_runner import TPModelRunner as cls
    runner = cls(model, sizes.num_kv_blocks, config.block_size, dtype, device, sizes.num_cpu_blocks,
                 layout=config.kv_cache_layout, info=info)
    lanes = config.forward_lanes or int(os.environ.get("FOLIO_FORWARD_LANES", 1))  # off unless asked: README
    if device.type == "cpu" and shards.size == 1 and lanes > 1:
        from folio.worker.forward_lanes import Lanes

        runner.lanes = Lanes(lanes)
    if shards.size > 1:
        runner.attach(group, list(followers))
    if config.warm_up:  # memory flat from here on
        runner.warm_up(sizes.max_num_batched_tokens, config.max_num_seqs)
    return runner, group
