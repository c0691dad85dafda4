"""Structured output (worker/guided.py, xgrammar): generated JSON schemas (nested objects,
enums, arrays, required fields, bounded numbers and strings) on a random-weight model, which
would never write JSON by itself: every output parses and validates; regexes, choices and
EBNF grammars likewise; a migration mid-output resumes the grammar exactly; a schema that
cannot compile is a clear error. Through the servers in tests/e2e/test_frontends.py."""

from __future__ import annotations

import json
import math
import re
from types import SimpleNamespace

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from folio.worker import LLM, SamplingParams
from folio.worker.errors import InvalidRequestError
from folio.worker.guided import GuidedSpec
from conftest import PROMPTS

names = st.text(alphabet="abcdefghij_", min_size=1, max_size=6)
leaf = st.one_of(
    st.just({"type": "boolean"}),
    st.builds(lambda lo, n: {"type": "integer", "minimum": lo, "maximum": lo + n}, st.integers(-50, 50),
              st.integers(0, 99)),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
    st.lists(st.text(alphabet="xyzXYZ -", min_size=1, max_size=5), min_size=1, max_size=4, unique=True)
    .map(lambda e: {"enum": e}),
    st.just({"type": "null"}),
)


def _obj(children):
    return st.dictionaries(names, children, min_size=1, max_size=4).flatmap(
        lambda props: st.lists(st.sampled_from(sorted(props)), unique=True).map(
            lambda req: {"type": "object", "properties": props, "required": req, "additionalProperties": False}))


schemas = st.recursive(leaf, lambda children: st.one_of(
    _obj(children), st.builds(lambda it, n: {"type": "array", "items": it, "maxItems": n}, children,
                              st.integers(0, 3))), max_leaves=8).filter(lambda s: s.get("type") == "object") \
    | _obj(leaf)


@pytest.fixture(scope="module")
def llm(model_dirs):
    return LLM(model_dirs["llama"], block_size=8, num_kv_blocks=1024)


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=schemas, seed=st.integers(0, 2**31))
def test_generated_schemas_always_validate(llm, schema, seed):
    spec = GuidedSpec("json_schema", json.dumps(schema))
    outs = llm.generate(PROMPTS[:4], [SamplingParams(max_tokens=400, temperature=1.0, seed=seed + i, guided=spec)
                                      for i in range(4)])
    for o in outs:
        assert o.finish_reason == "stop", (schema, o.text)
        jsonschema.validate(json.loads(o.text), schema)
    llm.engine.check_invariants()


def test_regex_choice_grammar_and_json_object(llm):
    cases = [
        (GuidedSpec("regex", r"[0-9]{3}-[a-z]{2,4}"), lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t)),
        (GuidedSpec.choice(["yes", "no", "not (sure)"]), lambda t: t in ("yes", "no", "not (sure)")),
        (GuidedSpec("grammar", 'root ::= "(" [a-c] [a-c]? [a-c]? ")" | "[" [0-9] "]"'),
         lambda t: re.fullmatch(r"\([a-c]{1,3}\)|\[[0-9]\]", t)),
        (GuidedSpec("json_object"), lambda t: isinstance(json.loads(t), dict) and compact(t)),
    ]
    for spec, ok in cases:
        for greedy in (True, False):
            params = [SamplingParams(max_tokens=200, temperature=0.0 if greedy else 1.0, seed=i, guided=spec)
                      for i in range(len(PROMPTS))]
            for o in llm.generate(PROMPTS, params):
                if spec.kind == "json_object" and o.finish_reason == "length":
                    assert compact(o.text), o.text  # any JSON may go on past max_tokens, but never on spaces
                    continue
                assert o.finish_reason == "stop" and ok(o.text), (spec, o.text)


@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(choices=st.lists(st.text(alphabet="abxy ", min_size=1, max_size=3), min_size=1, max_size=3, unique=True),
       temperature=st.sampled_from([0.0, 1.0]), seed=st.integers(0, 2**31))
def test_logprobs_are_over_what_the_grammar_allows(llm, choices, temperature, seed):
    """As vLLM's: read after the grammar's mask (vLLM applies it before its sampler), so a choice's
    logprobs are over the choices, and a forbidden token among the top k has -9999 (JSON has no -inf).
    They were the raw logits': a two-way choice's answer had p 0.77 from Folio, 0.97 from vLLM."""
    spec = GuidedSpec.choice(choices)
    out = llm.generate([PROMPTS[0]], [SamplingParams(max_tokens=20, temperature=temperature, seed=seed, guided=spec,
                                                     logprobs=20)])[0]
    lps = out.outputs[0].logprobs
    assert out.text in choices and len(lps) == len(out.token_ids)
    for entry in lps:
        allowed = [lp for lp in entry.values() if lp > -9999.0]
        # few tokens begin a choice's rest (at most 3 x 3 and the end): all are among the top 20
        assert len(allowed) < len(entry) and abs(sum(math.exp(lp) for lp in allowed) - 1) < 1e-4, entry
        assert all(lp == -9999.0 for lp in entry.values() if lp <= -9999.0)


