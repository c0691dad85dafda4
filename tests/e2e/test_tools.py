"""Tool calling (deploy/openai_tools.py): the plans of each tool_choice, the Hermes parser, and,
on a tiny model given a tool-aware chat template, required / named calls constrained to the
tools' schemas (every call parses and its arguments validate) and rendered tools in the prompt.
The stream parser on generated texts cut at random places adds up to the unstreamed message;
`folio serve` streams tool-call deltas to the official client for each tool_choice.
Over HTTP (test_openai_api): a model whose template has no tool support refuses tools; "none"
serves them unused."""

from __future__ import annotations

import json
import shutil

import jsonschema
import pytest

from hypothesis import given, settings
from hypothesis import strategies as st

from folio.deploy.openai_tools import merge_deltas, tool_plan
from folio.worker import LLM, SamplingParams
from folio.worker.errors import InvalidRequestError

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 12},
                                                "unit": {"enum": ["c", "f"]}},
                                                "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
# Hermes-style, as Qwen2.5's: the tools as JSON in the system turn, calls in <tool_call> tags
TEMPLATE = ("{% if tools %}<|system|> You may call: {% for t in tools %}{{ t | tojson }}{% endfor %}"
            " as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call></s> {% endif %}"
            "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }}</s> {% endfor %}"
            "{% if add_generation_prompt %}<|assistant|> {% endif %}")


def test_plans():
    assert tool_plan(None, None).mode == "none" and tool_plan(TOOLS, None).mode == "auto"  # OpenAI's defaults
    assert not tool_plan(TOOLS, "none").renders and tool_plan(TOOLS, "auto").guided is None
    req = tool_plan(TOOLS, "required")
    assert req.guided.kind == "json_schema" and json.loads(req.guided.value)["minItems"] == 1
    named = tool_plan(TOOLS, {"type": "function", "function": {"name": "add"}})
    assert json.loads(named.guided.value) == ADD["function"]["parameters"]
    for tools, choice in [(None, "auto"), (TOOLS, "sometimes"), (TOOLS, {"type": "function",
                                                                         "function": {"name": "nope"}}),
                          ([{"type": "function", "function": {}}], "auto"), ([{"type": "retrieval"}], "auto")]:
        with pytest.raises(InvalidRequestError):
            tool_plan(tools, choice)


def test_hermes_parser():
    plan = tool_plan(TOOLS, "auto")
    content, calls = plan.parse('Sure. <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n'
                                '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}'
                                '</tool_call> done')
    assert content == "Sure. \n done"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Oslo", "unit": "c"})]
    assert len({c["id"] for c in calls}) == 2 and all(c["type"] == "function" for c in calls)
    text = 'no call <tool_call>{not json}</tool_call> <tool_call>{"name": "rm", "arguments": {}}</tool_call>'
    assert plan.parse(text) == (text, [])  # bad JSON and unknown tools stay text
    assert plan.parse("plain answer") == ("plain answer", [])


@pytest.fixture(scope="module")
def tool_model(model_dirs, tmp_path_factory):
    from transformers import AutoTokenizer
    d = str(tmp_path_factory.mktemp("toolmodel") / "qwen2-tools")
    shutil.copytree(model_dirs["qwen2"], d)
    tok = AutoTokenizer.from_pretrained(d)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(d)
    return d, tok


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}},
                                    {"type": "function", "function": {"name": "add"}}])
def test_required_and_named_calls_always_parse_and_validate(tool_model, choice):
    d, tok = tool_model
    plan = tool_plan(TOOLS, choice)
    prompt = tok.apply_chat_template([{"role": "user", "content": "what is 2 + 3, and the weather in Rome?"}],
                                     tools=plan.tools, tokenize=False, add_generation_prompt=True)
    assert '"get_weather"' in prompt  # the tools reached the model
    llm = LLM(d, block_size=8, num_kv_blocks=1024)
    outs = llm.generate([prompt] * 6, [SamplingParams(max_tokens=300, temperature=1.0, seed=i, guided=plan.guided)
                                       for i in range(6)])
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for o in outs:
        assert o.finish_reason == "stop", o.text
        content, calls = plan.parse(o.text)
        assert calls and content is None
        for c in calls:
            if isinstance(choice, dict):
                assert c["function"]["name"] == choice["function"]["name"]
            jsonschema.validate(json.loads(c["function"]["arguments"]), by_name[c["function"]["name"]])


# ---- streaming: the deltas of any cut of the text add up to the unstreamed message ----------
_CALL = st.builds(lambda n, a, b: json.dumps({"name": n, "arguments": {"a": a, "b": b}}),
                  st.sampled_from(["add", "get_weather", "rm"]), st.integers(0, 99), st.text(max_size=6))
_PIECE = st.one_of(st.text(max_size=12),  # plain text, with tag-like debris
                   st.sampled_from(["<", "<tool", "<tool_call", "</tool_call>", "<tool_call>", "\n", " "]),
                   _CALL.map(lambda c: f"<tool_call>{c}</tool_call>"),
                   _CALL.map(lambda c: f"<tool_call>\n{c}\n</tool_call>"),
                   st.just("<tool_call>{not json}</tool_call>"))


def _cut(text: str, cuts: list[int]) -> list[str]:
    at = sorted({min(c, len(text)) for c in cuts})
    return [text[a:b] for a, b in zip([0] + at, at + [len(text)])]


def _streamed(plan, pieces: list[str]) -> tuple[str, list[dict]]:
    p, content, deltas = plan.stream(), [], []
    for piece in pieces:
        c, d = p.feed(piece)
        content.append(c)
        deltas += d
    c, d = p.finish()
    return "".join(content) + c, deltas


