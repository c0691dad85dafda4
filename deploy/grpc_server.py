"""The gRPC frontend: folio.v1.Generation (deploy/proto/folio/v1/generate.proto), the
standard grpc.health.v1.Health service, and server reflection: both grpc.reflection.v1 and
v1alpha (grpcio-reflection ships only v1alpha; v1 is the same protocol, messages and field
numbers, under another package name, so the same servicer answers it; see `_reflection`).

Status codes: INVALID_ARGUMENT (bad input), RESOURCE_EXHAUSTED (admission queue
full), UNAVAILABLE (no live worker), DEADLINE_EXCEEDED (the client's deadline: the
request is aborted when it passes), CANCELLED (aborted), UNAUTHENTICATED (API key
set and `authorization: Bearer <key>` missing from the metadata; the scheme is
case-insensitive). A client that
cancels or disconnects aborts its request: the handler's stream is closed, which
aborts it on the worker within one engine step.
"""

from __future__ import annotations

import json


import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from folio.deploy.auth import bearer_ok
from folio.deploy.frontend import Frontend
from folio.v1 import generate_pb2 as pb
from folio.v1 import generate_pb2_grpc as pb_grpc
from folio.worker.errors import FolioError, InvalidRequestError, OverloadedError, UnavailableError
from folio.worker.guided import GuidedSpec
from folio.worker.sampling_params import SamplingParams

SERVICE = pb.DESCRIPTOR.services_by_name["Generation"].full_name
OPEN_METHODS = ("/grpc.health.v1.Health/", "/grpc.reflection.")  # reachable without the API key
MAX_REQUEST_ID_CHARS = 256


