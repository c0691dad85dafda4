"""Tool calling (deploy/openai_tools.py): the plans of each tool_choice, the Hermes parser, and,
on a tiny model given a tool-aware chat template, required / named calls constrained to the
tools' schemas (every call parses and its arguments validate) and rendered tools in the prompt.
Over HTTP: a model whose template has no tool support refuses tools; "none" serves them unused."""

from __future__ import annotations

import json
import shutil

import jsonschema
import pytest

from folio.deploy.openai_tools import tool_plan
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
