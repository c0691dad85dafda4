"""What both frontends (OpenAI HTTP, gRPC) share: tokenization, admission control,
the router, and per-request metrics.

    frontend.prompt_ids(text | ids)          -> token ids (InvalidRequestError if empty)
    frontend.chat_ids(messages)              -> token ids through the chat template
    async for chunk in frontend.generate(ids, params, priority, request_id): ...

Admission: at most `max_num_requests` requests in flight through this frontend; one
more raises OverloadedError at once (429 / RESOURCE_EXHAUSTED), never a queue that
hangs. Errors are Folio's typed ones; each frontend maps them to its status codes.
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator

from folio.cluster.router import Router
from folio.cluster.state import ClusterState
from folio.cluster.worker_client import RayWorkerClient
from folio.deploy.metrics import Metrics
from folio.worker.errors import InvalidRequestError, OverloadedError
from folio.worker.messages import GenerateRequest, StreamChunk
from folio.worker.sampling_params import SamplingParams


@dataclass
class FrontendConfig:
    model: str  # checkpoint directory (the tokenizer and chat template come from it)
    redis_url: str
    namespace: str = "folio"
    router: str = "prefix-aware"
    max_model_len: int = 2048
    block_size: int = 16
    num_workers: int = 1
    max_num_requests: int = 256  # in flight through one frontend replica; more get 429
    api_key: str | None = None
    served_model_name: str | None = None  # what /v1/models lists (default: the directory's name)
    grpc_port: int | None = 50051
    metrics_port: int | None = None

    @property
    def model_name(self) -> str:
        return self.served_model_name or os.path.basename(os.path.normpath(self.model))


def plain_chat_prompt(messages: list[dict]) -> str:
    """For tokenizers without a chat template: one `role: content` line per message."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


class Frontend:
    def __init__(self, cfg: FrontendConfig, router: Router | None = None) -> None:
        from transformers import AutoTokenizer

        self.cfg = cfg
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model)
        self.vocab_size = len(self.tokenizer)
        state = ClusterState(cfg.redis_url, cfg.namespace)
        self.router = router or Router(state, RayWorkerClient(cfg.namespace, cfg.namespace), cfg.router)
        self.metrics = Metrics(ClusterState(cfg.redis_url, cfg.namespace))
        self.in_flight = 0

    # ---- prompts -----------------------------------------------------------------------
    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("the prompt is empty")
            ids = self.tokenizer(prompt).input_ids
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
        else:
            raise InvalidRequestError("a prompt is a string or a list of token ids")
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        return ids

    def chat_ids(self, messages: list[dict]) -> list[int]:
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError("messages must be a non-empty list")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise InvalidRequestError("each message needs a string 'role' and a string 'content'")
        if getattr(self.tokenizer, "chat_template", None):
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
                ids = ids["input_ids"]
            return list(ids)
        return self.prompt_ids(plain_chat_prompt(messages))

    # ---- serving -----------------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], params: SamplingParams, priority: int = 0,
                       request_id: str | None = None) -> AsyncIterator[StreamChunk]:
        """Admit (or raise OverloadedError), route, stream; records the request's metrics.
        Closing the iterator early aborts the request on its worker."""
        if len(prompt_ids) >= self.cfg.max_model_len:
            raise InvalidRequestError(f"the prompt has {len(prompt_ids)} tokens; max_model_len is "
                                      f"{self.cfg.max_model_len}, which leaves no room for a generated token")
        if self.in_flight >= self.cfg.max_num_requests:
            raise OverloadedError(f"{self.in_flight} requests in flight: the admission queue is full")
        self.in_flight += 1
        m = self.metrics
        rid = request_id or f"req-{uuid.uuid4().hex}"
        t0 = time.perf_counter()
        last = None
        reason = None
        stream = self.router.generate(GenerateRequest(rid, prompt_ids, params, priority))
        try:
            async for chunk in stream:
                if any(d.token_ids for d in chunk.deltas):
                    now = time.perf_counter()
                    if last is None:
                        m.ttft.observe(now - t0)
                    else:
                        m.itl.observe(now - last)
                    last = now
                if chunk.queue_s is not None:
                    m.queue.observe(chunk.queue_s)
                if chunk.finished:
                    reason = next((d.finish_reason for d in chunk.deltas if d.finish_reason), "stop")
                yield chunk
        finally:
            # closed here, not left to the garbage collector: closing it is what aborts the
            # request on its worker when the client went away (a CI run saw it run to the end)
            await stream.aclose()
            self.in_flight -= 1
            m.requests.labels(finish_reason=reason or "abort").inc()
            m.e2e.observe(time.perf_counter() - t0)

    async def abort(self, request_id: str) -> bool:
        return await self.router.abort(request_id)
