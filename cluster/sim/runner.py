"""RooflineRunner: LLMEngine's runner (worker/runner.py) for a simulated GPU. It holds no
model and no KV tensors; a step sleeps the roofline time of its batch on the named GPU and
model (roofline.py) times `time_scale`, and "samples" a hash of the request's prompt and
seed, the completion's index and the position, so a request produces the same tokens
wherever and however often it runs (the cluster tests check migrations with it).

Everything else is Folio's own engine: the scheduler, the block manager, preemption,
export / import, the worker around it. Prompts are token ids only (no tokenizer).

    engine = simulated_engine(Roofline.named("H200", "llama-3-8b"), num_kv_blocks=4096)
"""

from __future__ import annotations

import hashlib
import os
import time
import weakref

import torch

from folio.cluster.sim.roofline import Roofline
from folio.worker.config import EngineConfig
from folio.worker.engine import LLMEngine
from folio.worker.runner import ModelInfo
from folio.worker.sampler import SampleResult
from folio.worker.sizing import EngineSizes


class RooflineRunner:
    def __init__(self, roofline: Roofline, sizes: EngineSizes, block_size: int, time_scale: float = 1.0) -> None:
        self.roofline = roofline
        self.time_scale = time_scale
        self.info = ModelInfo(roofline.model.vocab_size, sizes, frozenset())
        self.bytes_per_block = sizes.bytes_per_block
        self.block_shape = (1, 2, block_size, 1, 0)  # zero-width: migrations carry no bytes
        self.simulated_seconds = 0.0  # sum of the simulated step durations
        self.lag_seconds = 0.0  # wall time beyond duration * time_scale (this host too slow to keep up)
        self.swap_seconds = 0.0  # simulated time of the swaps over the host link
        self._swapped = 0  # bytes swapped by this step, for its duration
        self._keys: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # group -> its token hash key

    def swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> int:
        moved = (len(swap_out) + len(swap_in)) * self.bytes_per_block
        self._swapped += moved
        self.swap_seconds += moved / self.roofline.gpu.host_link_bytes_per_s
        return moved

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        pass

    def run(self, scheduled, kv):
        t0 = time.perf_counter()
        shape = [(n, seq.num_computed_tokens + n) for seq, n in scheduled]
        to_sample = [seq for seq, n in scheduled if seq.num_computed_tokens + n == seq.num_tokens]
        duration = self.roofline.step_seconds(shape, self._swapped)
        self._swapped = 0
        self.simulated_seconds += duration
        sleep = duration * self.time_scale - (time.perf_counter() - t0)
        if sleep > 0:
            time.sleep(sleep)
        else:
            self.lag_seconds -= sleep
        return to_sample, torch.empty(len(to_sample), 0)

    def sample(self, logits, params, generators, seqs, eos_token_ids, grammars) -> SampleResult:
        return SampleResult([self._token(s) for s in seqs], [None] * len(seqs))

    def _token(self, seq) -> int:
        key = self._keys.get(seq.group)
        if key is None:
            key = hashlib.blake2b(repr((seq.group.prompt_token_ids, seq.params.seed)).encode(), digest_size=8).digest()
            self._keys[seq.group] = key
        h = hashlib.blake2b(key + seq.index.to_bytes(4, "little") + seq.num_tokens.to_bytes(8, "little"),
                            digest_size=8).digest()
        return int.from_bytes(h, "little") % self.info.vocab_size

    def healthy(self) -> bool:
        return True

    def process_ids(self) -> list[int]:
        return [os.getpid()]

    def read_blocks(self, blocks: list[int], on_host: bool) -> torch.Tensor:
        return torch.empty(len(blocks), *self.block_shape)

    def write_host_blocks(self, blocks: list[int], data: torch.Tensor) -> None:
        pass


def simulated_engine(roofline: Roofline, block_size: int = 16, num_kv_blocks: int | None = None,
                     num_cpu_blocks: int | None = None, max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                     max_model_len: int | None = None, enable_prefix_caching: bool = True,
                     preemption_mode: str = "swap", time_scale: float = 1.0,
                     host_memory_bytes: float = 256e9) -> LLMEngine:
    """An LLMEngine on a RooflineRunner: the device cache sized as vLLM sizes it beside the
    weights (unless `num_kv_blocks`), swap space from `host_memory_bytes` (unless `num_cpu_blocks`)."""
    m = roofline.model
    bytes_per_block = m.kv_bytes_per_token * block_size
    if num_cpu_blocks is None:
        num_cpu_blocks = 0 if preemption_mode == "recompute" else int(host_memory_bytes // bytes_per_block)
    sizes = EngineSizes(max_model_len or m.max_model_len, max_num_batched_tokens,
                        num_kv_blocks or roofline.num_kv_blocks(block_size), num_cpu_blocks, bytes_per_block)
    config = EngineConfig(model=f"sim:{roofline.gpu.name}/{m.name}", block_size=block_size,
                          max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                          max_model_len=sizes.max_model_len, enable_prefix_caching=enable_prefix_caching,
                          preemption_mode=preemption_mode, num_kv_blocks=sizes.num_kv_blocks,
                          num_cpu_blocks=num_cpu_blocks)
    return LLMEngine(config, runner=RooflineRunner(roofline, sizes, block_size, time_scale))