def test_min_tokens_yields_where_the_grammar_or_allow_list_leaves_only_the_end(llm):
    """A choice with min_tokens past its length failed its request after the answer ("no token to draw");
    an allow list of EOS alone with min_tokens drew token 0, which it does not allow. The hard constraint
    wins: the output ends there (vLLM's ends at the answer too); where other tokens are left, min_tokens holds."""
    eos = llm.tokenizer.eos_token_id
    for greedy in (True, False):
        t = dict(temperature=0.0 if greedy else 1.0, seed=3)
        o = llm.generate([PROMPTS[0]], [SamplingParams(max_tokens=10, min_tokens=6, guided=GuidedSpec.choice(
            ["yes", "no"]), **t)])[0]
        assert o.error is None and o.text in ("yes", "no") and o.outputs[0].finish_reason == "stop", o
        o = llm.generate([PROMPTS[0]], [SamplingParams(max_tokens=6, min_tokens=3, allowed_token_ids=[eos], **t)])[0]
        assert o.token_ids == [eos] and o.outputs[0].finish_reason == "stop", o
        o = llm.generate([PROMPTS[0]], [SamplingParams(max_tokens=6, min_tokens=3, allowed_token_ids=[eos, 5],
                                                       **t)])[0]
        assert o.token_ids[:3] == [5, 5, 5], o  # another token is left: min_tokens holds
    llm.engine.check_invariants()


WORDS = ["yes", "no", "maybe", "never", "okay"]


@pytest.fixture(scope="module")
def first_tokens(llm):
    """Each token whose text is a non-empty prefix of one of WORDS, by word: what a choice of them
    allows first (the oracle, read from the vocabulary, not from xgrammar)."""
    tok = llm.tokenizer
    texts = {t: tok.decode([t]) for t in range(llm.engine.vocab_size)}
    return {w: {t for t, x in texts.items() if x and w.startswith(x)} for w in WORDS}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(words=st.lists(st.sampled_from(WORDS), min_size=1, max_size=3, unique=True), data=st.data())
def test_an_allow_list_or_bad_words_that_take_a_grammars_first_tokens_are_refused_before_it_runs(
        llm, first_tokens, words, data):
    """A choice whose every first token allowed_token_ids leave out (or single-token bad words ban) failed
    in its first step (after a stream's 200); now it is refused when added, naming the grammar's field. What
    is added has a first token: it answers a choice, or fails later in the step (its masks empty a row)."""
    pool = sorted(set().union(*first_tokens.values()) | {100, 101, 102, 103})
    allowed = data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=5, unique=True))
    banned = data.draw(st.lists(st.sampled_from(pool), max_size=3, unique=True))
    p = SamplingParams(max_tokens=8, temperature=0.0, guided=GuidedSpec.choice(words), allowed_token_ids=allowed,
                       bad_words_token_ids=[[t] for t in banned])
    firsts = set().union(*(first_tokens[w] for w in words))
    if not (set(allowed) - set(banned)) & firsts:
        with pytest.raises(InvalidRequestError) as e:
            llm.generate([PROMPTS[0]], [p])
        assert e.value.param == ("bad_words" if set(allowed) <= set(banned) else "guided_choice"), e.value
        assert "no token to draw" in str(e.value)
    else:
        o = llm.generate([PROMPTS[0]], [p])[0]
        assert (o.error is None and o.text in words) or (
            "no token to draw" in o.error and "after 0 output tokens" not in o.error), o
    assert not llm.engine.has_unfinished_requests()


def compact(text: str) -> bool:
    """JSON text with no whitespace outside strings, from either engine (xgrammar's separators were
    ", " and ": " until 2026-12-08, llguidance's "," and ":")."""
    in_string = escaped = False
    for ch in text:
        if in_string:
            in_string, escaped = (escaped or ch != '"'), (not escaped and ch == "\\")
        elif ch == '"':
            in_string = True
        elif ch.isspace():
            return False
    return True


def test_compact_sees_free_whitespace():
    assert compact('{"a b":[1,{"c":"x\\" y"}],"d":null}')
    assert not compact('{ "a":1}') and not compact('{"a":1,\n"b":2}') and not compact('{"a": 1}')


def test_guided_and_plain_requests_share_a_batch(llm):
    plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone = llm.generate(PROMPTS, plain)
    spec = GuidedSpec.choice(["alpha", "beta"])
    mixed = llm.generate(PROMPTS * 2, [plain] * len(PROMPTS) + [SamplingParams(max_tokens=12, temperature=0.0,
                                                                                guided=spec)] * len(PROMPTS))
    assert [o.token_ids for o in mixed[:len(PROMPTS)]] == [o.token_ids for o in alone]
    assert all(o.text in ("alpha", "beta") for o in mixed[len(PROMPTS):])


