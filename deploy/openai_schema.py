"""The OpenAI HTTP request bodies as typed models: every field's JSON type is checked here,
in one place (strict: no "1" for 1, no 1.5 for an int, no 0 for false); the numeric
bounds are SamplingParams' (worker/sampling_params.py), shared with gRPC and the offline
`LLM`.

    req = parse(CompletionRequest, body)   # InvalidRequestError(param=...) on a bad field
    params = req.sampling_params(default_max_tokens)

Every field is honoured or refused, never ignored. The fields that OpenAI or vLLM define
and Folio does not implement (yet) are in `UNSUPPORTED`: each is accepted only at its no-op
value (its default: `tool_choice` "none", `prompt_logprobs` null, `structural_tag` null, ...) and anything else is a 400 whose `param` names it. Accepted because
they change nothing Folio does (`NO_OPS`): `user` (an end-user id for abuse monitoring),
`metadata` (tags of stored completions; Folio stores none), `parallel_tool_calls` (no tools),
`include_reasoning` (no reasoning parser), `service_tier` "auto" / "default" (one tier).
Unknown fields (in no OpenAI or vLLM schema Folio knows) are ignored with a warning in the
log, as vLLM does (its `OpenAIBaseModel`: extra="allow" plus "The following fields were
present in the request but ignored"): clients of newer API versions keep working.

Chat messages follow OpenAI's schema: `content` a string or a list of text parts (other
parts, e.g. image_url, are a 400 naming them), `name`, assistant messages with `content: null`
and `tool_calls`, `tool` messages with `tool_call_id`. `template_messages()` hands them to the
chat template as transformers' `apply_chat_template` expects: content as one string (text parts
joined by "\\n", as vLLM does; "" for a null content), tool_calls as [{"id", "type", "function":
{"name", "arguments": <the decoded JSON object>}}].
"""

from __future__ import annotations

import json
import logging
from typing import Any, ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from folio.worker.errors import InvalidRequestError
from folio.worker.guided import GuidedSpec
from folio.worker.sampling_params import SamplingParams

Ids = list[int]
log = logging.getLogger("folio.openai")
MAX_REQUEST_ID_CHARS = 256


def _none_or(number):
    return lambda v: v is None or (type(v) in (int, float) and v == number)


def _falsy(v) -> bool:
    return v is None or v is False


def _empty(v) -> bool:
    return v is None or v == [] or v == {} or v == ""


def _text_format(v) -> bool:
    return v is None or v == {"type": "text"}


