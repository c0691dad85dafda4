"""The offline API, as users know it from vLLM: LLM(model=DIR, ...).generate(prompts, params)."""

from __future__ import annotations

import uuid

from folio.worker.config import EngineConfig
from folio.worker.engine import LLMEngine
from folio.worker.sampling_params import SamplingParams
from folio.worker.sequence import RequestOutput


class LLM:
    def __init__(self, model: str, **kwargs) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 priority: list[int] | None = None) -> list[RequestOutput]:
        """prompts: a string, a list of strings, or a list of token-id lists. Outputs in prompt order.

        If any prompt is bad, nothing is run and the engine is left as it was.
        """
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("sampling_params must be one SamplingParams or one per prompt")
        prio = priority or [0] * len(prompts)
        tag = uuid.uuid4().hex[:8]
        ids: list[str] = []
        try:
            for i, (p, sp, pr) in enumerate(zip(prompts, params_list, prio)):
                ids.append(self.engine.add_request(f"{tag}-{i}", p, sp, priority=pr))
        except Exception:
            for rid in ids:
                self.engine.abort(rid)
            raise
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids):
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[rid] for rid in ids]
