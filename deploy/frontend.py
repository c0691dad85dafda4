"""What both frontends (OpenAI HTTP, gRPC) share: tokenization, validation, admission
control, the router, and per-request metrics.

    ids = await frontend.text_ids(text) | frontend.token_ids(ids) | await frontend.chat_ids(messages)
    await frontend.check(prompts, params, priority)   # every bound, before anything is admitted
    admission = frontend.admit(len(prompts))    # all of a request's prompts, or OverloadedError
    async for chunk in frontend.generate(ids, params, priority, request_id, admission): ...
    admission.release()                          # whatever its streams did not release

Admission: at most `max_num_requests` prompts in flight through this frontend; a request
whose prompts do not all fit raises OverloadedError at once (429 / RESOURCE_EXHAUSTED),
never a queue that hangs and never half of a request admitted. Errors are Folio's typed
ones; each frontend maps them to its status codes.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import os
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator

from folio.cluster.router import Router
from folio.cluster.state import ClusterState
from folio.cluster.worker_client import RayWorkerClient
from folio.deploy.grammar_check import GrammarChecks
from folio.deploy.metrics import Metrics
from folio.deploy.stream_text import StreamInterval, StreamText, worker_params
from folio.deploy.prompts import Prompts, plain_chat_prompt  # noqa: F401  (plain_chat_prompt: re-exported)
from folio.worker.errors import InvalidRequestError, OverloadedError
from folio.worker.messages import GenerateRequest, StreamChunk
from folio.worker.sampling_params import SamplingParams, check_priority, check_vocab, resolve_bad_words

MAX_BODY_BYTES = 8 * 2**20


@dataclass
class FrontendConfig:
    model: str  # checkpoint directory or GGUF file (the tokenizer and chat template come from it)
    redis_url: str
    tokenizer: str | None = None  # the tokenizer's directory when not the model's own (`folio serve --tokenizer`)
    namespace: str = "folio"
    router: str = "prefix-aware"
    max_model_len: int = 2048
    block_size: int = 16
    num_workers: int = 1
    max_num_requests: int = 256  # prompts in flight through one frontend replica; more get 429
    max_num_seqs: int = 256  # the workers' limit: n (and best_of) above it get 400
    api_key: str | None = None
    served_model_name: str | list[str] | None = None  # what /v1/models lists (aliases; default: the directory's name)
    grpc_port: int | None = 50051
    http_port: int | None = None  # each replica serves the HTTP API on it itself (http_server.py), no Serve proxy
    metrics_port: int | None = None
    host: str = "0.0.0.0"  # what the gRPC and metrics ports bind (`folio serve --host`)
    max_body_bytes: int = MAX_BODY_BYTES  # an HTTP body above it gets 413
    stream_interval: int = 1  # tokens per streamed chunk (vLLM's --stream-interval; a request may ask more)
    drain_s: float = 30.0  # a replica that Serve stops lets its requests finish this long (replica_drain.py)

    @property
    def model_name(self) -> str:
        names = self.served_model_name  # several: aliases, the first is the model's name
        names = names if isinstance(names, str) or not names else names[0]
        return names or os.path.basename(os.path.normpath(self.model))


def default_max_tokens(max_model_len: int, block_size: int, kv_blocks: list[int], n_prompt: int,
                       n: int = 1) -> int:
    """max_tokens when a request gives none: the room left after the prompt, in the model's
    length and in the smallest KV cache, for all n completions at once (they share the
    prompt's full blocks; each needs its own for the rest: the engine's fit check); at least
    1 (a prompt that leaves none is refused by `check`)."""
    room = max_model_len - n_prompt
    shared = n_prompt // block_size
    for b in kv_blocks:
        if b > 0:
            room = min(room, ((b - shared) // n + shared) * block_size - n_prompt)
    return max(room, 1)


def fit_context(max_model_len: int, prompts: list[list[int]], params: SamplingParams,
                param: str = "max_tokens") -> SamplingParams:
    """vLLM 0.32's answer to a prompt plus max_tokens past max_model_len: max_tokens (and
    min_tokens) cut to what fits after the shortest prompt, so each completion ends with
    finish_reason "length" where its context is full (the engine stops every sequence at
    max_model_len, so a longer prompt of the same request gets less); a max_tokens above
    max_model_len itself is a 400, as there. A prompt that fits no token is `check`'s refusal."""
    if params.max_tokens > max_model_len:
        raise InvalidRequestError(f"{param}={params.max_tokens} cannot be greater than max_model_len="
                                  f"{max_model_len}. Please request fewer output tokens.", param=param)
    room = max(1, max_model_len - min(len(p) for p in prompts))
    if params.max_tokens <= room:
        return params
    return dataclasses.replace(params, max_tokens=room, min_tokens=min(params.min_tokens, room))


