"""JSON schemas that xgrammar would not enforce whole, enforced by llguidance (vLLM's "auto" falls
back to it the same way: `has_xgrammar_unsupported_json_features`, then guidance).

The schemas that ordinary client code makes hit xgrammar 0.2.9's gaps: zod's `.email().max(100)`
and pydantic's `constr(pattern=..., max_length=...)` put a length beside a pattern or format,
`Field(multiple_of=0.01)` a multipleOf on a number, and pydantic's `$ref` with a description or
an `allOf` of two models. They were 400s (worker/schema_support.py names why, and since a fuzz sends
any `pattern`, `allOf` and more here: xgrammar got those wrong). llguidance
intersects a pattern with a length, takes multipleOf on numbers, merges allOf and follows a
`$ref` beside other keywords; what it does not implement (uniqueItems, contains, not, if/then,
propertyNames, ...) it refuses by name, so such a schema stays a 400 and nothing is dropped.

    llg = Llguidance(tokenizer, vocab_size, stop_token_ids)
    g = llg.compile_json_schema(schema_text, why_not_xgrammar)   # LlgGrammar, or InvalidRequestError
    m = new_matcher(xgr, g)           # xgrammar's GrammarMatcher or LlgMatcher: the same three calls

The matcher speaks xgrammar's: accept_token, fill_next_token_bitmask (the same packed int32
layout), is_terminated (only after the end token, as xgrammar's: a grammar that is complete
allows just that token, so a sequence ends as it does under xgrammar). JSON is compact here too.
"""

from __future__ import annotations

import json
import threading

import torch

from folio.worker.errors import InvalidRequestError


def _limits():
    """llguidance's bounds, tighter where its defaults let one grammar hold much memory: 250,000 lexer
    states at 1-2 kB each by its documentation; 10,000 here. Its errors say what broke, not the schema's
    text."""
    import llguidance

    return llguidance.LLParserLimits(max_lexer_states=10_000, verbose_errors=False)


def _guarded(fn, *args):
    """fn(*args), a Rust panic in llguidance (pyo3's PanicException, a BaseException that the engine's
    fault isolation, `except Exception`, would let through) raised as a RuntimeError instead."""
    try:
        return fn(*args)
    except Exception:
        raise
    except BaseException as e:
        if type(e).__name__ != "PanicException":
            raise
        raise RuntimeError(f"llguidance failed: {e}") from None


class LlgGrammar:
    """A compiled schema: a matcher at its start, copied for each sequence (llguidance's deep_copy)."""

    def __init__(self, start, text: str, stops: tuple[int, ...]) -> None:
        self.start, self.stops = start, stops
        # a cache's figure (guided.Grammars bounds its bytes); llguidance reports none. Measured on SmolLM2:
        # 120 distinct patterns such as ^(a|b|c)*a(a|b|c){12}x7$ beside a maxLength, each used for 3 x 60
        # tokens, grew the process ~1.1 MB apiece, and the cache at this figure kept it at +137 MB over 300
        self.memory_size_bytes = 2 * 1024 * 1024 + 64 * len(text)


