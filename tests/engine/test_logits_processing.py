"""Logits processing (penalties, logit_bias, min_tokens, bad words, allowed_token_ids): the
batched sampler against transformers' own logits processors, row by row, on generated inputs;
then greedy generation through the engine token-identical to transformers `generate` with the
same processors."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st
from transformers import (LogitsProcessor, LogitsProcessorList, MinNewTokensLengthLogitsProcessor,
                          NoBadWordsLogitsProcessor, RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor)

from folio.worker import LLM, SamplingParams
from folio.worker.errors import InvalidRequestError
from folio.worker.sampler import NO_TOKEN, process_logits, sample
from folio.worker.sampling_params import check_vocab, resolve_bad_words
from conftest import MIN_REFERENCE_MARGIN, PROMPTS

V = 40
EOS = 7


class Hist:
    def __init__(self, prompt: list[int], output: list[int]) -> None:
        self.token_ids = prompt + output
        self.num_prompt_tokens = len(prompt)


class OpenAIPenalties(LogitsProcessor):
    """The reference of OpenAI's presence / frequency penalties, written out per row:
    logit[t] -= count[t] * frequency + (count[t] > 0) * presence, counts over the output only."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        for row in range(scores.shape[0]):
            out = input_ids[row, self.prompt_len:].tolist()
            for t in set(out):
                scores[row, t] -= out.count(t) * self.frequency + self.presence
        return scores


class Allowed(LogitsProcessor):
    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def __call__(self, input_ids, scores):
        keep = torch.full_like(scores, float("-inf"))
        keep[:, self.ids] = 0.0
        return scores + keep


def hf_processors(p: SamplingParams, prompt_len: int, eos: int | list[int]) -> LogitsProcessorList:
    """transformers' processors for `p`, in the order Folio (and vLLM) applies them."""
    procs = []
    if p.allowed_token_ids is not None:
        procs.append(Allowed(p.allowed_token_ids))
    if p.bad_words_token_ids:
        procs.append(NoBadWordsLogitsProcessor(p.bad_words_token_ids, eos_token_id=None))
    if p.logit_bias:
        procs.append(SequenceBiasLogitsProcessor({(t,): b for t, b in p.logit_bias.items()}))
    if p.min_tokens:
        stops = sorted(set(p.stop_token_ids) | ({eos} if isinstance(eos, int) else set(eos)))
        procs.append(MinNewTokensLengthLogitsProcessor(prompt_len, p.min_tokens, stops))
    if p.repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(p.repetition_penalty))
    if p.presence_penalty or p.frequency_penalty:
        procs.append(OpenAIPenalties(prompt_len, p.presence_penalty, p.frequency_penalty))
    return LogitsProcessorList(procs)


tokens = st.integers(0, V - 1)
params_st = st.builds(
    lambda rep, pres, freq, bias, mint, bad, allowed: SamplingParams(
        max_tokens=64, temperature=0.0, repetition_penalty=rep, presence_penalty=pres, frequency_penalty=freq,
        logit_bias=bias, min_tokens=mint, bad_words_token_ids=bad, allowed_token_ids=allowed, stop_token_ids=[3]),
    st.sampled_from([1.0, 1.0, 0.5, 1.3, 2.0]),
    st.sampled_from([0.0, 0.0, 0.7, -1.5, 2.0]),
    st.sampled_from([0.0, 0.0, 0.4, -0.9, 2.0]),
    st.one_of(st.none(), st.dictionaries(tokens, st.floats(-100, 100), max_size=6)),
    st.sampled_from([0, 0, 2, 9]),
    st.lists(st.lists(tokens, min_size=1, max_size=3), max_size=4),
    st.one_of(st.none(), st.none(), st.lists(tokens, min_size=1, max_size=12, unique=True)),
)


@settings(max_examples=150, deadline=None)
@given(rows=st.lists(st.tuples(params_st, st.lists(tokens, min_size=1, max_size=8),
                               st.lists(tokens, max_size=12)), min_size=1, max_size=6),
       seed=st.integers(0, 2**31))