def test_a_migration_mid_output_resumes_the_grammar(model_dirs):
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 30}, "b": {"type": "integer"}},
              "required": ["a", "b"], "additionalProperties": False}
    p = SamplingParams(max_tokens=200, temperature=0.0, guided=GuidedSpec("json_schema", json.dumps(schema)))
    want = LLM(model_dirs["llama"], block_size=8, num_kv_blocks=256).generate(PROMPTS[:1], p)[0]
    a = LLM(model_dirs["llama"], block_size=8, num_kv_blocks=256).engine
    b = LLM(model_dirs["llama"], block_size=8, num_kv_blocks=256, num_cpu_blocks=64).engine
    a.add_request("m", PROMPTS[0], p)
    for _ in range(6):
        a.step()
    state = a.export_request("m")
    assert 0 < len(state.seqs[0].token_ids) - len(state.prompt_token_ids) < len(want.token_ids)
    b.import_request(state)
    done = []
    while b.has_unfinished_requests():
        done += [o for o in b.step() if o.finished]
    assert done[0].error is None, done[0].error
    assert done[0].token_ids == want.token_ids and done[0].text == want.text
    jsonschema.validate(json.loads(done[0].text), schema)


@pytest.mark.parametrize("spec", [GuidedSpec("json_schema", "{not json"), GuidedSpec("regex", "(unclosed"),
                                  GuidedSpec("grammar", "root ::= missing_rule"),
                                  GuidedSpec("json_schema", json.dumps({"type": "no-such-type"}))])
def test_what_cannot_compile_is_refused_and_leaves_nothing(llm, spec):
    with pytest.raises(InvalidRequestError) as e:
        llm.engine.add_request("bad", PROMPTS[0], SamplingParams(guided=spec))
    assert "cannot be compiled" in str(e.value) and not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("grammar", ["root ::= root", "root ::= a\na ::= root"])
def test_a_grammar_that_allows_no_token_is_refused_by_name(llm, grammar):
    """It compiles, but its first mask is empty: the request's first draw failed with "token 0
    does not match the request's grammar" (an attack's fuzzing, 2026-12-06)."""
    with pytest.raises(InvalidRequestError) as e:
        llm.engine.add_request("bad", PROMPTS[0], SamplingParams(guided=GuidedSpec("grammar", grammar)))
    assert "matches no text" in str(e.value) and not llm.engine.has_unfinished_requests()


