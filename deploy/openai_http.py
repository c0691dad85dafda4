"""The OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions, /v1/models,
/health, /metrics. Server-sent events end with `data: [DONE]`; errors use OpenAI's
JSON shape: {"error": {"message", "type", "param", "code"}}.

    400 bad input, a field Folio does not implement (param names it), or a prompt plus
        max_tokens past max_model_len (code context_length_exceeded; never clamped)
    401 missing/wrong API key · 404 an unknown model (code model_not_found) · 413 body too large
    429 admission queue full (Retry-After) · 503 no live worker (or the worker serving it
    died after streaming tokens) · 500 anything unexpected, still in this shape

`model` must be one of the served names (`--served-model-name`, aliases allowed; absent: the
first), and the response names the one asked for. Completions without max_tokens get 16
(OpenAI's and vLLM's default) or what fits if less; `max_tokens: null`, and chat without a
limit, get what fits. Completions logprobs carry `text_offset`: each token's character
offset in the choice's text (the echoed prompt included).

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
from folio.deploy.openai_logprobs import Choice, logprobs_chat, logprobs_completion, prompt_entries
from folio.deploy.openai_schema import ChatCompletionRequest, CompletionRequest, parse
from folio.deploy.openai_tools import ToolCallStream
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


# ---- model names ---------------------------------------------------------------------------
def served_names(cfg) -> list[str]:
    """What `model` may be: `--served-model-name`'s names (aliases), else the checkpoint's name."""
    names = cfg.served_model_name
    names = [names] if isinstance(names, str) else list(names or [])
    return [n for n in names if n] or [cfg.model_name]


def resolve_model(frontend: Frontend, model: str | None) -> str:
    """The served name a request asked for (absent: the first), or 404 model_not_found."""
    names = served_names(frontend.cfg)
    if model is None:
        return names[0]
    if model not in names:
        raise HTTPError(404, f"The model `{model}` does not exist.", "invalid_request_error", "model_not_found",
                        param="model")
    return model


# ---- request parsing ---------------------------------------------------------------------
async def completion_prompts(frontend: Frontend, req: CompletionRequest) -> list[list[int]]:
    special = req.add_special_tokens is not False
    return [req.truncate(frontend.token_ids(p) if isinstance(p, list)
                         else await frontend.prompts.text_ids(p, special)) for p in req.prompts()]


def check_context(frontend: Frontend, prompts: list[list[int]], max_tokens: int, chat: bool, param: str) -> None:
    """A prompt plus max_tokens past max_model_len is a 400, as vLLM's (never a silent clamp)."""
    limit = frontend.cfg.max_model_len
    longest = max(len(p) for p in prompts)
    if longest < limit < longest + max_tokens:  # (a prompt alone too long: frontend.check says so)
        where = "in the messages" if chat else "in the prompt"
        raise HTTPError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                             f"{longest + max_tokens} tokens ({longest} {where}, {max_tokens} in the completion). "
                             f"Please reduce the length of the {'messages' if chat else 'prompt'} or completion.",
                        "invalid_request_error", "context_length_exceeded", param=param)