def test_batched_processing_matches_transformers_processors_row_by_row(rows, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(rows), V, generator=g) * 4
    params = [p for p, _, _ in rows]
    hists = [Hist(prompt, out) for _, prompt, out in rows]
    got = process_logits(logits, params, hists, eos_ids={EOS})
    assert_rows_match(logits, got, rows)
    # the sampler's greedy pick is the processed argmax; logprobs stay the raw logits' (vLLM's default)
    res = sample(logits, [SamplingParams(**{**p.__dict__, "logprobs": 0}) for p in params], [None] * len(rows),
                 hists, {EOS})
    for r in range(len(rows)):
        if not torch.isfinite(got[r]).any():  # its own masks left nothing: no token (its request fails)
            assert res.token_ids[r] == NO_TOKEN and res.logprobs[r] is None
            continue
        assert res.token_ids[r] == int(got[r].argmax())
        lp = res.logprobs[r][res.token_ids[r]]
        assert math.isclose(lp, float(torch.log_softmax(logits[r], -1)[res.token_ids[r]]), abs_tol=1e-5)


def assert_rows_match(logits, got, rows) -> None:
    for r, (p, prompt, out) in enumerate(rows):
        ids = torch.tensor([prompt + out])
        want = hf_processors(p, len(prompt), EOS)(ids, logits[r:r + 1].clone())[0]
        assert torch.equal(torch.isinf(got[r]), torch.isinf(want)), f"row {r}: masks differ"
        finite = torch.isfinite(want)
        torch.testing.assert_close(got[r][finite], want[finite], rtol=1e-6, atol=1e-5)


@settings(max_examples=100, deadline=None)
@given(reqs=st.lists(params_st, min_size=1, max_size=3),
       rows=st.lists(st.tuples(st.integers(0, 2), st.lists(tokens, min_size=1, max_size=8),
                               st.lists(tokens, max_size=12)), min_size=1, max_size=8),
       allowed=st.lists(st.lists(tokens, min_size=1, max_size=12), min_size=3, max_size=3),
       seed=st.integers(0, 2**31))
def test_the_rows_of_one_request_share_its_params_and_each_matches_row_by_row(reqs, rows, allowed, seed):
    """A request's n rows hold one params object, whose allowed ids (repeats allowed) and
    logit_bias become tensors once, then are read from the cache: both steps are transformers'."""
    for k, p in enumerate(reqs):
        if p.allowed_token_ids is not None:
            p.allowed_token_ids = allowed[k]
    rows = [(reqs[k % len(reqs)], prompt, out) for k, prompt, out in rows]
    logits = torch.randn(len(rows), V, generator=torch.Generator().manual_seed(seed)) * 4
    hists = [Hist(prompt, out) for _, prompt, out in rows]
    for _ in range(2):  # built, then cached
        assert_rows_match(logits, process_logits(logits, [p for p, _, _ in rows], hists, eos_ids={EOS}), rows)


penalty_params = st.builds(
    lambda rep, pres, freq: SamplingParams(max_tokens=64, repetition_penalty=rep, presence_penalty=pres,
                                           frequency_penalty=freq),
    st.sampled_from([1.0, 0.5, 1.3, 2.0]), st.sampled_from([0.0, 0.7, -1.5, 2.0]),
    st.sampled_from([0.0, 0.4, -0.9, 2.0]))


class Fixed:  # a history that keeps nothing (no attribute can be set): its ids seen are made each step
    __slots__ = ("token_ids", "num_prompt_tokens")

    def __init__(self, prompt: list[int], output: list[int]) -> None:
        self.token_ids, self.num_prompt_tokens = prompt + output, len(prompt)


@settings(max_examples=120, deadline=None)
@given(rows=st.lists(st.tuples(penalty_params, st.lists(tokens, min_size=1, max_size=30), st.booleans()),
                     min_size=1, max_size=5),
       steps=st.lists(st.lists(st.lists(tokens, max_size=3), min_size=5, max_size=5), min_size=1, max_size=12),
       restart=st.integers(0, 12), seed=st.integers(0, 2**31))
