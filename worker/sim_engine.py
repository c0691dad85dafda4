"""A simulated engine: Folio's own scheduler and block manager, no tensors, and each
step's duration from a roofline model of a named GPU and model (roofline.py).

It is an LLMEngine in everything the cluster sees (add_request / step / abort /
export / import / preempt / stats), so a laptop can run a cluster of many simulated
H200 workers with real routing, scheduling, preemption and migration. Differences:
prompts are token ids only; a "sampled" token is a hash of the request's prompt,
the completion and the position, so a request produces the same tokens wherever
and however often it runs (the cluster tests check migrations with it); a step
sleeps for its simulated duration times `time_scale`.
"""

from __future__ import annotations

import hashlib
import itertools
import time
from dataclasses import dataclass

import torch

from folio.worker.block_manager import PagedKVManager
from folio.worker.config import EngineConfig
from folio.worker.engine import LLMEngine
from folio.worker.errors import InvalidRequestError
from folio.worker.preemption import PreemptionRates
from folio.worker.roofline import Roofline
from folio.worker.scheduler import Scheduler
from folio.worker.sequence import RequestOutput
from folio.worker.stats import StepTimings


@dataclass
class _SimModelConfig:
    vocab_size: int


class _NoDetokenizer:
    def append_token(self, seq, token: int):
        return None


class _SimRunner:
    """Holds no KV: zero-width caches keep the real migration code's shapes consistent."""

    def __init__(self, num_blocks: int, num_cpu_blocks: int, block_size: int, bytes_per_block: int) -> None:
        self.kv_blocks = torch.empty(num_blocks, 1, 2, block_size, 1, 0)
        self.host_blocks = torch.empty(max(num_cpu_blocks, 1), 1, 2, block_size, 1, 0)
        self.bytes_per_block = bytes_per_block


class SimulatedEngine(LLMEngine):
    def __init__(self, roofline: Roofline, block_size: int = 16, num_kv_blocks: int | None = None,
                 num_cpu_blocks: int | None = None, max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                 max_model_len: int | None = None, enable_prefix_caching: bool = True,
                 preemption_mode: str = "swap", time_scale: float = 1.0, host_memory_bytes: float = 256e9) -> None:
        m = roofline.model
        self.roofline = roofline
        self.time_scale = time_scale
        self.config = EngineConfig(model=f"sim:{roofline.gpu.name}/{m.name}", block_size=block_size,
                                   max_num_seqs=max_num_seqs, enable_prefix_caching=enable_prefix_caching,
                                   preemption_mode=preemption_mode)
        self.model_config = _SimModelConfig(m.vocab_size)
        self.max_model_len = max_model_len or m.max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.num_kv_blocks = num_kv_blocks or roofline.num_kv_blocks(block_size)
        bytes_per_block = m.kv_bytes_per_token * block_size
        if num_cpu_blocks is None:
            num_cpu_blocks = 0 if preemption_mode == "recompute" else int(host_memory_bytes // bytes_per_block)
        self.num_cpu_blocks = num_cpu_blocks
        self.device = torch.device("cpu")
        self.kv = PagedKVManager(self.num_kv_blocks, block_size, enable_prefix_caching, num_cpu_blocks=num_cpu_blocks)
        self.rates = PreemptionRates()
        self.scheduler = Scheduler(self.kv, max_num_seqs, max_num_batched_tokens, True,
                                   watermark_blocks=int(self.config.watermark * self.num_kv_blocks),
                                   preemption_mode=preemption_mode, kv_bytes_per_block=bytes_per_block,
                                   rates=self.rates)
        self.runner = _SimRunner(self.num_kv_blocks, num_cpu_blocks, block_size, bytes_per_block)
        self.tokenizer = None
        self.detokenizer = _NoDetokenizer()
        self.eos_token_ids: set[int] = set()
        self.groups = {}
        self.output_kinds = {}
        self._ids = itertools.count()
        self.num_steps = 0
        self.num_generated_tokens = 0
        self.timings = StepTimings()
        self.swap_bytes = 0
        self.swap_calls = 0
        self.simulated_seconds = 0.0  # sum of the simulated step durations
        self.lag_seconds = 0.0  # wall time beyond duration * time_scale (this host too slow to keep up)

    def _tokenize(self, prompt):
        if isinstance(prompt, str):
            raise InvalidRequestError("the simulated engine takes token ids, not text")
        return super()._tokenize(prompt)

    def add_request(self, request_id, prompt, params=None, **kw) -> str:
        if params is not None and params.detokenize:
            params.detokenize = False  # no tokenizer: text stays empty
        return super().add_request(request_id, prompt, params, **kw)

    def _token(self, seq) -> int:
        key = getattr(seq.group, "_sim_key", None)
        if key is None:
            key = hashlib.blake2b(repr((seq.group.prompt_token_ids, seq.params.seed)).encode(), digest_size=8).digest()
            seq.group._sim_key = key
        h = hashlib.blake2b(key + seq.index.to_bytes(4, "little") + seq.num_tokens.to_bytes(8, "little"),
                            digest_size=8).digest()
        return int.from_bytes(h, "little") % self.model_config.vocab_size

    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            if self.scheduler.has_unfinished():
                raise RuntimeError("the scheduler could not run any waiting request (engine stalled)")
            return []
        now = time.monotonic()
        moved = (len(sched.swap_out) + len(sched.swap_in)) * self.runner.bytes_per_block
        if moved:
            self.swap_bytes += moved
            self.swap_calls += 1
        self.kv.take_copies()
        shape = []
        for seq, n in sched.scheduled:
            if seq.group.metrics.first_scheduled_time is None:
                seq.group.metrics.first_scheduled_time = now
            seq.num_computed_tokens += n
            self.kv.cache_blocks(seq)
            shape.append((n, seq.num_computed_tokens))
        to_sample = [seq for seq, _ in sched.scheduled if seq.num_computed_tokens == seq.num_tokens]
        duration = self.roofline.step_seconds(shape, moved)
        self.simulated_seconds += duration
        self.timings.swap += moved / self.roofline.gpu.host_link_bytes_per_s
        self.num_steps += 1
        seqs, _ = self._fork(to_sample, torch.empty(len(to_sample), 0))
        sleep = duration * self.time_scale - (time.perf_counter() - t0)
        if sleep > 0:
            time.sleep(sleep)
        else:
            self.lag_seconds -= sleep

        class _Result:  # the sampler's result shape
            token_ids = [self._token(s) for s in seqs]
            logprobs = [None] * len(seqs)
        self.timings.steps += 1
        return self._apply_samples(seqs, _Result)