def test_bad_specs():
    with pytest.raises(InvalidRequestError):
        GuidedSpec("xml")
    with pytest.raises(InvalidRequestError):
        SamplingParams(guided={"type": "json_object"})


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 6), vocab=st.integers(1, 200), seed=st.integers(0, 2**31), some=st.booleans())
def test_apply_bitmask_equals_xgrammars_own(rows, vocab, seed, some):
    import torch
    import xgrammar as xgr

    from folio.worker.guided import apply_bitmask
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows + 2, vocab, generator=g)
    bm = torch.randint(-2**31, 2**31 - 1, (rows, (vocab + 31) // 32), dtype=torch.int32, generator=g)
    which = list(range(1, rows + 1)) if some else list(range(rows + 2))[:rows]
    if not some:
        logits = logits[:rows].clone()
    got = logits.clone()
    apply_bitmask(got, which, bm)
    want = logits.clone()  # written out: token t of row r is allowed when bit t % 32 of word t // 32 is set
    for j, r in enumerate(which):
        for t in range(vocab):
            if not (int(bm[j, t // 32]) >> (t % 32)) & 1:
                want[r, t] = float("-inf")
    assert torch.equal(got, want)
    if vocab >= 64:  # and as xgrammar's own apply (on a 1-token vocabulary it masked a row whose bit was set)
        part = logits[which].clone()
        xgr.apply_token_bitmask_inplace(part, bm)
        assert torch.equal(got[which], part)


AMBIGUOUS = r"(.{0,16}){0,16}"  # each token's mask: 0.02 s, then 0.6 s and growing (xgrammar 0.2.9, 2-core EPYC)


def test_a_grammar_too_slow_to_follow_fails_its_request_alone(llm, monkeypatch):
    """A request whose grammar takes longer than FILL_BUDGET_S to evaluate one token fails
    alone (a 400's message, blamed by fault isolation without a second slow fill); the plain
    and the well-behaved guided requests of the same batch finish as they would alone."""
    import folio.worker.guided as guided

    monkeypatch.setattr(guided, "FILL_BUDGET_S", 0.02)  # ~100x a well-behaved mask here, 1/30 of this one's
    plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    tame = SamplingParams(max_tokens=40, temperature=0.0, guided=GuidedSpec("regex", r"[0-9]{3}-[a-z]{2,4}"))
    alone = llm.generate(PROMPTS[:2], [plain, tame])
    slow = SamplingParams(max_tokens=40, temperature=1.0, seed=1, guided=GuidedSpec("regex", AMBIGUOUS))
    outs = llm.generate(PROMPTS[:2] * 2, [plain, tame, slow, slow])
    assert [o.token_ids for o in outs[:2]] == [o.token_ids for o in alone] and outs[0].error is outs[1].error is None
    for o in outs[2:]:
        assert o.error is not None and "InvalidRequestError" in o.error and "too ambiguous" in o.error, o.error
    assert not llm.engine.has_unfinished_requests()
    llm.engine.check_invariants()
    assert llm.engine.stats().num_free_blocks == llm.engine.stats().num_kv_blocks


def test_the_fill_budget_is_the_requests_whole_not_each_sequences(llm, monkeypatch):
    """FILL_BUDGET_S bounds all n sequences of a request together: n = 256 sequences each just
    under it made one step take ~50 s while every other stream of the worker waited. A clock
    that moves 0.1 s across each fill: a request of one sequence (0.1 s a token) runs, one of
    n = 4 (0.4 s) fails alone with the 400's message, and the batch's others finish as alone."""
    import folio.worker.guided as guided

    clock = iter(range(10**6))  # guided.py reads its clock twice a fill, and nowhere else
    monkeypatch.setattr(guided, "time", SimpleNamespace(perf_counter=lambda: 0.1 * next(clock)))
    monkeypatch.setattr(guided, "FILL_BUDGET_S", 0.25)
    one = SamplingParams(max_tokens=8, temperature=0.0, guided=GuidedSpec("regex", r"[0-9]{3}-[a-z]{2,4}"))
    four = SamplingParams(n=4, max_tokens=8, temperature=1.0, seed=3, guided=GuidedSpec("regex", r"[a-z]{2,6}"))
    plain = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    alone = llm.generate(PROMPTS[:2], [plain, one])
    calls, per_step, bitmask, step = [], [], guided.Grammars.bitmask, llm.engine.step

    def counted_step():
        before = len(calls)
        try:
            return step()
        finally:
            per_step.append(len(calls) - before)
    monkeypatch.setattr(guided.Grammars, "bitmask", lambda self, seqs: (calls.append(1), bitmask(self, seqs))[1])
    monkeypatch.setattr(llm.engine, "step", counted_step)
    outs = llm.generate(PROMPTS[:3], [plain, one, four])
    assert [o.token_ids for o in outs[:2]] == [o.token_ids for o in alone] and outs[0].error is outs[1].error is None
    assert outs[2].error is not None and "too ambiguous" in outs[2].error and "all its sequences" in outs[2].error
    assert max(per_step) == 1, f"a failed request had the batch sampled again, every mask filled again: {per_step}"
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.stats().num_free_blocks == llm.engine.stats().num_kv_blocks


def nested_schema(levels: int) -> str:
    """A JSON schema of objects `levels` deep (its document: 2 * levels + 1 deep)."""
    return '{"type":"object","properties":{"a":' * levels + '{"type":"string"}' + "}}" * levels


@pytest.mark.parametrize("levels, ok", [(63, True), (64, False), (450, False), (-30_000, False)])
def test_a_json_schema_past_the_nesting_bound_is_refused_before_it_compiles(llm, levels, ok):
    """xgrammar's EBNF for a schema grows with the square of its depth: 450 levels (16.7 KB)
    took ~9 s to compile, in a worker's step. Past MAX_SCHEMA_DEPTH it is a 400 naming the
    bound, at once; a document 30,000 lists deep (past what Python's JSON decoder follows) likewise."""
    import time

    from folio.worker.schema_support import MAX_SCHEMA_DEPTH

    spec = GuidedSpec("json_schema", nested_schema(levels) if levels > 0 else "[" * -levels + "]" * -levels)
    params = SamplingParams(max_tokens=4, temperature=0.0, guided=spec)
    t0 = time.perf_counter()
    if ok:
        assert llm.generate([PROMPTS[0]], params)[0].error is None
        return
    with pytest.raises(InvalidRequestError, match=f"at most {MAX_SCHEMA_DEPTH} are compiled"):
        llm.generate([PROMPTS[0]], params)
    assert time.perf_counter() - t0 < 2.0
    assert not llm.engine.has_unfinished_requests()


def test_the_grammar_cache_is_bounded_by_bytes_and_keeps_the_most_recently_used(llm, monkeypatch):
    """A compiled schema of 1,400 properties holds ~13 MB; under a count bound alone (256) the
    frontend and every worker held 3-5 GB of them (an attack, 2026-12-07). Past the byte bound
    the least recently used go; a spec used again stays; xgrammar's own cache holds nothing."""
    from folio.worker.guided import Grammars

    g = Grammars(llm.engine.tokenizer, llm.engine.vocab_size)
    specs = [GuidedSpec("regex", f"[a-z]{{4}}{c}") for c in "abcdefgh"]  # alike in size
    sizes = [g.compiled(s).memory_size_bytes for s in specs[:2]]
    monkeypatch.setattr(g, "MAX_CACHED_BYTES", int(max(sizes) * 3.5))
    for s in specs[2:]:
        g.compiled(specs[0])  # used again each time: it stays
        g.compiled(s)
    assert g._cached_bytes <= g.MAX_CACHED_BYTES
    assert g.cached(specs[0]) is not None and g.cached(specs[1]) is None and g.cached(specs[-1]) is not None
    assert g._cached_bytes == sum(v.memory_size_bytes for v in g._cache.values())
    assert g.compiler.get_cache_size_bytes() == 0


def test_the_frontends_grammar_check_never_queues_behind_a_compile(model_dirs, monkeypatch):
    """deploy/grammar_check.py: with every compile thread held, a cached spec is answered at
    once; requests of one spec share one compile; past MAX_COMPILING distinct specs a request
    is told to retry (429), and a bad spec is refused (400), again from the cache."""
    import asyncio
    import threading

    from transformers import AutoTokenizer

    import folio.deploy.grammar_check as gc
    from folio.worker.errors import OverloadedError

    checks = gc.GrammarChecks(AutoTokenizer.from_pretrained(model_dirs["llama"]), 512)
    cheap, bad = GuidedSpec.choice(["yes", "no"]), GuidedSpec("regex", "(")
    monkeypatch.setattr(gc, "MAX_COMPILING", 3)

    async def main():
        await checks.check(cheap)
        with pytest.raises(InvalidRequestError, match="cannot be compiled"):
            await checks.check(bad)
        held, calls, real = threading.Event(), [], checks._compile
        monkeypatch.setattr(checks, "_compile", lambda s: (calls.append(s), held.wait(30), real(s)))
        slow = [GuidedSpec("regex", f"[0-9]{{{k}}}") for k in (2, 3, 4)]
        waits = [asyncio.ensure_future(checks.check(s)) for s in slow + slow]
        await asyncio.sleep(0.2)
        await asyncio.wait_for(checks.check(cheap), 0.5)  # both threads held: from the cache
        with pytest.raises(InvalidRequestError):
            await asyncio.wait_for(checks.check(bad), 0.5)
        with pytest.raises(OverloadedError):
            await checks.check(GuidedSpec("regex", "[0-9]{9}"))
        held.set()
        await asyncio.wait_for(asyncio.gather(*waits), 30)
        assert sorted(calls, key=str) == sorted(slow, key=str) and not checks._compiling
        await checks.check(GuidedSpec("regex", "[0-9]{9}"))  # room again
    asyncio.run(main())


def test_costly_grammars_share_a_step_and_slow_only_their_own_requests(llm, monkeypatch):
    """Masks made to take 0.06 s each (a clock that moves so across each fill): past the first
    step, the guided requests' masks share STEP_FILL_S (0.1 s), so one of them runs a step, in
    turn; the plain request beside them runs every step; every output is the one it has alone."""
    import folio.worker.guided as guided
    from folio.worker import guided_budget

    plain = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    slow = [SamplingParams(max_tokens=6, temperature=0.0, guided=GuidedSpec("regex", f"[a-z]{{2,4}}-{k}[0-9]"))
            for k in range(3)]
    alone = [llm.generate([PROMPTS[0]], p)[0].token_ids for p in [plain] + slow]
    clock = iter(range(10**6))  # guided.py reads its clock twice a fill, and nowhere else
    monkeypatch.setattr(guided, "time", SimpleNamespace(perf_counter=lambda: 0.06 * next(clock)))
    steps, schedule = [], llm.engine.scheduler.schedule

    def logged():
        out = schedule()
        steps.append([s.params for s, _ in out.scheduled])
        return out
    monkeypatch.setattr(llm.engine.scheduler, "schedule", logged)
    outs = llm.generate([PROMPTS[0]] * 4, [plain] + slow)
    assert [o.token_ids for o in outs] == alone and all(o.error is None for o in outs)
    guided_per_step = [sum(1 for p in step if p.guided is not None) for step in steps]
    assert max(guided_per_step[2:]) == 1 and 0.06 * 2 > guided_budget.STEP_FILL_S, guided_per_step
    assert all(plain in step for step in steps[:len(alone[0])]), "the plain request sat a step out"


# What xgrammar enforces, beyond the generated schemas above: each sampled at temperature 1 on the
# random model, every output validated (formats by their shape; `format` is an annotation in JSON
# Schema). A constraint found broken here belongs in worker/schema_support.py's refusals (with the
# refusals off, uniqueItems broke 5 outputs of 8 and multipleOf 0.5 all 8).
ENFORCED = [
    {"type": "integer", "multipleOf": 7, "minimum": -50, "maximum": 50},
    {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
    {"type": "string", "pattern": "^[a-c]{2,4}$"},
    {"type": "string", "format": "date"},
    {"type": "string", "format": "uuid"},
    {"type": "string", "minLength": 2, "maxLength": 3},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 3},
    {"type": "array", "prefixItems": [{"type": "integer"}, {"const": "x"}], "items": False},
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "null"}}, "required": ["a"],
     "additionalProperties": False, "maxProperties": 1},
    {"anyOf": [{"type": "integer", "maximum": 0}, {"enum": ["up", "down"]}]},
    {"$defs": {"p": {"type": "integer", "minimum": 3, "maximum": 4}}, "type": "array", "items": {"$ref": "#/$defs/p"},
     "maxItems": 2},
    {"allOf": [{"type": "string", "maxLength": 2}]},
]


@pytest.mark.parametrize("schema", ENFORCED, ids=[json.dumps(s)[:40] for s in ENFORCED])
def test_what_is_not_refused_is_enforced(llm, schema):
    spec = GuidedSpec("json_schema", json.dumps(schema))
    outs = llm.generate(PROMPTS[:4] * 2, [SamplingParams(max_tokens=160, temperature=1.0, seed=i, guided=spec)
                                          for i in range(8)])
    done = [o for o in outs if o.finish_reason == "stop"]  # (a long string can run past max_tokens)
    assert len(done) >= 4, [o.text for o in outs]
    for o in done:
        # formats as xgrammar has them, by their shape (a date may be 4115-11-31)
        jsonschema.validate(json.loads(o.text), schema)
        shape = {"date": r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])", "uuid": r"[0-9a-fA-F]{8}(-[0-9a-fA-F]{4}){3}-"
                 r"[0-9a-fA-F]{12}"}.get(schema.get("format"))
        assert shape is None or re.fullmatch(shape, json.loads(o.text)), o.text