# field -> (the test of a value that has no effect, what to say). Both APIs unless marked.
UNSUPPORTED: dict[str, tuple] = {
    "prompt_logprobs": (lambda v: v is None, "prompt_logprobs is not supported"),
    "guided_whitespace_pattern": (lambda v: v is None, "guided_whitespace_pattern is not supported"),
    "structural_tag": (lambda v: v is None, "structural_tag is not supported"),
    "logits_processors": (_empty, "logits_processors is not supported"),
    "use_beam_search": (_falsy, "use_beam_search is not supported"),
    "length_penalty": (_none_or(1), "length_penalty is not supported (beam search only)"),
    "spaces_between_special_tokens": (lambda v: v is None or v is True,
                                      "spaces_between_special_tokens is not supported (other than true)"),
    "cache_salt": (lambda v: v is None, "cache_salt is not supported"),
    "kv_transfer_params": (_empty, "kv_transfer_params is not supported"),
    "vllm_xargs": (_empty, "vllm_xargs is not supported"),
    "mm_processor_kwargs": (_empty, "mm_processor_kwargs is not supported (text-only models)"),
}
UNSUPPORTED_COMPLETIONS: dict[str, tuple] = {
    "suffix": (_empty, "suffix is not supported"),
    "prompt_embeds": (lambda v: v is None, "prompt_embeds is not supported"),
}
UNSUPPORTED_CHAT: dict[str, tuple] = {
    "functions": (_empty, "functions is not supported"),
    "function_call": (lambda v: v is None or v == "none", 'function_call is not supported (other than "none")'),
    "continue_final_message": (_falsy, "continue_final_message is not supported"),
    "echo": (_falsy, "echo is not supported in chat completions"),
    "documents": (lambda v: v is None, "documents is not supported"),
    "chat_template": (lambda v: v is None, "chat_template is not supported (the model's own template is used)"),
    "add_special_tokens": (_falsy, "add_special_tokens is not supported in chat completions (the chat template "
                                   "adds the model's special tokens)"),
    "audio": (lambda v: v is None, "audio output is not supported"),
    "modalities": (lambda v: v is None or v == ["text"], 'modalities is not supported (other than ["text"])'),
    "prediction": (lambda v: v is None, "prediction is not supported"),
    "web_search_options": (lambda v: v is None, "web_search_options is not supported"),
    "reasoning_effort": (lambda v: v is None, "reasoning_effort is not supported"),
    "store": (_falsy, "store is not supported: Folio stores no completions"),
}
NO_OPS = ("user", "metadata", "parallel_tool_calls", "include_reasoning", "service_tier")
SERVICE_TIERS = ("auto", "default")


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class _Refusing(_Model):
    """A body whose UNSUPPORTED-style fields (any JSON value) are set aside before validation and
    judged by `refuse_unsupported`: a no-op value passes, anything else is a 400 naming the field."""
    UNSUPPORTED_FIELDS: ClassVar[dict[str, tuple]] = UNSUPPORTED
    extra_unsupported: dict[str, Any] = Field(default_factory=dict, exclude=True)

    @model_validator(mode="before")
    @classmethod
    def _take_unsupported(cls, data):
        if isinstance(data, dict):
            data = dict(data)
            data.pop("extra_unsupported", None)  # not a field a client can set
            data["extra_unsupported"] = {k: data.pop(k) for k in list(data) if k in cls.UNSUPPORTED_FIELDS}
        return data

    def refuse_unsupported(self) -> None:
        for name, value in self.extra_unsupported.items():
            noop, message = self.UNSUPPORTED_FIELDS[name]
            if not noop(value):
                raise InvalidRequestError(message, param=name)


class StreamOptions(_Model):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM's: usage in every chunk