def test_penalties_follow_each_history_as_it_grows(rows, steps, restart, seed):
    """The penalties keep each sequence's ids seen and their counts as its history grows
    (worker/penalties.py): step after step, with 0-3 tokens added to a row between steps (a
    prompt's chunks, a preemption's recompute), a history replaced by another (new tokens from
    its prompt on), and histories that keep nothing, the logits are transformers' processors'
    on the whole history."""
    g = torch.Generator().manual_seed(seed)
    params = [p for p, _, _ in rows]
    hists = [(Hist if keeps else Fixed)(prompt, []) for _, prompt, keeps in rows]
    for k, added in enumerate(steps):
        if k == restart:  # a history replaced (a new list): the ids seen must not carry over
            hists[0].token_ids = hists[0].token_ids[:hists[0].num_prompt_tokens]
        for h, more in zip(hists, added):
            h.token_ids.extend(more)  # in place, as the engine appends a sampled token
        logits = torch.randn(len(rows), V, generator=g) * 4
        logits[0, :3] = 0.0  # zeros: a penalty must not turn one into -0.0 or touch it
        got = process_logits(logits, params, hists, eos_ids={EOS})
        for r, (p, h) in enumerate(zip(params, hists)):
            want = hf_processors(p, h.num_prompt_tokens, EOS)(torch.tensor([h.token_ids]), logits[r:r + 1].clone())[0]
            torch.testing.assert_close(got[r], want, rtol=1e-6, atol=1e-5)  # (the reference sums in another order)
            assert torch.equal(got[r][logits[r] == 0.0].signbit(), want[logits[r] == 0.0].signbit()), (k, r)


def test_rows_without_processing_are_untouched_and_share_no_tensor():
    logits = torch.randn(3, V)
    plain = [SamplingParams(temperature=0.0)] * 3
    assert process_logits(logits, plain, None) is logits  # no histories needed, nothing copied
    mixed = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, logit_bias={5: 3.0}),
             SamplingParams(temperature=0.0)]
    out = process_logits(logits, mixed, [Hist([1], [])] * 3)
    assert out is not logits and torch.equal(out[[0, 2]], logits[[0, 2]])
    assert out[1, 5] == logits[1, 5] + 3.0


def test_sampled_rows_respect_masks_whatever_the_draw():
    logits = torch.zeros(1, V)  # uniform: every token as likely
    p = SamplingParams(temperature=1.0, allowed_token_ids=[4, 9, 11], seed=1, logit_bias={9: -100.0})
    drawn = {sample(logits, [p], [torch.Generator().manual_seed(s)], [Hist([1], [])]).token_ids[0]
             for s in range(300)}
    assert drawn == {4, 11}


@settings(max_examples=150, deadline=None)
@given(rows=st.lists(st.tuples(st.lists(st.integers(0, 5), min_size=1, max_size=3, unique=True),
                               st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=3), max_size=10),
                               st.lists(st.integers(0, 5), min_size=1, max_size=6),
                               st.sampled_from([0.0, 1.0]), st.sampled_from([None, 2])), min_size=1, max_size=5),
       seed=st.integers(0, 2**31))