# keywords neither engine enforces (worker/schema_support.py names xgrammar's gap, guided_llg.py llguidance's):
# each, anywhere a schema can be, is a 400 naming it
DROPPED = [({"uniqueItems": True}, "uniqueItems"), ({"contains": {"type": "integer"}}, "contains"),
           ({"not": {"type": "null"}}, "'not'"), ({"if": {"type": "integer"}, "then": {"minimum": 2}}, "'if'"),
           ({"propertyNames": {"maxLength": 2}}, "propertyNames"),
           ({"unevaluatedProperties": False}, "unevaluated"), ({"dependentRequired": {"a": ["b"]}}, "dependent")]
# ... and those xgrammar leaves out but llguidance enforces, as zod and pydantic write them: e.g. zod's
# .email().max(100) (format, pattern and maxLength), constr(pattern=, max_length=), Field(multiple_of=0.01),
# a $ref with a description, allOf of two models. They were 400s; vLLM's "auto" falls back the same way.
FALLBACK = [({"type": "number", "multipleOf": 0.5, "minimum": -4, "maximum": 4}, None),
            ({"type": "number", "exclusiveMinimum": 0, "multipleOf": 0.01, "maximum": 100}, None),
            ({"type": "string", "pattern": "^[A-Z]+$", "minLength": 3, "maxLength": 3}, None),
            ({"type": "string", "format": "email", "maxLength": 24,
              "pattern": r"^[A-Za-z0-9_+-]+@(?:[A-Za-z0-9][A-Za-z0-9-]*\.)+[A-Za-z]{2,}$"}, "email"),
            ({"type": "string", "format": "date-time", "maxLength": 30}, "date-time"),
            ({"type": "object", "patternProperties": {"^a[0-9]$": {"type": "integer"}}, "additionalProperties": False},
             None),
            ({"allOf": [{"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
                         "required": ["a"]},
                        {"properties": {"a": {}, "b": {"enum": ["x", "y"]}}, "required": ["b"],
                         "additionalProperties": False}]},
             None),
            ({"$defs": {"d": {"type": "string", "maxLength": 8}}, "type": "object", "required": ["p"],
              "properties": {"p": {"$ref": "#/$defs/d", "description": "a name", "minLength": 2}},
              "additionalProperties": False}, None)]


