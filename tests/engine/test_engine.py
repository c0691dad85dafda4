"""Engine behaviour: bad input, abort, stop conditions, sampling, n > 1, streaming deltas."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from folio.worker import LLM, ConfigError, InvalidRequestError, LLMEngine, ModelLoadError, SamplingParams
from folio.worker.config import EngineConfig
from conftest import PROMPTS


@pytest.fixture(scope="module")
def llm(model_dirs):
    return LLM(model_dirs["qwen2"], block_size=4, num_kv_blocks=64, max_model_len=128)


def assert_clean(engine: LLMEngine):
    engine.check_invariants()
    assert not engine.has_unfinished_requests()
    assert engine.kv.num_free_blocks == engine.num_kv_blocks, "KV blocks leaked"


@pytest.mark.parametrize("prompt,params,match", [
    ("", SamplingParams(), "empty"),
    ([], SamplingParams(), "empty"),
    ("x " * 200, SamplingParams(), "max_model_len"),
    ([1, 2, 10**6], SamplingParams(), "token ids"),
    ([1, -1], SamplingParams(), "token ids"),
    (12, SamplingParams(), "string or a list"),
    ({"text": "hi"}, SamplingParams(), "string or a list"),
])
def test_bad_request_is_rejected_and_engine_stays_usable(llm, prompt, params, match):
    with pytest.raises(InvalidRequestError, match=match):
        llm.engine.add_request(None, prompt, params)
    assert_clean(llm.engine)
    assert llm.generate(["ok"], SamplingParams(max_tokens=3, temperature=0.0))[0].finish_reason == "length"
    assert_clean(llm.engine)


def test_duplicate_request_id_is_rejected(llm):
    eng = llm.engine
    eng.add_request("dup", "hello", SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="already in use"):
        eng.add_request("dup", "hello", SamplingParams(max_tokens=2))
    eng.abort("dup")
    assert_clean(eng)


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=2.0), "min_p"),
    (dict(n=0), "n must"),
    (dict(stop=[""]), "stop"),
    (dict(logprobs=-1), "logprobs"),
    (dict(stop_token_ids=[2**31 - 1]), r"stop_token_ids must be .*in \[0, 2147483647\), got 1: \[2147483647\]"),
    (dict(stop_token_ids=[-1]), r"stop_token_ids .* got 1: \[-1\]"),
])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams(**kwargs)


def test_bad_prompt_in_a_batch_leaves_nothing_queued(llm):
    with pytest.raises(InvalidRequestError):
        llm.generate(["fine", "", "also fine"], SamplingParams(max_tokens=2))
    assert_clean(llm.engine)


def test_request_that_can_never_fit(model_dirs):
    llm = LLM(model_dirs["qwen2"], block_size=4, num_kv_blocks=8)  # 32 slots
    with pytest.raises(InvalidRequestError, match="never fit"):
        llm.generate(["hello"], SamplingParams(max_tokens=40))
    assert_clean(llm.engine)
    assert llm.generate(["hello"], SamplingParams(max_tokens=8, temperature=0.0))[0].token_ids


def test_unknown_architecture_and_missing_weights(model_dirs, tmp_path):
    bad = tmp_path / "gpt"
    shutil.copytree(model_dirs["llama"], bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="unsupported architecture"):
        LLM(str(bad))
    noweights = tmp_path / "noweights"
    shutil.copytree(model_dirs["llama"], noweights)
    os.remove(noweights / "model.safetensors")
    with pytest.raises(ModelLoadError, match="safetensors"):
        LLM(str(noweights))
    with pytest.raises(ModelLoadError, match="config.json"):
        LLM(str(tmp_path))


def test_an_unreadable_weight_file_is_named_as_such(model_dirs, tmp_path):
    """A checkpoint mounted for another user (a container's uid 1000, a 0600 file) gets the OS's
    reason, not safetensors' "No such file or directory"."""
    import subprocess
    import sys

    import tempfile

    top = tempfile.mkdtemp(dir="/tmp")  # pytest's own tmp_path sits under a 0700 directory
    try:
        os.chmod(top, 0o755)
        locked = os.path.join(top, "locked")
        shutil.copytree(model_dirs["llama"], locked)
        os.chmod(os.path.join(locked, "model.safetensors"), 0)
        shut = os.path.join(top, "shut")
        shutil.copytree(model_dirs["llama"], shut)
        os.chmod(shut, 0)
        code = ("import os, sys\n"
                "from folio.worker.models.model_config import ModelConfig\n"
                "from folio.worker.models.loader import load_state_dict\n"
                "from folio.worker import ModelLoadError\n"
                "if os.geteuid() == 0: os.setuid(65534)  # root reads anything: be nobody (imports done)\n"
                "for load in (ModelConfig.from_dir, load_state_dict):\n"
                "    try: load(sys.argv[1])\n"
                "    except ModelLoadError as e: print(e)\n")
        out = [subprocess.run([sys.executable, "-c", code, d], capture_output=True, text=True, timeout=120)
               for d in (locked, shut)]
        assert "cannot read weight file" in out[0].stdout and "Permission denied" in out[0].stdout, out[0]
        assert out[1].stdout.count("Permission denied") == 2, out[1]  # the directory: config and weights
    finally:
        os.chmod(os.path.join(top, "shut"), 0o755)
        shutil.rmtree(top)


def test_a_config_that_is_not_json_is_a_model_load_error(model_dirs, tmp_path):
    for text in ("{not json", "[1, 2]", "\xff\xfe"):
        bad = tmp_path / f"bad{len(text)}"
        shutil.copytree(model_dirs["llama"], bad)
        (bad / "config.json").write_bytes(text.encode("latin-1"))
        with pytest.raises(ModelLoadError, match="config.json"):
            LLM(str(bad))


def test_bad_engine_config(model_dirs):
    with pytest.raises(ConfigError, match="dtype"):
        EngineConfig(model=model_dirs["llama"], dtype="int8")
    with pytest.raises(ConfigError, match="kv_cache_layout"):
        EngineConfig(model=model_dirs["llama"], kv_cache_layout="heads_major")
    with pytest.raises(ConfigError, match="max_model_len"):
        LLM(model_dirs["llama"], max_model_len=10**6)
    with pytest.raises(ConfigError, match="contiguous"):
        LLM(model_dirs["llama"], kv_manager="contiguous", num_kv_blocks=4, max_model_len=512)
    with pytest.raises(ConfigError, match="long_prefill_token_threshold"):
        EngineConfig(model=model_dirs["llama"], long_prefill_token_threshold=-1)


def test_abort_running_and_waiting_requests_frees_blocks(llm):
    eng = llm.engine
    ids = [eng.add_request(None, p, SamplingParams(max_tokens=50, temperature=0.0)) for p in PROMPTS]
    for _ in range(4):
        eng.step()
    assert eng.kv.num_free_blocks < eng.num_kv_blocks
    assert eng.abort(ids[0]) and not eng.abort(ids[0]) and not eng.abort("nope")
    eng.check_invariants()
    for rid in ids[1:]:
        eng.abort(rid)
    assert eng.step() == []
    assert_clean(eng)


def test_stop_conditions(llm):
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    base = llm.generate([PROMPTS[0]], greedy)[0]
    toks, text = base.token_ids, base.text
    # stop token id: finishes on the first occurrence, the token is kept
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[toks[5]]))[0]
    first = toks.index(toks[5])
    assert out.token_ids == toks[: first + 1] and out.finish_reason == "stop"
    assert out.outputs[0].stop_reason == toks[5]
    # stop string: the text ends before it
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    if stop.strip():
        out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=20, temperature=0.0, stop=[stop]))[0]
        assert out.finish_reason == "stop" and out.text == text[: text.find(stop)]
        assert out.outputs[0].stop_reason == stop
    # max_tokens
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=3, temperature=0.0))[0]
    assert out.token_ids == toks[:3] and out.finish_reason == "length"
    assert_clean(llm.engine)


