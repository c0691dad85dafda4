"""The OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions, /v1/models,
/health, /metrics. Server-sent events end with `data: [DONE]`; errors use OpenAI's
JSON shape: {"error": {"message", "type", "param", "code"}}.

    400 bad input · 401 missing/wrong API key · 429 admission queue full (Retry-After)
    503 no live worker (or the worker serving it died after streaming tokens)

Handlers are plain functions of (frontend, body); deploy/serve_app.py mounts them on
the FastAPI app that Ray Serve runs. A client that disconnects closes the stream,
which aborts its request on the worker.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import AsyncIterator

from folio.deploy.frontend import Frontend
from folio.worker.errors import FolioError, InvalidRequestError, OverloadedError, UnavailableError
from folio.worker.sampling_params import SamplingParams

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
    if isinstance(e, HTTPError):
        return e
    if isinstance(e, InvalidRequestError):
        return HTTPError(400, str(e), "invalid_request_error")
    if isinstance(e, OverloadedError):
        return HTTPError(429, str(e), "rate_limit_error", "too_many_requests",
                         headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(e, UnavailableError):
        return HTTPError(503, str(e), "service_unavailable", "unavailable")
    if isinstance(e, FolioError):
        return HTTPError(500, str(e), "internal_error")
    raise e


def check_auth(api_key: str | None, authorization: str | None) -> None:
    if api_key and authorization != f"Bearer {api_key}":
        raise HTTPError(401, "a valid API key is required: Authorization: Bearer <key>", "authentication_error",
                        "invalid_api_key")


# ---- request parsing ---------------------------------------------------------------------
_IGNORED_ZERO = ("presence_penalty", "frequency_penalty")


def sampling_params(body: dict, default_max_tokens: int | None) -> SamplingParams:
    for name in _IGNORED_ZERO:
        if body.get(name) not in (None, 0, 0.0):
            raise InvalidRequestError(f"{name} is not supported")
    if body.get("echo"):
        raise InvalidRequestError("echo is not supported")
    if body.get("best_of") not in (None, 1, body.get("n", 1)):
        raise InvalidRequestError("best_of is not supported")
    logprobs = body.get("logprobs")
    if isinstance(logprobs, bool):  # chat: logprobs: true, top_logprobs: k
        logprobs = int(body.get("top_logprobs") or 0) if logprobs else None
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is None:
        max_tokens = default_max_tokens
    try:
        return SamplingParams(
            n=body.get("n", 1), max_tokens=max_tokens, temperature=float(body.get("temperature", 1.0)),
            top_p=float(body.get("top_p", 1.0)), top_k=body.get("top_k", 0), min_p=float(body.get("min_p", 0.0)),
            seed=body.get("seed"), stop=body.get("stop"), stop_token_ids=body.get("stop_token_ids") or [],
            ignore_eos=bool(body.get("ignore_eos", False)), logprobs=logprobs)
    except (TypeError, ValueError) as e:
        if isinstance(e, InvalidRequestError):
            raise
        raise InvalidRequestError(f"bad sampling parameter: {e}") from None


def completion_prompts(frontend: Frontend, prompt) -> list[list[int]]:
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], int)):
        return [frontend.prompt_ids(prompt)]
    if isinstance(prompt, list) and prompt:
        return [frontend.prompt_ids(p) for p in prompt]
    raise InvalidRequestError("prompt must be a string, a list of strings, or token ids")


def _top(d: dict, k: int) -> list[tuple[int, float]]:
    """The k most likely tokens of a step (the engine sends the chosen token plus the top k)."""
    return sorted(d.items(), key=lambda kv: -kv[1])[:k]


def _logprobs_completion(tok, entries: list[dict], k: int) -> dict:
    tokens, lps, tops = [], [], []
    for d in entries:
        chosen = next(iter(d))
        tokens.append(tok.decode([chosen]))
        lps.append(d[chosen])
        tops.append({tok.decode([t]): lp for t, lp in _top(d, k)})
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": []}


def _logprobs_chat(tok, entries: list[dict], k: int) -> dict:
    def item(t, lp):
        s = tok.decode([t])
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}
    content = []
    for d in entries:
        chosen = next(iter(d))
        content.append({**item(chosen, d[chosen]), "top_logprobs": [item(t, lp) for t, lp in _top(d, k)]})
    return {"content": content}


# ---- running ------------------------------------------------------------------------------
class _Run:
    """The streams of one API request: one per prompt, each with n completions."""

    def __init__(self, frontend: Frontend, prompts: list[list[int]], params: SamplingParams, priority: int) -> None:
        self.frontend, self.prompts, self.params, self.priority = frontend, prompts, params, priority
        self.id = uuid.uuid4().hex
        self.usage = {"prompt_tokens": sum(len(p) for p in prompts), "completion_tokens": 0, "total_tokens": 0}

    async def events(self) -> AsyncIterator[tuple[int, object]]:
        """(choice index, CompletionDelta) as they come, across all prompts."""
        n = self.params.n
        queue: asyncio.Queue = asyncio.Queue()
        gens = [self.frontend.generate(p, self.params, self.priority, f"{self.id}-{i}")
                for i, p in enumerate(self.prompts)]

        async def pump(i, gen):
            try:
                async for chunk in gen:
                    for d in chunk.deltas:
                        await queue.put((i * n + d.index, d))
            except asyncio.CancelledError:
                raise
            except BaseException as e:
                await queue.put(e)
            finally:
                queue.put_nowait(None)
        # the first prompt's admission error surfaces before anything is sent
        first = gens[0].__aiter__()
        try:
            head = await first.__anext__()
        except StopAsyncIteration:
            head = None
        tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens) if i > 0]
        try:
            if head is not None:
                for d in head.deltas:
                    yield d.index, d
                tasks.append(asyncio.create_task(pump(0, first)))
            open_ = len(tasks)
            while open_:
                item = await queue.get()
                if item is None:
                    open_ -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:  # stop every stream (a client gone aborts all its requests)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for g in [first, *gens[1:]]:
                await g.aclose()

    def count(self, d) -> None:
        self.usage["completion_tokens"] += len(d.token_ids)
        self.usage["total_tokens"] = self.usage["prompt_tokens"] + self.usage["completion_tokens"]


async def completions(frontend: Frontend, body: dict):
    """Returns a dict (non-streaming) or an async iterator of SSE byte strings."""
    params = sampling_params(body, 16)
    run = _Run(frontend, completion_prompts(frontend, body.get("prompt")), params, int(body.get("priority", 0)))
    return await _respond(frontend, body, run, chat=False)


async def chat_completions(frontend: Frontend, body: dict):
    ids = frontend.chat_ids(body.get("messages"))
    params = sampling_params(body, max(frontend.cfg.max_model_len - len(ids), 1))
    run = _Run(frontend, [ids], params, int(body.get("priority", 0)))
    return await _respond(frontend, body, run, chat=True)


async def _respond(frontend: Frontend, body: dict, run: _Run, chat: bool):
    model = frontend.cfg.model_name
    created = int(time.time())
    tok = frontend.tokenizer
    obj = "chat.completion" if chat else "text_completion"
    rid = ("chatcmpl-" if chat else "cmpl-") + run.id
    events = run.events()
    try:
        first = await events.__anext__()  # admission and validation errors surface here, as a status code
    except StopAsyncIteration:
        first = None

    async def all_events():
        if first is not None:
            yield first
        async for e in events:
            yield e

    if body.get("stream"):
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return _sse(all_events(), run, rid, obj + (".chunk" if chat else ""), created, model, chat, include_usage, tok)
    texts: dict[int, list[str]] = {}
    reasons: dict[int, str] = {}
    lps: dict[int, list] = {}
    async for i, d in all_events():
        run.count(d)
        texts.setdefault(i, []).append(d.text)
        if d.logprobs:
            lps.setdefault(i, []).extend(d.logprobs)
        if d.finish_reason:
            reasons[i] = d.finish_reason
    choices = []
    for i in sorted(texts):
        text = "".join(texts[i])
        lp = None
        if run.params.logprobs is not None:
            lp = (_logprobs_chat if chat else _logprobs_completion)(tok, lps.get(i, []), run.params.logprobs)
        if chat:
            choices.append({"index": i, "message": {"role": "assistant", "content": text}, "logprobs": lp,
                            "finish_reason": reasons.get(i)})
        else:
            choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": reasons.get(i)})
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": choices, "usage": run.usage}


async def _sse(events, run, rid, obj, created, model, chat, include_usage, tok) -> AsyncIterator[bytes]:
    def line(payload) -> bytes:
        return f"data: {json.dumps(payload)}\n\n".encode()
    started: set[int] = set()
    try:
        async for i, d in events:
            run.count(d)
            if chat:
                delta = {} if i in started else {"role": "assistant"}
                started.add(i)
                if d.text:
                    delta["content"] = d.text
                choice = {"index": i, "delta": delta, "logprobs": None, "finish_reason": d.finish_reason}
                if d.logprobs and run.params.logprobs is not None:
                    choice["logprobs"] = _logprobs_chat(tok, d.logprobs, run.params.logprobs)
            else:
                choice = {"index": i, "text": d.text, "logprobs": None, "finish_reason": d.finish_reason}
                if d.logprobs and run.params.logprobs is not None:
                    choice["logprobs"] = _logprobs_completion(tok, d.logprobs, run.params.logprobs)
            chunk = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
            if include_usage:
                chunk["usage"] = None
            yield line(chunk)
        if include_usage:
            yield line({"id": rid, "object": obj, "created": created, "model": model, "choices": [],
                        "usage": run.usage})
    except FolioError as e:  # after the first byte the status is sent: report in the stream
        yield line(http_error(e).body())
    yield b"data: [DONE]\n\n"


def models(frontend: Frontend) -> dict:
    return {"object": "list", "data": [{"id": frontend.cfg.model_name, "object": "model", "created": 0,
                                        "owned_by": "folio", "max_model_len": frontend.cfg.max_model_len}]}