def status_of(e: Exception) -> grpc.StatusCode:
    if isinstance(e, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(e, OverloadedError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(e, UnavailableError):
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
        allowed_token_ids=list(s.allowed_token_ids) or None, guided=_guided(s))


def _guided(s: pb.SamplingParameters) -> GuidedSpec | None:
    asked = [GuidedSpec("json_schema", s.guided_json)] if s.guided_json else []
    asked += [GuidedSpec("json_object")] if s.guided_json_object else []
    asked += [GuidedSpec("regex", s.guided_regex)] if s.guided_regex else []
    asked += [GuidedSpec.choice(list(s.guided_choice))] if s.guided_choice else []
    asked += [GuidedSpec("grammar", s.guided_grammar)] if s.guided_grammar else []
    if len(asked) > 1:
        raise InvalidRequestError("only one structured-output constraint (guided_*) at a time")
    if asked and asked[0].kind == "json_schema":
        try:
            json.loads(s.guided_json)
        except ValueError:
            raise InvalidRequestError("guided_json is not valid JSON", param="guided_json") from None
    return asked[0] if asked else None


def _logprobs(entries) -> list:
    return [pb.TopLogprobs(entries=[pb.TokenLogprob(token_id=t, logprob=lp) for t, lp in d.items()])
            for d in entries or []]


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend

    async def _prompt(self, request: pb.GenerateRequest) -> list[int]:
        which = request.WhichOneof("prompt")
        if which == "text":
            return await self.frontend.text_ids(request.text)
        if which == "token_ids":
            return self.frontend.token_ids(list(request.token_ids.ids))
        raise InvalidRequestError("the request has no prompt: set text or token_ids")

    async def _stream(self, request, context):
        """(chunk) of the request, with errors turned into the RPC's status: bad input is
        INVALID_ARGUMENT, and anything unexpected INTERNAL with its reason, never UNKNOWN."""
        try:
            if len(request.request_id) > MAX_REQUEST_ID_CHARS:
                raise InvalidRequestError(f"request_id is longer than {MAX_REQUEST_ID_CHARS} characters")
            params = sampling_params(request.sampling)
            ids = await self._prompt(request)
            limit = self.frontend.cfg.max_model_len
            if len(ids) < limit < len(ids) + params.max_tokens:  # refused as over HTTP, never clamped
                raise InvalidRequestError(f"This model's maximum context length is {limit} tokens. However, you "
                                          f"requested {len(ids) + params.max_tokens} tokens ({len(ids)} in the "
                                          f"prompt, {params.max_tokens} in the completion)", param="max_tokens")
            gen = self.frontend.generate(ids, params, request.priority, request.request_id or None)
            try:
                async for chunk in gen:
                    yield ids, chunk
            finally:
                await gen.aclose()
        except FolioError as e:
            self.frontend.count_error(e)
            await context.abort(status_of(e), str(e))
        except Exception as e:
            self.frontend.count_error(e)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error ({type(e).__name__}): {e}")

    async def Generate(self, request, context):
        texts, tokens, reasons, lps = {}, {}, {}, {}
        rid, n_prompt = request.request_id, 0
        async for ids, chunk in self._stream(request, context):
            rid, n_prompt = chunk.request_id, len(ids)
            for d in chunk.deltas:
                texts.setdefault(d.index, []).append(d.text)
                tokens.setdefault(d.index, []).extend(d.token_ids)
                lps.setdefault(d.index, []).extend(d.logprobs or [])
                if d.finish_reason:
                    reasons[d.index] = d.finish_reason
        if "abort" in reasons.values():
            await context.abort(grpc.StatusCode.CANCELLED, f"request {rid} was aborted")
        completions = [pb.Completion(index=i, text="".join(texts[i]), token_ids=tokens[i],
                                     finish_reason=reasons.get(i, ""), logprobs=_logprobs(lps[i]))
                       for i in sorted(texts)]
        out = sum(len(t) for t in tokens.values())
        return pb.GenerateResponse(request_id=rid, completions=completions,
                                   usage=pb.Usage(prompt_tokens=n_prompt, completion_tokens=out,
                                                  total_tokens=n_prompt + out))

    async def GenerateStream(self, request, context):
        out = 0
        async for ids, chunk in self._stream(request, context):
            out += sum(len(d.token_ids) for d in chunk.deltas)
            if any(d.finish_reason == "abort" for d in chunk.deltas):
                await context.abort(grpc.StatusCode.CANCELLED, f"request {chunk.request_id} was aborted")
            msg = pb.GenerateStreamResponse(
                request_id=chunk.request_id, finished=chunk.finished,
                deltas=[pb.Completion(index=d.index, text=d.text, token_ids=d.token_ids,
                                      finish_reason=d.finish_reason or "", logprobs=_logprobs(d.logprobs))
                        for d in chunk.deltas])
            if chunk.finished:
                msg.usage.CopyFrom(pb.Usage(prompt_tokens=len(ids), completion_tokens=out,
                                            total_tokens=len(ids) + out))
            yield msg

    async def Abort(self, request, context):
        return pb.AbortResponse(aborted=await self.frontend.abort(request.request_id))

    async def GetModelInfo(self, request, context):
        cfg = self.frontend.cfg
        return pb.ModelInfo(model=cfg.model_name, max_model_len=cfg.max_model_len, block_size=cfg.block_size,
                            vocab_size=self.frontend.vocab_size, num_workers=cfg.num_workers)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, api_key: str) -> None:
        self.api_key = api_key

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "a valid API key is required in the "
                                                                 "'authorization: Bearer <key>' metadata")
        self._deny = deny

    async def intercept_service(self, continuation, details):
        if details.method.startswith(OPEN_METHODS):
            return await continuation(details)
        if bearer_ok(self.api_key, dict(details.invocation_metadata or ()).get("authorization")):
            return await continuation(details)
        handler = await continuation(details)
        if handler is None:
            return None
        if handler.response_streaming:
            async def deny_stream(request, context):
                await self._deny(request, context)
                yield  # pragma: no cover
            return grpc.unary_stream_rpc_method_handler(deny_stream, handler.request_deserializer,
                                                        handler.response_serializer)
        return grpc.unary_unary_rpc_method_handler(self._deny, handler.request_deserializer,
                                                   handler.response_serializer)


class _Undecodable:
    """A request body protobuf could not parse: the handler answers INVALID_ARGUMENT (grpcio's
    own deserializer failing answers UNKNOWN, with no word on what was wrong)."""

    def __init__(self, why: str) -> None:
        self.why = why


