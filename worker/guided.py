"""Structured output: a request's output constrained to a grammar (JSON schema, any JSON, a
regex, a choice of strings, an EBNF grammar), through xgrammar, as vLLM's default backend.

    spec = GuidedSpec("json_schema", json.dumps(schema))     # in SamplingParams.guided
    grammars = Grammars(tokenizer, vocab_size)                # one per engine (and frontend)
    grammars.check(spec)                                      # InvalidRequestError for a bad one
    m = grammars.matcher(seq)                                 # the sequence's state, made lazily
    apply_bitmask(logits, rows, [m, ...])                     # sampler: what the grammar allows
    m.accept_token(token)                                     # after the draw (engine)

A matcher is made on first use by replaying the sequence's output tokens, so a sequence that
arrives by migration (or whose state was dropped) resumes exactly; it is never shipped. The
mask is xgrammar's packed bitmask (32 tokens per int32), filled per row and unpacked with
torch for the whole batch at once (xgrammar's own CPU apply took 25 ms at batch 64 here).
Why xgrammar: it compiles a schema in ~10 ms and fills a 49,152-token mask in microseconds
per row (benchmarks/logits_processing.py records the cost per step at batch 64); it is what
vLLM uses by default, and has CPU wheels. JSON is compact (no free whitespace), so a model
cannot run on emitting spaces. A schema xgrammar would not enforce whole goes to llguidance (guided_llg.py).
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from folio.worker.errors import InvalidRequestError
from folio.worker.guided_llg import Llguidance, new_matcher
from folio.worker.schema_support import Unenforced, json_schema_ebnf
from folio.worker.utf8_mask import Utf8Mask

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 64 * 1024
# The longest one request's masks for one token may take, all its sequences (n) together.
# xgrammar fills one in microseconds (a JSON schema) to milliseconds (an EBNF), but an ambiguous
# pattern (nested repetitions such as (.{0,8}){0,8}) makes its Earley parser's work grow with
# every token: 0.04 s, then 0.4 s a token here, and (.{0,64}){0,64} never finished one. Over
# this, the request fails alone; a fill that never returns is the step watchdog's
# (actor_steps.py). Per request, not per sequence: with n = 256 sequences each under the
# limit, (.{0,4}){0,4} made one step take ~50 s, every other stream of the worker waiting.
FILL_BUDGET_S = 0.25
TOO_AMBIGUOUS = ("is too ambiguous for the grammar engine to follow (nested repetitions, such as "
                 "(.{0,8}){0,8}, multiply the ways to match)")


@dataclass(frozen=True)
class GuidedSpec:
    """What a request's output must match. `value`: the schema as JSON text (json_schema),
    the pattern (regex), the choices as a JSON list (choice), the EBNF (grammar), "" (json_object).
    `param`: the request field it came from, which its refusals name (not part of its identity:
    the same schema from guided_json or response_format is one compiled grammar)."""
    kind: str
    value: str = ""
    param: str = field(default="response_format", compare=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidRequestError(f"guided decoding kind must be one of {KINDS}, got {self.kind!r}",
                                      param=self.param)
        if not isinstance(self.value, str) or len(self.value) > MAX_SPEC_CHARS:
            raise InvalidRequestError(f"a guided decoding spec is a string of at most {MAX_SPEC_CHARS} characters",
                                      param=self.param)

    @staticmethod
    def choice(options: list[str], param: str = "guided_choice") -> "GuidedSpec":
        return GuidedSpec("choice", json.dumps(list(options)), param)


def _plain(e: Exception) -> str:
    """xgrammar's message without its log prefix ("[16:23:13] /project/cpp/regex_converter.cc:94: "): the
    client gets what is wrong with its spec, not the library's paths or the first refusal's time (a refusal is
    cached, and its message with it)."""
    return re.sub(r"\[\d\d:\d\d:\d\d\] \S+:\d+: ", "", str(e))[:300]


def _regex_escape(s: str) -> str:
    return "".join("\\" + c if c in r".^$*+?{}[]\|()/" else c for c in s)


_ANY_OBJECT = json.dumps({"type": "object"})  # json_object: OpenAI's JSON mode writes an object


@dataclass(frozen=True)
class _Refused:
    why: str  # the spec's compile error, cached as a grammar is


def _size(g) -> int:
    """A cache entry's bytes: xgrammar's figure for a compiled grammar, a refusal's message."""
    return len(g.why) if isinstance(g, _Refused) else g.memory_size_bytes


