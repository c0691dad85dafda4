"""The request fields that completions and chat completions share (deploy/openai_schema.py's
`CompletionRequest` and `ChatCompletionRequest` extend `SamplingRequest`), and their translation
into the one SamplingParams (worker/sampling_params.py) that HTTP, gRPC and the offline `LLM` share;
SamplingParams checks the numeric bounds.

    params = req.sampling_params(default_max_tokens)   # InvalidRequestError(param=...) on a refusal

`sampling_params()` refuses first (`refuse_unsupported`: the UNSUPPORTED fields, stream_options
without stream, best_of other than n, two structured-output constraints at once); the subclasses
supply the logprobs they ask for (`_logprobs`, `_prompt_logprobs`) and may add a constraint of
their own (`_guided`: chat's tool_choice).
"""

from __future__ import annotations

import json
from typing import Any, Literal, Union

from pydantic import Field

from folio.deploy.openai_unsupported import RefusingModel, StrictModel
from folio.worker.errors import InvalidRequestError
from folio.worker.guided import GuidedSpec
from folio.worker.sampling_params import SEED_LIMIT, SamplingParams

MAX_REQUEST_ID_CHARS = 256


class StreamOptions(StrictModel):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM's: usage in every chunk


class SamplingRequest(RefusingModel):
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
    structured_outputs: dict[str, Any] | None = None  # vLLM 0.32's: {"json" | "regex" | "choice" | "grammar" | ...}
    cache_salt: str | None = None  # vLLM's: only requests of the same salt share cached prefix blocks
    return_token_ids: bool | None = None  # vLLM's: each choice's token ids and its prompt's, beside the text
    truncate_prompt_tokens: int | None = Field(None, ge=-1)  # keep the prompt's last k tokens (-1: what fits; vLLM)
    return_tokens_as_token_ids: bool | None = None  # logprobs' tokens as "token_id:<id>" (vLLM)
    request_id: str | None = Field(None, min_length=1, max_length=MAX_REQUEST_ID_CHARS)  # the response's id
    stream_interval: int | None = Field(None, ge=1)  # vLLM's: tokens per streamed chunk, at least the server's
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
            top_k=v(self.top_k, 0), min_p=v(self.min_p, 0.0), seed=_seed(self.seed), stop=self.stop,
            stop_token_ids=self.stop_token_ids or [], ignore_eos=bool(self.ignore_eos),
            include_stop_str_in_output=bool(self.include_stop_str_in_output),
            skip_special_tokens=v(self.skip_special_tokens, True), logprobs=self._logprobs(),
            presence_penalty=v(self.presence_penalty, 0.0), frequency_penalty=v(self.frequency_penalty, 0.0),
            repetition_penalty=v(self.repetition_penalty, 1.0), logit_bias=_logit_bias(self.logit_bias),
            min_tokens=v(self.min_tokens, 0), bad_words=self.bad_words or [],
            allowed_token_ids=self.allowed_token_ids, prompt_logprobs=self._prompt_logprobs(), guided=self._guided(),
            cache_salt=self.cache_salt)

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
            asked.append(("guided_json", GuidedSpec("json_schema", json.dumps(schema), "guided_json")))
        if self.guided_regex is not None:
            asked.append(("guided_regex", GuidedSpec("regex", self.guided_regex, "guided_regex")))
        if self.guided_choice is not None:
            if not self.guided_choice or not all(self.guided_choice):
                raise InvalidRequestError("guided_choice must be a non-empty list of non-empty strings",
                                          param="guided_choice")
            asked.append(("guided_choice", GuidedSpec.choice(self.guided_choice)))
        if self.guided_grammar is not None:
            asked.append(("guided_grammar", GuidedSpec("grammar", self.guided_grammar, "guided_grammar")))
        if self.structured_outputs is not None:
            asked += structured_outputs(self.structured_outputs)
        if len(asked) > 1:
            raise InvalidRequestError(f"only one structured-output constraint at a time, got {[a for a, _ in asked]}",
                                      param=asked[1][0])
        return asked[0][1] if asked else None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        # with include_usage only, as vLLM's: alone it sent a usage chunk with no choices, which a client
        # that never asked for usage reads as chunk.choices[0] (IndexError)
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)

    def truncate(self, ids: list[int], max_model_len: int) -> list[int]:
        k = keep_tokens(self.truncate_prompt_tokens, max_model_len)
        return ids if k is None or len(ids) <= k else ids[-k:]


def keep_tokens(k: int | None, max_model_len: int) -> int | None:
    """How many of a prompt's last tokens `truncate_prompt_tokens` keeps: -1 is vLLM's "what fits", the
    context less the one token to generate; 0 (nothing kept) and below -1 are refused."""
    if k is not None and k < 1 and k != -1:
        raise InvalidRequestError(f"truncate_prompt_tokens must be -1 (what fits) or at least 1, got {k}",
                                  param="truncate_prompt_tokens")
    return max_model_len - 1 if k == -1 else k


def _seed(seed: int | None) -> int | None:
    """OpenAI's seed is any 64-bit integer: -1 means none (vLLM's rule; some clients send it for
    "random"), another negative one is its two's complement (it was a 400). Past 64 bits it stays
    as sent, for SamplingParams to refuse."""
    if seed == -1:
        return None
    return seed % SEED_LIMIT if seed is not None and -2**63 <= seed < 0 else seed


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


# vLLM 0.32's `structured_outputs` (StructuredOutputsParams): the constraint kinds, and options that change
# nothing in Folio (its JSON is always compact; xgrammar is its one backend)
_SO_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
             "json_object": "json_object"}
_SO_NO_OPS = {"disable_fallback", "disable_any_whitespace"}


def structured_outputs(so) -> list[tuple[str, GuidedSpec]]:
    """vLLM 0.32's `structured_outputs` as GuidedSpecs (one expected): it was ignored with a warning, and
    the request ran unconstrained (a differential test against vLLM, 2026-12-07)."""
    if not isinstance(so, dict):
        raise InvalidRequestError("structured_outputs must be an object", param="structured_outputs")
    asked = []
    for key, value in so.items():
        if value is None or (key in _SO_NO_OPS and isinstance(value, bool)) or (key == "json_object" and not value):
            continue
        if key not in _SO_KINDS:
            raise InvalidRequestError(f"structured_outputs.{key} is not supported (Folio takes json, regex, choice, "
                                      "grammar or json_object)", param="structured_outputs")
        if key == "choice":
            if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
                raise InvalidRequestError("structured_outputs.choice must be a non-empty list of non-empty strings",
                                          param="structured_outputs")
            asked.append(("structured_outputs", GuidedSpec.choice(value, "structured_outputs")))
            continue
        if key == "json":
            try:
                value = json.dumps(value if not isinstance(value, str) else json.loads(value))
            except ValueError:
                raise InvalidRequestError("structured_outputs.json is not valid JSON", param="structured_outputs") \
                    from None
        elif key != "json_object" and not isinstance(value, str):
            raise InvalidRequestError(f"structured_outputs.{key} must be a string", param="structured_outputs")
        asked.append(("structured_outputs", GuidedSpec(_SO_KINDS[key], "" if key == "json_object" else value,
                                                       "structured_outputs")))
    if len(asked) > 1:
        raise InvalidRequestError("structured_outputs takes one kind of constraint at a time",
                                  param="structured_outputs")
    return asked
