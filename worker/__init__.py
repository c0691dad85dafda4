"""The engine of one worker: block manager, scheduler, model runner, models, sampler."""

from folio.worker.config import EngineConfig
from folio.worker.engine import LLMEngine
from folio.worker.errors import ConfigError, FolioError, InvalidRequestError, ModelLoadError
from folio.worker.llm import LLM
from folio.worker.sampling_params import SamplingParams
from folio.worker.sequence import CompletionOutput, RequestOutput

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput",
           "FolioError", "InvalidRequestError", "ModelLoadError", "ConfigError"]
