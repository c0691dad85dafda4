"""The Ray Serve application in front of the router: one deployment, `FolioFrontend`,
whose replicas each run the OpenAI-compatible HTTP API (Serve's FastAPI ingress, served
by the replica itself on `http_port`: http_server.py, no Serve proxy hop) and a gRPC
server (on `grpc_port`); both bind with SO_REUSEPORT, so replicas on one node share them,
plus an optional Prometheus port. Serve's own proxy, where one runs, serves the same routes.

    app = build_app(FrontendConfig(...))
    serve.run(app, name="folio", route_prefix="/")

Serve's own per-replica queue is set far above Folio's admission limit, so an excess
request gets Folio's 429 / RESOURCE_EXHAUSTED at once rather than waiting in Serve.

Routes: /v1/completions, /v1/chat/completions, /v1/models, /v1/models/{id}, /tokenize,
/detokenize, /version (openai_http.py, openai_tokens.py), /health, /metrics (OpenMetrics when
the scraper's Accept asks for it), /docs, /openapi.json.

With an API key every route but /health needs it (/v1/*, /tokenize, /detokenize, /version,
/metrics, /docs, /openapi.json, and the separate metrics port). Bodies are read up to `max_body_bytes` (413 past it);
404, 405 and anything unexpected answer in OpenAI's error shape, never plain text.
"""


import asyncio
import json
import threading

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from folio.deploy import openai_http as oai
from folio.deploy import http_deadlines, openai_run, openai_tokens
from folio.deploy.frontend import Frontend, FrontendConfig
from folio.deploy.openai_errors import http_error
from folio.deploy.replica_drain import DRAIN_S, drain, serve_options
from folio.deploy.serve_binds import narrow_replica_grpc_bind

narrow_replica_grpc_bind()  # Serve's inter-deployment gRPC port: loopback when the node is (serve_binds.py)

# docs and schema are routes of the deployment below, behind the API key like every route but /health
api = FastAPI(title="Folio", description="OpenAI-compatible API of a Folio cluster", docs_url=None, redoc_url=None,
              openapi_url=None)


def _error_response(e: Exception) -> JSONResponse:
    err = http_error(e)
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


@api.exception_handler(StarletteHTTPException)
async def _http_exception(request: Request, e: StarletteHTTPException) -> JSONResponse:
    """404 (no such route) as OpenAI words it ("Invalid URL (GET /v1/x)"), 405 (wrong method, with
    Allow) likewise; any other in the same shape."""
    what = {404: "Invalid URL", 405: "Method not allowed"}.get(e.status_code, str(e.detail))
    return JSONResponse({"error": {"message": f"{what} ({request.method} {request.url.path})",
                                   "type": "invalid_request_error", "param": None, "code": None}},
                        status_code=e.status_code, headers=getattr(e, "headers", None))


@api.exception_handler(Exception)
async def _unexpected(request: Request, e: Exception) -> JSONResponse:
    """Whatever escaped a handler is still a JSON 500 in OpenAI's shape, never plain text."""
    return _error_response(e)


async def read_json(request: Request, limit: int):
    """The body as JSON: 413 past `limit` bytes (from Content-Length, and counted while a chunked
    body arrives), 400 for anything that is not a JSON object (nesting too deep included)."""
    length = request.headers.get("content-length")
    length = None if length is None else length.strip(" \t")  # HTTP allows white space around it
    if length is not None and (not length.isdigit() or int(length) > limit):
        raise oai.HTTPError(413, f"the body is larger than the limit of {limit} bytes", "invalid_request_error",
                            "body_too_large")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise oai.HTTPError(413, f"the body is larger than the limit of {limit} bytes",
                                    "invalid_request_error", "body_too_large")
            chunks.append(chunk)
    except ClientDisconnect:  # gone mid-body: not an error of the server's (nor counted as one)
        raise ClientGone() from None
    raw = b"".join(chunks)
    try:  # a large body parses off the event loop, like tokenization
        body = json.loads(raw) if size < 2**16 else await asyncio.to_thread(json.loads, raw)
    except RecursionError:
        raise oai.HTTPError(400, "the body is nested too deeply", "invalid_request_error") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer of too many digits
        raise oai.HTTPError(400, f"the body is not valid JSON: {e}", "invalid_request_error") from None
    if not isinstance(body, dict):
        raise oai.HTTPError(400, "the body must be a JSON object", "invalid_request_error")
    return body


