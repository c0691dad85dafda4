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
    prompt_logprobs   None or an integer in [0, MAX_LOGPROBS] (each prompt token's logprob and the top-k)
    stop              at most MAX_STOP non-empty strings of at most MAX_STOP_CHARS characters
    stop_token_ids    at most MAX_STOP non-negative integers below MAX_TOKEN_ID (the frontends and the
                      engine check them against the vocabulary)
    presence_penalty, frequency_penalty   finite, in [-2, 2] (OpenAI's range)
    repetition_penalty    finite, in (0, MAX_REPETITION_PENALTY]; 1 = off
    logit_bias        at most MAX_LOGIT_BIAS {token id: bias} with a finite bias in [-100, 100]
    min_tokens        integer in [0, max_tokens]
    bad_words         at most MAX_BAD_WORDS non-empty strings of at most MAX_STOP_CHARS characters
                      (made token ids by `resolve_bad_words` with the tokenizer, as vLLM does)
    bad_words_token_ids   at most 2 * MAX_BAD_WORDS non-empty lists of at most MAX_BAD_WORD_TOKENS ids
    allowed_token_ids None or a non-empty list of at most MAX_ALLOWED_TOKENS ids
    priority          (not a sampling field, same checks) an integer in [PRIORITY_MIN, PRIORITY_MAX]

Token ids (stop_token_ids, logit_bias keys, allowed_token_ids, bad words) are checked against the
vocabulary where it is known: `check_vocab`, at the frontends and in the engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from folio.worker.errors import InvalidRequestError

MAX_N = 1024
MAX_TOKENS = 2**31 - 1
MAX_TOP_K = 2**31 - 1
MAX_LOGPROBS = 20  # vLLM's default max_logprobs; OpenAI: 20 top_logprobs (chat), 5 logprobs (completions)
MAX_SALT_CHARS = 1024
SEED_LIMIT = 2**64  # seeds are in [0, SEED_LIMIT): what torch.Generator.manual_seed takes
GREEDY_TEMPERATURE = 1e-5  # below it logits / T overflow float32: such a request is greedy
MAX_STOP = 64
MAX_STOP_CHARS = 1024
MAX_TOKEN_ID = 2**31 - 1
PRIORITY_MIN, PRIORITY_MAX = -(2**31), 2**31 - 1
MAX_PENALTY = 2.0  # presence / frequency: OpenAI's [-2, 2]
MAX_REPETITION_PENALTY = 100.0
MAX_BIAS = 100.0  # OpenAI: logit_bias values in [-100, 100]
MAX_LOGIT_BIAS = 4096
MAX_BAD_WORDS = 64
MAX_BAD_WORD_TOKENS = 64
MAX_ALLOWED_TOKENS = 2**20


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
    prompt_logprobs: int | None = None  # None = off; k: each prompt token's logprob plus the top-k (vLLM's)
    skip_special_tokens: bool = True
    detokenize: bool = True
    # logits processing (sampler.process_logits), in vLLM's order: allowed_token_ids, bad words,
    # logit_bias, min_tokens, then the penalties; logprobs are read before them (after a grammar's mask)
    presence_penalty: float = 0.0  # minus this from a token's logit once it is in the output
    frequency_penalty: float = 0.0  # minus this times its count in the output
    repetition_penalty: float = 1.0  # a logit of a token in the prompt or output: / p if > 0, else * p (HF)
    logit_bias: dict[int, float] | None = None  # added to the logits
    min_tokens: int = 0  # EOS and stop_token_ids masked, stop strings not looked for, before this many
    bad_words: list[str] = field(default_factory=list)  # never completed (token ids: resolve_bad_words)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)  # a sequence never emitted whole
    allowed_token_ids: list[int] | None = None  # only these can be sampled
    guided: "GuidedSpec | None" = None  # structured output: the grammar the output must match (guided.py)
    cache_salt: str | None = None  # prefix cache: only requests of the same salt share blocks (vLLM's; hashing.py)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple, type(None))):
            raise InvalidRequestError("stop must be a string or a list of strings", param="stop")
        if not isinstance(self.stop_token_ids, (list, tuple, type(None))):
            raise InvalidRequestError("stop_token_ids must be a list of integers", param="stop_token_ids")
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        for name in ("bad_words", "bad_words_token_ids", "allowed_token_ids"):
            v = getattr(self, name)
            if not isinstance(v, (list, tuple, type(None))):
                raise InvalidRequestError(f"{name} must be a list", param=name)
        if not isinstance(self.logit_bias, (dict, type(None))):
            raise InvalidRequestError("logit_bias must be a map of token ids to biases", param="logit_bias")
        self.bad_words = list(self.bad_words or [])
        self.bad_words_token_ids = [list(w) if isinstance(w, (list, tuple)) else w
                                    for w in self.bad_words_token_ids or []]
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.logit_bias is not None:
            self.logit_bias = dict(self.logit_bias)
        if self.guided is not None:
            from folio.worker.guided import GuidedSpec
            if not isinstance(self.guided, GuidedSpec):
                raise InvalidRequestError("guided must be a GuidedSpec", param="response_format")
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
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not 0 < len(self.cache_salt)
                                            <= MAX_SALT_CHARS):
            bad(f"cache_salt must be a non-empty string of at most {MAX_SALT_CHARS} characters")
        if len(self.stop) > MAX_STOP or any(not isinstance(s, str) or not s or len(s) > MAX_STOP_CHARS
                                            for s in self.stop):
            bad(f"stop must be at most {MAX_STOP} non-empty strings of at most {MAX_STOP_CHARS} characters")
        if len(self.stop_token_ids) > MAX_STOP or any(not _is_int(t) or not 0 <= t < MAX_TOKEN_ID
                                                      for t in self.stop_token_ids):
            bad(f"stop_token_ids must be at most {MAX_STOP} token ids, integers in [0, {MAX_TOKEN_ID}), got "
                f"{len(self.stop_token_ids)}: {str(list(self.stop_token_ids)[:4])[:120]}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            bad(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs)
                                                 or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            bad(f"prompt_logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                bad(f"{name} must be a boolean")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_real(v) or not -MAX_PENALTY <= v <= MAX_PENALTY:
                bad(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {v!r}")
        if not _is_real(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            bad(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}], got {self.repetition_penalty!r}")
        if self.logit_bias is not None:
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                bad(f"logit_bias must have at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}")
            for t, b in self.logit_bias.items():
                if not _is_int(t) or not 0 <= t < MAX_TOKEN_ID:
                    bad(f"logit_bias keys must be token ids (non-negative integers), got {t!r}")
                if not _is_real(b) or not -MAX_BIAS <= b <= MAX_BIAS:
                    bad(f"logit_bias values must be numbers in [-{MAX_BIAS:g}, {MAX_BIAS:g}], got {b!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            bad(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        if len(self.bad_words) > MAX_BAD_WORDS or any(not isinstance(w, str) or not w.strip()
                                                      or len(w) > MAX_STOP_CHARS for w in self.bad_words):
            bad(f"bad_words must be at most {MAX_BAD_WORDS} non-blank strings of at most {MAX_STOP_CHARS} "
                f"characters")
        if len(self.bad_words_token_ids) > 2 * MAX_BAD_WORDS or any(
                not isinstance(w, list) or not 1 <= len(w) <= MAX_BAD_WORD_TOKENS
                or any(not _is_int(t) or not 0 <= t < MAX_TOKEN_ID for t in w) for w in self.bad_words_token_ids):
            bad(f"bad_words_token_ids must be at most {2 * MAX_BAD_WORDS} non-empty lists of at most "
                f"{MAX_BAD_WORD_TOKENS} token ids")
        if self.allowed_token_ids is not None and (
                not 1 <= len(self.allowed_token_ids) <= MAX_ALLOWED_TOKENS
                or any(not _is_int(t) or not 0 <= t < MAX_TOKEN_ID for t in self.allowed_token_ids)):
            bad(f"allowed_token_ids must be a non-empty list of at most {MAX_ALLOWED_TOKENS} token ids")

    def completion_seed(self, index: int) -> int | None:
        """The seed of completion `index` of n: wraps modulo 2**64, so any valid seed works with any n."""
        return None if self.seed is None else (self.seed + index) % SEED_LIMIT

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def processes_logits(self) -> bool:
        """Whether the sampler changes this request's logits before it samples (sampler.process_logits)."""
        return (self.penalized or bool(self.logit_bias) or self.min_tokens > 0 or bool(self.bad_words_token_ids)
                or self.allowed_token_ids is not None or self.guided is not None)


def check_vocab(params: SamplingParams, vocab_size: int) -> None:
    """Every token id a request names is one the model has: [0, vocab_size); and its single-token
    bad words leave a token to draw (longer ones can still empty a row later: the sampler's NO_TOKEN)."""
    check_token_ids(params.stop_token_ids, vocab_size, "stop_token_ids", "stop_token_ids")
    if params.logit_bias:
        check_token_ids(list(params.logit_bias), vocab_size, "logit_bias keys", "logit_bias")
    if params.allowed_token_ids is not None:
        check_token_ids(params.allowed_token_ids, vocab_size, "allowed_token_ids", "allowed_token_ids")
    for w in params.bad_words_token_ids:
        check_token_ids(w, vocab_size, "bad_words token ids", "bad_words")
    banned = {w[0] for w in params.bad_words_token_ids if len(w) == 1}  # (ids in [0, vocab_size) by now)
    allowed = params.allowed_token_ids
    if banned and (banned.issuperset(allowed) if allowed is not None else len(banned) >= vocab_size):
        raise InvalidRequestError("bad_words ban every token allowed_token_ids allows: no token to draw",
                                  param="bad_words")


def resolve_bad_words(params: SamplingParams, tokenizer) -> SamplingParams:
    """`bad_words` made token id sequences, moved into `bad_words_token_ids` (in place, so a request
    resolved at its frontend is not resolved again on its worker).

    As vLLM's `update_from_tokenizer`: each word is encoded as is (at the start of a text) and with
    a leading space (inside a text), the second kept when it is a different word token of the same
    length. Without a tokenizer, bad words (strings) cannot be honoured: a 400."""
    if not params.bad_words:
        return params
    if tokenizer is None:
        raise InvalidRequestError("bad_words needs the model's tokenizer (give bad_words_token_ids instead)",
                                  param="bad_words")
    out: list[list[int]] = []
    for word in params.bad_words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if plain:
            out.append(list(plain))
        if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
            out.append(list(spaced))
    if any(len(w) > MAX_BAD_WORD_TOKENS for w in out):
        raise InvalidRequestError(f"a bad word is more than {MAX_BAD_WORD_TOKENS} tokens long", param="bad_words")
    params.bad_words_token_ids = list(params.bad_words_token_ids) + out
    params.bad_words = []
    return params