class LlgMatcher:
    def __init__(self, g: LlgGrammar) -> None:
        self.m = _guarded(g.start.deep_copy)
        self.stops = g.stops  # the engine's end tokens: llguidance knows the first, the others stand for it
        self.terminated = False

    def accept_token(self, token: int) -> bool:
        if self.terminated or self.m.is_error():  # (an error stops the matcher too: its mask is the end alone)
            return False
        stop = token in self.stops
        if self.m.is_stopped():  # complete: only an end token follows (llguidance takes no more)
            self.terminated = stop
            return stop
        ok = bool(_guarded(self.m.consume_token, self.stops[0] if stop else token)) and not self.m.is_error()
        self.terminated = ok and stop
        return ok

    def fill_next_token_bitmask(self, bitmask, index: int) -> None:
        # (as llguidance.torch's own fill, which is not imported: it imports torch._dynamo, 2-3 s here)
        row = bitmask[index]
        assert bitmask.dtype == torch.int32 and row.is_contiguous() and not row.is_cuda
        _guarded(self.m.unsafe_compute_mask_ptr, row.data_ptr(), row.numel() * 4)
        first = self.stops[0]
        if len(self.stops) > 1 and (int(bitmask[index, first // 32]) >> (first % 32)) & 1:
            for t in self.stops[1:]:  # (int32 words: set bit 31 as the negative number it is)
                word = int(bitmask[index, t // 32]) | (1 << (t % 32))
                bitmask[index, t // 32] = word - (1 << 32) if word >= 1 << 31 else word

    def is_terminated(self) -> bool:
        return self.terminated

    @property
    def error(self) -> str | None:
        """Why the matcher stopped taking tokens (a resource limit), else None."""
        return self.m.get_error().splitlines()[0][:200] if self.m.is_error() else None


def new_matcher(xgr, g):
    """A matcher at the grammar's start, for either engine's compiled grammar."""
    return LlgMatcher(g) if isinstance(g, LlgGrammar) else xgr.GrammarMatcher(g)


class Llguidance:
    """llguidance's view of one tokenizer, made on first use (a fallback most engines never need)."""

    def __init__(self, tokenizer, vocab_size: int, stops: list[int]) -> None:
        self._tokenizer, self._vocab_size = tokenizer, vocab_size
        self.stops = tuple(t for t in stops if t is not None and 0 <= t < vocab_size) or (0,)
        self._ll = None
        self._lock = threading.Lock()

    def _tok(self):
        with self._lock:
            if self._ll is None:
                import llguidance.hf

                self._ll = llguidance.hf.from_tokenizer(self._tokenizer, n_vocab=self._vocab_size,
                                                        eos_token=self.stops[0])
            return self._ll

    def compile_json_schema(self, schema: str, why_not: InvalidRequestError) -> LlgGrammar:
        """The schema compiled by llguidance, compact; `why_not` (xgrammar's gap) is raised, with
        llguidance's own reason, where it cannot enforce the schema either."""
        import jsonschema
        import llguidance

        try:  # a schema JSON Schema itself refuses (multipleOf -1: llguidance took it) is no grammar
            meta = jsonschema.Draft202012Validator(jsonschema.Draft202012Validator.META_SCHEMA)  # (formats unchecked:
            bad = jsonschema.exceptions.best_match(meta.iter_errors(json.loads(schema)))  # ECMA's \p{L} is no re's)
            if bad is not None:
                raise jsonschema.SchemaError.create_from(bad)
            # (oneOf as anyOf, as xgrammar takes it: a pattern beside a pydantic discriminated union was a 400)
            grammar = _guarded(llguidance.LLMatcher.grammar_from_json_schema, schema,
                               {"whitespace_flexible": False, "coerce_one_of": True})
            start = _guarded(lambda: llguidance.LLMatcher(self._tok(), grammar, log_level=0, limits=_limits()))
            if not start.is_error():  # some errors come with the first mask only (allOf: [{"$ref": "#"}, {}])
                probe = LlgMatcher(LlgGrammar(start, "", self.stops))
                probe.fill_next_token_bitmask(torch.zeros(1, (self._vocab_size + 31) // 32, dtype=torch.int32), 0)
                err = probe.error
            else:
                err = start.get_error()
        except jsonschema.SchemaError as e:
            err = f"not a valid JSON schema: {e.message[:150]} (at {'/'.join(['#', *map(str, e.path)])})"
        except Exception as e:  # (a schema it cannot read)
            err = str(e)
        if err:
            raise InvalidRequestError(f"{why_not}; the fallback engine cannot enforce it either: "
                                      f"{err.splitlines()[0][:200]}", param=why_not.param) from None
        return LlgGrammar(start, grammar, self.stops)
