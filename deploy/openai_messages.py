"""Chat messages as OpenAI's schema has them, checked, and handed to the chat template.

`content` is a string or a list of text parts (other parts, e.g. image_url, are a 400 naming them),
plus `name`, assistant messages with `content: null` and `tool_calls`, `tool` messages with
`tool_call_id`; `ChatMessage.check(i)` refuses the rest with InvalidRequestError(param="messages")
naming messages.<i>. `template_dict(i)` is the message as transformers' `apply_chat_template`
expects it: content as one string (non-empty text parts joined by "\\n", as vLLM does; "" for a null
content), tool_calls as [{"id", "type", "function": {"name", "arguments": <the decoded JSON
object>}}]. `RESERVED_TEMPLATE_KWARGS` are the template arguments Folio sets itself, which no
request's chat_template_kwargs may set.
"""

from __future__ import annotations

import json
from typing import Literal

from folio.deploy.openai_unsupported import StrictModel
from folio.worker.errors import InvalidRequestError


class ToolCallFunction(StrictModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(StrictModel):
    id: str
    type: Literal["function"]
    function: ToolCallFunction


class ChatMessage(StrictModel):
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
        if isinstance(self.content, list):  # empty parts add no line (as vLLM joins them)
            return "\n".join(p["text"] for p in self.content if p["text"])
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


# vLLM 0.32's values of chat completions' reasoning_effort (OpenAI's, and "max")
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


def check_prediction(prediction: dict | None) -> None:
    """OpenAI's `prediction`: {"type": "content", "content": text or text parts}. It only speeds up
    a response that repeats it, so it is honoured by not being used; its shape is still checked."""
    if prediction is None:
        return
    content = prediction.get("content")
    parts_ok = isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content)
    if set(prediction) - {"type", "content"} or prediction.get("type") != "content" or not (
            isinstance(content, str) or parts_ok):
        raise InvalidRequestError('prediction must be {"type": "content", "content": a string or text parts}',
                                  param="prediction")


RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs"})
