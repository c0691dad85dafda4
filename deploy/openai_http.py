"""The OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions, /v1/models,
/health, /metrics. Server-sent events end with `data: [DONE]`; errors use OpenAI's
JSON shape: {"error": {"message", "type", "param", "code"}}.

    400 bad input · 401 missing/wrong API key · 413 body too large (serve_app)
    429 admission queue full (Retry-After) · 503 no live worker (or the worker serving it
    died after streaming tokens) · 500 anything unexpected, still in this shape

Bodies are parsed by the typed models of openai_schema.py (the bounds are SamplingParams');
a request's prompts are checked, then admitted whole, and every path out of a run after
admission (an error, a client gone) aborts its streams and releases its slots.

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

from folio.deploy.auth import bearer_ok
from folio.deploy.frontend import Admission, Frontend
from folio.deploy.openai_schema import ChatCompletionRequest, CompletionRequest, parse
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
    if isinstance(e, FolioError):
        return HTTPError(500, str(e), "internal_error")
    return HTTPError(500, f"internal error ({type(e).__name__})", "internal_error")


def check_auth(api_key: str | None, authorization: str | None) -> None:
    if not bearer_ok(api_key, authorization):
        raise HTTPError(401, "a valid API key is required: Authorization: Bearer <key>", "authentication_error",
                        "invalid_api_key")


# ---- request parsing ---------------------------------------------------------------------
async def completion_prompts(frontend: Frontend, req: CompletionRequest) -> list[list[int]]:
    return [frontend.token_ids(p) if isinstance(p, list) else await frontend.text_ids(p) for p in req.prompts()]


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
    """The streams of one API request: one per prompt, each with n completions; admitted whole
    (`admission` holds a slot per prompt) and released whole when `events` ends, however it ends."""

    def __init__(self, frontend: Frontend, prompts: list[list[int]], params: SamplingParams, priority: int,
                 admission: Admission) -> None:
        self.frontend, self.prompts, self.params, self.priority = frontend, prompts, params, priority
        self.admission = admission
        self.id = uuid.uuid4().hex
        self.usage = {"prompt_tokens": sum(len(p) for p in prompts), "completion_tokens": 0, "total_tokens": 0}

    async def events(self) -> AsyncIterator[tuple[int, object]]:
        """(choice index, CompletionDelta) as they come, across all prompts."""
        n = self.params.n
        queue: asyncio.Queue = asyncio.Queue()
        gens = [self.frontend.generate(p, self.params, self.priority, f"{self.id}-{i}", self.admission)
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
        tasks: list[asyncio.Task] = []
        try:
            # the first prompt's admission error surfaces before anything is sent
            try:
                head = await gens[0].__anext__()
            except StopAsyncIteration:
                head = None
            tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens) if i > 0]
            if head is not None:
                for d in head.deltas:
                    yield d.index, d
                tasks.append(asyncio.create_task(pump(0, gens[0])))
            open_ = len(tasks)
            while open_:
                item = await queue.get()
                if item is None:
                    open_ -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:  # stop every stream (a client gone, or an error, aborts all its requests)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            try:
                for g in gens:
                    await g.aclose()
            finally:
                self.admission.release()

    def count(self, d) -> None:
        self.usage["completion_tokens"] += len(d.token_ids)
        self.usage["total_tokens"] = self.usage["prompt_tokens"] + self.usage["completion_tokens"]


def _too_many_prompts(frontend: Frontend, body) -> None:
    """Before anything runs per prompt (checks, parsing, tokenizing): a list of more prompts
    than the frontend can ever admit, or token ids that cannot fit, is refused at once (a
    body of 2 million one-token prompts held the event loop for 17 s)."""
    p = body.get("prompt") if isinstance(body, dict) else None
    if not isinstance(p, list) or not p:
        return
    if isinstance(p[0], int):
        if len(p) >= frontend.cfg.max_model_len:
            raise InvalidRequestError(f"the prompt has {len(p)} tokens; max_model_len is {frontend.cfg.max_model_len}",
                                      param="prompt")
    elif len(p) > frontend.cfg.max_num_requests:
        raise InvalidRequestError(f"{len(p)} prompts in one request exceed the frontend's limit of "
                                  f"{frontend.cfg.max_num_requests} in flight", param="prompt")


async def _parse(model, body):
    """parse() on the event loop for a small body; a body with long lists or objects (whose
    checks take time in proportion) is parsed on a thread, so it stalls no other request."""
    small = isinstance(body, dict) and all(not isinstance(v, (list, dict)) or len(v) < 256 for v in body.values())
    return parse(model, body) if small else await asyncio.to_thread(parse, model, body)


async def completions(frontend: Frontend, body: dict):
    """Returns a dict (non-streaming) or an async iterator of SSE byte strings."""
    _too_many_prompts(frontend, body)
    req = await _parse(CompletionRequest, body)
    if req.echo:
        raise InvalidRequestError("echo is not supported", param="echo")
    params = req.sampling_params(16)
    return await _start(frontend, req, await completion_prompts(frontend, req), params, chat=False)


async def chat_completions(frontend: Frontend, body: dict):
    req = await _parse(ChatCompletionRequest, body)
    n = req.sampling_params(1).n  # the cheap checks before the template is rendered
    ids = await frontend.chat_ids(req.message_dicts())
    params = req.sampling_params(await frontend.default_max_tokens(len(ids), n))
    return await _start(frontend, req, [ids], params, chat=True)


async def _start(frontend: Frontend, req, prompts: list[list[int]], params: SamplingParams, chat: bool):
    priority = 0 if req.priority is None else req.priority
    frontend.check(prompts, params, priority)
    admission = frontend.admit(len(prompts))
    try:
        run = _Run(frontend, prompts, params, priority, admission)
    except BaseException:
        admission.release()
        raise
    return await _respond(frontend, req, run, chat)


async def _respond(frontend: Frontend, req, run: _Run, chat: bool):
    model = frontend.cfg.model_name
    created = int(time.time())
    obj = "chat.completion" if chat else "text_completion"
    rid = ("chatcmpl-" if chat else "cmpl-") + run.id
    events = run.events()
    try:
        first = await events.__anext__()  # admission and validation errors surface here, as a status code
    except StopAsyncIteration:
        first = None
    except BaseException:
        await events.aclose()  # (finished already when it raised; released its admission)
        raise

    async def all_events():
        try:
            if first is not None:
                yield first
            async for e in events:
                yield e
        finally:
            await events.aclose()

    if req.stream:
        return _sse(all_events(), run, rid, obj + (".chunk" if chat else ""), created, model, chat,
                    req.include_usage, frontend)
    try:
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
    finally:
        await events.aclose()
    choices = []
    for i in sorted(texts):
        text = "".join(texts[i])
        lp = None
        if run.params.logprobs is not None:
            fmt = _logprobs_chat if chat else _logprobs_completion
            lp = await frontend.prompts.run(fmt, frontend.tokenizer, lps.get(i, []), run.params.logprobs)
        if chat:
            choices.append({"index": i, "message": {"role": "assistant", "content": text}, "logprobs": lp,
                            "finish_reason": reasons.get(i)})
        else:
            choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": reasons.get(i)})
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": choices, "usage": run.usage}


async def _sse(events, run, rid, obj, created, model, chat, include_usage, frontend) -> AsyncIterator[bytes]:
    tok = frontend.tokenizer
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
    except Exception as e:  # after the first byte the status is sent: report in the stream
        frontend.count_error(e)
        yield line(http_error(e).body())
    finally:
        await events.aclose()  # a client gone (or an error) aborts every stream of the request
    yield b"data: [DONE]\n\n"


def models(frontend: Frontend) -> dict:
    return {"object": "list", "data": [{"id": frontend.cfg.model_name, "object": "model", "created": 0,
                                        "owned_by": "folio", "max_model_len": frontend.cfg.max_model_len}]}
