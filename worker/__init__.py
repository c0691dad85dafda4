"""The engine of one worker: block manager, scheduler, model runner, models, sampler.

The names below are loaded on first use (PEP 562), so that importing a pure module of the
package (`folio.worker.block_manager`, `folio.worker.scheduler`, the wire types) does not
load torch and the kernels with the engine.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "EngineConfig": "folio.worker.config",
    "LLMEngine": "folio.worker.engine",
    "ConfigError": "folio.worker.errors",
    "FolioError": "folio.worker.errors",
    "InvalidRequestError": "folio.worker.errors",
    "ModelLoadError": "folio.worker.errors",
    "LLM": "folio.worker.llm",
    "SamplingParams": "folio.worker.sampling_params",
    "CompletionOutput": "folio.worker.sequence",
    "RequestOutput": "folio.worker.sequence",
}
__all__ = list(_EXPORTS)

if TYPE_CHECKING:
    from folio.worker.config import EngineConfig
    from folio.worker.engine import LLMEngine
    from folio.worker.errors import ConfigError, FolioError, InvalidRequestError, ModelLoadError
    from folio.worker.llm import LLM
    from folio.worker.sampling_params import SamplingParams
    from folio.worker.sequence import CompletionOutput, RequestOutput


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next lookup is a plain global
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