class _Sampling(_Refusing):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int | None = None
    best_of: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    priority: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's (HF's): 1 = off
    logit_bias: dict[str, float] | None = None  # OpenAI's: token ids as strings -> [-100, 100]
    min_tokens: int | None = None  # vLLM's
    bad_words: list[str] | None = None  # vLLM's
    allowed_token_ids: list[int] | None = None  # vLLM's
    # structured output (worker/guided.py): OpenAI's response_format, or one of vLLM's guided_*
    response_format: dict[str, Any] | None = None
    guided_json: Union[dict[str, Any], str, None] = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # only xgrammar (or "auto")
    truncate_prompt_tokens: int | None = Field(None, ge=1)  # keep the prompt's last k tokens (vLLM)
    return_tokens_as_token_ids: bool | None = None  # logprobs' tokens as "token_id:<id>" (vLLM)
    request_id: str | None = Field(None, min_length=1, max_length=MAX_REQUEST_ID_CHARS)  # the response's id
    # no effect in Folio (module docstring)
    user: str | None = None
    metadata: dict[str, str] | None = None
    service_tier: Literal["auto", "default"] | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options needs stream: true", param="stream_options")

    def _logprobs(self) -> int | None:
        return None

    def _prompt_logprobs(self) -> int | None:
        return None

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        self.refuse_unsupported()
        n = 1 if self.n is None else self.n
        if self.best_of not in (None, n):
            raise InvalidRequestError("best_of is not supported (other than best_of = n)", param="best_of")
        max_tokens = self.max_tokens if self.max_tokens is not None else default_max_tokens

        def v(x, default):
            return default if x is None else x
        return SamplingParams(
            n=n, max_tokens=max_tokens, temperature=v(self.temperature, 1.0), top_p=v(self.top_p, 1.0),
            top_k=v(self.top_k, 0), min_p=v(self.min_p, 0.0), seed=self.seed, stop=self.stop,
            stop_token_ids=self.stop_token_ids or [], ignore_eos=bool(self.ignore_eos),
            include_stop_str_in_output=bool(self.include_stop_str_in_output),
            skip_special_tokens=v(self.skip_special_tokens, True), logprobs=self._logprobs(),
            presence_penalty=v(self.presence_penalty, 0.0), frequency_penalty=v(self.frequency_penalty, 0.0),
            repetition_penalty=v(self.repetition_penalty, 1.0), logit_bias=_logit_bias(self.logit_bias),
            min_tokens=v(self.min_tokens, 0), bad_words=self.bad_words or [],
            allowed_token_ids=self.allowed_token_ids, prompt_logprobs=self._prompt_logprobs(), guided=self._guided())

    def _guided(self) -> GuidedSpec | None:
        """The one structured-output constraint asked for (two at once is a 400), as a GuidedSpec."""
        if self.guided_decoding_backend not in (None, "xgrammar", "auto"):
            raise InvalidRequestError(f"guided_decoding_backend {self.guided_decoding_backend!r} is not supported "
                                      f"(xgrammar is Folio's)", param="guided_decoding_backend")
        asked: list[tuple[str, GuidedSpec]] = []
        rf = self.response_format
        if rf is not None:
            kind = rf.get("type")
            if kind == "json_object":
                asked.append(("response_format", GuidedSpec("json_object")))
            elif kind == "json_schema":
                js = rf.get("json_schema")
                schema = js.get("schema") if isinstance(js, dict) else None
                if not isinstance(schema, dict):
                    raise InvalidRequestError("response_format.json_schema.schema must be a JSON schema (an object)",
                                              param="response_format")
                asked.append(("response_format", GuidedSpec("json_schema", json.dumps(schema))))
            elif kind != "text":
                raise InvalidRequestError('response_format.type must be "text", "json_object" or "json_schema", '
                                          f"got {kind!r}", param="response_format")
        if self.guided_json is not None:
            if not isinstance(self.guided_json, dict):
                try:
                    schema = json.loads(self.guided_json)
                except ValueError:
                    raise InvalidRequestError("guided_json is not valid JSON", param="guided_json") from None
            else:
                schema = self.guided_json
            asked.append(("guided_json", GuidedSpec("json_schema", json.dumps(schema))))
        if self.guided_regex is not None:
            asked.append(("guided_regex", GuidedSpec("regex", self.guided_regex)))
        if self.guided_choice is not None:
            if not self.guided_choice or not all(self.guided_choice):
                raise InvalidRequestError("guided_choice must be a non-empty list of non-empty strings",
                                          param="guided_choice")
            asked.append(("guided_choice", GuidedSpec.choice(self.guided_choice)))
        if self.guided_grammar is not None:
            asked.append(("guided_grammar", GuidedSpec("grammar", self.guided_grammar)))
        if len(asked) > 1:
            raise InvalidRequestError(f"only one structured-output constraint at a time, got {[a for a, _ in asked]}",
                                      param=asked[1][0])
        return asked[0][1] if asked else None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and (self.stream_options.include_usage or
                                             self.stream_options.continuous_usage_stats))

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def truncate(self, ids: list[int]) -> list[int]:
        k = self.truncate_prompt_tokens
        return ids if k is None or len(ids) <= k else ids[-k:]


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias (JSON keys are strings) as {token id: bias}; a key that is not a
    token id is a 400."""
    if not bias:
        return None
    out: dict[int, float] = {}
    for k, b in bias.items():
        if not (k.isascii() and k.isdigit()) or len(k) > 10:
            raise InvalidRequestError(f"logit_bias keys must be token ids, got {k!r}", param="logit_bias")
        out[int(k)] = b
    return out


class CompletionRequest(_Sampling):
    # a string, token ids, or a list of either (one choice group per prompt)
    prompt: Union[str, Ids, list[str], list[Ids]]
    logprobs: int | None = None
    echo: bool | None = None
    add_special_tokens: bool | None = None  # default true: the tokenizer's BOS etc. (vLLM)

    UNSUPPORTED_FIELDS: ClassVar[dict[str, tuple]] = {**UNSUPPORTED, **UNSUPPORTED_COMPLETIONS}

    def _logprobs(self) -> int | None:
        return self.logprobs

    def _prompt_logprobs(self) -> int | None:
        return self.logprobs if self.echo else None  # echo + logprobs: the prompt's tokens too

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        return list(p)


class ToolCallFunction(_Model):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Model):
    id: str
    type: Literal["function"]
    function: ToolCallFunction


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list | None = None  # the parts are checked in `_check` (to name a bad one)
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def check(self, i: int) -> None:
        where = f"messages.{i}"
        if isinstance(self.content, list):
            for j, part in enumerate(self.content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    what = f"{kind!r} content parts are" if isinstance(kind, str) else "a part without a type is"
                    raise InvalidRequestError(f"{where}.content.{j}: {what} not supported (text parts only)",
                                              param="messages")
                if not isinstance(part.get("text"), str):
                    raise InvalidRequestError(f"{where}.content.{j}.text must be a string", param="messages")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise InvalidRequestError(f"{where}.content is required (null only for an assistant message with "
                                      f"tool_calls)", param="messages")
        if self.tool_calls is not None and self.role != "assistant":
            raise InvalidRequestError(f"{where}.tool_calls: only assistant messages have tool_calls",
                                      param="messages")
        if self.role == "tool" and self.tool_call_id is None:
            raise InvalidRequestError(f"{where}.tool_call_id is required in a tool message", param="messages")
        if self.tool_call_id is not None and self.role != "tool":
            raise InvalidRequestError(f"{where}.tool_call_id: only tool messages have a tool_call_id",
                                      param="messages")

    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(p["text"] for p in self.content)
        return self.content or ""

    def template_dict(self, i: int) -> dict:
        d: dict = {"role": self.role, "content": self.text()}
        if self.name is not None:
            d["name"] = self.name
        if self.tool_calls is not None:
            d["tool_calls"] = [{"id": c.id, "type": c.type,
                                "function": {"name": c.function.name,
                                             "arguments": _arguments(c.function.arguments, i, k)}}
                               for k, c in enumerate(self.tool_calls)]
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        return d


def _arguments(text: str, i: int, k: int):
    """A tool call's arguments (JSON text) as the object transformers' templates render (`| tojson`)."""
    try:
        return json.loads(text) if text.strip() else {}
    except ValueError:
        raise InvalidRequestError(f"messages.{i}.tool_calls.{k}.function.arguments is not valid JSON",
                                  param="messages") from None


RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs"})


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict] | None = None  # deploy/openai_tools.py
    tool_choice: Union[str, dict, None] = None  # default "auto" with tools, "none" without (OpenAI)
    _plan: Any = PrivateAttr(default=None)
    add_generation_prompt: bool | None = None  # default true (vLLM)
    chat_template_kwargs: dict[str, Any] | None = None  # passed to the template (vLLM)
    parallel_tool_calls: bool | None = None  # no effect (no tools)
    include_reasoning: bool | None = None  # no effect (no reasoning parser)

    UNSUPPORTED_FIELDS: ClassVar[dict[str, tuple]] = {**UNSUPPORTED, **UNSUPPORTED_CHAT}

    def _logprobs(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise InvalidRequestError("top_logprobs needs logprobs: true", param="top_logprobs")
            return None
        return self.top_logprobs or 0

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        self.tool_plan()
        for i, m in enumerate(self.messages):
            m.check(i)
        bad = RESERVED_TEMPLATE_KWARGS & set(self.chat_template_kwargs or ())
        if bad:
            raise InvalidRequestError(f"chat_template_kwargs cannot set {sorted(bad)}", param="chat_template_kwargs")

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise InvalidRequestError("max_tokens and max_completion_tokens differ", param="max_tokens")
            self.max_tokens = self.max_completion_tokens
        return super().sampling_params(default_max_tokens)

    def tool_plan(self):
        from folio.deploy.openai_tools import tool_plan
        if self._plan is None:
            self._plan = tool_plan(self.tools, self.tool_choice)
        return self._plan

    def _guided(self) -> GuidedSpec | None:
        spec, tools = super()._guided(), self.tool_plan().guided
        if spec is not None and tools is not None:
            raise InvalidRequestError("tool_choice required or named constrains the output already: no "
                                      "response_format or guided_* beside it", param="tool_choice")
        return tools or spec

    def template_messages(self) -> list[dict]:
        return [m.template_dict(i) for i, m in enumerate(self.messages)]

    def template_kwargs(self) -> dict:
        kw = dict(self.chat_template_kwargs or {})
        if self.tool_plan().renders:
            kw["tools"] = self.tool_plan().tools
        return kw


class TokenizeRequest(_Refusing):
    """vLLM's /tokenize: {"prompt"} or {"messages"} -> {"tokens", "count", "max_model_len"}."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages
    add_generation_prompt: bool | None = None
    return_token_strs: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    UNSUPPORTED_FIELDS: ClassVar[dict[str, tuple]] = {
        **{k: UNSUPPORTED_CHAT[k] for k in ("continue_final_message", "chat_template", "documents")},
        "tools": (_empty, "tools is not supported"), "mm_processor_kwargs": UNSUPPORTED["mm_processor_kwargs"]}

    def check(self) -> None:
        self.refuse_unsupported()
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequestError("give either prompt or messages", param="prompt")
        for i, m in enumerate(self.messages or []):
            m.check(i)
        bad = RESERVED_TEMPLATE_KWARGS & set(self.chat_template_kwargs or ())
        if bad:
            raise InvalidRequestError(f"chat_template_kwargs cannot set {sorted(bad)}", param="chat_template_kwargs")
        if self.messages is not None and self.add_special_tokens:
            raise InvalidRequestError(UNSUPPORTED_CHAT["add_special_tokens"][1], param="add_special_tokens")