class Admission:
    """`count` slots of the frontend's admission limit, released one per finished stream
    (`done_one`) and all the rest by `release` (idempotent)."""

    def __init__(self, frontend: "Frontend", count: int) -> None:
        self.frontend, self.count = frontend, count

    def done_one(self) -> None:
        if self.count > 0:
            self.count -= 1
            self.frontend.in_flight -= 1

    def release(self) -> None:
        self.frontend.in_flight -= self.count
        self.count = 0


class Frontend:
    def __init__(self, cfg: FrontendConfig, router: Router | None = None) -> None:
        from folio.worker.models.model_config import ModelConfig

        self.cfg = cfg
        self.vocab_size = ModelConfig.from_dir(cfg.model).vocab_size  # what the model embeds
        self.prompts = Prompts(cfg.tokenizer or cfg.model, cfg.max_model_len, self.vocab_size)
        self.tokenizer = self.prompts.tokenizer
        state = ClusterState(cfg.redis_url, cfg.namespace)
        self.router = router or Router(state, RayWorkerClient(cfg.namespace, cfg.namespace), cfg.router)
        self.metrics = Metrics(ClusterState(cfg.redis_url, cfg.namespace), cfg.model_name)
        self.in_flight = 0
        self.cut_with: BaseException | None = None  # set by `cut`: requests admitted after it fail with it
        self.grammars = GrammarChecks(self.tokenizer, self.vocab_size)  # structured output's, before admission

    # ---- prompts and checks ------------------------------------------------------------
    async def text_ids(self, text: str) -> list[int]:
        return await self.prompts.text_ids(text)

    def token_ids(self, ids: list[int]) -> list[int]:
        return self.prompts.token_ids(ids)

    async def chat_ids(self, messages: list[dict]) -> list[int]:
        return await self.prompts.chat_ids(messages)

    async def check(self, prompts: list[list[int]], params: SamplingParams, priority: int,
                    prompt_param: str = "prompt") -> None:
        """Every bound the workers would enforce, checked before admission, so a request is
        refused whole (nothing of it runs) and no value the engine cannot take reaches it. A
        grammar compiles on a thread of its own (xgrammar lets go of the GIL): a schema that took
        seconds to compile held this event loop, every stream and /health of the replica, as long
        (grammar_check.py: compiles of distinct specs run side by side, a cached one waits for none)."""
        check_priority(priority)
        for ids in prompts:
            if len(ids) >= self.cfg.max_model_len:
                raise InvalidRequestError(f"the prompt has {len(ids)} tokens; max_model_len is "
                                          f"{self.cfg.max_model_len}, which leaves no room for a generated token",
                                          param=prompt_param)  # (chat's: "messages")
        if params.n > self.cfg.max_num_seqs:
            raise InvalidRequestError(f"n={params.n} completions exceed max_num_seqs={self.cfg.max_num_seqs}",
                                      param="n")
        if params.logprobs is not None and params.logprobs > self.vocab_size:
            raise InvalidRequestError(f"logprobs={params.logprobs} exceeds the vocabulary ({self.vocab_size})",
                                      param="logprobs")
        resolve_bad_words(params, self.tokenizer)  # bad_words -> token ids here, so workers need no tokenizer
        check_vocab(params, self.vocab_size)
        if params.guided is not None:  # a schema the workers could not compile: refused before admission
            await self.grammars.check(params.guided, params)
        if len(prompts) > self.cfg.max_num_requests:
            raise InvalidRequestError(f"{len(prompts)} prompts in one request exceed the frontend's limit of "
                                      f"{self.cfg.max_num_requests} in flight", param="prompt")

    async def default_max_tokens(self, n_prompt: int, n: int = 1) -> int:
        """A chat request without max_tokens gets what fits: up to max_model_len, and no more
        than one sequence can hold in the smallest live worker's KV cache."""
        try:
            kv = [l.num_kv_blocks for l in (await self.router.live_loads()).values()]
        except Exception:  # no figures (Redis away): the model's limit alone
            kv = []
        return default_max_tokens(self.cfg.max_model_len, self.cfg.block_size, kv, n_prompt, n)

    def admit(self, count: int = 1) -> Admission:
        if self.cut_with is not None:  # a drain's end (cut): this replica takes no more
            raise copy.copy(self.cut_with)
        if self.in_flight + count > self.cfg.max_num_requests:
            raise OverloadedError(f"{self.in_flight} requests in flight: the admission queue is full")
        self.in_flight += count
        return Admission(self, count)

    def count_error(self, e: BaseException) -> None:
        """A request that ended in an error (a bad one included) counts as finish_reason="error",
        once, never as an abort."""
        if not getattr(e, "_folio_counted", False):
            self.metrics.requests.labels(finish_reason="error").inc()

    # ---- serving -----------------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], params: SamplingParams, priority: int = 0,
                       request_id: str | None = None, admission: Admission | None = None,
                       stream_interval: int | None = None) -> AsyncIterator[StreamChunk]:
        """Route and stream one prompt (checked and admitted first unless `admission` is given);
        records the request's metrics. Chunks are merged up to the server's stream interval, or
        the request's where it asks for more (stream_text.StreamInterval). Closing the iterator
        early aborts the request on its worker."""
        if admission is None:
            await self.check([prompt_ids], params, priority)
            admission = self.admit(1)
        m = self.metrics
        rid = request_id or f"req-{uuid.uuid4().hex}"
        t0 = time.perf_counter()
        last = None
        reason = None
        text = StreamText(self.tokenizer, prompt_ids, params)  # the worker sends token ids; text is made here
        interval = StreamInterval(max(self.cfg.stream_interval, stream_interval or 1))
        stream = self.router.generate(GenerateRequest(request_id=rid, prompt_token_ids=prompt_ids,
                                                      params=worker_params(params), priority=priority))
        try:
            async for chunk in stream:
                on_worker = chunk.finished
                chunk = text.apply(chunk)
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
                chunk = interval.add(chunk)
                if chunk is None:  # held back: merged into the next one sent
                    continue
                yield chunk
                if chunk.finished and not on_worker:  # ended here (a stop string): closing aborts it there
                    break
        except (GeneratorExit, asyncio.CancelledError):
            raise
        except Exception as e:
            reason = reason or "error"
            e._folio_counted = True
            held = interval.flush()
            if held is not None:  # tokens merged before the error (a worker died) go out first
                yield held
            raise
        finally:
            # closed here, not left to the garbage collector: closing it is what aborts the
            # request on its worker when the client went away (a CI run saw it run to the end)
            try:
                await stream.aclose()
            finally:
                admission.done_one()
                m.requests.labels(finish_reason=reason or "abort").inc()
                m.e2e.observe(time.perf_counter() - t0)

    async def abort(self, request_id: str) -> bool:
        return await self.router.abort(request_id)

    def cut(self, err: BaseException) -> None:
        """End every request streaming through this frontend with `err` (a drain's end,
        replica_drain.py): each is aborted on its worker, and its client gets the error as its
        answer or its stream's last event; a request that comes after gets it too (a pipelined
        one, a body that came in after the cut: their streams were cut mid-body half a second
        later, an attack found)."""
        self.cut_with = err
        self.router.client.cut(err)