async def until_client_gone(request: Request, work):
    """`work`'s result, unless the client disconnects first: then `work` is cancelled (its run
    aborts its requests on the worker) and ClientGone is raised. A non-streaming answer, and a
    stream's first event, come only after the prefill: nothing else would see the client leave
    (a 7,000-token prompt ran to its end behind a closed connection)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(request.receive())  # the body is read: the next message is the end
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task not in done and _says_disconnect(watch):
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise ClientGone()
        return await task
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()


def _says_disconnect(watch: asyncio.Future) -> bool:
    """Whether the client's next ASGI message says it left (a receive that failed, as Serve's
    proxy's can, or any other message says nothing: the work goes on)."""
    if watch.cancelled() or watch.exception() is not None:
        return False
    msg = watch.result()
    return isinstance(msg, dict) and msg.get("type") == "http.disconnect"


class ClientGone(oai.HTTPError):
    _folio_counted = True  # an abort (its run counted it), not an error

    def __init__(self) -> None:
        super().__init__(499, "the client closed the connection", "invalid_request_error", "client_closed_request")


# A replica whose process stops (SIGSTOP, a hang that holds the GIL) keeps its listening sockets:
# every HTTP and gRPC client of it waited. Serve's defaults (a check every 10 s, failed after 30 s,
# 3 failures in a row) left it so for over 60 s (2026-12-07): now a check every 2 s, failed after 5,
# and a replica that fails is killed at once (RAY_SERVE_FORCE_STOP_UNHEALTHY_REPLICAS: launcher.py),
# not stopped gracefully. A healthy replica that Serve stops drains first (replica_drain.py).
HEALTH = dict(health_check_period_s=2, health_check_timeout_s=5, **serve_options(DRAIN_S))


@serve.deployment(name="FolioFrontend", ray_actor_options={"num_cpus": 0.1}, max_ongoing_requests=100_000,
                  **HEALTH)