def test_eos_stops_unless_ignored(llm):
    eng = llm.engine
    eos = llm.tokenizer.eos_token_id
    eng.eos_token_ids = {eos, llm.generate([PROMPTS[1]], SamplingParams(max_tokens=1, temperature=0.0))[0].token_ids[0]}
    try:
        out = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=10, temperature=0.0))[0]
        assert len(out.token_ids) == 1 and out.finish_reason == "stop"
        out = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0]
        assert len(out.token_ids) == 10 and out.finish_reason == "length"
    finally:
        eng.eos_token_ids = {eos}


def test_text_matches_full_decode(llm):
    for out in llm.generate(PROMPTS, SamplingParams(max_tokens=30, temperature=0.8, seed=3)):
        assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    p = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, top_k=50, seed=42)
    alone = llm.generate([PROMPTS[2]], p)[0].token_ids
    crowd = llm.generate(PROMPTS, [SamplingParams(max_tokens=16, temperature=1.0)] * 2 + [p]
                         + [SamplingParams(max_tokens=16, temperature=1.0)] * 3)[2].token_ids
    assert alone == crowd


def test_n_completions_share_the_prompt_copy_on_write(model_dirs):
    """Completion i of (seed s, n) equals completion 0 of (seed s + i, n = 1): forked
    sequences wrote nothing into each other's KV."""
    llm = LLM(model_dirs["llama"], block_size=8, num_kv_blocks=128)
    prompt = PROMPTS[2]  # its length ends mid-block: the partial block is shared, then copied
    n_out = llm.generate([prompt], SamplingParams(n=3, max_tokens=20, temperature=1.0, seed=10))[0]
    for i in range(3):
        single = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=1.0, seed=10 + i))[0]
        assert n_out.outputs[i].token_ids == single.token_ids
    assert len({tuple(c.token_ids) for c in n_out.outputs}) > 1
    assert_clean(llm.engine)


