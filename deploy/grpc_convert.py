"""Conversions between folio.v1's protobuf messages (deploy/proto/folio/v1/generate.proto) and
Folio's own types, for the gRPC servicer (grpc_servicer.py).

    status_of(e)          Folio's typed errors as status codes: InvalidRequestError INVALID_ARGUMENT,
                          OverloadedError RESOURCE_EXHAUSTED, UnavailableError and ShuttingDownError
                          UNAVAILABLE, else INTERNAL
    sampling_params(s)    pb.SamplingParameters -> SamplingParams; an unset optional field takes its
                          default (max_tokens 16, as HTTP completions); at most one guided_* constraint
                          (InvalidRequestError otherwise, or for guided_json that is not JSON)
    pb_logprobs(entries)  each token's {token id: logprob} -> [pb.TopLogprobs]
"""

from __future__ import annotations

import json

import grpc

from folio.v1 import generate_pb2 as pb
from folio.worker.errors import InvalidRequestError, OverloadedError, ShuttingDownError, UnavailableError
from folio.worker.guided import GuidedSpec
from folio.worker.sampling_params import SamplingParams


def status_of(e: Exception) -> grpc.StatusCode:
    if isinstance(e, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(e, OverloadedError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(e, (UnavailableError, ShuttingDownError)):
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.INTERNAL


def sampling_params(s: pb.SamplingParameters) -> SamplingParams:
    return SamplingParams(
        n=s.n if s.HasField("n") else 1,
        max_tokens=s.max_tokens if s.HasField("max_tokens") else 16,
        temperature=s.temperature if s.HasField("temperature") else 1.0,
        top_p=s.top_p if s.HasField("top_p") else 1.0,
        top_k=s.top_k if s.HasField("top_k") else 0,
        min_p=s.min_p if s.HasField("min_p") else 0.0,
        seed=s.seed if s.HasField("seed") else None,
        stop=list(s.stop), stop_token_ids=list(s.stop_token_ids), ignore_eos=s.ignore_eos,
        logprobs=s.logprobs if s.HasField("logprobs") else None,
        include_stop_str_in_output=s.include_stop_str_in_output, skip_special_tokens=not s.skip_special_tokens_off,
        presence_penalty=s.presence_penalty if s.HasField("presence_penalty") else 0.0,
        frequency_penalty=s.frequency_penalty if s.HasField("frequency_penalty") else 0.0,
        repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else 1.0,
        logit_bias=dict(s.logit_bias) or None, min_tokens=s.min_tokens if s.HasField("min_tokens") else 0,
        bad_words=list(s.bad_words), bad_words_token_ids=[list(w.ids) for w in s.bad_words_token_ids],
        allowed_token_ids=list(s.allowed_token_ids) or None, guided=_guided(s),
        cache_salt=s.cache_salt if s.HasField("cache_salt") else None)


def _guided(s: pb.SamplingParameters) -> GuidedSpec | None:
    asked = [GuidedSpec("json_schema", s.guided_json, "guided_json")] if s.guided_json else []
    asked += [GuidedSpec("json_object", "", "guided_json_object")] if s.guided_json_object else []
    asked += [GuidedSpec("regex", s.guided_regex, "guided_regex")] if s.guided_regex else []
    asked += [GuidedSpec.choice(list(s.guided_choice))] if s.guided_choice else []
    asked += [GuidedSpec("grammar", s.guided_grammar, "guided_grammar")] if s.guided_grammar else []
    if len(asked) > 1:
        raise InvalidRequestError("only one structured-output constraint (guided_*) at a time")
    if asked and asked[0].kind == "json_schema":
        try:
            json.loads(s.guided_json)
        except ValueError:
            raise InvalidRequestError("guided_json is not valid JSON", param="guided_json") from None
    return asked[0] if asked else None


def pb_logprobs(entries) -> list:
    return [pb.TopLogprobs(entries=[pb.TokenLogprob(token_id=t, logprob=lp) for t, lp in d.items()])
            for d in entries or []]