@serve.ingress(api)
class FolioFrontend:
    def __init__(self, cfg: FrontendConfig) -> None:
        from folio.cluster.liveness import CoordinatorWatch, SilentChannelWatch

        self.frontend = Frontend(cfg)
        # a stopped coordinator is restarted by one of the frontends (liveness.py); the router's Redis client
        self.coordinator_watch = CoordinatorWatch(self.frontend.router.state, cfg.namespace)
        self.watch_task = asyncio.get_running_loop().create_task(self.coordinator_watch.run())
        # a worker whose node stopped (no kill lands there): its streams here fail past a bound
        self.channel_watch = SilentChannelWatch(self.frontend.router.state, self.frontend.router.client)
        self.channel_watch_task = asyncio.get_running_loop().create_task(self.channel_watch.run())
        self.grpc = None
        if cfg.grpc_port:
            self.grpc_task = asyncio.get_running_loop().create_task(self._start_grpc(cfg.grpc_port))
        self.http = None
        if cfg.http_port:  # the API on this replica's own server: no Ray hop per chunk (http_server.py)
            from folio.deploy.http_server import HTTPServer

            self.http = HTTPServer(api, cfg.host, cfg.http_port, max_body_bytes=cfg.max_body_bytes).start(
                ready=lambda: serve.get_replica_context().servable_object is not None)
        self.metrics_stop = threading.Event()  # this replica's figures, for the others' scrapes
        threading.Thread(target=self.frontend.metrics.replicas.run, args=(self.metrics_stop,), daemon=True,
                         name="folio-replica-metrics").start()
        self.metrics_server = None
        if cfg.metrics_port:
            from folio.deploy.metrics_port import start_metrics_server

            self.metrics_server = start_metrics_server(self.frontend.metrics.registry, cfg.metrics_port, cfg.host,
                                                       cfg.api_key)

    async def __del__(self) -> None:
        """Serve stops this replica (a redeploy, fewer replicas): its requests finish first."""
        await drain(self, self.frontend.cfg.drain_s)

    async def _start_grpc(self, port: int) -> None:
        from folio.deploy.grpc_server import start_grpc_server

        self.grpc = await start_grpc_server(self.frontend, port, self.frontend.cfg.host)

    async def check_health(self) -> None:
        """Serve's replica health check: the gRPC server must be up when one was asked for."""
        if self.frontend.cfg.grpc_port and self.grpc_task.done() and self.grpc_task.exception():
            raise self.grpc_task.exception()
        if self.http is not None and self.http.failed is not None:
            raise self.http.failed

    def _auth(self, request: Request) -> None:
        oai.check_auth(self.frontend.cfg.api_key, request.headers.get("authorization"))

    async def _handle(self, request: Request, handler, generation: bool = True):
        try:
            self._auth(request)
            body = await read_json(request, self.frontend.cfg.max_body_bytes)
            with openai_run.aborts_listed_in(request.scope.setdefault(http_deadlines.CLIENT_LOST, [])):
                result = await until_client_gone(request, handler(self.frontend, body))
        except Exception as e:  # typed errors become their status; anything else a JSON 500
            if generation and (not isinstance(e, oai.HTTPError) or e.status != 401):
                self.frontend.count_error(e)
            return _error_response(e)
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(result, media_type="text/event-stream")

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._handle(request, oai.completions)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._handle(request, oai.chat_completions)

    @api.get("/v1/models")
    async def models(self, request: Request):
        try:
            self._auth(request)
        except oai.HTTPError as e:
            return _error_response(e)
        return JSONResponse(oai.models(self.frontend))

    @api.get("/v1/models/{model_id:path}")
    async def model(self, request: Request, model_id: str):
        try:
            self._auth(request)
            return JSONResponse(oai.model(self.frontend, model_id))
        except oai.HTTPError as e:
            return _error_response(e)

    @api.post("/tokenize")
    async def tokenize(self, request: Request):
        return await self._handle(request, openai_tokens.tokenize, generation=False)

    @api.post("/detokenize")
    async def detokenize(self, request: Request):
        return await self._handle(request, openai_tokens.detokenize, generation=False)

    @api.get("/version")
    async def version(self, request: Request):
        try:
            self._auth(request)
        except oai.HTTPError as e:
            return _error_response(e)
        return JSONResponse(openai_tokens.version())

    @api.get("/health")
    async def health(self):
        try:
            loads = await self.frontend.router.live_loads(refresh=True)
        except Exception as e:
            return JSONResponse({"status": "unavailable", "detail": str(e)}, status_code=503)
        if not loads:
            return JSONResponse({"status": "unavailable", "workers": 0}, status_code=503)
        if self.frontend.router.degraded:  # 200: it still serves (load-only routing, last known loads)
            return JSONResponse({"status": "degraded", "workers": len(loads),
                                 "detail": self.frontend.router.state_error})
        silent = self.coordinator_watch.silent_s()
        if silent:  # 200: it serves, but moves no request and restarts no frozen worker until it is back
            return JSONResponse({"status": "degraded", "workers": len(loads),
                                 "detail": f"the coordinator's heartbeat lapsed {silent:.0f} s ago"})
        return JSONResponse({"status": "ok", "workers": len(loads)})

    @api.get("/metrics")
    async def metrics(self, request: Request):
        try:
            self._auth(request)
        except oai.HTTPError as e:
            return _error_response(e)
        body, ctype = await asyncio.to_thread(self.frontend.metrics.render, request.headers.get("accept"))
        return Response(body, headers={"Content-Type": ctype})

    @api.get("/openapi.json", include_in_schema=False)
    async def openapi(self, request: Request):
        try:
            self._auth(request)
        except oai.HTTPError as e:
            return _error_response(e)
        return JSONResponse(api.openapi())

    @api.get("/docs", include_in_schema=False)
    async def docs(self, request: Request):
        try:
            self._auth(request)
        except oai.HTTPError as e:
            return _error_response(e)
        return get_swagger_ui_html(openapi_url="/openapi.json", title="Folio")


def build_app(cfg: FrontendConfig, replicas: int = 1):
    """`replicas` frontends share the HTTP, gRPC and metrics ports (SO_REUSEPORT) and their metrics."""
    return FolioFrontend.options(num_replicas=replicas, **serve_options(cfg.drain_s)).bind(cfg)
