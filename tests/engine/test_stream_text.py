"""Text made in the frontend from a worker's token ids (deploy/stream_text.py) equals the
offline engine's own text: the same incremental detokenization and stop-string rules,
whatever the chunking, stop strings split across tokens included."""

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

from folio.deploy.stream_text import StreamText, worker_params
from folio.worker import LLM, SamplingParams
from folio.worker.messages import CompletionDelta, StreamChunk

from conftest import PROMPTS

MAX = 24


@pytest.fixture(scope="module")
def llm(model_dirs):
    return LLM(model_dirs["llama"], block_size=8, num_kv_blocks=64, max_model_len=256)


@pytest.fixture(scope="module")
def free_runs(llm):
    """Each prompt's greedy output with no stop string: the tokens a worker streams."""
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX, temperature=0.0, ignore_eos=True))
    return {p: (list(o.prompt_token_ids), o.outputs[0].token_ids, o.outputs[0].text) for p, o in zip(PROMPTS, outs)}


def _stream(tokenizer, prompt_ids, tokens, params, cuts, end="length"):
    """Feed `tokens` as chunks cut at `cuts` (a worker's steps), the last with the worker's finish
    reason `end`; collect what a client gets."""
    text = StreamText(tokenizer, prompt_ids, params)
    got_text, got_ids, reason, n = "", [], None, 0
    bounds = sorted({0, len(tokens), *[c % (len(tokens) + 1) for c in cuts]})
    for a, b in zip(bounds, bounds[1:]):
        n += b - a
        last = b == len(tokens)
        chunk = StreamChunk(request_id="r", worker_id="w",
                            deltas=[CompletionDelta(index=0, token_ids=tokens[a:b], text="", num_tokens=n,
                                                    finish_reason=end if last else None)], finished=last)
        out = text.apply(chunk)
        for d in out.deltas:
            got_text += d.text
            got_ids += d.token_ids
            reason = d.finish_reason or reason
        if out.finished:
            break
    return got_text, got_ids, reason, text.texts[0].stop


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(which=st.integers(0, len(PROMPTS) - 1), start=st.integers(0, 200), length=st.integers(1, 6),
       include=st.booleans(), cuts=st.lists(st.integers(0, MAX), max_size=8), extra=st.booleans())
def test_frontend_text_equals_the_offline_engines(llm, free_runs, which, start, length, include, cuts, extra):
    prompt = PROMPTS[which]
    prompt_ids, tokens, full = free_runs[prompt]
    if not full:
        return
    start %= len(full)
    stops = [full[start : start + length]]  # a stop that occurs (often across a token boundary)
    if extra:
        stops.append("\x00never")  # and one that never does
    params = SamplingParams(max_tokens=MAX, temperature=0.0, ignore_eos=True, stop=stops,
                            include_stop_str_in_output=include)
    want = llm.generate([prompt], params)[0].outputs[0]
    got_text, got_ids, reason, stop = _stream(llm.engine.tokenizer, prompt_ids, tokens, params, cuts)
    assert (got_text, got_ids, reason) == (want.text, want.token_ids, want.finish_reason)
    assert stop == want.stop_reason


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(which=st.integers(0, len(PROMPTS) - 1), at=st.integers(0, MAX - 1), include=st.booleans(),
       cuts=st.lists(st.integers(0, MAX), max_size=8), stop_string=st.booleans(), special=st.booleans())
def test_a_stop_tokens_text_is_left_out_as_vllm_does(llm, free_runs, which, at, include, cuts, stop_string, special):
    """A completion ended by a stop token (stop_token_ids here; EOS and a grammar's end are the same
    case) has its text without that token's, unless include_stop_str_in_output: vLLM's rule
    (its detokenizer skips the stop token). Folio's text had it (a fuzz: " Paris" for stop_token_ids
    [" Paris"], "Paris<|im_end|>" for a guided choice with skip_special_tokens false). Offline and
    through the frontend alike; the token itself stays in the ids and the count."""
    prompt = PROMPTS[which]
    prompt_ids, tokens, _ = free_runs[prompt]
    stop_id = tokens[at]
    k = tokens.index(stop_id) + 1  # it stops at the first one
    stops = [llm.engine.tokenizer.decode([stop_id]).strip() or "\x00never"] if stop_string else []
    params = SamplingParams(max_tokens=MAX, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_id], stop=stops,
                            include_stop_str_in_output=include, skip_special_tokens=not special)
    want = llm.generate([prompt], params)[0].outputs[0]
    # the oracle: the same run cut by max_tokens, where no stop token is involved
    n = k - 1 + include
    before = llm.generate([prompt], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True,
                                                   skip_special_tokens=not special))[0].outputs[0].text if n else ""
    if want.stop_reason == stop_id:  # no stop string came first
        assert want.token_ids == tokens[:k] and want.finish_reason == "stop"
        assert want.text == before, (want.text, before, include)
    got_text, got_ids, reason, stop = _stream(llm.engine.tokenizer, prompt_ids, tokens[:k], params, cuts, end="stop")
    assert (got_text, got_ids, reason) == (want.text, want.token_ids, want.finish_reason)


def test_no_stop_strings_pass_text_through_and_no_detokenization_passes_through(llm, free_runs):
    prompt_ids, tokens, full = free_runs[PROMPTS[1]]
    params = SamplingParams(max_tokens=MAX, temperature=0.0, ignore_eos=True)
    assert _stream(llm.engine.tokenizer, prompt_ids, tokens, params, [3, 7])[:3] == (full, tokens, "length")
    raw = SamplingParams(max_tokens=MAX, temperature=0.0, stop=["x"], detokenize=False)
    assert worker_params(raw) is raw and not worker_params(params).detokenize
    chunk = StreamChunk(request_id="r", worker_id="w",
                        deltas=[CompletionDelta(index=0, token_ids=tokens, text="", num_tokens=len(tokens),
                                                finish_reason="length")], finished=True)
    assert StreamText(llm.engine.tokenizer, prompt_ids, raw).apply(chunk) is chunk
