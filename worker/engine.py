"""LLMEngine: add_request / step / abort on one device. Later issues wrap it in a Ray actor.

    step():  schedule -> copy-on-write -> run the model -> sample -> postprocess

Not thread-safe: one caller drives it.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable
import torch

from folio.worker.block_manager import KVCacheManager, PagedKVManager
from folio.worker.contiguous_kv import ContiguousKVManager
from folio.worker.config import EngineConfig
from folio.worker.detokenizer import Detokenizer, load_tokenizer
from folio.worker.errors import ConfigError, InvalidRequestError
from folio.worker.model_runner import ModelRunner
from folio.worker.models.config import ModelConfig, generation_eos_ids
from folio.worker.models.loader import load_model
from folio.worker.outputs import OUTPUT_KINDS, make_request_output
from folio.worker.migration import RequestState, export_request, import_request
from folio.worker.preemption import PreemptionRates
from folio.worker import fault_isolation
from folio.worker.sampler import sample
from folio.worker.sampling_params import SamplingParams, check_priority, check_vocab, resolve_bad_words
from folio.worker.scheduler import Scheduler
from folio.worker.sizing import size_engine
from folio.worker.sequence import CompletionOutput, RequestOutput, Sequence, SequenceGroup, SequenceStatus
from folio.worker.stats import EngineStats, StepTimings


class LLMEngine:
    """The engine of one device.

    - `add_request` validates and queues; on bad input it raises InvalidRequestError
      and leaves the engine exactly as it was.
    - `step` runs one iteration and returns the outputs of requests that produced
      tokens (as their output_kind asks); a request is forgotten after its final output.
    - `abort` frees a request's blocks at once, whatever its state.
    - One caller drives it: it is not thread-safe.
    """

    grammars = None  # structured output's compiler and cache (guided.py), made for the first such request

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_config = ModelConfig.from_dir(config.model)
        mc = self.model_config
        sizes = size_engine(config, mc)
        self.max_model_len = sizes.max_model_len
        self.max_num_batched_tokens = sizes.max_num_batched_tokens
        self.num_kv_blocks = sizes.num_kv_blocks
        self.num_cpu_blocks = sizes.num_cpu_blocks
        self.device = torch.device(config.device)
        dtype = config.torch_dtype
        if config.kv_manager == "paged":
            self.kv: KVCacheManager = PagedKVManager(self.num_kv_blocks, config.block_size,
                                                     config.enable_prefix_caching, num_cpu_blocks=self.num_cpu_blocks)
        else:
            self.kv = ContiguousKVManager(self.num_kv_blocks, config.block_size, self.max_model_len)
            if self.kv.reserve_blocks > self.num_kv_blocks:
                raise ConfigError(f"the contiguous baseline reserves {self.kv.reserve_blocks} blocks per "
                                  f"request but the cache has {self.num_kv_blocks}")
        self.rates = PreemptionRates()  # measured swap and prefill speeds, for preemption_mode="auto"
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, self.max_num_batched_tokens,
                                   config.enable_chunked_prefill,
                                   watermark_blocks=int(config.watermark * self.num_kv_blocks),
                                   preemption_mode=config.preemption_mode, kv_bytes_per_block=sizes.bytes_per_block,
                                   rates=self.rates)
        self.model = load_model(config.model, dtype, self.device, self.max_model_len, mc)
        self.runner = ModelRunner(self.model, self.num_kv_blocks, config.block_size, dtype, self.device,
                                  self.num_cpu_blocks, layout=config.kv_cache_layout)
        if config.warm_up:  # memory flat from here on
            self.runner.warm_up(self.max_num_batched_tokens, config.max_num_seqs)
        self.tokenizer = load_tokenizer(config.tokenizer)
        self.detokenizer = Detokenizer(self.tokenizer)
        self.eos_token_ids = set(mc.eos_token_ids) | generation_eos_ids(config.model)
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.groups: dict[str, SequenceGroup] = {}
        self.output_kinds: dict[str, str] = {}  # request id -> how its outputs are reported (migration.py carries it)
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
        check_vocab(params, self.model_config.vocab_size)
        if params.guided is not None:
            self.guided_grammars().check(params.guided)  # a schema it cannot compile: refused here
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
        if self.grammars is None:
            from folio.worker.guided import Grammars
            self.grammars = Grammars(self.tokenizer, self.model_config.vocab_size, sorted(self.eos_token_ids))
        return self.grammars

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("the prompt is empty")
            ids = self.tokenizer.encode(prompt)
            if not ids:
                raise InvalidRequestError("the prompt tokenizes to no tokens")
            return prompt, ids
        if isinstance(prompt, (list, tuple)):
            if not prompt:
                raise InvalidRequestError("the prompt is empty")
            vocab = self.model_config.vocab_size
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
        """The request's whole state (KV as CPU tensors), freed here. See migration.py."""
        return export_request(self, request_id)

    def import_request(self, state: RequestState) -> str:
        """Admit a request exported by another engine; it resumes from its KV. See migration.py."""
        return import_request(self, state)

    def preempt_request(self, request_id: str) -> bool:
        """Preempt a running request now (swap or recompute, per the preemption mode), between
        steps; it resumes when the scheduler finds room. False if it is not running here."""
        group = self.groups.get(request_id)
        running = [s for s in group.seqs if s.status is SequenceStatus.RUNNING] if group else []
        for seq in running:
            self.scheduler.preempt(seq)
        return bool(running)

    def request_summaries(self, request_ids: Iterable[str] | None = None) -> list[tuple[str, str, int, float, int]]:
        """(request id, "running" | "waiting" | "swapped", priority, arrival (monotonic), device
        blocks held or needed) for every unfinished request (or those of `request_ids` still
        here): what the coordinator plans with."""
        out = []
        groups = self.groups
        items = groups.items() if request_ids is None else ((r, groups[r]) for r in request_ids if r in groups)
        for rid, group in items:
            live = [s for s in group.seqs if not s.is_finished]
            if not live:
                continue
            states = {s.status for s in live}
            state = ("running" if SequenceStatus.RUNNING in states
                     else "swapped" if SequenceStatus.SWAPPED in states else "waiting")
            blocks = sum(len(self.kv.block_table(s)) if s.status is SequenceStatus.RUNNING
                         else self.kv.max_blocks_per_seq(s.num_tokens + 1) for s in live)
            out.append((rid, state, group.priority, group.arrival_time, blocks))
        return out

    def queued_request_ids(self) -> list[str]:
        """The requests with a sequence waiting or swapped out (O(queued), not O(all requests))."""
        sch = self.scheduler
        seqs = itertools.chain(sch.swapped, sch.waiting_sequences())
        return list(dict.fromkeys(s.group.request_id for s in seqs))

    def running_request_ids(self, min_priority: int | None = None) -> list[str]:
        """The requests with a running sequence, of priority > `min_priority` when given."""
        run = self.scheduler.running
        return list(dict.fromkeys(s.group.request_id for s in run if min_priority is None or s.priority > min_priority))

    def queue_figures(self) -> tuple[int, int | None]:
        """(prompt tokens not yet computed, over waiting, swapped and running sequences; the
        largest priority value, the least urgent, among running ones): one pass, for the
        heartbeat (running sequences still prefilling are the only running ones that count)."""
        sch = self.scheduler
        queued = sum(max(s.num_prompt_tokens - s.num_computed_tokens, 0)
                     for s in itertools.chain(sch.swapped, sch.waiting_sequences()))
        worst = None
        for s in sch.running:
            if s.num_computed_tokens < s.num_prompt_tokens:
                queued += s.num_prompt_tokens - s.num_computed_tokens
            p = s.group.priority
            if worst is None or p > worst:
                worst = p
        return queued, worst

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

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
        sample_seqs, logits, ran = fault_isolation.forward(self, sched.scheduled, blamed)
        t3 = time.perf_counter()
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
            seqs, result = fault_isolation.sample(self, sample, seqs, logits, blamed)
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

    def _fork(self, to_sample: list[Sequence], logits: torch.Tensor,
              blamed: dict[str, str] | None = None) -> tuple[list[Sequence], torch.Tensor]:
        """A request with n > 1 forks its completions when its prompt's prefill completes;
        the children sample from the parent's logits row. A request whose fork raises is
        blamed (and left unforked: nothing changed) when `blamed` is given."""
        rows: list[int] = []
        seqs: list[Sequence] = []
        for r, seq in enumerate(to_sample):
            group = seq.group
            gens: list = []
            if not group.forked:
                try:  # everything that can fail comes before the first change
                    gens = [group.make_generator(i) for i in range(1, group.params.n)]
                except Exception as e:
                    if blamed is None:
                        raise
                    blamed[group.request_id] = fault_isolation.describe(e)
                    continue
            rows.append(r)
            seqs.append(seq)
            if not group.forked:
                group.forked = True
                for i, gen in zip(range(1, group.params.n), gens):
                    child = Sequence(group, i, seq.token_ids)
                    child.generator = gen
                    child.num_computed_tokens = seq.num_computed_tokens
                    group.seqs.append(child)
                    if self.kv.fork(seq, child):
                        self.scheduler.add_running(child)
                        rows.append(r)
                        seqs.append(child)
                    else:  # no room to share: it waits and recomputes, sampling then
                        self.scheduler.requeue(child)
        if len(rows) != len(to_sample):
            logits = logits.index_select(0, torch.tensor(rows, dtype=torch.long, device=logits.device))
        return seqs, logits

    def _apply_samples(self, seqs: list[Sequence], result, blamed: dict[str, str] | None = None) -> list[RequestOutput]:
        now = time.monotonic()
        touched: dict[str, SequenceGroup] = {}
        for seq, token, lp in zip(seqs, result.token_ids, result.logprobs):
            group = seq.group
            if blamed and group.request_id in blamed:
                continue
            try:
                self._append_token(seq, token, lp)
            except Exception as e:  # detokenizing or a stop check raised: this request's fault
                if blamed is None:
                    raise
                blamed[group.request_id] = fault_isolation.describe(e)
                touched.pop(group.request_id, None)
                continue
            if group.metrics.first_token_time is None:
                group.metrics.first_token_time = now
            touched[group.request_id] = group
        self.num_generated_tokens += len(seqs)
        return self._make_outputs(touched.values(), now)

    def _append_token(self, seq: Sequence, token: int, logprob: dict[int, float] | None) -> None:
        p = seq.params
        seq.token_ids.append(token)
        if seq.logprobs is not None:
            seq.logprobs.append(logprob)
        reason = stop = None
        if p.detokenize:
            stop = self.detokenizer.append_token(seq, token)
        done_grammar = False
        if p.guided is not None:
            if seq.grammar is None:
                self.guided_grammars().matcher(seq)  # replays every output token, this one included
            elif not seq.grammar.accept_token(token):
                raise InvalidRequestError(f"token {token} does not match the request's grammar")
            done_grammar = seq.grammar.is_terminated()
        if done_grammar:  # the output is complete (the grammar took its stop token)
            reason = "stop"
        elif not p.ignore_eos and token in self.eos_token_ids:
            reason = "stop"
        elif token in p.stop_token_ids:
            reason, seq.stop_reason = "stop", token
        elif stop is not None:
            reason, seq.stop_reason = "stop", stop
        elif seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is not None:
            seq.finish_reason = reason
            self.scheduler.finish(seq, reason)

    def _fail_requests(self, blamed: dict[str, str]) -> list[RequestOutput]:
        """End every blamed request now: blocks freed, a final output with `error` set."""
        outs = []
        for rid, why in blamed.items():
            group = self.groups.pop(rid, None)
            self.output_kinds.pop(rid, None)
            if group is None:
                continue
            for seq in group.seqs:
                if not seq.is_finished:
                    seq.finish_reason = "error"
                    self.scheduler.finish(seq, "error")
            group.forked = True
            group.metrics.finished_time = time.monotonic()
            done = [CompletionOutput(s.index, [], "", "error") for s in group.seqs]
            outs.append(RequestOutput(rid, group.prompt, group.prompt_token_ids, done, True, group.metrics,
                                      error=f"request {rid} failed in the engine: {why}"))
        return outs

    def _make_outputs(self, groups, now: float) -> list[RequestOutput]:
        outs = []
        for group in groups:
            kind = self.output_kinds.get(group.request_id, "final")
            out = make_request_output(group, kind)
            if out is None:
                continue
            if out.finished:
                group.metrics.finished_time = now
                self.groups.pop(group.request_id, None)
                self.output_kinds.pop(group.request_id, None)
            outs.append(out)
        return outs

    # ---- figures -----------------------------------------------------------------------
    def live_sequences(self) -> list[Sequence]:
        return [s for g in self.groups.values() for s in g.seqs if not s.is_finished]

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
