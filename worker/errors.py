"""Typed errors of the engine. Failure is an exception the caller can map to a status code."""


class FolioError(Exception):
    """Base class of every error Folio raises on purpose."""


class InvalidRequestError(FolioError, ValueError):
    """The request itself is bad (HTTP 400 / gRPC INVALID_ARGUMENT). The engine is unchanged."""


class ModelLoadError(FolioError):
    """The checkpoint cannot be loaded: unknown architecture, missing or mismatched weights."""


class ConfigError(FolioError, ValueError):
    """The engine configuration is inconsistent."""
