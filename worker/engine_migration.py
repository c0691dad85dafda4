"""Part of LLMEngine (engine.py): moving a request between engines, export its whole
state, import it elsewhere.

The state crosses processes (the Ray object store) as plain values plus CPU
tensors: the tokens, sampling parameters and RNG state of every completion, the
text generated so far, and each unfinished completion's KV blocks. The importer
puts the KV into its swap space and the request resumes with the next swap-in,
as if it had been swapped out there; without room it recomputes instead. Either
way the continuation is the same tokens an uninterrupted run would produce.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from folio.worker.block_manager import cdiv
from folio.worker.errors import InvalidRequestError
from folio.worker.messages import FinishReason
from folio.worker.sampling_params import SamplingParams
from folio.worker.sequence import Sequence, SequenceGroup, SequenceStatus


@dataclass(kw_only=True)
class SequenceState:
    """One completion of an exported request."""

    index: int  # which of the n completions
    token_ids: list[int]  # prompt + output
    num_computed_tokens: int  # tokens whose KV is in `kv` (0: it recomputes)
    output_text: str  # detokenized so far ("" without detokenization)
    logprobs: list[dict[int, float]] | None  # per output token, when asked
    finish_reason: FinishReason | None  # set for a completion that already finished
    stop_reason: int | str | None  # the stop token or string that ended it
    rng_state: torch.Tensor | None  # torch.Generator state (None for greedy)
    sent_tokens: int  # output tokens already streamed to the client
    sent_text_len: int  # characters of output_text already streamed
    kv: torch.Tensor | None  # [num_blocks, layers, 2, block_size, kv_heads, head_dim] on CPU (Runner.read_blocks)


@dataclass(kw_only=True)
class RequestState:
    """A request exported by one engine for another (EngineCore.export_request / import_request)."""

    request_id: str
    prompt: str | None  # its text, if it came as text
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int  # lower runs first
    arrival_time: float  # monotonic, on the exporting host (the worker converts it on the wire)
    forked: bool  # the n completions exist (the prompt's prefill completed)
    output_kind: str  # how its outputs are reported (outputs.OUTPUT_KINDS)
    block_size: int  # the exporter's: KV moves only between engines of the same
    tensor_parallel_size: int = 1  # the exporter's ranks: `kv` holds every rank's heads, rank after rank
    seqs: list[SequenceState] = field(default_factory=list)  # one per completion (one before the fork)
    prompt_logprobs: list | None = None  # those computed so far (SequenceGroup.prompt_logprobs)
    prompt_logprobs_sent: bool = False  # already streamed to the client

    @property
    def kv_bytes(self) -> int:
        return sum(s.kv.numel() * s.kv.element_size() for s in self.seqs if s.kv is not None)


def export_request(engine, request_id: str) -> RequestState:
    """Snapshot `request_id` and free it on `engine` (no output is emitted for it there)."""
    group: SequenceGroup | None = engine.groups.get(request_id)
    if group is None:
        raise InvalidRequestError(f"unknown request {request_id!r}")
    kv, runner, B = engine.kv, engine.runner, engine.config.block_size
    seqs = []
    for seq in group.seqs:
        data = None
        if not seq.is_finished and seq.num_computed_tokens > 0:
            n = cdiv(seq.num_computed_tokens, B)
            swapped = seq.status is SequenceStatus.SWAPPED
            blocks = kv.host_block_table(seq) if swapped else kv.block_table(seq)
            data = runner.read_blocks(blocks[:n], on_host=swapped)
        seqs.append(SequenceState(
            index=seq.index, token_ids=list(seq.token_ids),
            num_computed_tokens=seq.num_computed_tokens if data is not None else 0, output_text=seq.output_text,
            logprobs=list(seq.logprobs) if seq.logprobs is not None else None, finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason, rng_state=seq.generator.get_state() if seq.generator is not None else None,
            sent_tokens=seq.sent_tokens, sent_text_len=seq.sent_text_len, kv=data))
    state = RequestState(request_id=request_id, prompt=group.prompt, prompt_token_ids=list(group.prompt_token_ids),
                         params=group.params, priority=group.priority, arrival_time=group.arrival_time,
                         forked=group.forked, output_kind=engine.output_kinds.get(request_id, "final"), block_size=B,
                         tensor_parallel_size=engine.config.tensor_parallel_size, seqs=seqs,
                         prompt_logprobs=list(group.prompt_logprobs) if group.prompt_logprobs is not None else None,
                         prompt_logprobs_sent=group.prompt_logprobs_sent)
    for seq in group.seqs:
        if not seq.is_finished:
            engine.scheduler.finish(seq, FinishReason.MIGRATED)
    engine.groups.pop(request_id)
    engine.output_kinds.pop(request_id, None)
    return state


def import_request(engine, state: RequestState) -> str:
    """Admit an exported request: its KV into the swap space (resumed by the next swap-in),
    or, without room there, queued to recompute. Raises InvalidRequestError if it cannot run here."""
    rid = state.request_id
    if rid in engine.groups:
        raise InvalidRequestError(f"request id {rid!r} is already in use")
    if state.block_size != engine.config.block_size:
        raise InvalidRequestError(f"block size {state.block_size} differs from this engine's "
                                  f"{engine.config.block_size}")
    if state.tensor_parallel_size != engine.config.tensor_parallel_size:
        raise InvalidRequestError(f"request {rid!r} was exported by a tensor-parallel group of "
                                  f"{state.tensor_parallel_size} ranks; this engine has "
                                  f"{engine.config.tensor_parallel_size}: its KV does not fit")
    longest = max(len(s.token_ids) for s in state.seqs)
    max_len = min(len(state.prompt_token_ids) + state.params.max_tokens, engine.max_model_len)
    if longest >= engine.max_model_len or engine.kv.max_blocks_per_seq(max_len) > engine.num_kv_blocks:
        raise InvalidRequestError(f"request {rid!r} cannot fit in this engine's KV cache")
    shape = tuple(engine.runner.block_shape)
    for s in state.seqs:
        if s.kv is not None and (s.kv.dim() != 6 or tuple(s.kv.shape[1:]) != shape):
            raise InvalidRequestError(f"KV of shape {tuple(s.kv.shape)} does not fit this model's cache {shape}")
        if s.kv is not None and s.kv.shape[0] != cdiv(s.num_computed_tokens, state.block_size):
            raise InvalidRequestError(f"KV of {s.kv.shape[0]} blocks does not hold {s.num_computed_tokens} tokens "
                                      f"in blocks of {state.block_size}")
    if state.params.guided is not None:  # its grammar compiles here too (its matchers replay its tokens)
        engine.guided_grammars().check(state.params.guided)
    group = SequenceGroup(rid, state.prompt_token_ids, state.params, state.arrival_time, state.priority, state.prompt)
    group.forked = state.forked
    if state.prompt_logprobs is not None:
        group.prompt_logprobs, group.prompt_logprobs_sent = list(state.prompt_logprobs), state.prompt_logprobs_sent
    group.seqs = []
    for s in state.seqs:
        seq = Sequence(group, s.index, s.token_ids)
        seq.output_text, seq.finish_reason, seq.stop_reason = s.output_text, s.finish_reason, s.stop_reason
        seq.logprobs = list(s.logprobs) if s.logprobs is not None else None
        seq.sent_tokens, seq.sent_text_len = s.sent_tokens, s.sent_text_len
        if s.rng_state is not None:
            seq.generator = torch.Generator(device="cpu")
            seq.generator.set_state(s.rng_state)
        group.seqs.append(seq)
    engine.groups[rid] = group
    engine.output_kinds[rid] = state.output_kind
    for seq, s in zip(group.seqs, state.seqs):
        if seq.finish_reason is not None:
            seq.status = SequenceStatus.FINISHED
            continue
        host = engine.kv.adopt_swapped(seq, s.kv.shape[0]) if s.kv is not None else None
        if host is None:  # no swap space here (or no KV yet): recompute from the tokens
            engine.scheduler.requeue(seq)
            continue
        engine.runner.write_host_blocks(host, s.kv)
        seq.num_computed_tokens = s.num_computed_tokens
        engine.scheduler.add_swapped(seq)
    return rid