def _positions(schema, sub):
    """`schema` with `sub` put at one of its schema positions, each in turn."""
    yield {**schema, **sub}
    if schema.get("type") == "object":
        for name in schema["properties"]:
            yield {**schema, "properties": {**schema["properties"], name: {**schema["properties"][name], **sub}}}
    yield {"anyOf": [schema, sub]}
    yield {"$defs": {"d": sub}, "type": "array", "items": {"$ref": "#/$defs/d"}}
    yield {"type": "array", "prefixItems": [schema, sub], "items": False}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=schemas, drop=st.sampled_from(DROPPED), data=st.data())
def test_a_keyword_no_engine_enforces_is_refused_by_name_wherever_it_is(llm, schema, drop, data):
    """A schema with a keyword the grammar would leave out was compiled without it, and the output
    could break it with finish "stop" (a fuzz: [-4, 0, 0] for uniqueItems, [10.9034295519625] for
    multipleOf 0.5, which llguidance now enforces). It is a 400 naming the keyword and where it is,
    from the field it came in."""
    sub, name = drop
    where = data.draw(st.sampled_from(list(_positions(schema, sub))))
    with pytest.raises(InvalidRequestError, match=name) as e:
        llm.generate(["x"], SamplingParams(max_tokens=4, guided=GuidedSpec("json_schema", json.dumps(where),
                                                                           "guided_json")))
    assert e.value.param == "guided_json" and "cannot be enforced" in str(e.value)
    assert llm.engine.scheduler.num_unfinished == 0 if hasattr(llm.engine.scheduler, "num_unfinished") else True
    # the same words as property names are data, not keywords
    named = {"type": "object", "properties": {k.strip("'"): {"type": "integer"} for k in (name, "not", "if")},
             "additionalProperties": False}
    assert llm.generate(["x"], SamplingParams(max_tokens=60, temperature=0.0, guided=GuidedSpec(
        "json_schema", json.dumps(named))))[0].finish_reason in ("stop", "length")


def _validated(llm, schema, fmt=None, n=8, max_tokens=160) -> list:
    spec = GuidedSpec("json_schema", json.dumps(schema))
    outs = llm.generate(PROMPTS[:4] * (n // 4), [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i,
                                                                guided=spec) for i in range(n)])
    done = [o for o in outs if o.finish_reason == "stop"]  # (a long string can run past max_tokens)
    for o in done:
        assert compact(o.text) and o.token_ids[-1] == llm.tokenizer.eos_token_id, o.text
        jsonschema.validate(json.loads(o.text), schema, format_checker=jsonschema.FormatChecker())
        if fmt == "date-time":  # (jsonschema checks date-time only with rfc3339-validator installed)
            value = next(iter(_strings(json.loads(o.text))))
            # (RFC 3339 takes a lower-case t and z too)
            assert re.fullmatch(r"\d{4}-\d\d-\d\d[Tt]\d\d:\d\d:\d\d(\.\d+)?([Zz]|[+-]\d\d:\d\d)", value), o.text
    llm.engine.check_invariants()
    return done


