"""Typed errors of the engine. Failure is an exception the caller can map to a status code."""


class FolioError(Exception):
    """Base class of every error Folio raises on purpose."""


class InvalidRequestError(FolioError, ValueError):
    """The request itself is bad (HTTP 400 / gRPC INVALID_ARGUMENT). The engine is unchanged.
    `param`: the request field at fault, when known (OpenAI's error shape names it)."""

    def __init__(self, message: str = "", param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ModelLoadError(FolioError):
    """The checkpoint cannot be loaded: unknown architecture, missing or mismatched weights."""


class ConfigError(FolioError, ValueError):
    """The engine configuration is inconsistent."""


class UnavailableError(FolioError):
    """No worker can take the request: none alive, or the one serving it died or is draining
    (HTTP 503 / gRPC UNAVAILABLE)."""


class WorkerFailedError(UnavailableError):
    """The worker running a request died or its engine failed after tokens were streamed:
    the request cannot be resumed elsewhere without repeating or losing tokens."""


class ShuttingDownError(FolioError):
    """The frontend replica serving the request stopped and its grace period is over (HTTP 503
    / gRPC UNAVAILABLE): the request was aborted on its worker; the client may send it again
    (another replica takes it). Not an UnavailableError: the router must not run it elsewhere
    through the replica that is going away."""


class OverloadedError(FolioError):
    """The admission queue is full (HTTP 429 with Retry-After / gRPC RESOURCE_EXHAUSTED):
    the request was not queued; retry later."""


class RequestFailedError(FolioError):
    """The engine failed this one request: a step raised and the fault was traced to it
    (it failed when run alone while the engine stayed healthy). The request's blocks are
    freed and the worker goes on serving the others (HTTP 500 / gRPC INTERNAL)."""


class EngineFailedError(FolioError):
    """A step raised and the fault could not be blamed on any request (the engine itself,
    or its device, is broken): the worker fails all its requests and is restarted."""
