"""Requests and their sequences: the state the scheduler and block manager work on.

A request (`SequenceGroup`) holds n sequences (completions). They share the
prompt: the first sequence prefills it, and when its prefill completes the other
n - 1 are forked from it, sharing its KV blocks (copy-on-write on the partial
last block). Every sequence then advances on its own, vLLM-v1 style: a sequence
is `token_ids` (prompt + output) and `num_computed_tokens` (how many of them
have KV in the cache); each step the scheduler gives it some number of new
tokens to compute, and when all of its tokens are computed it samples one more.
"""

from __future__ import annotations

import enum
import itertools
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

from folio.worker.hashing import BlockHash
from folio.worker.sampling_params import SamplingParams

if TYPE_CHECKING:  # torch is imported where a generator is made: the scheduler's tests need none
    import torch


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # seam for the swap issue: KV held in CPU memory
    FINISHED = "finished"


_seq_ids = itertools.count()


class Sequence:
    """One completion. Not thread-safe; owned by one engine."""

    __slots__ = (
        "seq_id", "group", "index", "token_ids", "num_prompt_tokens", "num_computed_tokens",
        "status", "block_hashes", "generator", "output_text", "logprobs", "finish_reason",
        "stop_reason", "num_preemptions", "decoder", "sent_tokens", "sent_text_len", "grammar", "penalty_seen",
    )

    def __init__(self, group: "SequenceGroup", index: int, token_ids: list[int]) -> None:
        self.seq_id = next(_seq_ids)
        self.group = group
        self.index = index
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(group.prompt_token_ids)
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING
        self.block_hashes: list[BlockHash] = []  # chained hashes of full blocks, filled lazily
        self.generator: torch.Generator | None = None
        self.output_text = ""
        self.logprobs: list[dict[int, float]] | None = [] if group.params.logprobs is not None else None
        self.finish_reason: str | None = None  # "stop" | "length" | "abort"
        self.stop_reason: int | str | None = None  # the stop token id or string that matched
        self.num_preemptions = 0
        self.decoder = None  # incremental detokenizer state (detokenizer.py)
        self.sent_tokens = 0  # output tokens already reported (outputs.py; a migration carries both)
        self.sent_text_len = 0  # characters of output_text already reported
        self.grammar = None  # structured output: its xgrammar matcher, made on first use (guided.py)
        self.penalty_seen = None  # the penalties' ids seen and counts, made on first use (penalties.py)

    # ---- derived figures -------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def params(self) -> SamplingParams:
        return self.group.params

    @property
    def priority(self) -> int:
        return self.group.priority

    @property
    def arrival_time(self) -> float:
        return self.group.arrival_time

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, req={self.group.request_id!r}, idx={self.index}, "
                f"tokens={self.num_tokens}, computed={self.num_computed_tokens}, {self.status.value})")


class SequenceGroup:
    """One request: a prompt, its sampling parameters and its n sequences."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 arrival_time: float, priority: int = 0, prompt: str | None = None) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.arrival_time = arrival_time
        self.priority = priority
        self.guided_too_slow: str | None = None  # why its grammar's masks were refused (guided.py)
        self.fill_s = 0.0  # its grammar's masks' time, its last token (guided.py); guided_budget.py
        self.fill_ran_at = 0  # the scheduler's step it last ran in, as a costly grammar (guided_budget.py)
        self.fill_credit = 0.0  # its share of the steps' mask time earned, not spent (guided_budget.py)
        self.seqs: list[Sequence] = [Sequence(self, 0, prompt_token_ids)]
        self.forked = params.n == 1  # children are created when the prompt's prefill completes
        self.seqs[0].generator = self.make_generator(0)
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        # prompt_logprobs: entry k for prompt token k (None for the first: nothing predicts it),
        # filled as the prefill computes them (model_runner.py); reported once complete
        self.prompt_logprobs: list[dict[int, float] | None] | None = (
            [None] if params.prompt_logprobs is not None else None)
        self.prompt_logprobs_sent = False

    @property
    def prompt_logprobs_done(self) -> int:
        """Prompt tokens whose logprobs are known (all of them when none were asked for)."""
        pl = self.prompt_logprobs
        return len(self.prompt_token_ids) if pl is None else len(pl)

    def make_generator(self, index: int) -> torch.Generator | None:
        if self.params.greedy:
            return None
        import torch

        g = torch.Generator(device="cpu")
        seed = self.params.completion_seed(index)
        seed = random.getrandbits(63) if seed is None else seed
        g.manual_seed(seed)
        return g

    @property
    def is_finished(self) -> bool:
        return self.forked and all(s.is_finished for s in self.seqs)


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0  # times any of its sequences was preempted (swap or recompute)


@dataclass
class CompletionOutput:
    index: int  # which of the n completions
    token_ids: list[int]  # output tokens: all of them ("final"), or those new since the last output ("delta")
    text: str  # detokenized text of those tokens (stop string excluded)
    finish_reason: str | None  # None while running; "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None  # per output token: {token_id: logprob}

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    error: str | None = None  # the engine failed this request (finish_reason "error"): why
    error_param: str | None = None  # the request field its error concerns (a grammar's: the field it came in)
    prompt_logprobs: list[dict[int, float] | None] | None = None  # per prompt token (the first: None)

    # Shortcuts to the first completion, as in DESIGN.md: outs[i].token_ids / .text / .finish_reason
    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason
