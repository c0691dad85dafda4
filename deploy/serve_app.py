"""The Ray Serve application in front of the router: one deployment, `FolioFrontend`,
whose replicas each run the OpenAI-compatible HTTP API (Serve's FastAPI ingress, on
Serve's HTTP port) and a gRPC server (on `grpc_port`; gRPC binds with SO_REUSEPORT, so
replicas on one node share it), plus an optional Prometheus port.

    app = build_app(FrontendConfig(...))
    serve.run(app, name="folio", route_prefix="/")

Serve's own per-replica queue is set far above Folio's admission limit, so an excess
request gets Folio's 429 / RESOURCE_EXHAUSTED at once rather than waiting in Serve.
"""


import asyncio

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from ray import serve

from folio.deploy import openai_http as oai
from folio.deploy.frontend import Frontend, FrontendConfig

api = FastAPI(title="Folio", description="OpenAI-compatible API of a Folio cluster")


def _error_response(e: Exception) -> JSONResponse:
    err = oai.http_error(e)
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


@serve.deployment(name="FolioFrontend", ray_actor_options={"num_cpus": 0.1}, max_ongoing_requests=100_000)
@serve.ingress(api)
class FolioFrontend:
    def __init__(self, cfg: FrontendConfig) -> None:
        self.frontend = Frontend(cfg)
        self.grpc = None
        if cfg.grpc_port:
            from folio.deploy.grpc_server import start_grpc_server

            self._grpc_task = asyncio.get_running_loop().create_task(self._start_grpc(cfg.grpc_port))
        if cfg.metrics_port:
            from prometheus_client import start_http_server

            start_http_server(cfg.metrics_port, registry=self.frontend.metrics.registry)

    async def _start_grpc(self, port: int) -> None:
        from folio.deploy.grpc_server import start_grpc_server

        self.grpc = await start_grpc_server(self.frontend, port)

    async def check_health(self) -> None:
        """Serve's replica health check: the gRPC server must be up when one was asked for."""
        if self.frontend.cfg.grpc_port and self._grpc_task.done() and self._grpc_task.exception():
            raise self._grpc_task.exception()

    async def _handle(self, request: Request, handler):
        try:
            oai.check_auth(self.frontend.cfg.api_key, request.headers.get("authorization"))
            try:
                body = await request.json()
            except ValueError:
                raise oai.HTTPError(400, "the body is not valid JSON", "invalid_request_error") from None
            if not isinstance(body, dict):
                raise oai.HTTPError(400, "the body must be a JSON object", "invalid_request_error")
            result = await handler(self.frontend, body)
        except Exception as e:  # typed errors become their status; anything else is a 500 from FastAPI
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
            oai.check_auth(self.frontend.cfg.api_key, request.headers.get("authorization"))
        except oai.HTTPError as e:
            return _error_response(e)
        return JSONResponse(oai.models(self.frontend))

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
        return JSONResponse({"status": "ok", "workers": len(loads)})

    @api.get("/metrics")
    async def metrics(self):
        body = await asyncio.to_thread(self.frontend.metrics.render)
        return PlainTextResponse(body, media_type="text/plain; version=0.0.4")


def build_app(cfg: FrontendConfig):
    return FolioFrontend.bind(cfg)