# ---- running ------------------------------------------------------------------------------
class _Run:
    """The streams of one API request: one per prompt, each with n completions; admitted whole
    (`admission` holds a slot per prompt) and released whole when `events` ends, however it ends."""

    def __init__(self, frontend: Frontend, prompts: list[list[int]], params: SamplingParams, priority: int,
                 admission: Admission) -> None:
        self.frontend, self.prompts, self.params, self.priority = frontend, prompts, params, priority
        self.admission = admission
        self.id = uuid.uuid4().hex
        n_prompt = sum(len(p) for p in prompts)
        self.usage = {"prompt_tokens": n_prompt, "completion_tokens": 0, "total_tokens": n_prompt}
        self.echo: list[str] | None = None  # completions' echo: each prompt's text, put before its choices
        self.prompt_logprobs: dict[int, list] = {}  # echo + logprobs: per prompt, from its first chunk

    def prompt_entries(self, choice: int) -> list[dict]:
        """Completions' logprobs entries of the echoed prompt of `choice` ([] without echo + logprobs)."""
        if not self.echo or self.params.prompt_logprobs is None:
            return []
        i = choice // self.params.n
        return prompt_entries(self.prompts[i], self.prompt_logprobs.get(i))

    async def events(self) -> AsyncIterator[tuple[int, object]]:
        """(choice index, CompletionDelta) as they come, across all prompts."""
        n = self.params.n
        queue: asyncio.Queue = asyncio.Queue()
        gens = [self.frontend.generate(p, self.params, self.priority, f"{self.id}-{i}", self.admission)
                for i, p in enumerate(self.prompts)]

        async def pump(i, gen):
            try:
                async for chunk in gen:
                    if chunk.prompt_logprobs is not None:
                        self.prompt_logprobs[i] = chunk.prompt_logprobs
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
                if head.prompt_logprobs is not None:
                    self.prompt_logprobs[0] = head.prompt_logprobs
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
    model = resolve_model(frontend, req.model)
    n = req.sampling_params(1).n  # the cheap checks (and the refusals) before any tokenizing
    prompts = await completion_prompts(frontend, req)
    if req.max_tokens is not None:
        default = req.max_tokens
    elif "max_tokens" in req.model_fields_set:  # an explicit null: what fits (vLLM)
        default = min([await frontend.default_max_tokens(len(p), n) for p in prompts])
    else:  # absent: 16, or what fits if less
        default = max(1, min([16] + [frontend.cfg.max_model_len - len(p) for p in prompts]))
    params = req.sampling_params(default)
    check_context(frontend, prompts, params.max_tokens, False, "max_tokens")
    echo = None
    if req.echo:  # the prompt as given; token ids (or a truncated prompt) decoded
        echo = [p if isinstance(p, str) and req.truncate_prompt_tokens is None
                else await frontend.prompts.run(frontend.tokenizer.decode, ids) for p, ids in zip(req.prompts(), prompts)]
    return await _start(frontend, req, prompts, params, False, model, echo)


async def chat_completions(frontend: Frontend, body: dict):
    req = await _parse(ChatCompletionRequest, body)
    model = resolve_model(frontend, req.model)
    n = req.sampling_params(1).n  # the cheap checks before the template is rendered
    if req.tool_plan().renders and "tools" not in (getattr(frontend.tokenizer, "chat_template", None) or ""):
        raise InvalidRequestError("this model's chat template has no tool support: tools can only be given "
                                  'with tool_choice "none"', param="tools")
    ids = req.truncate(await frontend.prompts.chat_ids(req.template_messages(), req.add_generation_prompt is not False,
                                                       req.template_kwargs()))
    params = req.sampling_params(await frontend.default_max_tokens(len(ids), n))
    check_context(frontend, [ids], params.max_tokens, True,
                  "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens")
    return await _start(frontend, req, [ids], params, True, model, None)


async def _start(frontend: Frontend, req, prompts: list[list[int]], params: SamplingParams, chat: bool, model: str,
                 echo: list[str] | None):
    priority = 0 if req.priority is None else req.priority
    frontend.check(prompts, params, priority)
    admission = frontend.admit(len(prompts))
    try:
        run = _Run(frontend, prompts, params, priority, admission)
    except BaseException:
        admission.release()
        raise
    run.echo = echo
    return await _respond(frontend, req, run, chat, model)