class DetokenizeRequest(_Model):
    model: str | None = None
    tokens: list[int]


_warned: set[frozenset] = set()


def _warn_unknown(model: type[_Model], body: dict) -> None:
    """Unknown top-level fields: ignored, logged (once per set of names, a bounded number of sets)."""
    known = set(model.model_fields) | set(getattr(model, "UNSUPPORTED_FIELDS", ()))
    unknown = frozenset(k for k in body if k not in known and isinstance(k, str))
    if unknown and unknown not in _warned and len(_warned) < 1000:
        _warned.add(unknown)
        log.warning("The following fields were present in the request but ignored: %s",
                    sorted(ascii(k)[1:-1] for k in unknown))


def parse(model: type[_Model], body) -> _Model:
    """The body as `model`, or InvalidRequestError naming the first bad field."""
    if not isinstance(body, dict):
        raise InvalidRequestError("the body must be a JSON object")
    check_text(body)
    try:
        req = model.model_validate(body)
    except ValidationError as e:
        err = e.errors(include_url=False, include_input=False)[0]
        loc = [str(x) for x in err["loc"]]
        where = ".".join(loc)
        if loc and loc[0] == "prompt":  # a union: pydantic reports each member; one line says it
            where, err = "prompt", {"msg": "must be a string, a list of strings, token ids (integers) or a "
                                           "list of token-id lists"}
        raise InvalidRequestError(f"{where}: {err['msg']}" if loc else err["msg"],
                                  param=loc[0] if loc else None) from None
    _warn_unknown(model, body)
    return req


def check_text(body) -> None:
    """Every string in the body (keys too) is valid Unicode: JSON's \\ud800 escapes can make a
    lone surrogate, which no UTF-8 tokenizer, log or reply can hold. Iterative: any depth."""
    stack = [(body, None)]
    while stack:
        x, top = stack.pop()
        if isinstance(x, str):
            try:
                x.encode("utf-8")
            except UnicodeEncodeError:
                raise InvalidRequestError("a string holds a lone UTF-16 surrogate", param=top) from None
        elif isinstance(x, dict):
            for k, v in x.items():
                where = top or (k if _is_unicode(k) else None)  # a bad key cannot name itself in the reply
                stack.append((k, where))
                stack.append((v, where))
        elif isinstance(x, list):
            stack.extend((v, top) for v in x)


def _is_unicode(s: str) -> bool:
    try:
        s.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False
