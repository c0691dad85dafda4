"""The OpenAI HTTP request bodies as typed models: every field's JSON type is checked here,
in one place (strict: no "1" for 1, no 1.5 for an int, no 0 for false); the numeric
bounds are SamplingParams' (worker/sampling_params.py), shared with gRPC and the offline
`LLM`.

    req = parse(CompletionRequest, body)   # InvalidRequestError(param=...) on a bad field
    params = req.sampling_params(default_max_tokens)

The fields both APIs share, and their SamplingParams, are openai_sampling.py's; chat messages are
openai_messages.py's. Every field is honoured or refused, never ignored: the fields OpenAI or vLLM
define and Folio does not implement are accepted only at their no-op value, and anything else is
a 400 whose `param` names it (openai_unsupported.py). Unknown fields (in no OpenAI or vLLM schema
Folio knows) are ignored with a warning in the log, as vLLM does (its `OpenAIBaseModel`:
extra="allow" plus "The following fields were present in the request but ignored"): clients of
newer API versions keep working.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar, Literal, Union

from pydantic import Field, PrivateAttr, ValidationError

from folio.deploy.openai_messages import REASONING_EFFORTS, RESERVED_TEMPLATE_KWARGS, ChatMessage, check_prediction
from folio.deploy.openai_sampling import SamplingRequest
from folio.deploy.openai_unsupported import (UNSUPPORTED, UNSUPPORTED_CHAT, UNSUPPORTED_COMPLETIONS, RefusingModel,
                                             StrictModel)
from folio.worker.errors import InvalidRequestError
from folio.worker.guided import GuidedSpec
from folio.worker.sampling_params import MAX_LOGPROBS, SamplingParams

Ids = list[int]
log = logging.getLogger("folio.openai")


class CompletionRequest(SamplingRequest):
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


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict] | None = None  # deploy/openai_tools.py
    tool_choice: Union[str, dict, None] = None  # default "auto" with tools, "none" without (OpenAI)
    _plan: Any = PrivateAttr(default=None)
    add_generation_prompt: bool | None = None  # default true (vLLM)
    continue_final_message: bool | None = None  # the final message is continued (an assistant's prefill)
    echo: bool | None = None  # the final message's text leads each choice where its role is the response's
    chat_template_kwargs: dict[str, Any] | None = None  # passed to the template (vLLM)
    parallel_tool_calls: bool | None = None  # no effect (no tools)
    include_reasoning: bool | None = None  # no effect (no reasoning parser)
    # handed to the chat template with enable_thinking (unless chat_template_kwargs sets it), as vLLM does
    reasoning_effort: Literal[REASONING_EFFORTS] | None = None
    prediction: dict | None = None  # OpenAI's predicted output: a hint for speed only (checked, then unused)

    UNSUPPORTED_FIELDS: ClassVar[dict[str, tuple]] = {**UNSUPPORTED, **UNSUPPORTED_CHAT}

    def _logprobs(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise InvalidRequestError("top_logprobs needs logprobs: true", param="top_logprobs")
            return None
        k = self.top_logprobs
        if k is not None and not 0 <= k <= MAX_LOGPROBS:  # named as sent (the check below names "logprobs")
            raise InvalidRequestError(f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {k}",
                                      param="top_logprobs")
        return k or 0

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        self.tool_plan()
        for i, m in enumerate(self.messages):
            m.check(i)
        bad = RESERVED_TEMPLATE_KWARGS & set(self.chat_template_kwargs or ())
        if bad:
            raise InvalidRequestError(f"chat_template_kwargs cannot set {sorted(bad)}", param="chat_template_kwargs")
        check_prediction(self.prediction)
        self.generation_prompt()

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

    def generation_prompt(self) -> bool:
        return generation_prompt(self.add_generation_prompt, self.continue_final_message)

    def response_role(self) -> str:
        """vLLM's: "assistant" after a generation prompt, else the final message's role (a continued one)."""
        return "assistant" if self.generation_prompt() else self.messages[-1].role

    def echoed(self) -> str:
        """What `echo` puts before each choice's content: the final message's text where its role is the
        response's (a continued assistant message), as vLLM does; else nothing."""
        last = self.messages[-1]
        return last.text() if self.echo and last.role == self.response_role() else ""

    def template_kwargs(self) -> dict:
        kw = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:  # vLLM's: the field over chat_template_kwargs, enable_thinking under
            kw["reasoning_effort"] = self.reasoning_effort
            kw.setdefault("enable_thinking", self.reasoning_effort != "none")
        if self.tool_plan().renders:
            kw["tools"] = self.tool_plan().tools
        return kw


class TokenizeRequest(RefusingModel):
    """vLLM's /tokenize: {"prompt"} or {"messages"} -> {"tokens", "count", "max_model_len"}."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    return_token_strs: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict] | None = None  # rendered by the chat template, as chat completions' with tool_choice "auto"
    UNSUPPORTED_FIELDS: ClassVar[dict[str, tuple]] = {
        **{k: UNSUPPORTED_CHAT[k] for k in ("chat_template", "documents")},
        "mm_processor_kwargs": UNSUPPORTED["mm_processor_kwargs"]}

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
        generation_prompt(self.add_generation_prompt, self.continue_final_message)


def generation_prompt(add_generation_prompt: bool | None, continue_final_message: bool | None) -> bool:
    """Whether the chat template adds a generation prompt: by default yes, but not when the final
    message is continued; both asked for is a 400 (as in vLLM)."""
    if continue_final_message and add_generation_prompt:
        raise InvalidRequestError("continue_final_message and add_generation_prompt cannot both be true: the "
                                  "prompt either continues the final message or starts a new one",
                                  param="continue_final_message")
    return add_generation_prompt is not False and not continue_final_message


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[int]


_warned: set[frozenset] = set()


def _warn_unknown(model: type[StrictModel], body: dict) -> None:
    """Unknown top-level fields: ignored, logged (once per set of names, a bounded number of sets)."""
    known = set(model.model_fields) | set(getattr(model, "UNSUPPORTED_FIELDS", ()))
    unknown = frozenset(k for k in body if k not in known and isinstance(k, str))
    if unknown and unknown not in _warned and len(_warned) < 1000:
        _warned.add(unknown)
        log.warning("The following fields were present in the request but ignored: %s",
                    sorted(ascii(k)[1:-1] for k in unknown))


def parse(model: type[StrictModel], body) -> StrictModel:
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