async def _respond(frontend: Frontend, req, run: _Run, chat: bool, model: str):
    created = int(time.time())
    obj = "chat.completion" if chat else "text_completion"
    rid = ("chatcmpl-" if chat else "cmpl-") + (req.request_id or run.id)
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
        return _sse(all_events(), run, rid, obj + (".chunk" if chat else ""), created, model, chat, req, frontend)
    choices: dict[int, Choice] = {}
    try:
        async for i, d in all_events():
            run.count(d)
            if i not in choices:
                choices[i] = Choice(run.echo[i // run.params.n] if run.echo else "")
            choices[i].add(d)
    finally:
        await events.aclose()
    out = []
    as_ids = bool(req.return_tokens_as_token_ids)
    for i in sorted(choices):
        c = choices[i]
        text = "".join(c.texts)
        lp = None
        if run.params.logprobs is not None:
            if chat:
                lp = await frontend.prompts.run(logprobs_chat, frontend.tokenizer, c.entries, run.params.logprobs,
                                                as_ids)
            else:
                echoed = run.prompt_entries(i)
                spans = [(0, len(c.texts[0]), len(echoed))] * bool(echoed) + c.spans
                lp = await frontend.prompts.run(logprobs_completion, frontend.tokenizer, echoed + c.entries,
                                                run.params.logprobs, spans, as_ids)
        if chat:
            message: dict = {"role": "assistant", "content": text}
            reason = c.reason
            plan = req.tool_plan()
            if plan.mode != "none":
                message["content"], calls = plan.parse(text)
                if calls:
                    message["tool_calls"] = calls
                    reason = "tool_calls" if reason == "stop" else reason
            out.append({"index": i, "message": message, "logprobs": lp, "finish_reason": reason})
        else:
            out.append({"index": i, "text": text, "logprobs": lp, "finish_reason": c.reason})
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": out, "usage": run.usage}


async def _sse(events, run, rid, obj, created, model, chat, req, frontend) -> AsyncIterator[bytes]:
    tok = frontend.tokenizer
    as_ids = bool(req.return_tokens_as_token_ids)

    def line(payload) -> bytes:
        return f"data: {json.dumps(payload)}\n\n".encode()
    lengths: dict[int, int] = {}  # characters streamed so far per choice
    plan = req.tool_plan() if chat else None
    tools: dict[int, ToolCallStream] = {}  # per choice, with tools: text -> content and tool-call deltas
    try:
        async for i, d in events:
            run.count(d)
            if chat:
                delta = {} if i in lengths else {"role": "assistant"}
                lengths[i] = 0
                text, calls, reason = d.text, [], d.finish_reason
                if plan.mode != "none":
                    parser = tools.get(i) or tools.setdefault(i, plan.stream())  # made once per choice
                    text, calls = parser.feed(d.text)
                    if reason is not None:
                        more, last = parser.finish()
                        text, calls = text + more, calls + last
                        if parser.calls and reason == "stop":
                            reason = "tool_calls"
                if text:
                    delta["content"] = text
                if calls:
                    delta["tool_calls"] = calls
                choice = {"index": i, "delta": delta, "logprobs": None, "finish_reason": reason}
                if d.logprobs and run.params.logprobs is not None:
                    choice["logprobs"] = logprobs_chat(tok, d.logprobs, run.params.logprobs, as_ids)
            else:
                echoed = run.prompt_entries(i) if i not in lengths else []  # with the echo, its logprobs
                prefix = run.echo[i // run.params.n] if run.echo and i not in lengths else ""
                at = lengths.get(i, 0) + len(prefix)
                lengths[i] = at + len(d.text)
                choice = {"index": i, "text": prefix + d.text, "logprobs": None, "finish_reason": d.finish_reason}
                if (d.logprobs or echoed) and run.params.logprobs is not None:
                    spans = [(0, len(prefix), len(echoed))] * bool(echoed) + [(at, len(d.text), len(d.logprobs or []))]
                    choice["logprobs"] = logprobs_completion(tok, echoed + (d.logprobs or []), run.params.logprobs,
                                                              spans, as_ids)
            chunk = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
            if req.include_usage:
                chunk["usage"] = dict(run.usage) if req.continuous_usage else None
            yield line(chunk)
        if req.include_usage:
            yield line({"id": rid, "object": obj, "created": created, "model": model, "choices": [],
                        "usage": run.usage})
    except Exception as e:  # after the first byte the status is sent: report in the stream
        frontend.count_error(e)
        yield line(http_error(e).body())
    finally:
        await events.aclose()  # a client gone (or an error) aborts every stream of the request
    yield b"data: [DONE]\n\n"


def model_card(frontend: Frontend, name: str) -> dict:
    return {"id": name, "object": "model", "created": 0, "owned_by": "folio", "root": served_names(frontend.cfg)[0],
            "parent": None, "max_model_len": frontend.cfg.max_model_len}


def models(frontend: Frontend) -> dict:
    return {"object": "list", "data": [model_card(frontend, n) for n in served_names(frontend.cfg)]}


def model(frontend: Frontend, model_id: str) -> dict:
    """GET /v1/models/{id}: the card, or 404 model_not_found."""
    return model_card(frontend, resolve_model(frontend, model_id))
