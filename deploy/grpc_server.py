"""The gRPC frontend: folio.v1.Generation (deploy/proto/folio/v1/generate.proto; the servicer is
grpc_servicer.py's), the standard grpc.health.v1.Health service, and server reflection: both
grpc.reflection.v1 and v1alpha (grpc_reflection_v1.py).

Status codes: INVALID_ARGUMENT (bad input, or a body that is no valid protobuf message),
RESOURCE_EXHAUSTED (admission queue full), UNAVAILABLE (no live worker), DEADLINE_EXCEEDED (the
client's deadline: the request is aborted when it passes), CANCELLED (aborted), UNAUTHENTICATED
(API key set and `authorization: Bearer <key>` missing from the metadata; the scheme is
case-insensitive; health and reflection are open). A client that cancels or disconnects aborts
its request: the handler's stream is closed, which aborts it on the worker within one engine step.

A client that stops reading a stream: once HTTP/2 flow control is full (the client's window:
grpcio's grows to a few MiB, a client can keep it small), each message waits for the client to take bytes, and the call held its handler,
its admission slot and its buffered text for good (a request that had ended too). As over HTTP
(http_deadlines.py's SEND_TIMEOUT_S, nginx's send_timeout): a message that waits SEND_TIMEOUT_S for
the client ends the call with DEADLINE_EXCEEDED, and the request is aborted. A slow reader that
keeps taking messages is never cut.
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from folio.deploy.auth import bearer_ok
from folio.deploy.frontend import Frontend
from folio.deploy.grpc_reflection_v1 import enable_reflection
from folio.deploy.grpc_servicer import GenerationServicer
from folio.v1 import generate_pb2 as pb
from folio.worker.errors import InvalidRequestError

SEND_TIMEOUT_S = 60.0
SERVICE = pb.DESCRIPTOR.services_by_name["Generation"].full_name
OPEN_METHODS = ("/grpc.health.v1.Health/", "/grpc.reflection.")  # reachable without the API key


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


class _SendWatch:
    """Cancels the handler's task once one message has waited `limit_s` to be sent (one timer
    a call, re-armed, rather than a timeout task a message)."""

    def __init__(self, limit_s: float) -> None:
        self.loop, self.task, self.limit_s = asyncio.get_running_loop(), asyncio.current_task(), limit_s
        self.since: float | None = None  # when the message now being sent began to wait
        self.expired = False
        self.timer = self.loop.call_later(limit_s, self._check)

    def _check(self) -> None:
        now = self.loop.time()
        if self.since is not None and now - self.since >= self.limit_s:
            self.expired = True
            self.task.cancel()
        else:
            self.timer = self.loop.call_later(self.limit_s if self.since is None else self.since + self.limit_s - now,
                                              self._check)


def _guarded(fn, streaming: bool, send_timeout_s: float = SEND_TIMEOUT_S, count=None):
    """`count`: called with the error of a body that does not parse (a generation's: counted
    as finish_reason="error", as every other bad request, and as over HTTP)."""
    async def undecodable(request, context):
        if count is not None:
            count(InvalidRequestError(request.why))
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.why)

    if streaming:
        async def handler(request, context):  # writes its messages (not a generator): they are timed
            if isinstance(request, _Undecodable):
                await undecodable(request, context)
            watch = _SendWatch(send_timeout_s)
            try:
                clock = watch.loop.time
                async with contextlib.aclosing(fn(request, context)) as items:  # closed: the request aborted
                    async for item in items:
                        watch.since = clock()  # (inline: a coroutine a message cost ~3 % of its CPU)
                        await context.write(item)
                        watch.since = None
            except asyncio.CancelledError:
                if not watch.expired:
                    raise
                asyncio.current_task().uncancel()
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"the client took none of the stream's "
                                                                       f"messages for {send_timeout_s:g} s")
            finally:
                watch.timer.cancel()
    else:
        async def handler(request, context):
            if isinstance(request, _Undecodable):
                await undecodable(request, context)
            return await fn(request, context)
    return handler


def add_generation_servicer(servicer: GenerationServicer, server, send_timeout_s: float = SEND_TIMEOUT_S,
                            count_error=None) -> None:
    """pb_grpc.add_GenerationServicer_to_server, but a body that does not parse is
    INVALID_ARGUMENT with its reason (a generation's passed to `count_error`), and a stream's
    messages are timed (SEND_TIMEOUT_S)."""
    methods = {  # name: (streaming, request type, response type)
        "Generate": (False, pb.GenerateRequest, pb.GenerateResponse),
        "GenerateStream": (True, pb.GenerateRequest, pb.GenerateStreamResponse),
        "Abort": (False, pb.AbortRequest, pb.AbortResponse),
        "GetModelInfo": (False, pb.GetModelInfoRequest, pb.ModelInfo),
    }
    handlers = {}
    for name, (streaming, req, resp) in methods.items():
        make = grpc.unary_stream_rpc_method_handler if streaming else grpc.unary_unary_rpc_method_handler
        count = count_error if name.startswith("Generate") else None
        handlers[name] = make(_guarded(getattr(servicer, name), streaming, send_timeout_s, count),
                              request_deserializer=_lenient(req.FromString),
                              response_serializer=resp.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))


async def start_grpc_server(frontend: Frontend, port: int, host: str = "0.0.0.0") -> grpc.aio.Server:
    """Serves on host:port only (`folio serve --host`), never on every interface unless told."""
    interceptors = [ApiKeyInterceptor(frontend.cfg.api_key)] if frontend.cfg.api_key else []
    server = grpc.aio.server(interceptors=interceptors)
    add_generation_servicer(GenerationServicer(frontend), server, count_error=frontend.count_error)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    enable_reflection(server, (SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name))
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"  # an IPv6 literal needs brackets
    if server.add_insecure_port(address) == 0:
        raise RuntimeError(f"cannot bind the gRPC port {port}")
    await server.start()
    for name in ("", SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server