class Grammars:
    """The compiler and a cache of compiled grammars for one tokenizer, bounded by count and by
    bytes (the least recently used go first): a compiled schema of 1,400 properties holds ~13 MB,
    and 256 of them, under a count alone, held 3-5 GB in the frontend and in every worker (an
    attack, 2026-12-07). The bytes are xgrammar's own figure (`memory_size_bytes`): the process
    grew ~1.45x that per schema, so 128 MB of it is ~190 MB of memory. xgrammar's own cache,
    unbounded by default, is off."""

    MAX_CACHED = 256
    MAX_CACHED_BYTES = 128 << 20

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int] | None = None) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        # the engine's EOS ids (generation_config's too): the grammar ends on what ends a sequence
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=stop_token_ids or None)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self.utf8 = Utf8Mask(self.info.decoded_vocab, vocab_size)
        # what xgrammar would not enforce whole goes to llguidance (guided_llg.py), ending on the same tokens
        self.llg = Llguidance(tokenizer, vocab_size, list(stop_token_ids or [tokenizer.eos_token_id]))
        self._cache: OrderedDict[GuidedSpec, Any] = OrderedDict()  # oldest use first
        self._cached_bytes = 0
        self._lock = threading.Lock()
        self.evaluating = None  # the sequence whose grammar is being evaluated (the step watchdog names it)

    def cached(self, spec: GuidedSpec):
        """The spec's compiled grammar if the cache holds it, else None; never compiles (an
        event loop may ask). A spec refused before is refused again."""
        with self._lock:
            g = self._cache.get(spec)
            if g is not None:
                self._cache.move_to_end(spec)
        if isinstance(g, _Refused):
            raise InvalidRequestError(g.why, param=spec.param)
        return g

    def compiled(self, spec: GuidedSpec):
        """The spec's compiled grammar, from the cache or compiled now. Safe from several threads
        (a worker compiles a request's grammar on a thread before its step thread adds it)."""
        g = self.cached(spec)
        if g is None:
            try:
                g = self._compile(spec)  # outside the lock: xgrammar's compiler takes concurrent calls
                self._allows_a_first_token(spec, g)
            except InvalidRequestError as e:  # kept too: the step thread does not compile it again
                g = _Refused(str(e))
            self._keep(spec, g)
        if isinstance(g, _Refused):
            raise InvalidRequestError(g.why, param=spec.param)
        return g

    def _keep(self, spec: GuidedSpec, g) -> None:
        with self._lock:
            if spec in self._cache:
                return
            self._cache[spec] = g
            self._cached_bytes += _size(g)
            while len(self._cache) > 1 and (len(self._cache) > self.MAX_CACHED
                                            or self._cached_bytes > self.MAX_CACHED_BYTES):
                _, old = self._cache.popitem(last=False)  # (a sequence's matcher keeps its own reference)
                self._cached_bytes -= _size(old)

    def _compile(self, spec: GuidedSpec):
        c = self.compiler
        try:
            if spec.kind == "json_schema":
                try:
                    return c.compile_grammar(json_schema_ebnf(spec.value))
                except Unenforced as e:
                    return self.llg.compile_json_schema(spec.value, e)
            if spec.kind == "json_object":  # any object, compact as a schema's: xgrammar's builtin
                return c.compile_grammar(json_schema_ebnf(_ANY_OBJECT))  # JSON let a model write spaces forever
            if spec.kind == "regex":
                return c.compile_regex(spec.value)
            if spec.kind == "choice":
                options = json.loads(spec.value)
                if not options or not all(isinstance(o, str) and o for o in options):
                    raise ValueError("choices must be a non-empty list of non-empty strings")
                return c.compile_regex("(" + "|".join(_regex_escape(o) for o in options) + ")")
            return c.compile_grammar(spec.value)
        except InvalidRequestError as e:
            raise InvalidRequestError(str(e), param=spec.param) from None
        except Exception as e:  # xgrammar's errors: a schema, regex or grammar it cannot compile
            raise InvalidRequestError(f"the {spec.kind.replace('_', ' ')} cannot be compiled: {_plain(e)}",
                                      param=spec.param) from None

    def _allows_a_first_token(self, spec: GuidedSpec, g) -> None:
        """A grammar that allows no token at all (`root ::= root`) is refused here, by name: its
        request's first draw was from an empty mask ("token 0 does not match the grammar")."""
        bm = self._xgr.allocate_token_bitmask(1, self.vocab_size)
        new_matcher(self._xgr, g).fill_next_token_bitmask(bm, 0)
        if not bm.any():
            raise InvalidRequestError(f"the {spec.kind.replace('_', ' ')} matches no text: it allows no first token",
                                      param=spec.param)

    def check(self, spec: GuidedSpec | None) -> None:
        if spec is not None:
            self.compiled(spec)

    def check_first_token(self, params) -> None:
        """A request whose allowed_token_ids and single-token bad words take every first token its
        grammar allows is refused before it runs (it failed in its first step: after a stream's 200)."""
        spec = params.guided
        banned = {w[0] for w in params.bad_words_token_ids if len(w) == 1}
        if spec is None or (params.allowed_token_ids is None and not banned):
            return
        bm = self._xgr.allocate_token_bitmask(1, self.vocab_size)
        new_matcher(self._xgr, self.compiled(spec)).fill_next_token_bitmask(bm, 0)
        if params.allowed_token_ids is None:
            keep = torch.ones(self.vocab_size, dtype=torch.bool)
            keep[sorted(t for t in banned if 0 <= t < self.vocab_size)] = False
            ids = keep.nonzero().flatten()
        else:
            ids = torch.tensor(sorted({t for t in params.allowed_token_ids if 0 <= t < self.vocab_size} - banned),
                               dtype=torch.long)
        # (int32 words: bit 31 sign-extends in int64, still read right)
        if not bool(((bm[0].long()[ids // 32] >> (ids % 32)) & 1).any()):
            raise InvalidRequestError(f"the {spec.kind.replace('_', ' ')} allows no first token that "
                                      "allowed_token_ids and bad_words leave: no token to draw", param=spec.param)

    def matcher(self, seq):
        """The sequence's matcher, made on first use with its output tokens so far replayed."""
        m = seq.grammar
        if m is None:
            m = new_matcher(self._xgr, self.compiled(seq.params.guided))
            for t in seq.output_token_ids:
                if not m.accept_token(t):
                    raise InvalidRequestError(f"output token {t} does not match the request's grammar")
            seq.grammar = m
        return m

    def accept(self, seq, token: int) -> None:
        """After the draw: the sequence's matcher takes `token` (a new matcher replays the output).
        A request whose masks took too long (`bitmask`) fails here."""
        why = getattr(getattr(seq, "group", seq), "guided_too_slow", None)
        if why is not None:
            raise InvalidRequestError(why, param=seq.params.guided.param)
        self.evaluating = seq
        try:
            if seq.grammar is None:
                self.matcher(seq)  # replays every output token, this one included
            elif not seq.grammar.accept_token(token):  # drawn from a row its other masks emptied
                if getattr(seq.grammar, "error", None):  # (llguidance past one of its limits)
                    raise InvalidRequestError(f"the grammar engine stopped: {seq.grammar.error}",
                                              param=seq.params.guided.param)
                # (the token drawn from a row with nothing left is no information: it was not named)
                raise InvalidRequestError("the request's grammar and its other constraints (allowed_token_ids, "
                                          "bad_words, logit_bias) leave no token to draw after "
                                          f"{seq.num_output_tokens - 1} output tokens", param=seq.params.guided.param)
        finally:
            self.evaluating = None

    def bitmask(self, seqs: list) -> torch.Tensor:
        """The packed mask (int32 [len(seqs), ceil(V / 32)]) of what each sequence's grammar allows
        next, less what would make its output ill-formed UTF-8 (utf8_mask.py). A row that mask
        empties (a grammar that allows only ill-formed bytes there) is the request's error."""
        bm = self._xgr.allocate_token_bitmask(len(seqs), self.vocab_size)
        spent: dict[int, float] = {}  # id(request) -> its sequences' fill time in this call
        try:
            for i, s in enumerate(seqs):
                m = self.matcher(s)
                req = getattr(s, "group", s)  # the request: its n sequences share one budget
                if getattr(req, "guided_too_slow", None) is not None:  # failed: no second slow fill; its
                    continue  # rows stay all-allowed and `accept` fails it after the draw, the batch's others untouched
                self.evaluating, t0 = s, time.perf_counter()
                m.fill_next_token_bitmask(bm, i)
                took = spent[id(req)] = spent.get(id(req), 0.0) + time.perf_counter() - t0
                if took > FILL_BUDGET_S:  # (raising here re-sampled the whole batch, refilling every mask)
                    kind = s.params.guided.kind.replace("_", " ")
                    req.guided_too_slow = (f"the request's {kind} {TOO_AMBIGUOUS}: one token took {took:.2f} s "
                                           f"(the limit is {FILL_BUDGET_S} s, all its sequences together)")
        finally:
            self.evaluating = None
            for s in seqs:  # what each request's masks took, for the step's share (guided_budget.py)
                req = getattr(s, "group", s)
                req.fill_s = spent.get(id(req), 0.0)
        if self.utf8.restrict(bm, seqs):
            raise InvalidRequestError("no token the request's grammar allows here keeps the output well-formed "
                                      "UTF-8", param="response_format")
        return bm


# byte -> what its 8 bits (lowest first) add to 8 logits: 0 where allowed, -inf where not. A
# packed little-endian int32 word of the mask, read as 4 bytes, unpacks in token order; one
# lookup and one add (masked_fill on the same [64, 49152] took 15 ms here, add 0.8 ms)
_ADD = torch.where(((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool(), 0.0, float("-inf"))


def apply_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """logits[rows] = -inf wherever the packed bitmask (int32 [len(rows), ceil(V / 32)]) has a 0."""
    vocab = logits.shape[-1]
    as_bytes = bitmask.contiguous().view(torch.uint8).reshape(-1).to(logits.device).long()
    add = _ADD.to(device=logits.device, dtype=logits.dtype).index_select(0, as_bytes).reshape(len(rows), -1)
    add = add[:, :vocab]
    if rows == list(range(logits.shape[0])):  # every row: in place, no gather of rows
        logits.add_(add)
    else:
        logits.index_add_(0, torch.tensor(rows, dtype=torch.long, device=logits.device), add)