def _lenient(parse):
    def deserialize(data: bytes):
        try:
            return parse(data)
        except Exception as e:  # DecodeError, invalid UTF-8 in a string field
            return _Undecodable(f"the request is not a valid protobuf message: {type(e).__name__}: {e}"[:300])
    return deserialize


def _guarded(fn, streaming: bool):
    if streaming:
        async def handler(request, context):
            if isinstance(request, _Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.why)
            async for item in fn(request, context):
                yield item
    else:
        async def handler(request, context):
            if isinstance(request, _Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.why)
            return await fn(request, context)
    return handler


def add_generation_servicer(servicer: GenerationServicer, server) -> None:
    """pb_grpc.add_GenerationServicer_to_server, but a body that does not parse is
    INVALID_ARGUMENT with its reason."""
    methods = {  # name: (streaming, request type, response type)
        "Generate": (False, pb.GenerateRequest, pb.GenerateResponse),
        "GenerateStream": (True, pb.GenerateRequest, pb.GenerateStreamResponse),
        "Abort": (False, pb.AbortRequest, pb.AbortResponse),
        "GetModelInfo": (False, pb.GetModelInfoRequest, pb.ModelInfo),
    }
    handlers = {}
    for name, (streaming, req, resp) in methods.items():
        make = grpc.unary_stream_rpc_method_handler if streaming else grpc.unary_unary_rpc_method_handler
        handlers[name] = make(_guarded(getattr(servicer, name), streaming),
                              request_deserializer=_lenient(req.FromString),
                              response_serializer=resp.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))


REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"
_REFLECTION_V1_FILE = "grpc/reflection/v1/reflection.proto"


def _reflection_v1_descriptor() -> None:
    """v1's file descriptor (v1alpha's, renamed) in the default pool, so reflection can describe
    the v1 service too. Idempotent; a pool that has it already (a newer grpcio-reflection) is kept."""
    from google.protobuf import descriptor_pb2, descriptor_pool
    from grpc_reflection.v1alpha import reflection_pb2

    pool = descriptor_pool.Default()
    try:
        pool.FindFileByName(_REFLECTION_V1_FILE)
        return
    except KeyError:
        pass
    fdp = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(fdp)
    old, new = "." + fdp.package + ".", ".grpc.reflection.v1."
    fdp.name, fdp.package = _REFLECTION_V1_FILE, "grpc.reflection.v1"
    fdp.ClearField("options")
    messages = list(fdp.message_type)
    while messages:
        m = messages.pop()
        messages.extend(m.nested_type)
        for f in m.field:
            if f.HasField("type_name"):  # (assigning "" would mark a scalar field as typed)
                f.type_name = f.type_name.replace(old, new)
    for svc in fdp.service:
        for meth in svc.method:
            meth.input_type, meth.output_type = meth.input_type.replace(old, new), meth.output_type.replace(old, new)
    pool.AddSerializedFile(fdp.SerializeToString())


def _reflection(server: grpc.aio.Server) -> None:
    """Server reflection as grpc.reflection.v1alpha (grpcio-reflection's) and grpc.reflection.v1
    (the same servicer behind v1's method name: the wire format is identical)."""
    from grpc_reflection.v1alpha import reflection_pb2

    names = (SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, REFLECTION_V1,
             reflection.SERVICE_NAME)
    _reflection_v1_descriptor()
    reflection.enable_server_reflection(names, server)
    servicer = reflection.aio.ReflectionServicer(names)
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo, request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(REFLECTION_V1,
                                                                          {"ServerReflectionInfo": handler}),))


async def start_grpc_server(frontend: Frontend, port: int, host: str = "0.0.0.0") -> grpc.aio.Server:
    """Serves on host:port only (`folio serve --host`), never on every interface unless told."""
    interceptors = [ApiKeyInterceptor(frontend.cfg.api_key)] if frontend.cfg.api_key else []
    server = grpc.aio.server(interceptors=interceptors)
    add_generation_servicer(GenerationServicer(frontend), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    _reflection(server)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"  # an IPv6 literal needs brackets
    if server.add_insecure_port(address) == 0:
        raise RuntimeError(f"cannot bind the gRPC port {port}")
    await server.start()
    for name in ("", SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server