def _strings(v):
    if isinstance(v, str):
        yield v
    for x in (v.values() if isinstance(v, dict) else v if isinstance(v, list) else ()):
        yield from _strings(x)


@pytest.mark.parametrize("case", FALLBACK, ids=[json.dumps(c[0])[:40] for c in FALLBACK])
def test_what_xgrammar_leaves_out_llguidance_enforces(llm, case):
    """Sampled at temperature 1 on the random model, every finished output validates (formats too),
    compact, ended by the engine's end token."""
    assert len(_validated(llm, case[0], case[1])) >= 4


@settings(max_examples=16, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=schemas, case=st.sampled_from(FALLBACK[:-2]), data=st.data())  # (allOf merged into a property could
def test_what_xgrammar_leaves_out_llguidance_enforces_wherever_it_is(llm, schema, case, data):  # contradict it; $ref)
    """The same, anywhere in a generated schema."""
    sub, fmt = case
    # (put in place of a property's schema, not merged with it: an enum of strings with "type": "number"
    # contradicts itself, and llguidance rightly says so)
    placed = [{**schema, "properties": {**schema["properties"], k: sub}} for k in schema["properties"]]
    where = data.draw(st.sampled_from(placed + [
        {"anyOf": [schema, sub]}, {"type": "array", "prefixItems": [schema, sub], "items": False},
        {"$defs": {"d": sub}, "type": "array", "items": {"$ref": "#/$defs/d"}, "maxItems": 2}]))
    assert len(_validated(llm, where, fmt)) >= 4, where


@pytest.mark.parametrize("schema", ENFORCED, ids=[json.dumps(s)[:40] for s in ENFORCED])
def test_what_xgrammar_enforces_llguidance_enforces_too(llm, schema):
    """Every kind of constraint above, in a schema that goes to llguidance (an allOf of two), is
    enforced or refused whole (maxProperties beside optional properties), never dropped."""
    inner = {k: v for k, v in schema.items() if k != "$defs"}
    wrapped = {"allOf": [inner, {"$comment": "to llguidance"}], **({"$defs": schema["$defs"]} if "$defs" in schema
                                                                   else {})}
    if "maxProperties" in schema:
        with pytest.raises(InvalidRequestError, match="maxProperties"):
            _validated(llm, wrapped)
        return
    assert len(_validated(llm, wrapped)) >= 4


