"""OpenAI's error shape and Folio's typed errors as HTTP statuses.

    HTTPError(status, message, type, code, param, headers).body()
        == {"error": {"message", "type", "param", "code"}}
    http_error(e): InvalidRequestError 400 (its param) · OverloadedError 429 with Retry-After
        · UnavailableError and ShuttingDownError 503 · any other FolioError 500 · anything else
        500 naming only its type

The handlers (openai_http.py) raise HTTPError for what only HTTP refuses (401, 404, 413, a context
length past max_model_len); the app (serve_deployment.py) answers every error with `http_error(e)`, and a
stream that has started reports it as its last event (openai_sse.py).
"""

from __future__ import annotations

from folio.worker.errors import FolioError, InvalidRequestError, OverloadedError, ShuttingDownError, UnavailableError

RETRY_AFTER_S = 1


class HTTPError(Exception):
    def __init__(self, status: int, message: str, type_: str, code: str | None = None, param: str | None = None,
                 headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def http_error(e: Exception) -> HTTPError:
    """Folio's typed errors as their status; anything else is a 500, still in OpenAI's shape."""
    if isinstance(e, HTTPError):
        return e
    if isinstance(e, InvalidRequestError):
        return HTTPError(400, str(e), "invalid_request_error", param=getattr(e, "param", None))
    if isinstance(e, OverloadedError):
        return HTTPError(429, str(e), "rate_limit_error", "too_many_requests",
                         headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(e, UnavailableError):
        return HTTPError(503, str(e), "service_unavailable", "unavailable")
    if isinstance(e, ShuttingDownError):  # the code of the server's own 503 when it stops (http_deadlines.py)
        return HTTPError(503, str(e), "service_unavailable", "server_shutting_down")
    if isinstance(e, FolioError):
        return HTTPError(500, str(e), "internal_error")
    return HTTPError(500, f"internal error ({type(e).__name__})", "internal_error")
