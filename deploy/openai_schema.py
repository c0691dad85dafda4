"""The OpenAI HTTP request bodies as typed models: every field's JSON type is checked here,
in one place (strict: no "1" for 1, no 1.5 for an int, no 0 for false); the numeric
bounds are SamplingParams' (worker/sampling_params.py), shared with gRPC and the offline
`LLM`. Unknown fields are ignored, as OpenAI-compatible servers do.

    req = parse(CompletionRequest, body)   # InvalidRequestError(param=...) on a bad field
    params = req.sampling_params(default_max_tokens)
"""

from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from folio.worker.errors import InvalidRequestError
from folio.worker.sampling_params import SamplingParams

Ids = list[int]


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Model):
    include_usage: bool | None = None


class _Sampling(_Model):
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
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    priority: int | None = None
    user: str | None = None

    def _logprobs(self) -> int | None:
        return None

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0.0):
                raise InvalidRequestError(f"{name} is not supported", param=name)
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
            skip_special_tokens=v(self.skip_special_tokens, True), logprobs=self._logprobs())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    # a string, token ids, or a list of either (one choice group per prompt)
    prompt: Union[str, Ids, list[str], list[Ids]]
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None

    def _logprobs(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        return list(p)


class TextPart(_Model):
    type: Literal["text"]
    text: str


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None

    def _logprobs(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise InvalidRequestError("top_logprobs needs logprobs: true", param="top_logprobs")
            return None
        return self.top_logprobs or 0

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise InvalidRequestError("max_tokens and max_completion_tokens differ", param="max_tokens")
            self.max_tokens = self.max_completion_tokens
        return super().sampling_params(default_max_tokens)

    def message_dicts(self) -> list[dict]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


def parse(model: type[_Model], body) -> _Model:
    """The body as `model`, or InvalidRequestError naming the first bad field."""
    if not isinstance(body, dict):
        raise InvalidRequestError("the body must be a JSON object")
    check_text(body)
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors(include_url=False, include_input=False)[0]
        loc = [str(x) for x in err["loc"]]
        where = ".".join(loc)
        if loc and loc[0] == "prompt":  # a union: pydantic reports each member; one line says it
            where, err = "prompt", {"msg": "must be a string, a list of strings, token ids (integers) or a "
                                           "list of token-id lists"}
        raise InvalidRequestError(f"{where}: {err['msg']}" if loc else err["msg"],
                                  param=loc[0] if loc else None) from None


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