def test_an_llguidance_grammar_ends_on_any_of_the_engines_end_tokens(model_dirs):
    """The engine's end tokens (EOS and generation_config's) all end a schema llguidance compiled,
    as under xgrammar: the mask has each where the text may end, and any of them terminates."""
    import torch

    from folio.worker.guided import Grammars
    from folio.worker.guided_llg import new_matcher
    eng = LLM(model_dirs["llama"], block_size=8, num_kv_blocks=64).engine
    stops = [eng.tokenizer.eos_token_id, 7, 900]
    g = Grammars(eng.tokenizer, eng.vocab_size, stops)
    spec = GuidedSpec("json_schema", json.dumps({"type": "number", "multipleOf": 0.5, "minimum": 1, "maximum": 1}))
    for stop in stops:
        m = new_matcher(g._xgr, g.compiled(spec))
        for t in eng.tokenizer.encode("1", add_special_tokens=False):
            assert m.accept_token(t) and not m.is_terminated()
        bm = torch.zeros(1, (eng.vocab_size + 31) // 32, dtype=torch.int32)
        m.fill_next_token_bitmask(bm, 0)
        allowed = {t for t in range(eng.vocab_size) if (int(bm[0, t // 32]) >> (t % 32)) & 1}
        assert set(stops) <= allowed, allowed
        assert m.accept_token(stop) and m.is_terminated() and not m.accept_token(stop)


@pytest.mark.parametrize("schema, fragment", [
    ({"type": "number", "multipleOf": -1}, "less than or equal to the minimum of 0 (at #/multipleOf)"),
    ({"type": "number", "multipleOf": 0}, "(at #/multipleOf)"), ({"type": "number", "multipleOf": "x"}, "not of type"),
    ({"type": "string", "format": "email", "maxLength": -1}, "(at #/maxLength)"),
    ({"allOf": [{"$ref": "#"}, {}]}, "cannot enforce it either"),  # (llguidance's error comes with its first mask)
    ({"type": "string", "pattern": "^[a-z]+$", "minLength": 5, "maxLength": 2}, "cannot enforce it either")])
def test_a_schema_llguidance_would_take_wrongly_or_cannot_start_is_refused(llm, schema, fragment):
    """llguidance compiled multipleOf -1 (JSON Schema wants > 0) without a word: a schema the draft 2020-12
    metaschema refuses is a 400 before it reaches llguidance (formats unchecked: ECMA's \\p{L} is valid)."""
    with pytest.raises(InvalidRequestError, match=re.escape(fragment)) as e:
        llm.generate(["x"], SamplingParams(max_tokens=4, guided=GuidedSpec("json_schema", json.dumps(schema),
                                                                           "guided_json")))
    assert e.value.param == "guided_json"
    ok = GuidedSpec("json_schema", json.dumps({"type": "string", "pattern": "^\\p{L}{2}$", "maxLength": 3}))
    outs = llm.generate(PROMPTS[:4], [SamplingParams(max_tokens=20, temperature=1.0, seed=i, guided=ok) for i in range(4)])
    assert all(o.finish_reason == "stop" and len(json.loads(o.text)) == 2 and json.loads(o.text).isalpha() for o in outs)


def test_a_grammar_past_llguidances_limits_fails_its_request_alone(llm):
    """minLength 10**6 beside a pattern builds too many regex states at the first token: that request
    fails in its step, naming the limit and its field; the batch's others are as alone."""
    plain = SamplingParams(max_tokens=8, temperature=0.0)
    alone = llm.generate([PROMPTS[1]], [plain])[0].token_ids
    huge = GuidedSpec("json_schema", json.dumps({"type": "string", "pattern": "^a+$", "minLength": 10**6}),
                      "guided_json")
    outs = llm.generate([PROMPTS[0], PROMPTS[1]], [SamplingParams(max_tokens=8, guided=huge), plain])
    assert outs[0].error is not None and "grammar engine stopped" in outs[0].error, outs[0]
    assert outs[1].token_ids == alone and outs[1].error is None
    llm.engine.check_invariants()


def test_a_panic_in_llguidance_is_an_exception_the_engine_isolates():
    """pyo3 raises a Rust panic as PanicException, a BaseException: `except Exception` in the step's
    fault isolation let it through. It comes out as a RuntimeError; interrupts still pass."""
    from folio.worker.guided_llg import _guarded

    class PanicException(BaseException):
        pass

    def boom(e):
        raise e
    with pytest.raises(RuntimeError, match="llguidance failed"):
        _guarded(boom, PanicException("index out of bounds"))
    with pytest.raises(KeyboardInterrupt):
        _guarded(boom, KeyboardInterrupt())
    with pytest.raises(ValueError):
        _guarded(boom, ValueError("x"))


# what a fuzz of the served xgrammar path found broken in "stop" outputs (2026-12-08): now llguidance's, or 400s
XGRAMMAR_GAPS = [
    ({"type": "integer", "allOf": [{"maximum": 3}], "minimum": 0}, None),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False,
      "allOf": [{"properties": {"a": {"minimum": 0, "maximum": 3}}}]}, None),
    ({"type": "integer", "multipleOf": 3, "maximum": 1000000}, None),
    ({"type": "integer", "multipleOf": 5000}, None),
    ({"type": "object", "properties": {"a": {"$ref": "#/x-defs/n"}}, "required": ["a"], "additionalProperties": False,
      "x-defs": {"n": {"type": "number", "multipleOf": 0.5, "minimum": 0, "maximum": 5}}}, None),
    ({"type": "string", "pattern": "^\\t\\n$"}, None),  # (xgrammar wrote the tab and newline raw: no JSON)
    # a pydantic discriminated union with a pattern inside: oneOf taken as anyOf by llguidance too (its branches
    # are disjoint; llguidance refuses oneOf otherwise, and the pattern sends it there)
    ({"type": "object", "required": ["pet"], "additionalProperties": False, "properties": {"pet": {
        "discriminator": {"propertyName": "kind"}, "oneOf": [
            {"type": "object", "properties": {"kind": {"const": "cat"}, "name": {"type": "string",
             "pattern": "^[A-Z][a-z]{0,5}$"}}, "required": ["kind", "name"], "additionalProperties": False},
            {"type": "object", "properties": {"kind": {"const": "dog"}}, "required": ["kind"],
             "additionalProperties": False}]}}}, None),
    ({"type": "object", "properties": {"a": {"$ref": "#/foo"}}, "required": ["a"], "additionalProperties": False,
      "foo": {"type": "array", "uniqueItems": True, "items": {"type": "integer"}}}, "uniqueItems"),
    ({"type": "string", "pattern": "a^b"}, "pattern"), ({"type": "string", "pattern": "^(?!a)[a-c]$"}, "pattern"),
    ({"anyOf": []}, "anyOf"), ({"oneOf": []}, "oneOf"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"],
      "additionalProperties": False}, "required"),
]


@pytest.mark.parametrize("schema, refused", XGRAMMAR_GAPS, ids=[json.dumps(s)[:50] for s, _ in XGRAMMAR_GAPS])
def test_what_xgrammar_got_wrong_is_enforced_or_refused(llm, schema, refused):
    if refused is None:
        assert len(_validated(llm, schema)) >= 4
        return
    with pytest.raises(InvalidRequestError, match=refused) as e:
        llm.generate(["x"], SamplingParams(max_tokens=4, guided=GuidedSpec("json_schema", json.dumps(schema),
                                                                           "guided_json")))
    assert e.value.param == "guided_json"


def test_xgrammars_json_is_compact_too(llm):
    """Its separators were ", " and ": " (375 outputs of a fuzz), llguidance's "," and ":"."""
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                               "b": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
              "required": ["a", "b"], "additionalProperties": False}
    assert len(_validated(llm, schema)) >= 4  # (_validated asserts each is compact)
