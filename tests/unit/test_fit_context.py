"""frontend.fit_context: a prompt plus max_tokens past max_model_len, answered as vLLM 0.32
answers it (max_tokens cut to what fits, a 400 only for max_tokens above max_model_len), for
generated prompts, limits and sampling fields."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from folio.deploy.frontend import fit_context
from folio.worker.errors import InvalidRequestError
from folio.worker.sampling_params import SamplingParams


@settings(max_examples=300, deadline=None)
@given(limit=st.integers(2, 4096), data=st.data())
def test_every_completion_ends_where_vllm_would_end_it(limit, data):
    lens = data.draw(st.lists(st.integers(1, limit - 1), min_size=1, max_size=4))
    max_tokens = data.draw(st.integers(1, limit))
    min_tokens = data.draw(st.integers(0, max_tokens))
    params = SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens, temperature=0.7, seed=3, n=2)
    got = fit_context(limit, [[7] * n for n in lens], params)
    assert got.min_tokens <= got.max_tokens
    # what each prompt's completion gets: the cut max_tokens, then the engine's stop at max_model_len
    for n in lens:
        assert min(got.max_tokens, limit - n) == min(max_tokens, limit - n)  # vLLM's get_max_tokens
    assert got.max_tokens == min(max_tokens, limit - min(lens))
    assert got.min_tokens == min(min_tokens, got.max_tokens)
    if got is not params:  # nothing else changed
        assert (got.temperature, got.seed, got.n) == (0.7, 3, 2)
    else:
        assert max_tokens <= limit - min(lens)


@given(limit=st.integers(2, 4096), over=st.integers(1, 2**31 - 1 - 4096), param=st.sampled_from(
    ["max_tokens", "max_completion_tokens"]))
def test_max_tokens_above_max_model_len_is_refused_naming_the_field(limit, over, param):
    with pytest.raises(InvalidRequestError) as e:
        fit_context(limit, [[1]], SamplingParams(max_tokens=limit + over), param)
    assert e.value.param == param
    assert str(e.value).startswith(f"{param}={limit + over} cannot be greater than max_model_len={limit}")


def test_a_prompt_that_fits_no_token_is_left_to_the_length_check():
    # check() refuses it ("leaves no room for a generated token"); fit_context must not raise first
    got = fit_context(8, [[1] * 8], SamplingParams(max_tokens=8))
    assert got.max_tokens == 1