def _same_calls(got: list[dict], want: list[dict]):
    strip = [(c["type"], c["function"]["name"], c["function"]["arguments"]) for c in got]
    assert strip == [(c["type"], c["function"]["name"], c["function"]["arguments"]) for c in want]


@settings(max_examples=300, deadline=None)
@given(st.lists(_PIECE, max_size=8).map("".join), st.lists(st.integers(0, 200), max_size=12))
def test_streamed_auto_calls_add_up_to_the_message(text, cuts):
    plan = tool_plan(TOOLS, "auto")
    content, calls = plan.parse(text)
    streamed, deltas = _streamed(plan, _cut(text, cuts))
    _same_calls(merge_deltas(deltas), calls)
    assert [d["index"] for d in deltas] == list(range(len(deltas)))  # whole calls, numbered in order
    if calls:
        assert (streamed.strip() or None) == content
    else:
        assert streamed == text == content  # no call: every character is content, verbatim


_JSONISH = st.text(alphabet='"\\{}[],: a\u00e9', max_size=6)  # what a string-blind scanner trips on


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "get_weather"]),
                          st.dictionaries(_JSONISH, st.one_of(st.integers(), _JSONISH,
                                                                        st.lists(st.booleans(), max_size=2)),
                                          max_size=3)), min_size=1, max_size=4),
       st.lists(st.integers(0, 400), max_size=20), st.integers(0, 400), st.booleans())
def test_streamed_required_and_named_calls_add_up_to_the_message(items, cuts, cut_short, indent):
    text = json.dumps([{"name": n, "parameters": p} for n, p in items], indent=2 if indent else None)
    plan = tool_plan(TOOLS, "required")
    content, calls = plan.parse(text)
    assert content is None and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] \
        == [(n, p) for n, p in items]
    streamed, deltas = _streamed(plan, _cut(text, cuts))
    assert streamed == "" and _same_calls(merge_deltas(deltas), calls) is None
    # cut short (max_tokens): the elements that closed are calls; with none, the text is the content
    short = text[:cut_short]
    content, calls = plan.parse(short)
    assert len(calls) == sum(1 for i in range(len(items))
                             if len(json.dumps([{"name": n, "parameters": p} for n, p in items[:i + 1]],
                                               indent=2 if indent else None).rstrip("]").rstrip()) <= len(short))
    assert (content is None) == bool(calls) and (calls or content == short)
    named = tool_plan(TOOLS, {"type": "function", "function": {"name": "add"}})
    streamed, deltas = _streamed(named, _cut(text, cuts))
    (call,) = merge_deltas(deltas)
    assert streamed == "" and call["function"] == {"name": "add", "arguments": text}
    assert deltas[0]["id"].startswith("call_") and all("id" not in d for d in deltas[1:])


@pytest.fixture(scope="module")
def tool_server(tool_model):
    from conftest import folio_serve

    with folio_serve(tool_model[0], "--num-workers", "1", "--block-size", "8", "--num-kv-blocks", "512",
                     "--max-model-len", "1024", "--namespace", "tools", "--grace-period-s", "2") as server:
        yield server


_AUTO_TEXT = 'Let me add. <tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call> ok'


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}},
                                    "auto"])
def test_tool_calls_stream_to_the_openai_client(tool_server, choice):
    import openai

    client = openai.OpenAI(base_url=tool_server["http"] + "/v1", api_key="none", max_retries=0)
    extra = {"guided_regex": __import__("re").escape(_AUTO_TEXT)} if choice == "auto" else {}
    kw = dict(model="qwen2-tools", messages=[{"role": "user", "content": "2 + 3? And Rome's weather?"}],
              tools=TOOLS, tool_choice=choice, max_tokens=300, temperature=1.0, seed=7, n=2, extra_body=extra)
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, **kw))
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for want in whole.choices:
        deltas = [ch.choices[0].delta for ch in chunks if ch.choices and ch.choices[0].index == want.index]
        reasons = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].index == want.index]
        assert reasons[-1] == want.finish_reason == "tool_calls" and not any(reasons[:-1])
        calls: dict[int, dict] = {}
        for d in deltas:
            for tc in d.tool_calls or []:
                c = calls.setdefault(tc.index, {"id": tc.id, "name": tc.function.name, "arguments": ""})
                c["arguments"] += tc.function.arguments or ""
        assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
            [(c.function.name, json.loads(c.function.arguments)) for c in want.message.tool_calls]
        assert all(c["id"] and c["id"].startswith("call_") for c in calls.values())
        for c in calls.values():
            jsonschema.validate(json.loads(c["arguments"]), by_name[c["name"]])
        content = "".join(d.content or "" for d in deltas)
        assert (content.strip() or None) == want.message.content
        if choice == "auto":
            assert want.message.content == "Let me add.  ok" and calls[0]["name"] == "add"


def test_tokenize_renders_tools_as_chat_completions_does(tool_server, tool_model):
    """vLLM's /tokenize takes tools (a 400 before): the ids are the chat template's with the tools shown,
    as chat completions' prompt is; tools without messages are a 400 naming tools."""
    import http.client

    _, tok = tool_model
    messages = [{"role": "user", "content": "2 + 3?"}]

    def tokenize(body):
        host, port = tool_server["http"].removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        conn.request("POST", "/tokenize", json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    status, out = tokenize({"messages": messages, "tools": TOOLS})
    want = tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=True)
    assert status == 200 and out["tokens"] == list(want["input_ids"] if hasattr(want, "keys") else want), out
    assert len(out["tokens"]) > len(tokenize({"messages": messages})[1]["tokens"])
    status, out = tokenize({"prompt": "hi", "tools": TOOLS})
    assert status == 400 and out["error"]["param"] == "tools", out