def test_logprobs_are_returned_per_token(llm):
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=5, temperature=0.0, logprobs=3))[0]
    lps = out.outputs[0].logprobs
    assert len(lps) == 5
    for tok, d in zip(out.token_ids, lps):
        assert tok in d and d[tok] == max(d.values()) and len(d) == 3 and d[tok] <= 0.0


def test_delta_outputs_stream_every_token_once(llm):
    eng = llm.engine
    rid = eng.add_request("stream-1", PROMPTS[0], SamplingParams(max_tokens=12, temperature=0.0),
                          output_kind="delta")
    toks, text, finished = [], "", False
    while eng.has_unfinished_requests():
        for o in eng.step():
            assert o.request_id == rid
            toks += o.outputs[0].token_ids
            text += o.outputs[0].text
            finished = o.finished
    assert finished
    final = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=12, temperature=0.0))[0]
    assert toks == final.token_ids and text == final.text


def test_streamed_text_holds_back_a_possible_stop_string(model_dirs):
    """A stop string that spans tokens is cut from the text when it completes; the deltas
    sent before must not have carried its first characters."""
    llm = LLM(model_dirs["llama"], block_size=8, num_kv_blocks=48, max_model_len=256)
    greedy = dict(max_tokens=20, temperature=0.0, ignore_eos=True)
    full = llm.generate([PROMPTS[2]], SamplingParams(**greedy))[0].text
    stop = full[len(full) // 2:][:3]  # on this model: " c ", completed one token after " c"
    want = llm.generate([PROMPTS[2]], SamplingParams(**greedy, stop=[stop]))[0]
    assert want.finish_reason == "stop" and want.text == full[:full.index(stop)]
    eng = llm.engine
    eng.add_request("s", PROMPTS[2], SamplingParams(**greedy, stop=[stop]), output_kind="delta")
    text = ""
    while eng.has_unfinished_requests():
        for o in eng.step():
            text += o.outputs[0].text
    assert text == want.text


def test_priority_is_served_first(model_dirs):
    # one sequence at a time: completion order is admission order
    llm = LLM(model_dirs["qwen2"], block_size=4, num_kv_blocks=64, max_num_seqs=1)
    eng = llm.engine
    for rid, prio in [("low", 5), ("mid", 1), ("high", 0)]:
        eng.add_request(rid, PROMPTS[0], SamplingParams(max_tokens=2, temperature=0.0), priority=prio)
    order = []
    while eng.has_unfinished_requests():
        order += [o.request_id for o in eng.step() if o.finished]
    assert order == ["high", "mid", "low"]


def test_n_larger_than_max_num_seqs_is_rejected(model_dirs):
    llm = LLM(model_dirs["qwen2"], block_size=4, num_kv_blocks=64, max_num_seqs=2)
    with pytest.raises(InvalidRequestError, match="max_num_seqs"):
        llm.generate(["hi"], SamplingParams(n=3, max_tokens=2))
    assert_clean(llm.engine)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_and_mostly_agrees(model_dirs, hf_reference, dtype):
    """Low-precision weights and KV: the engine runs; greedy tokens start out as in float32."""
    llm = LLM(model_dirs["llama"], block_size=8, num_kv_blocks=256, dtype=dtype)
    assert llm.engine.runner.kv_blocks.dtype == getattr(__import__("torch"), dtype)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0))
    ref = hf_reference(model_dirs["llama"], PROMPTS, 24)
    agree = sum(o.token_ids[0] == r[0] for o, r in zip(outs, ref))
    assert all(len(o.token_ids) == 8 for o in outs) and agree >= len(PROMPTS) - 1
    assert_clean(llm.engine)
