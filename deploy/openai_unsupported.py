"""The OpenAI and vLLM request fields Folio does not implement (yet), and the base models of every
request body (deploy/openai_schema.py) that judge them.

Every field is honoured or refused, never ignored. The fields that OpenAI or vLLM define and Folio
does not implement are in `UNSUPPORTED` (both APIs), `UNSUPPORTED_COMPLETIONS` and `UNSUPPORTED_CHAT`:
each is accepted only at its no-op value (its default: `tool_choice` "none", `prompt_logprobs` null,
`structural_tag` null, ...) and anything else is a 400 whose `param` names it. Accepted because they
change nothing Folio does (`NO_OPS`, plain fields of the request models): `user` (an end-user id for
abuse monitoring), `metadata` (tags of stored completions; Folio stores none), `parallel_tool_calls`
(no tools), `include_reasoning` (no reasoning parser), `service_tier` "auto" / "default" (one tier),
`prediction` (OpenAI's predicted output: a hint for speed, never a change to the output, so honoured by
ignoring its content; its shape is checked). `reasoning_effort` is handed to the chat template, as vLLM
does (openai_schema.py).

    StrictModel      strict JSON types (no "1" for 1, no 1.5 for an int, no 0 for false); unknown
                     fields dropped (openai_schema.parse logs them)
    RefusingModel    a StrictModel whose UNSUPPORTED_FIELDS (any JSON value) are set aside before
                     validation; `refuse_unsupported()` raises InvalidRequestError(param=<the field>)
                     for the first one not at its no-op value
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from folio.worker.errors import InvalidRequestError


def none_or(number):
    return lambda v: v is None or (type(v) in (int, float) and v == number)


def falsy(v) -> bool:
    return v is None or v is False


def is_empty(v) -> bool:
    return v is None or v == [] or v == {} or v == ""


def text_format(v) -> bool:
    return v is None or v == {"type": "text"}


# field -> (the test of a value that has no effect, what to say). Both APIs unless marked.
UNSUPPORTED: dict[str, tuple] = {
    "prompt_logprobs": (lambda v: v is None, "prompt_logprobs is not supported"),
    "guided_whitespace_pattern": (lambda v: v is None, "guided_whitespace_pattern is not supported"),
    "structural_tag": (lambda v: v is None, "structural_tag is not supported"),
    "logits_processors": (is_empty, "logits_processors is not supported"),
    "use_beam_search": (falsy, "use_beam_search is not supported"),
    "length_penalty": (none_or(1), "length_penalty is not supported (beam search only)"),
    # both: the fast tokenizers Folio loads put no space between special tokens either way (vLLM's too)
    "spaces_between_special_tokens": (lambda v: v is None or isinstance(v, bool),
                                      "spaces_between_special_tokens is not supported other than as true or false"),
    "kv_transfer_params": (is_empty, "kv_transfer_params is not supported"),
    "vllm_xargs": (is_empty, "vllm_xargs is not supported"),
    "mm_processor_kwargs": (is_empty, "mm_processor_kwargs is not supported (text-only models)"),
    # vLLM 0.32's (they were ignored with a warning until 2026-12-07)
    "logprob_token_ids": (is_empty, "logprob_token_ids is not supported"),
    "repetition_detection": (lambda v: v is None, "repetition_detection is not supported"),
    "return_token_offsets": (falsy, "return_token_offsets is not supported"),
    "thinking_token_budget": (lambda v: v is None, "thinking_token_budget is not supported (no reasoning parser)"),
    "truncation_side": (lambda v: v is None or v == "left", 'truncation_side is not supported (other than "left": '
                                                            "truncate_prompt_tokens keeps the prompt's last tokens)"),
    "watermarking": (falsy, "watermarking is not supported"),
    "session_id": (lambda v: v is None, "session_id is not supported"),
    "ec_transfer_params": (is_empty, "ec_transfer_params is not supported"),
    "mm_payload": (lambda v: v is None, "mm_payload is not supported (text-only models)"),
    "return_mm_kwargs": (falsy, "return_mm_kwargs is not supported (text-only models)"),
    "routed_experts_prompt_start": (lambda v: v is None, "routed_experts_prompt_start is not supported"),
}
UNSUPPORTED_COMPLETIONS: dict[str, tuple] = {
    "suffix": (is_empty, "suffix is not supported"),
    "prompt_embeds": (lambda v: v is None, "prompt_embeds is not supported"),
}
UNSUPPORTED_CHAT: dict[str, tuple] = {
    "functions": (is_empty, "functions is not supported"),
    "function_call": (lambda v: v is None or v == "none", 'function_call is not supported (other than "none")'),
    "documents": (lambda v: v is None, "documents is not supported"),
    "chat_template": (lambda v: v is None, "chat_template is not supported (the model's own template is used)"),
    "add_special_tokens": (falsy, "add_special_tokens is not supported in chat completions (the chat template "
                                  "adds the model's special tokens)"),
    "audio": (lambda v: v is None, "audio output is not supported"),
    "modalities": (lambda v: v is None or v == ["text"], 'modalities is not supported (other than ["text"])'),
    "web_search_options": (lambda v: v is None, "web_search_options is not supported"),
    "store": (falsy, "store is not supported: Folio stores no completions"),
    "media_io_kwargs": (is_empty, "media_io_kwargs is not supported (text-only models)"),
    "return_prompt_text": (falsy, "return_prompt_text is not supported"),
}
NO_OPS = ("user", "metadata", "parallel_tool_calls", "include_reasoning", "service_tier")
SERVICE_TIERS = ("auto", "default")


class StrictModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class RefusingModel(StrictModel):
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