def test_a_row_its_own_masks_empty_draws_no_token_and_only_such_a_row(rows, seed):
    """allowed_token_ids and bad words (these over the tokens before, longer ones too) can leave a
    row nothing to draw: it was drawn from anyway (token 0, not allowed). Such a row gets NO_TOKEN,
    every other row a token its masks allow, whatever the batch holds, greedy or sampled."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(rows), V, generator=g) * 4
    params = [SamplingParams(max_tokens=8, temperature=t, seed=1, allowed_token_ids=a, bad_words_token_ids=b,
                             logprobs=lp) for a, b, _, t, lp in rows]
    hists = [Hist([9], out) for _, _, out, _, _ in rows]
    masked = process_logits(logits, params, hists)
    gens = [torch.Generator().manual_seed(seed + i) for i in range(len(rows))]
    got = sample(logits, params, gens, hists)
    for i, (tok, lps) in enumerate(zip(got.token_ids, got.logprobs)):
        if not torch.isfinite(masked[i]).any():
            assert tok == NO_TOKEN and lps is None
        else:
            assert tok in params[i].allowed_token_ids and math.isfinite(masked[i, tok]), (i, tok)
            assert (lps is not None) == (params[i].logprobs is not None)


def test_bad_words_banning_the_whole_allow_list_are_refused_before_any_work():
    for allowed, bad in (([4], [[4]]), ([4, 9], [[9], [2, 4], [4]]), (None, [[t] for t in range(V)])):
        with pytest.raises(InvalidRequestError) as e:
            check_vocab(SamplingParams(allowed_token_ids=allowed, bad_words_token_ids=bad), V)
        assert e.value.param == "bad_words" and "no token to draw" in str(e.value)
    for allowed, bad in (([4, 9], [[9], [2, 4]]), (None, [[t] for t in range(V - 1)]), ([4], [[3, 4]])):
        check_vocab(SamplingParams(allowed_token_ids=allowed, bad_words_token_ids=bad), V)


def test_a_request_its_bad_words_empty_mid_output_fails_alone(model_dirs):
    """Two allowed tokens and every pair of them banned: the first token is drawn, the second has
    none. That request fails (a 400's message naming bad_words); the batch's others finish as
    they would alone, and nothing is left behind."""
    llm = LLM(model_dirs["llama"], block_size=8, num_kv_blocks=256)
    plain = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    alone = llm.generate(PROMPTS[:2], plain)
    pairs = [[a, b] for a in (100, 200) for b in (100, 200)]
    for temperature in (0.0, 1.0):
        boxed = SamplingParams(max_tokens=10, temperature=temperature, seed=5, ignore_eos=True, logprobs=2,
                               allowed_token_ids=[100, 200], bad_words_token_ids=pairs)
        outs = llm.generate(PROMPTS[:2] + PROMPTS[:1], [plain, plain, boxed])
        assert [o.outputs[0].token_ids for o in outs[:2]] == [o.outputs[0].token_ids for o in alone]
        assert outs[0].error is outs[1].error is None
        assert outs[2].error is not None and "InvalidRequestError" in outs[2].error, outs[2].error
        assert "after 1 output tokens" in outs[2].error and outs[2].error_param == "bad_words"
    assert not llm.engine.has_unfinished_requests()
    llm.engine.check_invariants()
    assert llm.engine.stats().num_free_blocks == llm.engine.stats().num_kv_blocks


@pytest.mark.parametrize("bad", [
    dict(presence_penalty=2.5), dict(frequency_penalty=-3.0), dict(presence_penalty=float("nan")),
    dict(repetition_penalty=0.0), dict(repetition_penalty=-1.0), dict(repetition_penalty=float("inf")),
    dict(logit_bias={1: 101.0}), dict(logit_bias={1: float("nan")}), dict(logit_bias={-1: 1.0}),
    dict(logit_bias={"1": 1.0}), dict(logit_bias=[1]), dict(min_tokens=-1), dict(min_tokens=17),
    dict(min_tokens=1.5), dict(bad_words=[""]), dict(bad_words=["  "]), dict(bad_words="word"),
    dict(bad_words_token_ids=[[]]), dict(bad_words_token_ids=[[-2]]), dict(allowed_token_ids=[]),
    dict(allowed_token_ids=[1, True]), dict(allowed_token_ids=[-1]),
])
def test_bad_values_are_refused_naming_their_field(bad):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(max_tokens=16, **bad)
    assert e.value.param == next(iter(bad))


def test_ids_outside_the_vocabulary_are_refused():
    for bad in (dict(logit_bias={V: 1.0}), dict(allowed_token_ids=[0, V]), dict(bad_words_token_ids=[[1, V]])):
        with pytest.raises(InvalidRequestError) as e:
            check_vocab(SamplingParams(**bad), V)
        assert e.value.param in (next(iter(bad)), "bad_words")


# ---- through the engine, greedy, against transformers `generate` ----------------------------
MAX_NEW = 20
CASES = ["repetition 1.6", "repetition 0.7", "presence + frequency", "logit_bias", "min_tokens", "bad_words",
         "allowed", "all at once"]


def _case(name: str, b: list[int]) -> dict:
    """The fields of one case, made from the plain greedy output `b` of the prompt (so each
    one changes what the model would have said)."""
    kw: dict = {"repetition 1.6": dict(repetition_penalty=1.6), "repetition 0.7": dict(repetition_penalty=0.7),
                "presence + frequency": dict(presence_penalty=1.5, frequency_penalty=0.8),
                "allowed": dict(allowed_token_ids=list(range(100, 400)))}.get(name, {})
    if name in ("logit_bias", "all at once"):  # its 2nd token pushed out, another pulled up
        kw["logit_bias"] = {b[1]: -100.0, (b[1] + 17) % 1000 + 1: 4.5}
    if name in ("bad_words", "all at once"):
        kw["bad_words_token_ids"] = [b[2:4], [b[5]]]
    if name in ("min_tokens", "all at once"):  # the model's own 3rd token made a stop token
        kw.update(min_tokens=6, stop_token_ids=[b[2]])
    if name == "all at once":
        kw.update(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.3)
    return kw


@pytest.fixture(scope="module")
def hf_llama(model_dirs):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    d = model_dirs["llama"]
    return d, AutoTokenizer.from_pretrained(d), AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()


def test_greedy_with_processing_matches_transformers_generate(hf_llama):
    d, tok, model = hf_llama
    llm = LLM(d, block_size=8, num_kv_blocks=512)
    eos = sorted(llm.engine.eos_token_ids)
    plain = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True))
    checked = skipped = 0
    for name in CASES:
        params = [SamplingParams(max_tokens=MAX_NEW, temperature=0.0, **_case(name, o.token_ids)) for o in plain]
        outs = llm.generate(PROMPTS, params)  # all the prompts in one batch, beside each other
        for i, (p, sp, o) in enumerate(zip(PROMPTS, params, outs)):
            ids = tok(p, return_tensors="pt").input_ids
            stops = eos + sp.stop_token_ids
            with torch.no_grad():
                gen = model.generate(ids, max_new_tokens=MAX_NEW, do_sample=False,
                                     logits_processor=hf_processors(sp, ids.shape[1], stops), eos_token_id=stops,
                                     pad_token_id=stops[0], output_scores=True, return_dict_in_generate=True)
            ref = gen.sequences[0, ids.shape[1]:].tolist()
            margin = min(float(s[0][torch.isfinite(s[0])].topk(2).values.diff().abs()) for s in gen.scores)
            if margin <= MIN_REFERENCE_MARGIN:
                skipped += 1
                continue
            assert o.token_ids == ref, f"{name}, prompt {i}:\n folio {o.token_ids}\n hf    {ref}"
            if name == "min_tokens":
                assert len(ref) > 6 and sp.stop_token_ids[0] in plain[i].token_ids[:6]
            checked += 1
    assert checked >= len(CASES) * len(PROMPTS) - 2, f"only {checked} checked, {skipped} near-ties"
    # and the cases changed what the model said (the test would catch a processor that did nothing)
    assert sum(o.token_ids != p.token_ids for o, p in zip(outs, plain)) == len(PROMPTS)
    llm.engine.check_invariants()
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks


def test_effects_on_the_real_outputs(model_dirs):
    llm = LLM(model_dirs["llama"], block_size=8, num_kv_blocks=512)
    base = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    banned = {t for o in base for t in o.token_ids[:4]}
    sampled = SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True,
                             logit_bias={t: -100.0 for t in banned})
    for o in llm.generate(PROMPTS * 3, sampled):
        assert not banned & set(o.token_ids)
    # min_tokens with a stop string that the text would contain at once: not before min_tokens
    text = base[0].text
    stop = text[:2] if text[:2].strip() else text[:3]
    if stop.strip():
        short = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                          stop=[stop]))[0]
        longer = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                           stop=[stop], min_tokens=5))[0]
        assert len(longer.token_ids) > 5 >= len(short.token_ids)
    # bad words as strings, tokenized as vLLM does: the words are not completed
    words = [llm.engine.tokenizer.decode([t]).strip() for t in base[1].token_ids[:3]]
    words = [w for w in words if w]
    if words:
        o = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                      bad_words=words))[0]
        assert o.token_ids != base[1].token_ids
    llm.engine.check_invariants()
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks


def test_resolve_bad_words_as_vllm(model_dirs):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dirs["llama"])
    p = resolve_bad_words(SamplingParams(bad_words=["hello", " world"]), tok)
    assert p.bad_words == []
    assert tok.encode("hello", add_special_tokens=False) in p.bad_words_token_ids
    assert tok.encode("world", add_special_tokens=False) in p.bad_words_token_ids
    assert resolve_bad_words(p, tok).bad_words_token_ids == p.bad_words_token_ids  # once only
    with pytest.raises(InvalidRequestError):
        resolve_bad_words(SamplingParams(bad_words=["x"]), None)
