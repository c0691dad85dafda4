"""Sampling parameters of one request, validated on construction against hard bounds.

This is the one schema every entry point shares (the OpenAI HTTP API, gRPC and the
offline `LLM`): a value that passes `_check` is one the sampler can run, so no request
can make an engine step raise. The bounds (also in the README's "Bad input" section):

    n, best_of        integers in [1, MAX_N]; the engine and the frontends also cap them at max_num_seqs
    max_tokens        integer in [1, MAX_TOKENS] (the engine clamps to max_model_len - prompt)
    temperature       finite, >= 0; below GREEDY_TEMPERATURE it is greedy (set to 0, as vLLM does)
    top_p             finite, in (0, 1];  min_p finite, in [0, 1]
    top_k             -1 or 0 (off) or an integer in [1, MAX_TOP_K]; above the vocabulary it keeps all
    seed              None or an integer in [0, 2**64); completion i of n draws with (seed + i) mod 2**64
    logprobs          None or an integer in [0, MAX_LOGPROBS]
    stop              at most MAX_STOP non-empty strings of at most MAX_STOP_CHARS characters
    stop_token_ids    at most MAX_STOP non-negative integers below MAX_TOKEN_ID (the frontends and the
                      engine check them against the vocabulary)
    priority          (not a sampling field, same checks) an integer in [PRIORITY_MIN, PRIORITY_MAX]
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from folio.worker.errors import InvalidRequestError

MAX_N = 1024
MAX_TOKENS = 2**31 - 1
MAX_TOP_K = 2**31 - 1
MAX_LOGPROBS = 20  # vLLM's default max_logprobs; OpenAI: 20 top_logprobs (chat), 5 logprobs (completions)
SEED_LIMIT = 2**64  # seeds are in [0, SEED_LIMIT): what torch.Generator.manual_seed takes
GREEDY_TEMPERATURE = 1e-5  # below it logits / T overflow float32: such a request is greedy
MAX_STOP = 64
MAX_STOP_CHARS = 1024
MAX_TOKEN_ID = 2**31 - 1
PRIORITY_MIN, PRIORITY_MAX = -(2**31), 2**31 - 1


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def check_priority(priority) -> int:
    """A request's priority (lower runs first): an integer in [PRIORITY_MIN, PRIORITY_MAX]."""
    if not _is_int(priority) or not PRIORITY_MIN <= priority <= PRIORITY_MAX:
        raise InvalidRequestError(f"priority must be an integer in [{PRIORITY_MIN}, {PRIORITY_MAX}], "
                                  f"got {priority!r}", param="priority")
    return priority


def check_token_ids(ids, vocab_size: int, what: str = "prompt token ids", param: str = "prompt") -> list[int]:
    """Token ids as the model can embed them: integers in [0, vocab_size)."""
    if not isinstance(ids, (list, tuple)) or any(not _is_int(t) or not 0 <= t < vocab_size for t in ids):
        raise InvalidRequestError(f"{what} must be integers in [0, {vocab_size})", param=param)
    return list(ids)


@dataclass
class SamplingParams:
    n: int = 1  # independent completions sharing the prompt's KV blocks
    max_tokens: int = 16  # new tokens per completion
    temperature: float = 1.0  # 0 = greedy (and anything below GREEDY_TEMPERATURE)
    top_p: float = 1.0  # nucleus mass, in (0, 1]
    top_k: int = 0  # 0 (or -1) = off
    min_p: float = 0.0  # drop tokens below min_p * p(max), in [0, 1]
    seed: int | None = None  # per-request RNG: same seed, same tokens, whatever the batch
    stop: list[str] | str | None = None  # stop strings, not included in the text
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # None = off; k in [0, MAX_LOGPROBS]: chosen token's logprob plus top-k
    skip_special_tokens: bool = True
    detokenize: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple, type(None))):
            raise InvalidRequestError("stop must be a string or a list of strings", param="stop")
        if not isinstance(self.stop_token_ids, (list, tuple, type(None))):
            raise InvalidRequestError("stop_token_ids must be a list of integers", param="stop_token_ids")
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._check()
        if self.temperature < GREEDY_TEMPERATURE:
            self.temperature = 0.0

    def _check(self) -> None:
        def bad(msg: str) -> None:
            raise InvalidRequestError(msg, param=msg.split()[0])  # each message starts with its field

        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            bad(f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        if not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= MAX_TOKENS:
            bad(f"max_tokens must be an integer in [1, {MAX_TOKENS}], got {self.max_tokens!r}")
        if not _is_real(self.temperature) or self.temperature < 0.0:  # also rejects NaN and inf
            bad(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or not 0 <= self.top_k <= MAX_TOP_K:
            bad(f"top_k must be -1, 0 (off) or an integer in [1, {MAX_TOP_K}], got {self.top_k!r}")
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < SEED_LIMIT):
            bad(f"seed must be an integer in [0, 2**64), got {self.seed!r}")
        if len(self.stop) > MAX_STOP or any(not isinstance(s, str) or not s or len(s) > MAX_STOP_CHARS
                                            for s in self.stop):
            bad(f"stop must be at most {MAX_STOP} non-empty strings of at most {MAX_STOP_CHARS} characters")
        if len(self.stop_token_ids) > MAX_STOP or any(not _is_int(t) or not 0 <= t < MAX_TOKEN_ID
                                                      for t in self.stop_token_ids):
            bad(f"stop_token_ids must be at most {MAX_STOP} non-negative integers")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            bad(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                bad(f"{name} must be a boolean")

    def completion_seed(self, index: int) -> int | None:
        """The seed of completion `index` of n: wraps modulo 2**64, so any valid seed works with any n."""
        return None if self.seed is None else (self.seed + index) % SEED_LIMIT

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
