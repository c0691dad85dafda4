"""LLMEngine: add_request / step / abort on one device (the worker's EngineCore, engine_core.py).

    step():  schedule -> swap -> copy-on-write -> runner.run -> runner.sample -> postprocess

The engine owns the requests, the scheduler and the block manager; its runner (runner.py)
owns the model and the KV tensors, or simulates them (cluster/sim/). Parts of the class live
beside it: engine_outputs.py (postprocess), engine_queries.py (the worker's queries),
engine_migration.py (export / import). Not thread-safe: one caller drives it.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time

from folio.worker import fault_isolation, guided_budget
from folio.worker.block_manager import KVCacheManager, PagedKVManager
from folio.worker.config import EngineConfig
from folio.worker.contiguous_kv import ContiguousKVManager
from folio.worker.detokenizer import Detokenizer
from folio.worker.engine_migration import RequestState, export_request, import_request
from folio.worker.engine_outputs import Postprocess
from folio.worker.engine_queries import RequestQueries
from folio.worker.errors import InvalidRequestError
from folio.worker.outputs import OUTPUT_KINDS
from folio.worker.preemption import PreemptionRates
from folio.worker.runner import Runner, load_runner
from folio.worker.sampling_params import SamplingParams, check_priority, check_vocab, resolve_bad_words
from folio.worker.scheduler import Scheduler
from folio.worker.sequence import RequestOutput, SequenceGroup, SequenceStatus
from folio.worker.stats import EngineStats, StepTimings

_GRAMMARS_MADE = threading.Lock()  # an engine's Grammars is made once (guided_grammars)


class LLMEngine(RequestQueries, Postprocess):
    """The engine of one device.

    - `add_request` validates and queues; on bad input it raises InvalidRequestError
      and leaves the engine exactly as it was.
    - `step` runs one iteration and returns the outputs of requests that produced
      tokens (as their output_kind asks); a request is forgotten after its final output.
    - `abort` frees a request's blocks at once, whatever its state.
    - One caller drives it: it is not thread-safe.
    """

    grammars = None  # structured output's compiler and cache (guided.py), made for the first such request

    def __init__(self, config: EngineConfig, runner: Runner | None = None) -> None:
        """`runner`: what runs the steps (runner.py); None loads `config.model` (load_runner)."""
        self.config = config
        self.runner = runner if runner is not None else load_runner(config)
        info = self.runner.info
        sizes = info.sizes
        self.vocab_size = info.vocab_size
        self.max_model_len = sizes.max_model_len
        self.max_num_batched_tokens = sizes.max_num_batched_tokens
        self.num_kv_blocks = sizes.num_kv_blocks
        self.num_cpu_blocks = sizes.num_cpu_blocks
        if config.kv_manager == "paged":
            self.kv: KVCacheManager = PagedKVManager(self.num_kv_blocks, config.block_size,
                                                     config.enable_prefix_caching, num_cpu_blocks=self.num_cpu_blocks)
        else:
            self.kv = ContiguousKVManager(self.num_kv_blocks, config.block_size, self.max_model_len)
        self.rates = PreemptionRates()  # measured swap and prefill speeds, for preemption_mode="auto"
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, self.max_num_batched_tokens,
                                   config.enable_chunked_prefill,
                                   watermark_blocks=int(config.watermark * self.num_kv_blocks),
                                   preemption_mode=config.preemption_mode, kv_bytes_per_block=sizes.bytes_per_block,
                                   rates=self.rates, long_prefill_tokens=sizes.long_prefill_tokens)
        self.tokenizer = info.tokenizer
        self.detokenizer = Detokenizer(self.tokenizer) if self.tokenizer is not None else None
        self.eos_token_ids = set(info.eos_token_ids)
        self.groups: dict[str, SequenceGroup] = {}
        self.output_kinds: dict[str, str] = {}  # request id -> how its outputs are reported (engine_migration.py)
        self.streak = fault_isolation.Streak()
        self._ids = itertools.count()
        self.num_steps = 0
        self.num_generated_tokens = 0
        self.timings = StepTimings()
        self.swap_bytes = 0
        self.swap_calls = 0  # steps that swapped

    # ---- requests ----------------------------------------------------------------------
    def add_request(self, request_id: str | None, prompt: str | list[int], params: SamplingParams | None = None,
                    priority: int = 0, arrival_time: float | None = None, output_kind: str = "final") -> str:
        """Validate and queue a request. Raises InvalidRequestError and changes nothing on bad input."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("params must be a SamplingParams")
        if output_kind not in OUTPUT_KINDS:
            raise InvalidRequestError(f"output_kind must be one of {OUTPUT_KINDS}")
        check_priority(priority)  # an integer in [-2**31, 2**31), as at the frontends
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self.groups:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if params.n > self.config.max_num_seqs:
            raise InvalidRequestError(f"n={params.n} completions exceed max_num_seqs={self.config.max_num_seqs}")
        resolve_bad_words(params, self.tokenizer)  # bad_words -> token ids (in place, as vLLM does)
        check_vocab(params, self.vocab_size)
        if params.guided is not None:
            self.guided_grammars().check(params.guided)  # a schema it cannot compile: refused here
            self.guided_grammars().check_first_token(params)
        text, token_ids = self._tokenize(prompt)
        n_prompt = len(token_ids)
        if n_prompt >= self.max_model_len:
            raise InvalidRequestError(f"the prompt has {n_prompt} tokens; max_model_len is {self.max_model_len}, "
                                      "which leaves no room for a generated token")
        max_len = min(n_prompt + params.max_tokens, self.max_model_len)
        # all n completions at their longest at once: they share the prompt's full blocks (paged)
        # and need their own for the rest; a request that cannot fit whole would thrash the cache
        # forever, preempting its own completions and starving every other request
        per_seq = self.kv.max_blocks_per_seq(max_len)
        shared = n_prompt // self.config.block_size if self.config.kv_manager == "paged" else 0
        need = per_seq + (params.n - 1) * (per_seq - shared)
        if need > self.num_kv_blocks:
            raise InvalidRequestError(f"the request needs up to {need} KV blocks ({params.n} x {max_len} tokens) "
                                      f"but the cache holds {self.num_kv_blocks}: it can never fit", param="max_tokens")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        group = SequenceGroup(request_id, token_ids, params, arrival, priority, text)
        self.groups[request_id] = group
        self.output_kinds[request_id] = output_kind
        self.scheduler.add(group)
        return request_id

    def guided_grammars(self):
        with _GRAMMARS_MADE:  # compile_grammar's thread and the step thread may both be first
            if self.grammars is None:
                from folio.worker.guided import Grammars
                if self.tokenizer is None:
                    raise InvalidRequestError("structured output needs the model's tokenizer")
                self.grammars = Grammars(self.tokenizer, self.vocab_size, sorted(self.eos_token_ids))
        return self.grammars

    def compile_grammar(self, spec) -> None:
        """`spec`'s grammar into the cache add_request reads (a spec that does not compile is
        kept as refused, and add_request raises it). Safe from a thread other than the step
        thread: the worker compiles a request's grammar there before adding it."""
        with contextlib.suppress(InvalidRequestError):
            self.guided_grammars().compiled(spec)

    def grammar_compiled(self, spec) -> bool:
        """Whether add_request would compile nothing for `spec` (compiled, or refused, before)."""
        try:
            return self.grammars is not None and self.grammars.cached(spec) is not None
        except InvalidRequestError:
            return True

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("the prompt is empty")
            if self.tokenizer is None:
                raise InvalidRequestError("this engine has no tokenizer: the prompt must be token ids")
            ids = self.tokenizer.encode(prompt)
            if not ids:
                raise InvalidRequestError("the prompt tokenizes to no tokens")
            return prompt, ids
        if isinstance(prompt, (list, tuple)):
            if not prompt:
                raise InvalidRequestError("the prompt is empty")
            vocab = self.vocab_size
            if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in prompt):
                raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})")
            return None, list(prompt)
        raise InvalidRequestError(f"a prompt is a string or a list of token ids, got {type(prompt).__name__}")

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks now. False if it is unknown or already done."""
        group = self.groups.pop(request_id, None)
        self.output_kinds.pop(request_id, None)
        if group is None:
            return False
        for seq in group.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
        group.forked = True
        return True

    def export_request(self, request_id: str) -> RequestState:
        """The request's whole state (KV as CPU tensors), freed here. See engine_migration.py."""
        return export_request(self, request_id)

    def import_request(self, state: RequestState) -> str:
        """Admit a request exported by another engine; it resumes from its KV. See engine_migration.py."""
        return import_request(self, state)

    def preempt_request(self, request_id: str) -> bool:
        """Preempt a running request now (swap or recompute, per the preemption mode), between
        steps; it resumes when the scheduler finds room. False if it is not running here."""
        group = self.groups.get(request_id)
        running = [s for s in group.seqs if s.status is SequenceStatus.RUNNING] if group else []
        for seq in running:
            self.scheduler.preempt(seq)
        return bool(running)

    # ---- the step ----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        self.timings.schedule += time.perf_counter() - t0
        if sched.is_empty:
            if self.scheduler.has_unfinished():
                raise RuntimeError("the scheduler could not run any waiting request (engine stalled)")
            return []
        now = time.monotonic()
        for seq, _ in sched.scheduled:
            if seq.group.metrics.first_scheduled_time is None:
                seq.group.metrics.first_scheduled_time = now
        t1 = time.perf_counter()
        # swaps before copy-on-write: see swap_space.py and Scheduler._preempt for the ordering
        moved = self.runner.swap(sched.swap_out, sched.swap_in)
        if moved:
            ts = time.perf_counter() - t1
            self.timings.swap += ts
            self.swap_bytes += moved
            self.swap_calls += 1
            self.rates.swap_bytes_per_s = PreemptionRates.ema(self.rates.swap_bytes_per_s, moved / max(ts, 1e-9))
            t1 = time.perf_counter()
        self.runner.copy_blocks(sched.block_copies)
        blamed: dict[str, str] = {}  # request id -> why: a fault traced to it (fault_isolation.py)
        t2 = time.perf_counter()
        sample_seqs, logits, ran = fault_isolation.forward(self.runner, self.kv, sched.scheduled, blamed, self.streak)
        t3 = time.perf_counter()
        self.scheduler.mask_share_s = guided_budget.share(t3 - t2)  # costly grammars' share of a step
        if sched.num_batched_tokens >= 64:  # a prompt-sized batch: what recomputing costs
            self.rates.prefill_tokens_per_s = PreemptionRates.ema(self.rates.prefill_tokens_per_s,
                                                                  sched.num_batched_tokens / max(t3 - t2, 1e-9))
        self.num_steps += 1
        for seq, n in ran:  # only sequences whose forward completed advance
            seq.num_computed_tokens += n
            self.kv.cache_blocks(seq)
        outs: list[RequestOutput] = []
        t4 = t3
        if logits is not None:
            seqs, logits = self._fork(sample_seqs, logits, blamed)
            seqs, result = fault_isolation.sample(self.runner, seqs, logits, blamed, self.streak, self.eos_token_ids,
                                                  self.grammars)
            t4 = time.perf_counter()
            if result is not None:
                outs = self._apply_samples(seqs, result, blamed)
        if blamed:
            outs += self._fail_requests(blamed)
        tm = self.timings
        tm.prepare += t2 - t1
        tm.forward += t3 - t2
        tm.sample += t4 - t3
        tm.postprocess += time.perf_counter() - t4
        tm.steps += 1
        return outs

    # ---- figures -----------------------------------------------------------------------
    def cached_block_hashes(self) -> set[bytes]:
        """Every block hash in the prefix cache now (the heartbeat's whole index)."""
        return self.kv.cached_block_hashes()

    def prefix_cache_changes(self) -> tuple[dict[bytes, bool], bool]:
        """Hashes stored (True) or removed (False) since the last call, and whether changes
        were lost (the caller then re-sends cached_block_hashes())."""
        return self.kv.prefix_cache_changes()

    def process_ids(self) -> list[int]:
        """This process, then each follower rank's (tensor parallelism)."""
        return self.runner.process_ids()

    def check_invariants(self) -> None:
        """Every block free or owned by a live sequence; ref counts equal table references."""
        self.kv.check_invariants(self.live_sequences())

    def stats(self) -> EngineStats:
        kv = self.kv
        st = self.scheduler.stats
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_swapped=self.scheduler.num_swapped,
            num_free_blocks=kv.num_free_blocks,
            num_kv_blocks=self.num_kv_blocks,
            kv_usage=kv.usage,
            num_cpu_blocks=self.num_cpu_blocks,
            num_free_cpu_blocks=kv.num_free_cpu_blocks,
            cpu_usage=kv.cpu_usage,
            num_preemptions=st.num_preemptions,
            preemptions_by_mode=dict(st.preemptions_by_mode),
            num_recomputed_tokens=st.num_recomputed_tokens,
            swapped_out_blocks=st.swapped_out_blocks,
            swapped_in_blocks=st.swapped_in_blocks,
            swap_bytes=self.swap_bytes,
            swap_calls=self.swap_calls,
            swap_seconds=self.timings.swap,
            prefix_cache_queries=kv.prefix_queries,
            prefix_cache_hits=kv.prefix_hits,
            num_steps=self.num_steps,
            num_generated_tokens=self.num_generated_tokens,
        )
